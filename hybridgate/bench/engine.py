"""`hybridgate bench engine --kind gpu`: the engine in-process against transformers, side by side.

Reports medians over `--repeats` of:
- decode tokens/s at each concurrency c: c prompts of `--prompt-len` tokens,
  `--new-tokens` tokens each (ignore EOS), c * new tokens / wall time of the
  whole run (prefill included, the same for the baseline);
- prefill tokens/s: `--prefill-prompts` prompts of each length, one token out;
- TTFT of a `--ttft-len`-token prompt, cold and then prefix-cached.
Baseline: transformers `generate(use_cache=True)` on the same GGUF, device and
dtype, batched with left padding and exactly `--new-tokens` new tokens;
prefill: one forward of the batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from hybridgate.models import Tokenizer, default_model_path, load_gguf, model_fingerprint
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.engine import EngineCore
from hybridgate.workers.scheduler import SchedulerConfig

log = logging.getLogger("hybridgate.bench")

PARAGRAPH = ("Section {i}. Engineers measure before they optimise: latency, throughput and memory trade against "
             "each other, and every layer of a system hides the one below it, from gates to services.\n")


def prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    text = "".join(PARAGRAPH.format(i=i) for i in range(count * length // 20 + 8))
    ids = tokenizer.encode(text)
    return [ids[i * 17 : i * 17 + length] for i in range(count)]


class EngineBench:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, kv_cache_memory: str | None,
                 enforce_eager: bool = False):
        from hybridgate.workers.gpu.runner import TorchRunner

        self.runner = TorchRunner(model, device, dtype, kv_cache_memory=kv_cache_memory, enforce_eager=enforce_eager)
        self.runner.warm_up()
        self.fingerprint = model_fingerprint(model)

    def engine(self, prefix_caching: bool = False) -> EngineCore:
        return EngineCore(self.runner, SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
                          self.fingerprint, prefix_caching)

    def _run(self, engine: EngineCore, batch: list[list[int]], new_tokens: int) -> float:
        for i, ids in enumerate(batch):
            engine.add(AddRequest(str(i), ids, SamplingParams(temperature=0, ignore_eos=True), 0, new_tokens, -1))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        if self.runner.model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def decode(self, batch, new_tokens: int) -> float:
        return len(batch) * new_tokens / self._run(self.engine(), batch, new_tokens)

    def prefill(self, batch) -> float:
        return sum(len(p) for p in batch) / self._run(self.engine(), batch, 1)

    def decode_step_ms(self, prompt: list[int], steps: int = 64) -> float:
        """Median wall time of one decode step at batch 1 (host to sampled id)."""
        engine = self.engine()
        engine.add(AddRequest("s", prompt, SamplingParams(temperature=0, ignore_eos=True), 0, steps + 1, -1))
        engine.step()  # prefill
        times = []
        while engine.has_work():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def ttft(self, prompt: list[int]) -> tuple[float, float]:
        engine = self.engine(prefix_caching=True)
        return self._run(engine, [prompt], 1), self._run(engine, [prompt], 1)


class TransformersBaseline:
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                          attn_implementation="sdpa").to(device).eval()
        self.device = device

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def decode(self, batch, new_tokens: int) -> float:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
        start = time.perf_counter()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, use_cache=True, pad_token_id=0)
        self._sync()
        return len(batch) * new_tokens / (time.perf_counter() - start)

    @torch.inference_mode()
    def prefill(self, batch) -> float:
        ids = torch.tensor(batch, device=self.device)
        start = time.perf_counter()
        self.model(ids, use_cache=True, logits_to_keep=1)
        self._sync()
        return ids.numel() / (time.perf_counter() - start)


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def run(args: argparse.Namespace) -> dict:
    if args.kind != "gpu":
        raise ValueError("--kind: only 'gpu' (the torch runner) is built so far")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path()
    model = load_gguf(path)
    tokenizer = Tokenizer.from_model(model)
    ours = EngineBench(model, device, dtype, args.kv_cache_memory)
    base = None if args.no_baseline else TransformersBaseline(path, device, dtype)
    out: dict = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                 "repeats": args.repeats, "decode": {}, "prefill": {}}
    for c in args.concurrency:
        batch = prompts(tokenizer, c, args.prompt_len)
        row = {"hybridgate_tokens_per_s": _median(lambda: ours.decode(batch, args.new_tokens), args.repeats)}
        if base is not None:
            row["transformers_tokens_per_s"] = _median(lambda: base.decode(batch, args.new_tokens), args.repeats)
            row["ratio"] = row["hybridgate_tokens_per_s"] / row["transformers_tokens_per_s"]
        out["decode"][c] = row
        _print("decode", f"c={c}", row)
    for length in args.prefill_lens:
        batch = prompts(tokenizer, args.prefill_prompts, length)
        row = {"hybridgate_tokens_per_s": _median(lambda: ours.prefill(batch), args.repeats)}
        if base is not None:
            row["transformers_tokens_per_s"] = _median(lambda: base.prefill(batch), args.repeats)
            row["ratio"] = row["hybridgate_tokens_per_s"] / row["transformers_tokens_per_s"]
        row["hybridgate_tflops"] = 2 * ours.runner.model.weight_bytes / ours.runner.model.embed.element_size() \
            * row["hybridgate_tokens_per_s"] / 1e12  # 2 x weights x tokens / s (attention excluded)
        out["prefill"][f"{args.prefill_prompts}x{length}"] = row
        _print("prefill", f"{args.prefill_prompts}x{length}", row)
    step_prompt = prompts(tokenizer, 1, args.prompt_len)[0]
    out["decode_step_ms_c1"] = _median(lambda: ours.decode_step_ms(step_prompt), args.repeats)
    print(f"decode step at batch 1: {out['decode_step_ms_c1']:.3f} ms", flush=True)
    if args.compare_eager and device.type == "cuda":
        eager = EngineBench(model, device, dtype, "2GiB", enforce_eager=True)
        out["decode_step_ms_c1_eager"] = _median(lambda: eager.decode_step_ms(step_prompt), args.repeats)
        print(f"decode step at batch 1, eager: {out['decode_step_ms_c1_eager']:.3f} ms", flush=True)
    ttfts = [ours.ttft(prompts(tokenizer, 1, args.ttft_len)[0]) for _ in range(args.repeats)]
    cold, cached = statistics.median(t[0] for t in ttfts), statistics.median(t[1] for t in ttfts)
    out["ttft"] = {"prompt_tokens": args.ttft_len, "cold_ms": cold * 1e3, "cached_ms": cached * 1e3,
                   "cached_over_cold": cached / cold}
    _print("ttft", f"{args.ttft_len} tokens", out["ttft"])
    if 1 in out["decode"] and 16 in out["decode"]:
        out["decode_scaling_16_over_1"] = (out["decode"][16]["hybridgate_tokens_per_s"]
                                           / out["decode"][1]["hybridgate_tokens_per_s"])
        print(f"decode scaling c=16 / c=1: {out['decode_scaling_16_over_1']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


def _print(kind: str, case: str, row: dict) -> None:
    print(f"{kind:8} {case:12} " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in row.items()), flush=True)
