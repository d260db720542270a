"""`hybridgate bench engine --kind gpu|cpu`: the engine in-process against a baseline, side by side.

Reports medians over `--repeats` of:
- decode tokens/s at each concurrency c: c prompts of `--prompt-len` tokens,
  `--new-tokens` tokens each (ignore EOS), c * new tokens / wall time of the
  whole run (prefill included, the same for the baseline);
- prefill tokens/s: `--prefill-prompts` prompts of each length, one token out;
- TTFT of a `--ttft-len`-token prompt, cold and then prefix-cached.
Baselines: for `--kind gpu`, transformers `generate(use_cache=True)` on the
same GGUF, device and dtype, batched with left padding and exactly
`--new-tokens` new tokens; prefill: one forward of the batch. For `--kind cpu`
(`--baseline llama-cpp`), llama.cpp on the same file, threads and prompts, its
parallel sequences decoded in one batch per step (`llama_baseline`), twice:
`llama_cpp_defaults` (the library's defaults, extra buffer types on) and
`llama_cpp_plain` (extra buffer types off), each in its own process, each
with its ratio; ours and the baselines run alternately, `--repeats` times.
The CPU runner also reports its ISA path, the bytes of weights it reads per
batch-1 decode step (`CpuModel.batch1_bytes`: of a mixture of experts, the
router and the experts one token chooses; not an untied embedding), the read
rate that makes at batch 1 beside this machine's measured read bandwidth (a parallel Numba sum over `--bandwidth-mib` in a child
process, probed before each of its timed steps: `bandwidth`), each
quant type's share of the batch-1 step (`type_shares`), and this process's
peak RSS. `--shape NAME --quant MIX` measures a random-weight file of a named
model's shapes in one of llama.cpp's mixes (`model_files`) instead of `--model`.

`--profile-out FILE` writes a worker profile for `bench sim` instead: the
engine's own step tables (`EngineCore.measure_rates` over more step sizes:
decode step seconds by batch, prefill tokens/s by step tokens; medians of
several steps), its KV capacity in blocks and the scheduler's caps at serve's
defaults, with the machine, threads and command that measured them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from hybridgate.bench.bandwidth import BandwidthProbe, report_bandwidth
from hybridgate.config import resolve
from hybridgate.models import Tokenizer, load_gguf, model_fingerprint
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers import affinity
from hybridgate.workers.engine import EngineCore
from hybridgate.workers.config import EngineConfig
from hybridgate.workers.scheduler import SchedulerConfig

log = logging.getLogger("hybridgate.bench")

PARAGRAPH = ("Section {i}. Engineers measure before they optimise: latency, throughput and memory trade against "
             "each other, and every layer of a system hides the one below it, from gates to services.\n")


def prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    text = "".join(PARAGRAPH.format(i=i) for i in range(count * length // 20 + 8))
    ids = tokenizer.encode(text)
    return [ids[i * 17 : i * 17 + length] for i in range(count)]


# Each mode's defaults of the case flags: --kind cpu, --kind gpu on a file, --kind gpu --shape (random weights made
# on the device: the cases, 1k-token prompts and 256 new tokens).
DEFAULTS = {
    "cpu": dict(concurrency=[1, 4, 16], prefill_lens=[128, 512], prefill_prompts=4, prompt_len=32, new_tokens=64),
    "gpu": dict(concurrency=[1, 4, 16, 64], prefill_lens=[128, 512, 2048], prefill_prompts=16, prompt_len=32,
                new_tokens=64),
    "gpu-shape": dict(concurrency=[1, 16, 64, 256], prefill_lens=[512, 2048, 8192], prefill_prompts=1,
                      prompt_len=1024, new_tokens=256),
}
def apply_defaults(args: argparse.Namespace, mode: str) -> None:
    """Fill the case flags left unset with `DEFAULTS[mode]`."""
    args.concurrency_given = bool(args.concurrency)
    for name, value in DEFAULTS[mode].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.baseline_concurrency = getattr(args, "baseline_concurrency", None) or args.concurrency


BENCH_SCHEDULER = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)  # the runner profiles its steps


class EngineBench:
    """Engines over one warmed-up runner; `fingerprint` keys their prefix cache (a file's, or a random model's)."""

    def __init__(self, runner, fingerprint: str):
        self.runner = runner
        self.runner.warm_up()
        self.fingerprint = fingerprint

    @classmethod
    def torch(cls, model, device: torch.device, dtype: torch.dtype, kv_cache_memory: str | None,
              enforce_eager: bool = False,
              gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization) -> EngineBench:
        from hybridgate.workers.gpu.runner import TorchRunner

        return cls(TorchRunner(model, device, dtype, kv_cache_memory=kv_cache_memory,
                               enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                               max_num_batched_tokens=BENCH_SCHEDULER.max_num_batched_tokens),
                   model_fingerprint(model))

    def engine(self, prefix_caching: bool = False, scheduler: SchedulerConfig = BENCH_SCHEDULER) -> EngineCore:
        return EngineCore(self.runner, scheduler, self.fingerprint, prefix_caching)

    def _run(self, engine: EngineCore, batch: list[list[int]], new_tokens: int) -> float:
        for i, ids in enumerate(batch):
            engine.add(AddRequest(str(i), ids, SamplingParams(temperature=0, ignore_eos=True), 0, new_tokens, -1))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        if self.runner.kind == "gpu" and self.runner.model.device.type == "cuda":
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
    """transformers' causal LM `model` on `device`, timed as the engine is: `generate` and one forward."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device

    @classmethod
    def from_gguf(cls, path: Path, device: torch.device, dtype: torch.dtype) -> TransformersBaseline:
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                        attn_implementation="sdpa").to(device).eval(), device)

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


def _alternate(measure, ours, bases: dict, repeats: int, key: str = "tokens_per_s", ratio: bool = True) -> dict:
    """Medians of `measure(x)` for ours and each baseline, run alternately (ours, then each baseline,
    `repeats` times), so a shared machine's load falls on all of them alike. A baseline that
    crashes drops out of the row (its error under `<name>_error`); `ratio` is ours over the first
    baseline that finished (a higher-is-better figure), `<name>_ratio` over each, and `ratio_vs_fastest`
    over the best of them (llama.cpp's plain run beat its defaults by 1.8x at prefill on a Zen 4)."""
    runs: dict[str, list[float]] = {"hybridgate": [], **{name: [] for name in bases}}
    row: dict = {}
    for _ in range(repeats):
        runs["hybridgate"].append(measure(ours))
        for name, base in bases.items():
            if f"{name}_error" in row:
                continue
            try:
                runs[name].append(measure(base))
            except RuntimeError as exc:
                row[f"{name}_error"] = str(exc)
    mine = statistics.median(runs["hybridgate"])
    row[f"hybridgate_{key}"] = mine
    for name, values in runs.items():
        if name == "hybridgate" or not values or f"{name}_error" in row:
            continue
        row[f"{name}_{key}"] = statistics.median(values)
        if ratio:
            row[f"{name}_ratio"] = mine / row[f"{name}_{key}"]
            row.setdefault("ratio", row[f"{name}_ratio"])
            row["ratio_vs_fastest"] = min(row.get("ratio_vs_fastest", row[f"{name}_ratio"]), row[f"{name}_ratio"])
    return row


def run(args: argparse.Namespace) -> dict:
    """The bench as `bench engine` runs it: the engine and its baselines built, then the measurements in
    turn (throughput, the batch-1 step, TTFT), `out` printed as it fills and written to `--json`."""
    settings = resolve(args).settings
    cpu = settings.worker.kind == "cpu"
    baseline = _check_args(args, settings, cpu)
    path = _model_path(args, settings)
    threads = affinity.pin_engine(settings.worker.engine)  # before the weights are read and any thread starts
    model = load_gguf(path)
    tokenizer = Tokenizer.from_model(model)
    build = _numba_bench if cpu else _torch_bench
    ours, out = build(model, settings.worker.engine, threads)
    out["baseline"] = baseline
    if args.profile_out:
        return write_profile(args, ours, out, model)
    if args.constrained_fraction is not None:
        from hybridgate.bench import constrained

        count = args.concurrency[-1] if args.concurrency_given else 16
        return constrained.run(args, ours, prompts(tokenizer, count, args.prompt_len), out)
    if args.mixed_load:
        return _mixed_load(args, ours, out, tokenizer, settings)
    from hybridgate.bench.machine import describe

    out.update({"model": str(path), "machine": describe(), "repeats": args.repeats, "decode": {}, "prefill": {}})
    bases = _baselines(args, baseline, path, out)
    _throughput(args, ours, bases, tokenizer, out)
    step_prompt = prompts(tokenizer, 1, args.prompt_len)[0]
    paired = _decode_step(args, ours, bases, step_prompt, out)
    if args.compare_eager and not cpu and out["device"].startswith("cuda"):
        eager = EngineBench.torch(model, torch.device(out["device"]), getattr(torch, out["dtype"]), "2GiB",
                                  enforce_eager=True)
        out["decode_step_ms_c1_eager"] = _median(lambda: eager.decode_step_ms(step_prompt), args.repeats)
        print(f"decode step at batch 1, eager: {out['decode_step_ms_c1_eager']:.3f} ms", flush=True)
    _ttft(args, ours, tokenizer, out)
    _scaling(out)
    for b in bases.values():
        if hasattr(b, "close"):
            b.close()
    out["peak_rss_mib"] = _peak_rss_mib()
    print(f"peak RSS: {out['peak_rss_mib']:.0f} MiB" + (
        f" ({out['peak_rss_mib_before_baseline']:.0f} MiB before the baseline loaded)"
        if "peak_rss_mib_before_baseline" in out else ""), flush=True)
    if cpu:
        report_bandwidth(out, paired)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


def _check_args(args: argparse.Namespace, settings, cpu: bool) -> str:
    """The baseline to run ("none", "transformers" or "llama-cpp"), after the runner's defaults are applied.

    Raises:
        ValueError: naming the flag, for a baseline of the other runner, --shape with --model, or --tiny.
    """
    apply_defaults(args, "cpu" if cpu else "gpu")
    baseline = "none" if args.no_baseline else (args.baseline or ("none" if cpu else "transformers"))
    if baseline == "transformers" and cpu:
        raise ValueError("--baseline transformers: only with --kind gpu (use llama-cpp for the CPU runner)")
    if baseline == "llama-cpp" and not cpu:
        raise ValueError("--baseline llama-cpp: only with --kind cpu")
    if args.shape and settings.model:
        raise ValueError("--shape and --model: name one model file, not both")
    if getattr(args, "tiny", False):
        raise ValueError("--tiny: only with --kind gpu --shape")
    return baseline


def _model_path(args: argparse.Namespace, settings) -> Path:
    """`--model`, or the random-weight file of `--shape` in the `--quant` mix (written once, then reused)."""
    if not args.shape:
        return Path(settings.model_path)
    from hybridgate.bench.model_files import named_bench_model

    path = named_bench_model(args.shape, args.quant, args.seed, args.layers)
    print(f"model: {path}", flush=True)
    return path


def _numba_bench(model, engine: EngineConfig, threads: int | None) -> tuple[EngineBench, dict]:
    """The CPU runner on its ISA path and thread policy, and the opening of its report."""
    from hybridgate.workers.cpu import isa, threadwait

    isa.select(engine.cpu_isa, engine.cpu_amx)
    try:
        threadwait.select(engine.cpu_thread_wait)
    except RuntimeError as exc:  # in a process whose Numba threads already run (a test session)
        log.warning("%s; the bench keeps the policy in force", exc)
    import numba

    from hybridgate.workers.cpu.runner import NumbaRunner

    runner = NumbaRunner(model, engine.kv_cache_memory or "1GiB", threads=threads,
                         activations=engine.cpu_activations, kv_cache_dtype=engine.kv_cache_dtype,
                         thread_fallback=engine.cpu_thread_fallback)
    kernels = runner.prompt_kernels
    print(f"CPU kernels: {runner.cpu_isa} path, activations {runner.cpu_activations}, KV cache {runner.kv_dtype.name}"
          f"{f', {kernels} for prompts of {runner.long_prompt}+ tokens' if kernels else ''}"
          f"{f' ({runner.expert_long_prompt}+ in the experts)' if kernels and runner.expert_long_prompt else ''}",
          flush=True)
    out = {"kind": "cpu", "cpu_isa": runner.cpu_isa, "threads": numba.get_num_threads(),
           "cpu_activations": runner.cpu_activations, "kv_cache_dtype": runner.kv_dtype.name,
           "cpu_amx": "AMX-BF16" in (kernels or ""), "cpu_prompt_kernels": kernels,
           "cpu_long_prompt": runner.long_prompt,
           "cpu_expert_long_prompt": runner.expert_long_prompt}
    return EngineBench(runner, model_fingerprint(model)), out


def _torch_bench(model, engine: EngineConfig, threads: int | None) -> tuple[EngineBench, dict]:
    """The torch runner (bf16 on CUDA, float32 on the CPU device), and the opening of its report."""
    device = torch.device(engine.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if threads:
        torch.set_num_threads(threads)
    ours = EngineBench.torch(model, device, dtype, engine.kv_cache_memory,
                             gpu_memory_utilization=engine.gpu_memory_utilization)
    return ours, {"kind": "gpu", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                  "threads": torch.get_num_threads()}


def _baselines(args: argparse.Namespace, baseline: str, path: Path, out: dict) -> dict:
    """The baselines by name: transformers on our device and dtype, llama.cpp's configurations, or none."""
    if baseline == "transformers":
        return {"transformers": TransformersBaseline.from_gguf(path, torch.device(out["device"]),
                                                               getattr(torch, out["dtype"]))}
    if baseline == "llama-cpp":
        out["peak_rss_mib_before_baseline"] = _peak_rss_mib()  # the baselines run in their own processes
        from hybridgate.bench.llama_baseline import start_baselines

        return start_baselines(path, out, max(args.concurrency), args.llama_cpp_path)
    return {}


def _throughput(args: argparse.Namespace, ours: EngineBench, bases: dict, tokenizer, out: dict) -> None:
    """Decode tokens/s at each concurrency and prefill tokens/s at each length, alternated with the baselines."""
    for c in args.concurrency:
        batch = prompts(tokenizer, c, args.prompt_len)
        out["decode"][c] = row = _alternate(lambda b: b.decode(batch, args.new_tokens), ours, bases, args.repeats)
        _print("decode", f"c={c}", row)
    for length in args.prefill_lens:
        batch = prompts(tokenizer, args.prefill_prompts, length)
        row = _alternate(lambda b: b.prefill(batch), ours, bases, args.repeats)
        if out["kind"] == "gpu":
            row["hybridgate_tflops"] = 2 * ours.runner.model.weight_bytes / ours.runner.model.embed.element_size() \
                * row["hybridgate_tokens_per_s"] / 1e12  # 2 x weights x tokens / s (attention excluded)
        out["prefill"][f"{args.prefill_prompts}x{length}"] = row
        _print("prefill", f"{args.prefill_prompts}x{length}", row)


def _decode_step(args: argparse.Namespace, ours: EngineBench, bases: dict, step_prompt: list[int],
                 out: dict) -> list[tuple[float, float]]:
    """The batch-1 decode step in ms (the CPU runner's beside llama.cpp's, each of ours after a bandwidth
    probe, and the weights it reads); returns the (GB/s probed just before, our step's ms) pairs."""
    cpu = out["kind"] == "cpu"
    paired: list[tuple[float, float]] = []
    with BandwidthProbe(args.bandwidth_mib, out["threads"]) if cpu else contextlib.nullcontext() as probe:

        def step_ms(b) -> float:
            if b is not ours or probe is None:
                return b.decode_step_ms(step_prompt)
            gb_per_s = probe.measure()
            ms = b.decode_step_ms(step_prompt)
            paired.append((gb_per_s, ms))
            return ms

        steps = _alternate(step_ms, ours, bases if cpu else {}, args.repeats, key="decode_step_ms", ratio=False)
    out["decode_step_ms_c1"] = steps.pop("hybridgate_decode_step_ms")
    print(f"decode step at batch 1: {out['decode_step_ms_c1']:.3f} ms", flush=True)
    if not cpu:
        return paired
    model = ours.runner.model
    weights = getattr(model, "batch1_bytes", model.weight_bytes)  # a mixture of experts reads the chosen ones
    out["weight_bytes_read_per_step"] = weights
    out["weight_bytes_held"] = model.weight_bytes
    out["weight_read_gb_per_s_c1"] = weights / out["decode_step_ms_c1"] / 1e6
    print(f"weights read per step: {weights / 2**20:.1f} MiB ({out['weight_read_gb_per_s_c1']:.1f} GB/s at "
          "batch 1)", flush=True)
    for name, ms in steps.items():
        if name.endswith("_decode_step_ms"):
            out[f"{name}_c1"] = ms
            print(f"{name.removesuffix('_decode_step_ms')} decode step at batch 1: {ms:.3f} ms", flush=True)
    if args.type_shares:
        from hybridgate.bench.type_shares import print_shares

        print_shares(out, ours.runner.model, args.repeats)
    return paired


def _ttft(args: argparse.Namespace, ours: EngineBench, tokenizer, out: dict) -> None:
    """Time to first token of a `--ttft-len` prompt, cold and then from the prefix cache (medians)."""
    ttfts = [ours.ttft(prompts(tokenizer, 1, args.ttft_len)[0]) for _ in range(args.repeats)]
    cold, cached = statistics.median(t[0] for t in ttfts), statistics.median(t[1] for t in ttfts)
    out["ttft"] = {"prompt_tokens": args.ttft_len, "cold_ms": cold * 1e3, "cached_ms": cached * 1e3,
                   "cached_over_cold": cached / cold}
    _print("ttft", f"{args.ttft_len} tokens", out["ttft"])


def _scaling(out: dict) -> None:
    """Decode tokens/s at c=16 over c=1 (and, on the CPU, over llama.cpp's single stream), when both ran."""
    if 1 not in out["decode"] or 16 not in out["decode"]:
        return
    out["decode_scaling_16_over_1"] = (out["decode"][16]["hybridgate_tokens_per_s"]
                                       / out["decode"][1]["hybridgate_tokens_per_s"])
    print(f"decode scaling c=16 / c=1: {out['decode_scaling_16_over_1']:.2f}x")
    first = out["decode"][1]
    single = first.get("llama_cpp_defaults_tokens_per_s") or first.get("llama_cpp_plain_tokens_per_s")
    if out["kind"] == "cpu" and single:
        out["c16_over_llama_cpp_c1"] = out["decode"][16]["hybridgate_tokens_per_s"] / single
        print(f"c=16 over llama.cpp's single stream: {out['c16_over_llama_cpp_c1']:.2f}x")


def _mixed_load(args: argparse.Namespace, ours: EngineBench, out: dict, tokenizer, settings) -> dict:
    from hybridgate.bench import mixload

    if out["kind"] != "cpu":
        raise ValueError("--mixed-load: only with --kind cpu")
    report = mixload.run(args, ours, out, settings, prompts(tokenizer, 1, args.prompt_len)[0],
                         prompts(tokenizer, 2, args.long_prompt)[1])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


PROFILE_PREFILL_LENS = (16, 64, 256, 1024, 2048)
PROFILE_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def write_profile(args: argparse.Namespace, ours: EngineBench, out: dict, model) -> dict:
    """Measure the step tables at serve's scheduler defaults and write them as a `bench sim` profile."""
    import shlex
    import sys

    from hybridgate.bench.machine import describe

    engine = EngineCore(ours.runner, SchedulerConfig(), ours.fingerprint, prefix_caching=False)
    engine.measure_rates(PROFILE_PREFILL_LENS, PROFILE_DECODE_BATCHES, decode_steps=6)
    mc = model.config
    element = 2 if out.get("dtype") in ("bfloat16", "float16") else 4
    profile = {
        "name": Path(args.profile_out).stem.removeprefix("profile-"), "kind": out["kind"],
        "decode_step_s": {str(k): v for k, v in sorted(engine.rates.decode.medians.items())},
        "prefill_tokens_per_s": {str(k): v for k, v in sorted(engine.rates.prefill.medians.items())},
        "blocks_total": ours.runner.num_blocks, "block_size": engine.allocator.block_size,
        "max_num_seqs": engine.scheduler.config.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
        "kv_bytes_per_token": 2 * element * mc.num_layers * mc.num_kv_heads * mc.head_dim,
        "source": f"measured by `hybridgate bench {shlex.join(sys.argv[2:])}` (medians of 6 steps per size)",
        "model": Path(model.path).name, "machine": describe(), **{k: v for k, v in out.items() if k != "kind"},
    }
    Path(args.profile_out).write_text(json.dumps(profile, indent=1) + "\n")
    print(f"profile: {args.profile_out}: decode step s by batch {profile['decode_step_s']}, prefill tokens/s "
          f"by step tokens {profile['prefill_tokens_per_s']}, {profile['blocks_total']} blocks", flush=True)
    return profile


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _print(kind: str, case: str, row: dict) -> None:
    print(f"{kind:8} {case:12} " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in row.items()), flush=True)
