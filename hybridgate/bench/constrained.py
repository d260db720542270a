"""`hybridgate bench engine --constrained-fraction F [--schema FILE]`: what constraints cost the engine.

In one process, alternately, `--repeats` times: a batch of c sequences (`--concurrency`, default 16)
decoded unconstrained, and the same batch with round(F * c) of them constrained by the JSON schema
(compiled as `start: %json SCHEMA`, as a request's json_schema is). Both sample at temperature 1.0
with the same seeds. Reported, medians:
- decode tokens/s at the full batch: c / the median time of the decode steps that ran all c
  sequences, the same steps in both runs (constrained ones end when their grammar does, so later
  steps are smaller), and the ratio constrained / unconstrained (issue 28's target: >= 0.9);
- mask fill time per sequence and step, p50 and p99 (the fill runs on a thread beside the forward
  pass; target p50 <= 50 us, p99 <= 500 us), and the time sampling waited for it per step;
- grammar compile time of the schema, cold (a fresh compiler, its tokenizer built first) and
  cached (the same text again: a cache hit), milliseconds.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from hybridgate.wire import AddRequest, Constraint, SamplingParams

# A typical tool's parameters: what a function-calling client sends.
DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "city and country"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}


def _decode_step_times(engine, prompts: list[list[int]], params: list[SamplingParams], new_tokens: int) -> list[float]:
    """Seconds of each decode step that ran every sequence of the batch."""
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add(AddRequest(str(i), ids, p, 1000 + i, new_tokens, -1))
    times = []
    while engine.has_work():
        running = engine.scheduler.running
        full = len(running) == len(prompts) and all(s.output_ids for s in running)
        started = time.perf_counter()
        engine.step()
        if full:
            times.append(time.perf_counter() - started)
    return times


def _compile_ms(ours, grammar: str) -> tuple[float, float]:
    """(cold, cached) compile of `grammar` in milliseconds, on a fresh compiler whose tokenizer is built first."""
    from hybridgate.workers.engine import default_constraints

    constraints = default_constraints(ours.runner)
    compiler = constraints.compiler
    try:
        compiler.tokenizer  # noqa: B018 (built before the clock starts)
        started = time.perf_counter()
        compiler.submit(grammar).result()
        cold = time.perf_counter() - started
        started = time.perf_counter()
        compiler.submit(grammar).result()
        return cold * 1e3, (time.perf_counter() - started) * 1e3
    finally:
        constraints.close()


def run(args, ours, prompts: list[list[int]], out: dict) -> dict:
    """Measure (see the module doc) with `ours` (an `EngineBench`); figures go into `out` and are returned."""
    schema = json.loads(Path(args.schema).read_text()) if args.schema else DEFAULT_SCHEMA
    grammar = "start: %json " + json.dumps(schema)
    constraint = Constraint(kind="json_schema", grammar=grammar)
    c = len(prompts)
    k = round(args.constrained_fraction * c)
    free = [SamplingParams(temperature=1.0, ignore_eos=True)] * c
    mixed = [SamplingParams(temperature=1.0, constraint=constraint)] * k + free[k:]
    rows: dict[str, list] = {"unconstrained": [], "constrained": [], "fill": [], "wait": [], "steps": []}
    for _ in range(args.repeats):
        times = {}
        for name, params in (("unconstrained", free), ("constrained", mixed)):
            engine = ours.engine()
            try:
                times[name] = _decode_step_times(engine, prompts, params, args.new_tokens)
                if name == "constrained":
                    stats = engine.refresh_stats()
                    rows["fill"] += list(engine.constraints.fill_times)
                    rows["wait"].append(stats.mask_wait_seconds_total / max(stats.steps, 1))
            finally:
                engine.constraints.close()
        # the same steps of both runs (the same context lengths): those while every sequence ran in both
        n = min(len(t) for t in times.values())
        rows["steps"].append(n)
        for name, t in times.items():
            rows[name].append(c / statistics.median(t[:n]) if n else 0.0)
    fill = sorted(rows["fill"])
    q = statistics.quantiles(fill, n=100, method="inclusive") if len(fill) > 1 else [0.0] * 99
    cold, cached = _compile_ms(ours, grammar)
    unconstrained, constrained = statistics.median(rows["unconstrained"]), statistics.median(rows["constrained"])
    out["constrained"] = result = {
        "concurrency": c, "constrained_sequences": k, "schema": args.schema or "default tool schema",
        "unconstrained_tokens_per_s": unconstrained, "constrained_tokens_per_s": constrained,
        "ratio": constrained / unconstrained if unconstrained else 0.0,
        "runs_unconstrained_tokens_per_s": rows["unconstrained"], "runs_constrained_tokens_per_s": rows["constrained"],
        "full_batch_steps": statistics.median(rows["steps"]),
        "mask_fill_us_p50": q[49] * 1e6, "mask_fill_us_p99": q[98] * 1e6, "mask_fills": len(fill),
        "mask_wait_ms_per_step": statistics.median(rows["wait"]) * 1e3,
        "compile_ms_cold": cold, "compile_ms_cached": cached,
    }
    print(f"decode at {c} sequences, {k} constrained: {constrained:.1f} tokens/s vs {unconstrained:.1f} "
          f"unconstrained (ratio {result['ratio']:.3f}; median over {args.repeats} runs, "
          f"{result['full_batch_steps']:.0f} full-batch steps each)", flush=True)
    print(f"mask fill per sequence-step: p50 {result['mask_fill_us_p50']:.1f} us, p99 "
          f"{result['mask_fill_us_p99']:.1f} us ({len(fill)} fills); sampling waited "
          f"{result['mask_wait_ms_per_step']:.3f} ms per step", flush=True)
    print(f"grammar compile: {cold:.2f} ms cold, {cached:.3f} ms cached", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out
