"""`hybridgate bench accuracy --kind cpu|gpu`: next-token distributions against the fp32 reference.

Teacher-forces the committed token file (8 chat prompts x 64 ids, greedy from
transformers fp32 with EOS masked) through a runner and, in the same run,
through the torch runner in fp32 on the CPU (pinned to transformers by the
foundation tests), and compares each of the 512 positions: top-1 agreement
(the runner's argmax equals the reference's argmax) and KL(reference || runner),
mean and p99. `--quant MIX` first requantizes the model with llama.cpp's own
quantizer (`model_files.requantize`), so the floors are checked on the types
real files hold (Q4_K_M, Q6_K, Q8_0, F16 ...); the reference is then that
file, dequantized to fp32. `--baseline llama-cpp` (the default with `--quant`)
puts llama.cpp's own figures on the same file and positions beside ours
(`llama_cpp`) and says whether ours are at least as good on both
(`as_accurate_as_llama_cpp`): the CPU issue's floor.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

import numpy as np

from hybridgate.config import resolve
from hybridgate.models import load_gguf
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence


def load_cases() -> list[dict]:
    text = resources.files("hybridgate.bench").joinpath("data/accuracy_tokens.json").read_text()
    return json.loads(text)["cases"]


def teacher_forced_logits(runner, cases: list[dict]) -> np.ndarray:
    """float64 `[cases * 64, vocab]`: logits predicting each committed id, all cases batched per step."""
    seqs = []
    for i, case in enumerate(cases):
        s = Sequence(AddRequest(str(i), case["prompt_ids"], SamplingParams(temperature=0), 0, 64, -1))
        blocks = -(-(len(case["prompt_ids"]) + 64) // runner.block_size)
        s.block_table = list(range(i * blocks, (i + 1) * blocks))
        seqs.append(s)
    steps = []
    for k in range(len(cases[0]["ids"])):
        entries = [(s, s.num_tokens - s.num_computed) for s in seqs]
        steps.append(np.asarray(_to_numpy(runner.forward(ScheduledBatch(entries))), dtype=np.float64))
        for s, (_, n) in zip(seqs, entries):
            s.num_computed += n
            s.output_ids.append(cases[int(s.request_id)]["ids"][k])
    return np.stack(steps, axis=1).reshape(len(cases) * len(steps), -1)  # case-major


def _to_numpy(x):
    return x.float().cpu().numpy() if hasattr(x, "cpu") else x


def compare(reference: np.ndarray, got: np.ndarray) -> dict:
    def log_softmax(z):
        z = z - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    lp, lq = log_softmax(reference), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    return {"positions": int(reference.shape[0]),
            "top1_agreement": float((reference.argmax(1) == got.argmax(1)).mean()),
            "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99))}


def baseline_of(args: argparse.Namespace) -> str:
    """--baseline, whose default is llama-cpp with --quant (which needs llama.cpp already) and none without."""
    return args.baseline or ("llama-cpp" if args.quant else "none")


def llama_cpp_figures(path: Path, reference: np.ndarray, cases: list[dict], threads: int | None,
                      llama_cpp_path: str | None) -> dict:
    """llama.cpp's own figures on the same file and positions against the same fp32 reference (`compare`),
    with its defaults (repacked weights, as users run it), in a child process (`LlamaCppProcess`).
    Raises RuntimeError when llama.cpp cannot be imported or crashes."""
    import os

    from hybridgate.bench.llama_baseline import LlamaCppProcess

    base = LlamaCppProcess(path, threads or len(os.sched_getaffinity(0)), len(cases), "defaults", llama_cpp_path)
    try:
        figures = compare(reference, base.teacher_forced_logits(cases))
    finally:
        base.close()
    return {"config": "defaults", "version": base.info["version"], **figures}


def run(args: argparse.Namespace) -> dict:
    import torch

    from hybridgate.workers.gpu.runner import TorchRunner

    settings = resolve(args).settings
    path = Path(settings.model_path)
    if args.quant:
        from hybridgate.bench.mixes import mix
        from hybridgate.bench.model_files import requantize

        path = requantize(path, mix(args.quant), args.llama_cpp_path)
        print(f"model: {path} ({args.quant}, requantized by llama.cpp)", flush=True)
    model = load_gguf(path)
    cases = load_cases()
    memory = "512MiB"
    reference = teacher_forced_logits(TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory=memory),
                                      cases)
    if settings.worker.kind == "cpu":
        from hybridgate.workers.cpu import isa

        isa.select(settings.worker.engine.cpu_isa, settings.worker.engine.cpu_amx)
        from hybridgate.workers.cpu.runner import NumbaRunner

        runner = NumbaRunner(model, kv_cache_memory=memory, threads=settings.worker.engine.threads,
                             activations=settings.worker.engine.cpu_activations,
                             kv_cache_dtype=settings.worker.engine.kv_cache_dtype)
    else:
        device = torch.device(settings.worker.engine.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        runner = TorchRunner(model, device, kv_cache_memory=memory)
    cpu = {"cpu_isa": runner.cpu_isa, "cpu_amx": "AMX-BF16" in (runner.prompt_kernels or ""),
           "cpu_prompt_kernels": runner.prompt_kernels, "cpu_activations": runner.cpu_activations,
           "kv_cache_dtype": runner.kv_dtype.name} if hasattr(runner, "cpu_isa") else {}
    from hybridgate.bench.machine import describe

    out = {"kind": settings.worker.kind, "model": str(path), "machine": describe(), **cpu,
           **compare(reference, teacher_forced_logits(runner, cases))}
    if baseline_of(args) == "llama-cpp":
        out["llama_cpp"] = llama_cpp_figures(path, reference, cases, settings.worker.engine.threads,
                                             args.llama_cpp_path)
        out["as_accurate_as_llama_cpp"] = (out["top1_agreement"] >= out["llama_cpp"]["top1_agreement"]
                                           and out["kl_mean"] <= out["llama_cpp"]["kl_mean"])
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out
