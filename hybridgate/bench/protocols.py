"""`hybridgate bench serve --compare-protocols`: the gRPC door and the OpenAI HTTP door side by side.

One `serve`, the same model and worker behind both doors; the load generator
alternates the protocol run by run (and which goes first, pair by pair), so a
drift of the machine's speed falls on both alike. Two cases:

- one stream: one request at a time (`--compare-max-tokens` ids, `ignore_eos`);
  per request its decode tokens/s from the token counts of its messages and
  their arrival times (`workload.Outcome.decode_tokens_per_s`: the ids after
  the first message's over the time to the message with the last id; gRPC
  counts by token_index, HTTP by each chunk's usage), never from how many
  messages came: ids coalesce into fewer messages when a door falls behind, and
  (tokens − 1) / (e2e − TTFT) then credited a first message holding most ids
  with a near-zero decode time (a 463x HTTP/gRPC ratio on a busy machine).
  TTFT, where HTTP's per-request connection cost lands, is reported on its own;
- N streams at once (`--compare-concurrency`): aggregate tokens/s, streamed ids
  over the time from the first send to the last final message.

Per run the gateway process's CPU time (user + system, from /proc) over the ids
streamed is its CPU per streamed token. Every figure is a median over
`--compare-pairs` pairs, and each ratio (HTTP / gRPC) is the median of the
pairs' ratios.
"""

from __future__ import annotations

import os
import statistics
import time

from hybridgate.bench import workload as wl

PROMPT_TOKENS = 64


def gateway_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one_run(client, pid: int, streams: int, max_tokens: int, time_limit: float) -> dict:
    items = [wl.WorkItem("compare", PROMPT_TOKENS, max_tokens)] * streams
    cpu0, t0 = gateway_cpu_s(pid), time.perf_counter()
    outcomes = await client.run(items, [0.0] * streams, time_limit)
    wall, cpu = time.perf_counter() - t0, gateway_cpu_s(pid) - cpu0
    bad = [o for o in outcomes if not o.ended or o.error or o.tokens != max_tokens]
    if bad:
        o = bad[0]
        raise RuntimeError(f"a compared request failed: {o.error or 'cut off'} after {o.tokens} of {max_tokens} ids")
    tokens = sum(o.tokens for o in outcomes)
    end = max(o.arrival_s + o.e2e_s for o in outcomes)
    start = min(o.arrival_s for o in outcomes)
    return {"tokens_per_s": tokens / (end - start),
            "decode_tokens_per_s": _median_or_none([r for o in outcomes if (r := o.decode_tokens_per_s) is not None]),
            "ttft_s": statistics.median(o.ttft_s for o in outcomes),
            "gateway_cpu_us_per_token": cpu / tokens * 1e6, "wall_s": wall}


async def compare(clients: dict, pid: int, streams: int, pairs: int, max_tokens: int, time_limit: float,
                  progress=print) -> dict:
    """Alternate `clients` ({"grpc": ..., "openai": ...}) over `pairs` pairs of runs of `streams` requests at
    once. Returns per protocol the median of each figure, and per figure the median HTTP/gRPC ratio."""
    runs: dict[str, list[dict]] = {name: [] for name in clients}
    order = list(clients)
    for i in range(pairs):
        for name in (order if i % 2 == 0 else order[::-1]):
            r = await _one_run(clients[name], pid, streams, max_tokens, time_limit)
            runs[name].append(r)
            progress(f"  {streams} stream(s), pair {i + 1}/{pairs}, {name}: {r['tokens_per_s']:.1f} tokens/s, "
                     f"decode {_fmt(r['decode_tokens_per_s'])} tokens/s, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
                     f"gateway CPU {r['gateway_cpu_us_per_token']:.0f} us/token")
    keys = runs[order[0]][0].keys()
    out: dict = {name: {k: _median_or_none([r[k] for r in rs if r[k] is not None]) for k in keys}
                 for name, rs in runs.items()}
    out["runs"] = runs
    # A short run can use less gateway CPU than one clock tick (10 ms), and a run whose ids all came in one
    # message has no decode rate: such a pair has no ratio of that figure, and a figure no pair has a ratio of
    # is None.
    out["ratio_openai_over_grpc"] = {k: _median_or_none([h[k] / g[k] for g, h in zip(runs["grpc"], runs["openai"])
                                                          if g[k] and h[k] is not None]) for k in keys}
    return out


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


async def run_compare(bench, proc, clients: dict) -> dict:
    """The two cases (see the module docstring) against the running `proc`; prints a line per figure."""
    args = bench.args
    report = {}
    for label, streams in (("one_stream", 1), ("concurrent", args.compare_concurrency)):
        max_tokens = args.compare_max_tokens if streams == 1 else max(8, args.compare_max_tokens // 4)
        print(f"{label}: {streams} stream(s) of {max_tokens} ids, {args.compare_pairs} gRPC/HTTP pairs", flush=True)
        r = await compare(clients, proc.proc.pid, streams, args.compare_pairs, max_tokens, args.time_limit,
                          progress=lambda s: print(s, flush=True))
        r.update(streams=streams, max_tokens=max_tokens, prompt_tokens=PROMPT_TOKENS)
        report[label] = r
        ratio = r["ratio_openai_over_grpc"]
        print(f"{label}: HTTP/gRPC tokens/s {_fmt(ratio['tokens_per_s'], '.3f')}, decode tokens/s "
              f"{_fmt(ratio['decode_tokens_per_s'], '.3f')}, TTFT {_fmt(ratio['ttft_s'], '.2f')}; gateway CPU per "
              f"token {_fmt(r['grpc']['gateway_cpu_us_per_token'], '.0f')} us (gRPC), "
              f"{_fmt(r['openai']['gateway_cpu_us_per_token'], '.0f')} us (HTTP)", flush=True)
    return report
