"""`hybridgate bench gateway`: what the gateway costs per streamed token.

Three processes, so that each one's CPU time is its own: an instant worker
(`hybridgate.bench.instant`: the real worker process and wire, a runner that
computes nothing), `hybridgate gateway` connected to it, and a client process
driving N concurrent gRPC streams (`ignore_eos`, `max_tokens` ids each). Per
concurrency it reports streamed tokens/s, response messages per token, the
gateway's CPU seconds per streamed token (utime + stime of the process and
all its threads, from /proc, over the measured window), the worker's and the
client's CPU per token beside it, and client-side TTFT and ITL percentiles
(ITL per token: a message of n ids after a gap t counts n gaps of t / n, as
SGLang's bench_serving counts them). `--protocol openai` drives the OpenAI-compatible HTTP door of
the same gateway instead (`/v1/completions`, server-sent events; a response
message is one SSE chunk, tokens are counted from the usage chunk, and ITL is
the gap between two chunks, one token each unless the door joined them).
`--tools` sends chats instead, alternately without and with a tool (`auto`,
the Hermes format): the instant worker streams a recorded tool-call generation
for the latter (`hybridgate.bench.instant.TOOL_TEXT`), which the gateway parses
into calls; it reports the medians' ratio, tools / no tools, of the gateway's
CPU per streamed token.

The client shares the machine's cores with the gateway: on a 2-core machine
the figure "gateway CPU per token" holds, the tokens/s is bounded by what the
three processes leave each other, and the output says how much CPU the client
and the worker took.

The gateway runs as it is deployed: with a bearer token that every call
carries (`--no-auth` to measure without), and the response cache off (the
bench's requests are deterministic and identical: a cache would replay them).
`--protocol grpc,openai` measures both doors of the same gateway, alternately,
`--repeats` times each, and ends with one line per door: the median gateway
CPU per streamed token. `--profile FILE` profiles the gateway over the
measured runs (`hybridgate.bench.profile`: cProfile, or callgrind's
instruction counts, which a busy machine does not disturb).
`--coalesce on,off` starts a gateway per mode of its output coalescing
(`--stream-coalesce`) on the same worker and measures them alternately, and
`--stream-interval N` is passed to every gateway; with `--grpc-floor` each
mode's gRPC door is set against the bare grpc.aio server's CPU per message:
what it adds per message, and per token less the floor's cost of the
messages it sent per token.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hybridgate.bench import safety
from hybridgate.bench.gateway_client import run_client
from hybridgate.bench.instant import run_instant_worker
from hybridgate.bench.machine import describe, summary
from hybridgate.bench.workload import percentile
from hybridgate.router.config import RouterConfig
from hybridgate.run.config import LayoutConfig

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid` and all its threads (Linux /proc; zeros elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS  # utime, stime (fields 14, 15 of stat(5))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and all its threads (Linux /proc; 0 elsewhere)."""
    return sum(cpu_times(pid))


def tree_cpu_times(pid: int) -> tuple[float, float]:
    """`cpu_times` of `pid` and of its living children (the other gateways of `--gateways N`), summed."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # field 4: ppid
                children.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    times = [cpu_times(p) for p in (pid, *children)]
    return sum(t[0] for t in times), sum(t[1] for t in times)


class _Gateway:
    """`hybridgate gateway` as a child process; `target` once it says READY. `token`: the bearer token it
    requires (None: none); `profiler`: a `hybridgate.bench.profile` profiler it runs under; `coalesce` and
    `stream_interval`: its --stream-coalesce and --stream-interval. Its response cache is off whatever the
    environment says."""

    def __init__(self, model: str, endpoint: str, timeout_s: float, gateways: int = LayoutConfig.gateways,
                 extra: tuple = (), tls_ca: str | None = None, token: str | None = None, profiler=None,
                 coalesce: bool = RouterConfig.stream_coalesce, stream_interval: int = RouterConfig.stream_interval):
        args = ["gateway", "--model", model, "--port", "0", "--http-port", "0", "--worker", endpoint,
                "--worker-startup-timeout", str(timeout_s), "--gateways", str(gateways), "--metrics-port", "0",
                "--response-cache", "off", "--stream-coalesce" if coalesce else "--no-stream-coalesce",
                "--stream-interval", str(stream_interval), *extra]
        self.coalesce, self.stream_interval = coalesce, stream_interval
        cmd = profiler.command(args) if profiler is not None else [sys.executable, "-m", "hybridgate.cli", *args]
        env = {k: v for k, v in os.environ.items() if k != safety.TOKEN_ENV}
        if token:
            env[safety.TOKEN_ENV] = token  # not a flag: a flag shows in the process list
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.tls_ca, self.token, self.profiler = tls_ca, token, profiler
        port = self._wait_for("hybridgate: gRPC on ", timeout_s).rsplit(":", 1)[1].split()[0]
        http = self._wait_for("hybridgate: OpenAI-compatible HTTP on ", timeout_s).split("://", 1)[1]
        self.http_target = http.split("/", 1)[0]
        self.metrics_url = self._wait_for("hybridgate: metrics on ", timeout_s).split()[-1]
        self._wait_for("hybridgate: READY", timeout_s)
        self.target = f"127.0.0.1:{port}"
        threading.Thread(target=self._drain, daemon=True).start()  # never let its pipe fill

    def _wait_for(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith(prefix):
                return line.strip()
        self.stop()
        raise RuntimeError(f"the gateway did not print {prefix!r}:\n{''.join(self.lines[-20:])}")

    def _drain(self) -> None:
        for _ in self.proc.stdout:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30 if self.profiler is None else 300)  # a profiler writes its file on the way out
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure(gateway: _Gateway, worker_pid: int, concurrency: int, requests: int, max_tokens: int,
            large_chat_bytes: int = 0, protocol: str = "grpc", tools: bool | None = None) -> dict:
    """One concurrency: the client's figures and the processes' CPU over the same window; with
    `large_chat_bytes`, chats of that size arrive meanwhile and the row has the loop's lag.
    `protocol`: the gRPC stream or the OpenAI HTTP door (`openai`) of the same gateway; `tools`: chats
    with a tool (True) or without (False) instead of a prompt (None). A gateway with a profiler is
    profiled over the measured run only (not the warm-up before it)."""
    tls = dict(tls_ca=gateway.tls_ca, token=gateway.token)
    target = gateway.http_target if protocol == "openai" else gateway.target
    run_client(target, concurrency, min(requests, 2 * concurrency), max_tokens, protocol=protocol, tools=tools,
                **tls)  # warm-up
    lag0 = safety.lag_buckets(gateway.metrics_url)
    chats = safety.LargeChats(gateway.target, large_chat_bytes, **tls) if large_chat_bytes else None
    if gateway.profiler is not None:
        gateway.profiler.start(gateway.proc.pid)
    (user0, sys0), wk0 = tree_cpu_times(gateway.proc.pid), cpu_seconds(worker_pid)
    r = run_client(target, concurrency, requests, max_tokens, protocol=protocol, tools=tools, **tls)
    (user, system), wk = tree_cpu_times(gateway.proc.pid), cpu_seconds(worker_pid) - wk0
    gw_sys = system - sys0
    gw = (user - user0) + gw_sys  # as `measure_floor`: the system share never exceeds the total by a rounding
    profiled = gateway.profiler.stop(gateway.proc.pid) if gateway.profiler is not None else {}
    large = chats.stop() if chats is not None else None
    lag = safety.lag_summary(lag0, safety.lag_buckets(gateway.metrics_url))
    tokens = r["tokens"]
    per_token = (lambda s: s / tokens * 1e6 if tokens else None)
    ms = (lambda v: v * 1e3 if v is not None else None)
    return {
        "concurrency": concurrency, "requests": requests, "max_tokens": max_tokens,
        "tokens": tokens, "messages": r["messages"], "errors": r["errors"], "short_streams": r["short"],
        "tool_calls": r["tool_calls"],
        "wall_s": r["wall_s"], "tokens_per_s": tokens / r["wall_s"] if r["wall_s"] else None,
        "messages_per_token": r["messages"] / tokens if tokens else None,
        "gateway_cpu_s": gw, "gateway_cpu_us_per_token": per_token(gw),
        "gateway_cpu_us_per_message": gw / r["messages"] * 1e6 if r["messages"] else None,
        "gateway_system_share": gw_sys / gw if gw else None,  # in the kernel (syscalls), which callgrind misses
        "worker_cpu_us_per_token": per_token(wk), "client_cpu_us_per_token": per_token(r["client_cpu_s"]),
        "ttft_ms": {f"p{q}": ms(percentile(r["ttft_s"], q / 100)) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": ms(percentile(r["itl_s"], q / 100)) for q in (50, 90, 99)},
        "tls": gateway.tls_ca is not None, "auth": gateway.token is not None, "protocol": protocol,
        "coalesce": gateway.coalesce, "stream_interval": gateway.stream_interval,
        "event_loop_lag": lag, "large_chats": large,
        "instructions_per_token": profiled["instructions"] / tokens if "instructions" in profiled and tokens else None,
        "profile_file": profiled.get("file"), "tools": tools,
    }


def run(args) -> list[dict]:
    from hybridgate.bench import profile
    from hybridgate.config import resolve

    _check(args)
    profiler = profile.make(args.profiler, args.profile) if args.profile else None
    repeats = args.repeats or (3 if args.tls or args.tools else 1)
    model = resolve(args).settings.model_path
    machine = describe()  # before the run loads it
    print(summary(machine), flush=True)
    folder = tempfile.mkdtemp(prefix="hybridgate-bench-")  # mode 0700: the ipc socket's private folder
    endpoint = f"ipc://{folder}/instant-0"
    worker = _start_worker(model, endpoint, args.step_ms)
    gateways: list[_Gateway] = []
    results, ratios, floors = [], [], []
    floor = None
    try:
        if args.grpc_floor:
            from hybridgate.bench.grpcfloor import FloorServer

            floor = FloorServer(args.step_ms / 1e3)
        gateways += _start_gateways(args, model, endpoint, folder, profiler)
        for concurrency in args.concurrency:
            if args.tools:
                ratios += [_tools_pair(args, gateways[0], worker.pid, concurrency, results, protocol, repeats)
                           for protocol in args.protocol]
            else:
                ratios += _side_by_side(args, gateways, worker.pid, concurrency, repeats, results, floor, floors)
    finally:
        for gateway in gateways:
            gateway.stop()
        if floor is not None:
            floor.stop()
        worker.terminate()
        worker.join(30)
        shutil.rmtree(folder, ignore_errors=True)
    _report(args, machine, results, ratios, floors)
    return results


def _check(args) -> None:
    """Refuse the combinations of flags that measure nothing sensible (SystemExit naming them)."""
    if args.tls and args.protocol != ["grpc"]:
        raise SystemExit("bench gateway: --tls measures the gRPC door; leave --protocol at grpc with it")
    if args.profile and (args.gateways > 1 or len(args.coalesce) > 1):
        raise SystemExit("bench gateway: --profile profiles one gateway process; leave --gateways at 1 and "
                         "--coalesce at one mode with it")
    if args.tls and (args.tools or len(args.coalesce) > 1):
        raise SystemExit("bench gateway: --tls, --tools and --coalesce on,off are separate comparisons; run them "
                         "one at a time")
    if args.grpc_floor and (args.tls or args.tools or "grpc" not in args.protocol or not args.step_ms):
        raise SystemExit("bench gateway: --grpc-floor compares the plaintext gRPC door, a worker step at a time: "
                         "it needs --step-ms > 0 and grpc among --protocol, and not --tls or --tools")


def _start_worker(model: str, endpoint: str, step_ms: float):
    from hybridgate.workers.process import WorkerConfig

    worker = mp.get_context("spawn").Process(
        target=run_instant_worker, name="bench-instant-worker",
        args=(WorkerConfig(model_path=model, endpoint=endpoint, parent_pid=os.getpid(), name="instant-0"),
              step_ms / 1e3))
    worker.start()
    return worker


def _start_gateways(args, model: str, endpoint: str, folder: str, profiler) -> list[_Gateway]:
    """One gateway per `--coalesce` mode on the same worker, and with `--tls` one more beside the first."""
    token = safety.new_token() if args.auth else None
    tools = ("--tool-call-format", "hermes") if args.tools else ()
    gateways = [_Gateway(model, endpoint, args.startup_timeout, args.gateways, token=token, profiler=profiler,
                         extra=tools, coalesce=coalesce, stream_interval=args.stream_interval)
                for coalesce in args.coalesce]
    if args.tls:  # beside it on the same worker: TLS with a self-signed certificate, and a bearer token
        cert, key = safety.self_signed(folder)
        gateways.append(_Gateway(model, endpoint, args.startup_timeout, args.gateways,
                                 extra=("--tls-cert", cert, "--tls-key", key), tls_ca=cert,
                                 token=token or safety.new_token(), coalesce=args.coalesce[0],
                                 stream_interval=args.stream_interval))
    return gateways


def _side_by_side(args, gateways: list[_Gateway], worker_pid: int, concurrency: int, repeats: int,
                  results: list[dict], floor, floors: list[dict]) -> list[dict]:
    """`repeats` rounds at one concurrency, each door of each gateway (coalescing on, off; plaintext, TLS)
    in turn and then the floor server; the rows go to `results` and `floors`. Returns the TLS ratio, if any."""
    rows: dict[bool, list[dict]] = {False: [], True: []}
    requests = max(args.requests, concurrency)
    for _ in range(repeats):
        for protocol in args.protocol:  # the doors, alternately
            for gateway in gateways:  # side by side, alternately
                row = measure(gateway, worker_pid, concurrency, requests, args.max_tokens, args.large_chat_bytes,
                              protocol)
                rows[row["tls"]].append(row)
                results.append(row)
                _print_row(row)
        if floor is not None:
            floors.append(measure_floor(floor, concurrency, requests, args.max_tokens))
            _print_floor(floors[-1])
    if not args.tls:
        return []
    ratio = _tls_ratio(concurrency, rows[False], rows[True])
    print(f"concurrency {concurrency:>4}: TLS + auth / plaintext{' + auth' if args.auth else ''} "
          f"tokens/s = {ratio['ratio']:.3f} (medians of {len(rows[True])}: "
          f"{ratio['tls_tokens_per_s']:.0f} / {ratio['plain_tokens_per_s']:.0f})", flush=True)
    return [ratio]


def _report(args, machine: dict, results: list[dict], ratios: list[dict], floors: list[dict]) -> dict:
    """Print the summaries per door and against the floor; write the JSON report (`--json`)."""
    doors = door_summary(results)
    for door in doors:
        _print_door(door, args.step_ms)
    floor_doors = floor_summary(floors, doors)
    for f in floor_doors:
        _print_floor_door(f, args.step_ms)
    report = {"benchmark": "gateway", "protocol": ",".join(args.protocol), "gateways": args.gateways,
              "step_ms": args.step_ms, "auth": args.auth, "response_cache": "off", "cpus": os.cpu_count(),
              "coalesce": [("on" if c else "off") for c in args.coalesce], "stream_interval": args.stream_interval,
              "machine": machine, "large_chat_bytes": args.large_chat_bytes,
              "profile": {"profiler": args.profiler, "file": args.profile} if args.profile else None,
              "results": results, "doors": doors, ("tools_ratios" if args.tools else "tls_ratios"): ratios,
              "grpc_floor": {"runs": floors, "summary": floor_doors} if args.grpc_floor else None}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def measure_floor(floor, concurrency: int, requests: int, max_tokens: int) -> dict:
    """One run of the same gRPC client against the grpc.aio floor server (`hybridgate.bench.grpcfloor`):
    its CPU per message (each message carries one id), user and system."""
    run_client(floor.target, concurrency, min(requests, 2 * concurrency), max_tokens)  # warm-up
    user0, sys0 = cpu_times(floor.pid)
    r = run_client(floor.target, concurrency, requests, max_tokens)
    user, system = cpu_times(floor.pid)
    messages = r["messages"]
    per = (lambda s: s / messages * 1e6 if messages else None)
    # the system share added to the user one, so that it never exceeds the total by a rounding (it did, by
    # 1e-13, when all of a run's CPU was system time)
    user_s, system_s = user - user0, system - sys0
    return {"concurrency": concurrency, "requests": requests, "max_tokens": max_tokens, "messages": messages,
            "errors": r["errors"], "wall_s": r["wall_s"], "cpu_us_per_message": per(user_s + system_s),
            "system_us_per_message": per(system_s)}


def floor_summary(floors: list[dict], doors: list[dict]) -> list[dict]:
    """Per concurrency and coalescing mode: the floor's median CPU per message beside the plaintext gRPC
    door's medians, and what the door adds above the floor: per message (its CPU per message less the
    floor's) and per token (its CPU per token less the floor's cost of the messages it sent per token;
    at one id a message the two are the same figure)."""
    import statistics

    out = []
    for c in dict.fromkeys(f["concurrency"] for f in floors):
        values = [f["cpu_us_per_message"] for f in floors if f["concurrency"] == c and f["cpu_us_per_message"]]
        floor_us = statistics.median(values) if values else None
        for door in [d for d in doors if d["concurrency"] == c and d["protocol"] == "grpc" and not d["tls"]]:
            per_token, per_message, mpt = (door[k] for k in ("gateway_cpu_us_per_token", "gateway_cpu_us_per_message",
                                                              "messages_per_token"))
            known = floor_us is not None and None not in (per_token, per_message, mpt)
            out.append({"concurrency": c, "coalesce": door["coalesce"], "runs": len(values),
                        "floor_cpu_us_per_message": floor_us, "gateway_cpu_us_per_token": per_token,
                        "gateway_cpu_us_per_message": per_message, "messages_per_token": mpt,
                        "gateway_less_floor_us": per_token - floor_us * mpt if known else None,
                        "gateway_less_floor_us_per_message": per_message - floor_us if known else None})
    return out


def _print_floor(f: dict) -> None:
    fmt = (lambda v: "-" if v is None else f"{v:.1f}")
    print(f"concurrency {f['concurrency']:>4}: grpc.aio floor {fmt(f['cpu_us_per_message'])} µs CPU/message "
          f"({fmt(f['system_us_per_message'])} µs of it system), {f['messages']} messages"
          + (f", {f['errors']} errors" if f["errors"] else ""), flush=True)


def _print_floor_door(f: dict, step_ms: float) -> None:
    fmt = (lambda v, spec=".1f": "-" if v is None else format(v, spec))
    print(f"bare grpc.aio server at concurrency {f['concurrency']}, step {step_ms:g} ms: "
          f"{fmt(f['floor_cpu_us_per_message'])} µs CPU a message (median of {f['runs']}); the gateway's gRPC door, "
          f"coalescing {'on' if f['coalesce'] else 'off'}: {fmt(f['gateway_cpu_us_per_message'])} µs a message, "
          f"{fmt(f['gateway_less_floor_us_per_message'])} above it; {fmt(f['gateway_cpu_us_per_token'])} µs a token, "
          f"{fmt(f['gateway_less_floor_us'])} above the floor's cost of its "
          f"{fmt(f['messages_per_token'], '.2f')} messages a token", flush=True)


def door_summary(results: list[dict]) -> list[dict]:
    """Per (concurrency, door, TLS, auth, coalescing, stream interval): the medians over its runs of the
    gateway's CPU per streamed token and per message (µs), its instructions per token (callgrind; None
    otherwise), messages per token, and the client's ITL p50 and p99 (ms)."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r["concurrency"], r["protocol"], r["tls"], r["auth"], r["coalesce"], r["stream_interval"])
        groups.setdefault(key, []).append(r)
    median = (lambda vs: statistics.median(v) if (v := [x for x in vs if x is not None]) else None)
    keys = ("gateway_cpu_us_per_token", "gateway_cpu_us_per_message", "instructions_per_token", "messages_per_token")
    return [{"concurrency": c, "protocol": p, "tls": tls, "auth": auth, "coalesce": coalesce,
             "stream_interval": interval, "runs": len(rows), **{k: median(r[k] for r in rows) for k in keys},
             "itl_ms": {q: median(r["itl_ms"][q] for r in rows) for q in ("p50", "p99")}}
            for (c, p, tls, auth, coalesce, interval), rows in groups.items()]


def _print_door(d: dict, step_ms: float) -> None:
    fmt = (lambda v, spec=".1f": "-" if v is None else format(v, spec))
    door = {"grpc": "gRPC", "openai": "OpenAI HTTP"}[d["protocol"]] + (" + TLS" if d["tls"] else "")
    print(f"per streamed token, {door:<11} at concurrency {d['concurrency']}, step {step_ms:g} ms, "
          f"auth {'on' if d['auth'] else 'off'}, response cache off, coalescing {'on' if d['coalesce'] else 'off'}"
          + (f", stream interval {d['stream_interval']}" if d["stream_interval"] > 1 else "")
          + f": gateway {fmt(d['gateway_cpu_us_per_token'])} µs CPU"
          + (f", {fmt(d['instructions_per_token'], ',.0f')} instructions"
             if d["instructions_per_token"] is not None else "")
          + f" ({fmt(d['gateway_cpu_us_per_message'])} a message, {fmt(d['messages_per_token'], '.2f')} messages/token;"
          f" ITL p50 {fmt(d['itl_ms']['p50'], '.2f')} ms p99 {fmt(d['itl_ms']['p99'], '.2f')} ms; median of "
          f"{d['runs']} run" + ("s)" if d["runs"] > 1 else ")"), flush=True)


# --- --tools: chats without and with a tool, alternately ---------------------------------------------------------

def _tools_pair(args, gateway: _Gateway, worker_pid: int, concurrency: int, results: list[dict], protocol: str,
                repeats: int) -> dict:
    """`--repeats` pairs of runs at one concurrency, without then with tools (which goes first swaps pair by
    pair); the medians of each side's gateway CPU per token and tokens/s, and their ratios, tools / no tools."""
    import statistics

    rows: dict[bool, list[dict]] = {False: [], True: []}
    for k in range(repeats):
        for tools in ((False, True) if k % 2 == 0 else (True, False)):
            row = measure(gateway, worker_pid, concurrency, max(args.requests, concurrency), args.max_tokens,
                          args.large_chat_bytes, protocol, tools=tools)
            rows[tools].append(row)
            results.append(row)
            _print_row(row)
    med = {t: {key: statistics.median(r[key] or 0.0 for r in rows[t])
               for key in ("gateway_cpu_us_per_token", "tokens_per_s")} for t in rows}
    ratio = {key: med[True][key] / med[False][key] if med[False][key] else None for key in med[True]}
    print(f"concurrency {concurrency:>4}: tools / no tools: gateway CPU per token "
          f"{med[True]['gateway_cpu_us_per_token']:.1f} / {med[False]['gateway_cpu_us_per_token']:.1f} µs = "
          f"{ratio['gateway_cpu_us_per_token'] or 0:.3f}, tokens/s {med[True]['tokens_per_s']:.0f} / "
          f"{med[False]['tokens_per_s']:.0f} = {ratio['tokens_per_s'] or 0:.3f} (medians of {repeats}, {protocol})",
          flush=True)
    return {"concurrency": concurrency, "tools": med[True], "no_tools": med[False], "runs": repeats, "protocol": protocol,
            "gateway_cpu_ratio": ratio["gateway_cpu_us_per_token"], "tokens_per_s_ratio": ratio["tokens_per_s"]}


def _tls_ratio(concurrency: int, plain: list[dict], tls: list[dict]) -> dict:
    import statistics

    p = statistics.median(r["tokens_per_s"] or 0.0 for r in plain)
    t = statistics.median(r["tokens_per_s"] or 0.0 for r in tls)
    return {"concurrency": concurrency, "plain_tokens_per_s": p, "tls_tokens_per_s": t,
            "ratio": t / p if p else None, "runs": len(tls)}


def _print_row(r: dict) -> None:
    fmt = (lambda v, spec=".1f": "-" if v is None else format(v, spec))
    print(f"concurrency {r['concurrency']:>4}: {fmt(r['tokens_per_s'], '.0f')} tokens/s, "
          f"gateway {fmt(r['gateway_cpu_us_per_token'])} µs CPU/token "
          f"({fmt(100 * r['gateway_system_share'] if r['gateway_system_share'] is not None else None, '.0f')}% system) "
          f"(worker {fmt(r['worker_cpu_us_per_token'])}, client {fmt(r['client_cpu_us_per_token'])}), "
          f"{fmt(r['messages_per_token'], '.2f')} messages/token, "
          f"TTFT p50 {fmt(r['ttft_ms']['p50'])} ms p99 {fmt(r['ttft_ms']['p99'])} ms, "
          f"ITL p50 {fmt(r['itl_ms']['p50'], '.3f')} ms p99 {fmt(r['itl_ms']['p99'], '.3f')} ms"
          + (" [TLS]" if r["tls"] else "") + (" [auth]" if r["auth"] else "")
          + (" [OpenAI HTTP]" if r["protocol"] == "openai" else "")
          + ({True: " [chat with tools]", False: " [chat]"}.get(r.get("tools"), ""))
          + (f", {r['instructions_per_token']:,.0f} instructions/token" if r["instructions_per_token"] else "")
          + (f", loop lag p99 <= {fmt(r['event_loop_lag']['p99_ms_at_most'], '.0f')} ms "
             f"({fmt(100 * (r['event_loop_lag']['within_20ms'] or 0), '.1f')}% of "
             f"{r['event_loop_lag']['probes']} probes within 20 ms; large chats {r['large_chats']})"
             if r["large_chats"] is not None else "")
          + (f", {r['errors']} errors" if r["errors"] else ""), flush=True)
