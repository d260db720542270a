"""Measure `hybridgate serve` from the outside: time to READY, TTFT, decode rate, 8-way aggregate.

    .venv/bin/python bench/serve_client.py [--runs 3] [--threads N] [--json OUT]

Starts `hybridgate serve` itself (each start timed from exec to READY), then
over gRPC: one 128-token request (temperature 0, ignore_eos) for TTFT and
decode tokens/s (tokens after the first / time after the first), and 8 such
requests at once for aggregate tokens/s. Reports medians over `--runs`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc

HYBRIDGATE = str(Path(sys.executable).parent / "hybridgate")


def start_serve(threads: int | None) -> tuple[subprocess.Popen, str, float]:
    args = [HYBRIDGATE, "serve", "--port", "0"] + (["--threads", str(threads)] if threads else [])
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = None
    for line in proc.stdout:
        if m := re.search(r"gRPC on [\d.]+:(\d+)", line):
            port = m.group(1)
        if "hybridgate: READY" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, f"127.0.0.1:{port}", time.monotonic() - start
    raise RuntimeError("serve exited before READY")


def one_request(stub, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tokens/s after the first token, tokens)."""
    start = time.monotonic()
    first = last = None
    n = 0
    for msg in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=tokens, temperature=0, ignore_eos=True)):
        now = time.monotonic()
        first = first or now
        last, n = now, n + len(msg.token_ids)
    return first - start, (n - 1) / (last - first), n


def concurrent(stub, k: int, tokens: int) -> float:
    """Aggregate tokens/s of k requests sent together."""
    counts = [0] * k

    def run(i):
        counts[i] = one_request(stub, f"Write a story about the number {i}.", tokens)[2]

    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="serve starts (and request rounds) to take medians over")
    ap.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    ready, ttft, decode, agg8 = [], [], [], []
    for _ in range(args.runs):
        proc, target, t_ready = start_serve(args.threads)
        ready.append(t_ready)
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(target))
        one_request(stub, "warm-up", 4)
        t, d, _ = one_request(stub, "Once upon a time", args.tokens)
        ttft.append(t), decode.append(d)
        agg8.append(concurrent(stub, 8, args.tokens))
        proc.terminate()
        proc.wait()
    figures = {
        "time_to_ready_s": ready, "ttft_ms_median": statistics.median(ttft) * 1e3,
        "decode_tokens_per_s_median": statistics.median(decode),
        "aggregate_tokens_per_s_8_concurrent_median": statistics.median(agg8), "tokens_per_request": args.tokens,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
