"""What the activations' number format alone does to a model's next-token distributions.

    .venv/bin/python bench/activation_precision.py [--model FILE | --quant MIX ...] [--format NAME ...]
        [--llama-cpp] [--threads N] [--json OUT]

The torch runner in fp32 on the CPU (`hybridgate bench accuracy`'s reference) teacher-forces the
committed token file (8 chats x 64 ids, 512 positions); a copy of the cases per format, in the same
batches (the same figures as a pass per format, in one pass), rounds the input of every weight matmul
(QKV, O, gate-up, down, LM head; not attention's) to that format, and is compared as
`hybridgate.bench.accuracy.compare` compares: top-1 agreement, KL(reference || rounded) mean and p99,
against the project's floor (top-1 >= 99.5%, mean KL <= 1e-4). The weights are the file's, dequantized
to fp32 on both sides, except in "bf16 both", which rounds them to bf16 too (what a bf16 x bf16 tile
product such as AMX's `tdpbf16ps` multiplies).

Formats: bf16 and fp16 (round to nearest even, per element); int8/32, int8/64, int8/128, int8/256 and
int16/256 (symmetric, one scale per 32 ... 256 columns = max |x| / 127 or / 32767, round to nearest:
llama.cpp's Q8_0 and Q8_K activations, and this project's superblock kernels), on every weight matmul;
and "int8/G K" (G = 64, 128, 256): int8 per G columns where the weight is a K-quant (256-column
super-blocks) and int8 per 32 where it is not, as kernels chosen per weight type would round (and as
llama.cpp does: Q8_K for K-quants, Q8_0 or Q8_1 for 32-blocks). A matmul counts as a K-quant's when
every GGUF tensor fused into it is one (a model whose rows are not a multiple of 256 falls back to
32-block types there: SmolLM2-135M's 576 columns leave only ffn_down a K-quant).

`--quant MIX` (repeatable) first requantizes the default model with llama.cpp's quantizer, as
`hybridgate bench accuracy --quant` does, and measures each file in turn. `--llama-cpp` also
teacher-forces llama.cpp (llama-cpp-python, the bench extra) through the same positions, stepped as
the runners are, in both baseline configurations (`defaults`: weight repacking on; `plain`), and
checks issue 41's floor for int8 prompt activations: top-1 >= 98%, mean KL <= 5e-4, and neither
worse than llama.cpp's (its `defaults`) in the same run. A one-off measurement for the choice of a
kernel's activation format, not a test.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hybridgate.bench.accuracy import compare, load_cases
from hybridgate.models import load_gguf
from hybridgate.models.paths import default_model_path
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence


def blockwise(x: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    """x rounded to integers in [-levels, levels] times one scale per `block` columns (max |x| / levels)."""
    cols = x.shape[-1]
    v = F.pad(x, (0, (-cols) % block)).reshape(*x.shape[:-1], -1, block)
    scale = v.abs().amax(dim=-1, keepdim=True) / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(v / scale).clamp(-levels, levels) * scale).reshape(*x.shape[:-1], -1)[..., :cols]


TOP1_FLOOR, KL_FLOOR = 0.995, 1e-4  # the project's accuracy floor (`bench accuracy`)
INT8_TOP1_FLOOR, INT8_KL_FLOOR = 0.98, 5e-4  # issue 41's floor for int8 prompt activations (and llama.cpp's)

FORMATS = {
    "bf16": lambda x: x.to(torch.bfloat16).to(torch.float32),
    "bf16 both": lambda x: x.to(torch.bfloat16).to(torch.float32),
    "fp16": lambda x: x.to(torch.float16).to(torch.float32),
    "int8/32": lambda x: blockwise(x, 32, 127),
    "int8/64": lambda x: blockwise(x, 64, 127),
    "int8/128": lambda x: blockwise(x, 128, 127),
    "int8/256": lambda x: blockwise(x, 256, 127),
    "int16/256": lambda x: blockwise(x, 256, 32767),
}
# name -> (format on K-quant weights, format on the rest)
BY_TYPE = {f"int8/{g} K": (f"int8/{g}", "int8/32") for g in (64, 128, 256)}
K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"}


class RoundInputs(TorchFunctionMode):
    """Rounds the left operand of every matmul whose right operand is a key of `weights` (by id), and the
    weight too when `both`; `weights[id]` holds one function (or None: as it is) per group of rows.

    The groups are contiguous row ranges set per forward step (`set_rows`): the formats run as copies of
    the cases in one batch, so each step reads the weights once for all of them. A matmul's rows are the
    step's tokens, or its sequences (the LM head, on each sequence's last token)."""

    def __init__(self, weights: dict[int, list], both: bool = False):
        super().__init__()
        self.weights, self.both = weights, both
        self.bounds: dict[int, list[tuple[int, int]]] = {}

    def set_rows(self, tokens_per_seq: list[int], groups: int) -> None:
        per = len(tokens_per_seq) // groups

        def bounds(sizes):
            edges = np.cumsum([0, *sizes])
            return [(int(edges[g * per]), int(edges[(g + 1) * per])) for g in range(groups)]

        self.bounds = {int(sum(tokens_per_seq)): bounds(tokens_per_seq)}
        self.bounds.setdefault(len(tokens_per_seq), bounds([1] * len(tokens_per_seq)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__matmul__, torch.matmul, F.linear) and len(args) >= 2 and id(args[1]) in self.weights:
            fns, x = self.weights[id(args[1])], args[0]
            if len(fns) == 1:
                x = x if fns[0] is None else fns[0](x)
            else:
                x = torch.cat([x[a:b] if fn is None else fn(x[a:b])
                               for fn, (a, b) in zip(fns, self.bounds[x.shape[0]], strict=True)])
            weight = fns[0](args[1]) if self.both and fns[0] is not None else args[1]
            args = (x, weight, *args[2:])
        return func(*args, **(kwargs or {}))


def grouped_figures(runner, cases: list[dict], mode: RoundInputs, groups: int) -> tuple[np.ndarray, list[dict]]:
    """Teacher-forces `groups` copies of `cases` in one batch per step (as `teacher_forced_logits`
    steps one), group 0 unrounded: the reference logits (float64, case-major) and each other group's
    `compare` figures against them."""
    n, steps = len(cases), len(cases[0]["ids"])
    seqs = []
    for g in range(groups):
        for i, case in enumerate(cases):
            s = Sequence(AddRequest(f"{g}:{i}", case["prompt_ids"], SamplingParams(temperature=0), 0, steps, -1))
            blocks = -(-(len(case["prompt_ids"]) + steps) // runner.block_size)
            s.block_table = list(range((g * n + i) * blocks, (g * n + i + 1) * blocks))
            seqs.append(s)
    if seqs[-1].block_table[-1] >= runner.num_blocks:
        raise ValueError(f"{groups} groups of {n} cases need more than the KV cache's {runner.num_blocks} blocks")
    reference = np.empty((n, steps, runner.vocab_size))
    kl = np.empty((groups, n, steps))
    top1 = np.empty((groups, n, steps), dtype=bool)
    with mode:
        for k in range(steps):
            entries = [(s, s.num_tokens - s.num_computed) for s in seqs]
            mode.set_rows([e[1] for e in entries], groups)
            logits = runner.forward(ScheduledBatch(entries)).double().reshape(groups, n, -1)
            lp = torch.log_softmax(logits, dim=-1)
            kl[:, :, k] = (lp[0].exp() * (lp[0] - lp)).sum(-1).numpy()
            top1[:, :, k] = (logits.argmax(-1) == logits[0].argmax(-1)).numpy()
            reference[:, k] = logits[0].numpy()
            for s, (_, m) in zip(seqs, entries):
                s.num_computed += m
                s.output_ids.append(cases[int(s.request_id.split(":")[1])]["ids"][k])
    figures = [{"positions": n * steps, "top1_agreement": float(top1[g].mean()), "kl_mean": float(kl[g].mean()),
                "kl_p99": float(np.percentile(kl[g], 99))} for g in range(groups)]
    return reference.reshape(n * steps, -1), figures


def weight_matrices(dm, model) -> dict[int, bool]:
    """id of each weight matmul's right operand -> whether every GGUF tensor fused into it is a K-quant."""
    types = {name: t.ggml_type.name for name, t in model.tensors.items()}
    row = model.config.arch

    def k(names):
        return all(types[n] in K_QUANTS for n in names)

    out = {}
    for i, layer in enumerate(dm.layers):
        blk = lambda n: f"blk.{i}.{n}.weight"  # noqa: E731
        out[id(layer.w_qkv)] = k([blk(n) for n in row.qkv_tensors])
        out[id(layer.wo)] = k([blk("attn_output")])
        out[id(layer.w_gate_up)] = k([blk(n) for n in row.gate_up_tensors])
        out[id(layer.w_down)] = k([blk("ffn_down")])
    out[id(dm.lm_head)] = k(["output.weight" if "output.weight" in types else "token_embd.weight"])
    return out


def llama_cpp_rows(path: Path, cases: list[dict], reference, threads: int) -> dict:
    """llama.cpp's teacher-forced figures against `reference`, per baseline configuration."""
    from hybridgate.bench.llama_baseline import CONFIGS, LlamaCppBaseline

    rows = {}
    for config, extra_bufts in CONFIGS.items():
        start = time.perf_counter()
        base = LlamaCppBaseline(path, threads, max_seqs=len(cases), extra_bufts=extra_bufts)
        try:
            rows[config] = {**compare(reference, base.teacher_forced_logits(cases)), "build": base.build()}
        finally:
            base.close()
        rows[config]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"llama.cpp {config:8} {json.dumps({k: v for k, v in rows[config].items() if k != 'build'})}",
              flush=True)
    return rows


def verdicts(row: dict, llama: dict | None) -> None:
    """Adds the project's floor and issue 41's int8 prompt floor (None: llama.cpp not measured) to `row`."""
    row["meets_floor"] = row["top1_agreement"] >= TOP1_FLOOR and row["kl_mean"] <= KL_FLOOR
    own = row["top1_agreement"] >= INT8_TOP1_FLOOR and row["kl_mean"] <= INT8_KL_FLOOR
    row["meets_int8_floor_absolute"] = own
    row["meets_int8_prompt_floor"] = None if llama is None else (
        own and row["top1_agreement"] >= llama["top1_agreement"] and row["kl_mean"] <= llama["kl_mean"])


def measure(path: Path, names: list[str], cases: list[dict], with_llama: bool, threads: int) -> dict:
    model = load_gguf(path)
    runner = TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory="1GiB")
    matrices = weight_matrices(runner.model, model)
    types = {}
    for t in model.tensors.values():
        if len(t.shape) == 2:
            types[t.ggml_type.name] = types.get(t.ggml_type.name, 0) + 1
    out = {"model": str(path), "matrix_types": types, "k_quant_matmuls": sum(matrices.values()),
           "matmuls": len(matrices)}

    def fns(name):
        if name in BY_TYPE:
            on_k, rest = (FORMATS[f] for f in BY_TYPE[name])
            return {w: on_k if is_k else rest for w, is_k in matrices.items()}
        return dict.fromkeys(matrices, FORMATS[name])

    # Formats that round only the activations run together (one group each, after the reference's);
    # "both" formats round the shared weights, so each runs alone.
    shared = [n for n in names if not n.endswith("both")]
    start = time.perf_counter()
    per = {n: fns(n) for n in shared}
    mode = RoundInputs({w: [None, *(per[n][w] for n in shared)] for w in matrices})
    reference, figures = grouped_figures(runner, cases, mode, 1 + len(shared))
    rows = dict(zip(shared, figures[1:]))
    seconds = {"reference and activation formats, one batch": round(time.perf_counter() - start, 1)}
    print(f"{path.name}: {len(shared)} formats in {seconds} s", flush=True)
    for name in names:
        if name.endswith("both"):
            start = time.perf_counter()
            mode = RoundInputs({w: [None, fn] for w, fn in fns(name).items()}, both=True)
            rows[name] = grouped_figures(runner, cases, mode, 2)[1][1]
            seconds[name] = round(time.perf_counter() - start, 1)
    llama = None
    if with_llama:
        out["llama_cpp"] = llama_cpp_rows(path, cases, reference, threads)
        llama = out["llama_cpp"]["defaults"]
    out["formats"] = {}
    for name in names:
        row = out["formats"][name] = rows[name]
        verdicts(row, llama)
        verdict = f"floor {'met' if row['meets_floor'] else 'missed'}"
        if row["meets_int8_prompt_floor"] is not None:
            verdict += f", int8 prompt floor {'met' if row['meets_int8_prompt_floor'] else 'missed'}"
        print(f"{name:10} {json.dumps(row)}: {verdict}", flush=True)
    out["seconds"] = seconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--quant", action="append", metavar="MIX",
                        help="requantize the model with llama.cpp to this mix (Q4_K_M, Q6_K, Q8_0 ...) and measure "
                             "that file; repeatable")
    parser.add_argument("--format", action="append", choices=[*FORMATS, *BY_TYPE],
                        help="a format to run; repeatable, quote 'bf16 both' (default: all)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also measure llama.cpp on the same file and positions (needs llama-cpp-python)")
    parser.add_argument("--threads", type=int, default=None, help="torch's and llama.cpp's threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the rows to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = args.model or default_model_path()
    paths = {path.stem: path}
    if args.quant:
        from hybridgate.bench.mixes import mix
        from hybridgate.bench.model_files import requantize

        paths = {q: requantize(path, mix(q)) for q in args.quant}
    cases = load_cases()
    names = args.format or [*FORMATS, *BY_TYPE]
    start = time.perf_counter()
    files = {key: measure(p, names, cases, args.llama_cpp, threads) for key, p in paths.items()}
    if args.json:
        from hybridgate.bench.machine import describe

        out = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "machine": describe(),
               "torch": torch.__version__, "threads": threads, "seconds": round(time.perf_counter() - start),
               "floors": {"project": {"top1_min": TOP1_FLOOR, "kl_mean_max": KL_FLOOR},
                          "int8_prompt": {"top1_min": INT8_TOP1_FLOOR, "kl_mean_max": INT8_KL_FLOOR,
                                          "and_not_worse_than": "llama.cpp (defaults) in the same run"}},
               "files": files}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
