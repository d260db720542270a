"""What the activations' number format alone does to a model's next-token distributions.

    .venv/bin/python bench/activation_precision.py [--model FILE] [--format NAME ...] [--json OUT]

The torch runner in fp32 on the CPU (`hybridgate bench accuracy`'s reference) teacher-forces the
committed token file (8 chats x 64 ids, 512 positions); a second pass per format rounds the input of
every weight matmul (QKV, O, gate-up, down, LM head; not attention's) to that format, and is compared
with `hybridgate.bench.accuracy.compare`: top-1 agreement, KL(reference || rounded) mean and p99,
against the project's floor (top-1 >= 99.5%, mean KL <= 1e-4). The weights are the file's, dequantized
to fp32 on both sides, except in "bf16 both", which rounds them to bf16 too (what a bf16 x bf16 tile
product such as AMX's `tdpbf16ps` multiplies).

Formats: bf16 and fp16 (round to nearest even, per element); int8/32, int8/256 and int16/256
(symmetric, one scale per 32 or 256 columns = max |x| / 127 or / 32767, round to nearest: llama.cpp's
Q8_0 and Q8_K activations, and this project's superblock kernels). A one-off measurement for the
choice of a kernel's activation format, not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hybridgate.bench.accuracy import compare, load_cases, teacher_forced_logits
from hybridgate.models import load_gguf
from hybridgate.models.paths import default_model_path
from hybridgate.workers.gpu.runner import TorchRunner


def blockwise(x: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    """x rounded to integers in [-levels, levels] times one scale per `block` columns (max |x| / levels)."""
    cols = x.shape[-1]
    v = F.pad(x, (0, (-cols) % block)).reshape(*x.shape[:-1], -1, block)
    scale = v.abs().amax(dim=-1, keepdim=True) / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(v / scale).clamp(-levels, levels) * scale).reshape(*x.shape[:-1], -1)[..., :cols]


TOP1_FLOOR, KL_FLOOR = 0.995, 1e-4  # the project's accuracy floor (`bench accuracy`)

FORMATS = {
    "bf16": lambda x: x.to(torch.bfloat16).to(torch.float32),
    "bf16 both": lambda x: x.to(torch.bfloat16).to(torch.float32),
    "fp16": lambda x: x.to(torch.float16).to(torch.float32),
    "int8/32": lambda x: blockwise(x, 32, 127),
    "int8/256": lambda x: blockwise(x, 256, 127),
    "int16/256": lambda x: blockwise(x, 256, 32767),
}


class RoundInputs(TorchFunctionMode):
    """Rounds the left operand of every matmul whose right operand is one of `weights` (by id), and the
    weight too when `both`."""

    def __init__(self, weights: set[int], fn, both: bool):
        super().__init__()
        self.weights, self.fn, self.both = weights, fn, both

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__matmul__, torch.matmul, F.linear) and len(args) >= 2 and id(args[1]) in self.weights:
            weight = self.fn(args[1]) if self.both else args[1]
            args = (self.fn(args[0]), weight, *args[2:])
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--format", action="append", choices=list(FORMATS),
                        help="a format to run; repeatable, quote 'bf16 both' (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows to this JSON file")
    args = parser.parse_args()
    path = args.model or default_model_path()
    model, cases = load_gguf(path), load_cases()
    new_runner = lambda: TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory="512MiB")  # noqa: E731
    reference = teacher_forced_logits(new_runner(), cases)
    rows = {}
    for name in args.format or list(FORMATS):
        runner = new_runner()
        dm = runner.model
        weights = {id(getattr(layer, n)) for layer in dm.layers for n in ("w_qkv", "wo", "w_gate_up", "w_down")}
        with RoundInputs(weights | {id(dm.lm_head)}, FORMATS[name], name.endswith("both")):
            rows[name] = compare(reference, teacher_forced_logits(runner, cases))
        row = rows[name]
        row["meets_floor"] = row["top1_agreement"] >= TOP1_FLOOR and row["kl_mean"] <= KL_FLOOR
        print(f"{name:10} {json.dumps(row)}: floor {'met' if row['meets_floor'] else 'missed'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "formats": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
