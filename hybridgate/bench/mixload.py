"""`hybridgate bench engine --kind cpu --mixed-load`: a running stream's inter-token gaps while a long
prompt is prefilled on the same engine, against the stream's unloaded ITL.

In-process, on the engine the worker runs (its scheduler settings, its rates
measured first as a worker does before READY). Cases, each `--repeats` times
with the gaps pooled:
- unloaded: one stream of `--prompt-len` tokens decoding `--new-tokens`
  tokens alone; its ITL p50 is the baseline;
- mixed: the same stream, and once it has 8 tokens a `--long-prompt`-token
  prompt arrives; the stream's gaps until that prompt's first token (p50,
  p99, max) and the prompt's TTFT;
- mixed, budget off: the same with --mixed-step-budget 0 (prompt chunks of
  the whole token budget), the behaviour before the step budget.
The target (issue 27): mixed p99 <= 4 x unloaded p50 + 50 ms.

`--busy-core` runs every case beside a process spinning on one core and adds
decode tokens/s at one sequence with the default threads against one thread,
alternately (target: the default threads >= 0.8 x one thread), the runner's thread fallback
(--cpu-thread-fallback) as configured, carrying on from the cases before as in a running worker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import subprocess
import sys
import time

from hybridgate.bench.machine import describe, summary
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.engine import EngineCore

WARM_TOKENS = 8  # the stream's tokens before the long prompt arrives


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


def _add(engine: EngineCore, rid: str, prompt: list[int], max_tokens: int):
    error = engine.add(AddRequest(rid, prompt, SamplingParams(temperature=0, ignore_eos=True), 0, max_tokens, -1))
    if error is not None:
        raise ValueError(f"--mixed-load: the engine refused the {rid} request: {error.message}")
    return engine.scheduler.waiting[-1]


def stream_alone(engine: EngineCore, prompt: list[int], new_tokens: int) -> list[float]:
    """The gaps (ms) between one stream's tokens, decoding alone."""
    stream, times = _add(engine, "stream", prompt, new_tokens), []
    while engine.has_work():
        if stream in engine.step():
            times.append(time.perf_counter())
    return _gaps_ms(times)


def stream_beside_prompt(engine: EngineCore, prompt: list[int],
                         long_prompt: list[int]) -> tuple[list[float], float, list[int]]:
    """(gaps in ms between the stream's tokens while the long prompt is prefilled, its TTFT in ms,
    the prompt tokens each step ran)."""
    # A token every step until the prompt is done: at most one step per prompt token.
    limit = engine.runner.max_model_len - len(prompt) - 1
    stream, times = _add(engine, "stream", prompt, min(len(long_prompt) + WARM_TOKENS + 1, limit)), []
    while len(times) < WARM_TOKENS and engine.has_work():
        if stream in engine.step():
            times.append(time.perf_counter())
    arrived = time.perf_counter()
    times = times[-1:]
    long, chunks = _add(engine, "long", long_prompt, 1), []
    while not long.status.finished:
        before = long.num_computed
        if stream in engine.step():
            times.append(time.perf_counter())
        chunks.append(long.num_computed - before)
    ttft = (time.perf_counter() - arrived) * 1e3
    engine.abort(["stream"])
    return _gaps_ms(times), ttft, chunks


def _row(gaps: list[float]) -> dict:
    return {"gaps": len(gaps), "p50_ms": statistics.median(gaps), "p99_ms": percentile(gaps, 99),
            "max_ms": max(gaps)}


def mixed_rows(ours, settings, prompt: list[int], long_prompt: list[int], args: argparse.Namespace) -> dict:
    """The three cases of the module docstring, with the target's bound and verdict."""
    scheduler = settings.worker.scheduler
    engines = {"budgeted": scheduler, "budget_off": dataclasses.replace(scheduler, mixed_step_budget=0)}
    engine = EngineCore(ours.runner, scheduler, ours.fingerprint, prefix_caching=False)
    engine.measure_rates()  # as a worker does before READY: the step budget reads these figures
    rates = (dict(engine.rates.prefill.medians), dict(engine.rates.decode.medians))
    alone = [g for _ in range(args.repeats) for g in stream_alone(engine, prompt, args.new_tokens)]
    out = {"unloaded": _row(alone), "rates": {"prefill_tokens_per_s": rates[0], "decode_step_s": rates[1]}}
    for name, config in engines.items():
        gaps, ttfts, chunks = [], [], []
        for _ in range(args.repeats):
            case = EngineCore(ours.runner, config, ours.fingerprint, prefix_caching=False)
            case.rates = engine.rates  # the measured figures, kept up to date by every case
            case.scheduler.cost = engine.scheduler.cost
            g, ttft, c = stream_beside_prompt(case, prompt, long_prompt)
            gaps, chunks = gaps + g, chunks + c
            ttfts.append(ttft)
        out[name] = {**_row(gaps), "long_prompt_ttft_ms": statistics.median(ttfts),
                     "prompt_steps": len(chunks) // args.repeats, "chunk_tokens_p50": statistics.median(chunks),
                     "chunk_tokens_max": max(chunks)}
    bound = 4 * out["unloaded"]["p50_ms"] + 50
    out["target_p99_ms"] = bound
    out["meets_target"] = out["budgeted"]["p99_ms"] <= bound
    out["p99_over_unloaded_p50"] = out["budgeted"]["p99_ms"] / out["unloaded"]["p50_ms"]
    return out


def threads_row(ours, prompt: list[int], default: int, args: argparse.Namespace) -> dict:
    """Decode tokens/s at one sequence on the `default` threads, the runner's thread fallback (when on)
    carrying on from the cases before as a running worker's does, and on one thread, alternately; medians."""
    import numba

    runner = ours.runner
    fallback, runs = runner.thread_fallback, {"default": [], "one": []}
    for _ in range(args.repeats):
        for name, n in (("default", fallback.current if fallback is not None else default), ("one", 1)):
            numba.set_num_threads(n)
            runner.thread_fallback = fallback if name == "default" else None
            runs[name].append(ours.decode([prompt], args.new_tokens))
    runner.thread_fallback = fallback
    row = {"threads": default, "thread_fallback": fallback is not None,
           "fallback_switches": fallback.switches if fallback is not None else 0,
           "fallback_threads_at_end": fallback.current if fallback is not None else default,
           "default_tokens_per_s": statistics.median(runs["default"]),
           "one_thread_tokens_per_s": statistics.median(runs["one"])}
    row["ratio"] = row["default_tokens_per_s"] / row["one_thread_tokens_per_s"]
    row["meets_target"] = row["ratio"] >= 0.8
    return row


@contextlib.contextmanager
def busy_core(on: bool):
    """A process spinning on one core while the block runs (nothing when `on` is false)."""
    if not on:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let the scheduler place it
        yield
    finally:
        hog.kill()
        hog.wait()


def run(args: argparse.Namespace, ours, out: dict, settings, prompt: list[int], long_prompt: list[int]) -> dict:
    """The mixed-load report: `out` (the runner's description) with `mixed_load`, and `busy_core_threads`
    under --busy-core; each printed as it is measured."""
    from hybridgate.workers.cpu import threadwait

    machine = describe()
    print(summary(machine), flush=True)
    out.update({"machine_at_start": machine, "repeats": args.repeats, "busy_core": args.busy_core,
                "cpu_thread_wait": threadwait.selected(),
                "cpu_thread_fallback": ours.runner.thread_fallback is not None, "long_prompt_tokens": len(long_prompt),
                "stream_prompt_tokens": len(prompt),
                "scheduler": dataclasses.asdict(settings.worker.scheduler)})
    with busy_core(args.busy_core):
        out["mixed_load"] = rows = mixed_rows(ours, settings, prompt, long_prompt, args)
        for name in ("unloaded", "budgeted", "budget_off"):
            print(f"mixed    {name:12} " + "  ".join(f"{k}={v:.1f}" for k, v in rows[name].items()), flush=True)
        print(f"target: p99 {rows['budgeted']['p99_ms']:.1f} ms <= 4 x unloaded p50 + 50 = "
              f"{rows['target_p99_ms']:.1f} ms: {'met' if rows['meets_target'] else 'missed'}", flush=True)
        if args.busy_core:
            out["busy_core_threads"] = t = threads_row(ours, prompt, out["threads"], args)
            print(f"busy core: decode at one sequence {t['default_tokens_per_s']:.1f} tokens/s on {t['threads']} "
                  f"threads, {t['one_thread_tokens_per_s']:.1f} on one: {t['ratio']:.2f}x (target >= 0.8)", flush=True)
    out["machine_at_end"] = describe()
    return out
