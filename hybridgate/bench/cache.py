"""`hybridgate bench cache`: what the response cache saves, measured side by side over gRPC.

Processes: a real CPU worker (`hybridgate worker`, the Numba runner), a
redis-server (started here from PATH unless `--redis-url` names one), and per
cache mode (`memory`, `redis`) a `hybridgate gateway --response-cache MODE`.
Per mode, with medians of `--repeats`:

- hit TTFT: the client's time from the call to the first message of a cached
  answer, beside one gRPC round trip to the same gateway (a grpc.health.v1
  Check, the baseline), and the difference;
- replay: the client's time to receive a `--replay-tokens` answer generated
  (the first request: a miss, timed once) and replayed (later requests), and
  their ratio;
- single-flight (memory mode): the worker's own step counters
  (`hybridgate:engine_steps_total`, and sequence-steps: steps weighted by batch
  size) for one request alone and for `--coalesce` identical ones sent at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from hybridgate.bench.machine import describe, summary

HYBRIDGATE = str(Path(sys.executable).parent / "hybridgate")


class _Proc:
    """A child `hybridgate` process whose output goes to a log file that we wait on."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self._out = open(log, "wb")
        self.popen = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", "HYBRIDGATE_LOG_LEVEL": "INFO"})

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log.read_text(errors="replace"))
            if match:
                return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.popen.args[1]}: no {pattern!r} within {timeout_s:g} s; see {self.log}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._out.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(folder: str) -> tuple[subprocess.Popen, str] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)


class _Gateway:
    def __init__(self, folder: Path, model: str, endpoint: str, mode: str, redis_url: str | None, timeout_s: float):
        import grpc

        from hybridgate.v1 import generation_pb2_grpc as pb_grpc

        argv = [HYBRIDGATE, "gateway", "--model", model, "--worker", endpoint, "--port", "0", "--http-port", "0",
                "--metrics-port", "0",
                "--response-cache", mode] + (["--redis-url", redis_url] if redis_url else [])
        self.proc = _Proc(argv, folder / f"gateway-{mode}.log")
        port = self.proc.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)", timeout_s).group(1)
        self.metrics_url = self.proc.wait_for(r"metrics on (http://\S+)", timeout_s).group(1)
        self.proc.wait_for(r"hybridgate: READY", timeout_s)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.GenerationStub(self.channel)

    def worker_work(self) -> tuple[float, float]:
        """(engine steps, sequence-steps) of the worker once it is idle and its counters have settled."""
        from prometheus_client.parser import text_string_to_metric_families

        last, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:
            steps = seq_steps = running = 0.0
            text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "hybridgate:engine_steps_total":
                        steps += s.value
                    elif s.name == "hybridgate:engine_steps_by_batch_size_total":
                        seq_steps += float(s.labels["batch_size"]) * s.value
                    elif s.name == "hybridgate:num_requests_running":
                        running += s.value
            if running == 0 and (steps, seq_steps) == last:
                return last
            last = (steps, seq_steps)
            time.sleep(0.3)  # past two heartbeats (100 ms)
        raise RuntimeError("the worker did not go idle within 60 s")

    def stop(self) -> None:
        self.channel.close()
        self.proc.stop()


def _request(question: str, max_tokens: int, ignore_eos: bool = False):
    from hybridgate.v1 import generation_pb2 as pb

    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]),
                              max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)


def _timed(gw: _Gateway, request) -> tuple[float, float, list]:
    """(seconds to the first message, seconds to the last, the messages) of one call."""
    start = time.perf_counter()
    first, messages = None, []
    for m in gw.stub.Generate(request, timeout=600):
        if first is None:
            first = time.perf_counter() - start
        messages.append(m)
    return first, time.perf_counter() - start, messages


def _round_trip(gw: _Gateway) -> float:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(gw.channel)
    start = time.perf_counter()
    health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    return time.perf_counter() - start


def measure_mode(gw: _Gateway, repeats: int, replay_tokens: int) -> dict:
    ms = (lambda s: s * 1e3)
    for _ in range(3):
        _round_trip(gw)  # the channel's connection and the server's first calls
    short = _request("What is the capital of France?", 8)
    miss_ttft, _, _ = _timed(gw, short)
    rtts, hits = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine load
        rtts.append(_round_trip(gw))
        ttft, _, messages = _timed(gw, short)
        if messages[-1].route != "cache":
            raise RuntimeError(f"expected a cache hit, got route {messages[-1].route!r}")
        hits.append(ttft)
    long = _request("Write a very long story about a lighthouse keeper.", replay_tokens, ignore_eos=True)
    _, generated, first = _timed(gw, long)
    replays = []
    for _ in range(repeats):
        _, total, messages = _timed(gw, long)
        if messages[-1].route != "cache" or len(messages) != len(first):
            raise RuntimeError("the replay differs from the generated stream")
        replays.append(total)
    rtt, hit, replay = statistics.median(rtts), statistics.median(hits), statistics.median(replays)
    return {"round_trip_ms": ms(rtt), "hit_ttft_ms": ms(hit), "hit_ttft_minus_round_trip_ms": ms(hit - rtt),
            "miss_ttft_ms": ms(miss_ttft), "replay_tokens": replay_tokens, "replay_messages": len(first),
            "generate_s": generated, "replay_s": replay, "replay_speedup": generated / replay}


def measure_coalescing(gw: _Gateway, n: int, tokens: int) -> dict:
    before = gw.worker_work()
    _timed(gw, _request("Count to one hundred.", tokens, ignore_eos=True))
    after_one = gw.worker_work()
    request = _request("Count to two hundred.", tokens, ignore_eos=True)
    barrier = threading.Barrier(n)
    errors = []

    def one() -> None:
        barrier.wait()
        try:
            _timed(gw, request)
        except Exception as exc:  # reported, never hidden
            errors.append(repr(exc))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after_n = gw.worker_work()
    one_steps = [a - b for a, b in zip(after_one, before)]
    n_steps = [a - b for a, b in zip(after_n, after_one)]
    return {"requests": n, "max_tokens": tokens, "errors": errors,
            "one_alone": {"steps": one_steps[0], "sequence_steps": one_steps[1]},
            "coalesced": {"steps": n_steps[0], "sequence_steps": n_steps[1]},
            "worker_time_ratio": n_steps[1] / one_steps[1] if one_steps[1] else None}


def run(args) -> dict:
    from hybridgate.config import resolve

    model = resolve(args).settings.model_path
    machine = describe()
    print(summary(machine), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="hybridgate-bench-"))  # mode 0700: the ipc socket's private folder
    endpoint = f"ipc://{folder}/w0.sock"
    worker = _Proc([HYBRIDGATE, "worker", "--model", model, "--endpoint", endpoint, "--threads", str(args.threads),
                    "--worker-name", "cpu-0"], folder / "worker.log")
    redis = None
    report = {"benchmark": "cache", "machine": machine, "repeats": args.repeats, "modes": {}}
    try:
        worker.wait_for(r"hybridgate worker: READY", args.startup_timeout)
        redis_url = args.redis_url
        if not redis_url:
            redis = _start_redis(str(folder))
            redis_url = redis[1] if redis is not None else None
        for mode in ("memory", "redis"):
            if mode == "redis" and not redis_url:
                print("redis: skipped (no --redis-url and no redis-server on PATH)", flush=True)
                continue
            gw = _Gateway(folder, model, endpoint, mode, redis_url if mode == "redis" else None, args.startup_timeout)
            try:
                row = measure_mode(gw, args.repeats, args.replay_tokens)
                if mode == "memory":
                    report["coalescing"] = measure_coalescing(gw, args.coalesce, args.coalesce_tokens)
            finally:
                gw.stop()
            report["modes"][mode] = row
            print(f"{mode}: hit TTFT {row['hit_ttft_ms']:.2f} ms = one gRPC round trip {row['round_trip_ms']:.2f} ms "
                  f"+ {row['hit_ttft_minus_round_trip_ms']:.2f} ms (miss TTFT {row['miss_ttft_ms']:.1f} ms); "
                  f"{row['replay_tokens']} tokens generated in {row['generate_s']:.2f} s, replayed in "
                  f"{row['replay_s'] * 1e3:.1f} ms ({row['replay_speedup']:.0f}x)", flush=True)
        c = report.get("coalescing")
        if c is not None:
            print(f"single-flight: {c['requests']} identical requests took {c['coalesced']['steps']:.0f} steps "
                  f"({c['coalesced']['sequence_steps']:.0f} sequence-steps); one alone {c['one_alone']['steps']:.0f} "
                  f"({c['one_alone']['sequence_steps']:.0f}): {c['worker_time_ratio']:.2f}x the worker time"
                  + (f"; errors: {c['errors']}" if c["errors"] else ""), flush=True)
    finally:
        worker.stop()
        if redis is not None:
            redis[0].terminate()
            redis[0].wait(10)
        shutil.rmtree(folder, ignore_errors=True)
    report["loadavg_after"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report
