"""`hybridgate bench serve`: open-loop load against a real gateway, per policy and layout, goodput under SLOs.

Either it starts `hybridgate serve` itself on 127.0.0.1 (a free port; once per
layout and policy, so each policy starts from cold caches) or it drives the
gateway at `--target`, the only address it ever sends to. Per run it sends the
workload's first n requests (`ignore_eos`, so each produces `max_tokens`
tokens; prompts are made of seeded random words, unique per run, so neither
the prefix cache nor the response cache serves one run from another) at
Poisson arrival times, and waits for them within a time limit. Figures:
`hybridgate.bench.workload.summarize`.

Steps: unloaded probes (one request at a time) give the default SLOs and a
start rate; a capacity search per policy (doubling, then bisection; a few short
runs) finds the capacity under SLO; then a sweep over `--rates` (absolute, or
multiples of the first policy's capacity, the same rates for every policy).

`--chaos-kill-every S` instead runs one load of `--chaos-duration` seconds
while it SIGKILLs one worker process of its `serve` every S seconds (the
workers in turn); it reports requests lost (ended with neither a final message
nor an error status), KV blocks and pinned bytes still held once idle
(`hybridgate:kv_cache_blocks_used`, `hybridgate:pinned_bytes_in_use`,
`hybridgate:kv_handoff_pinned_bytes_in_use`), each worker's restart time, and
the time from each restart until the attainment of the requests arriving in a
sliding window is back to its pre-kill level.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hybridgate.bench import workload as wl
from hybridgate.bench.machine import describe, summary
from hybridgate.bench.serve_clients import Client, Prompts, make_client

RECOVERY_WINDOW_S = 5.0


class ServeProcess:
    """`hybridgate serve` as a child (its own session), its output in `log`; `target` once READY."""

    def __init__(self, model: str, serve_args: list[str], log: Path, timeout_s: float):
        self.log = log
        cmd = [sys.executable, "-m", "hybridgate.cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", "0", "--metrics-port", "0", "--http-port", "0", *serve_args]
        self._out = open(log, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.target = "127.0.0.1:" + self._wait_for("hybridgate: gRPC on 127.0.0.1:", timeout_s).split()[0]
        self.http_target = self._wait_for("hybridgate: OpenAI-compatible HTTP on http://", timeout_s).split("/")[0]
        self.metrics_url = self._wait_for("hybridgate: metrics on ", timeout_s).split()[0]
        self._wait_for("hybridgate: READY", timeout_s)

    def _wait_for(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix):]
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        self.stop()
        raise RuntimeError(f"serve did not print {prefix!r} within {timeout_s:g} s (--startup-timeout):\n{tail}")

    def worker_pids(self) -> list[int]:
        """The worker processes (multiprocessing spawn children of serve, not its resource tracker)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmdline:
                pids.append(int(stat.parent.name))
        return sorted(pids)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


def scrape(url: str) -> dict[str, dict[str, float]]:
    """{metric sample name: {worker label: value}} of the gateway's metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[s.labels.get("worker", "")] = s.value
    return out


def serve_args_for(layout: str, total_threads: int, policy: str, settings) -> list[str]:
    """`serve` flags for a layout "gpu+cpu" / "gpu" / "cpu*2": worker counts, the total threads split
    evenly among the workers (so layouts compare at the same total), the policy and its SLOs."""
    counts = {"gpu": 0, "cpu": 0}
    for part in layout.split("+"):
        kind, _, n = part.strip().partition("*")
        if kind not in counts:
            raise ValueError(f"--layouts: a worker kind is gpu or cpu, got {part!r}")
        try:
            counts[kind] += int(n) if n else 1
        except ValueError:
            raise ValueError(f"--layouts: a count after * must be an integer, got {part!r}") from None
    workers = counts["gpu"] + counts["cpu"]
    if workers == 0:
        raise ValueError(f"--layouts: {layout!r} has no worker")
    args = ["--gpu-workers", str(counts["gpu"]), "--cpu-workers", str(counts["cpu"]),
            "--threads", str(max(1, total_threads // workers)), "--policy", policy]
    router = settings.router
    if router.ttft_slo_s is not None:
        args += ["--ttft-slo", str(router.ttft_slo_s)]
    if router.tpot_slo_s is not None:
        args += ["--tpot-slo", str(router.tpot_slo_s)]
    return args


class Bench:
    """The steps of one `bench serve` (see the module docstring)."""

    def __init__(self, args, settings):
        self.args, self.settings = args, settings
        self.model = settings.model_path
        self.prompts = Prompts(self.model)
        if args.workload:
            self.items = wl.file_items(args.workload)
        else:
            self.items = wl.builtin_items(args.max_requests, args.seed, wl.parse_mix(args.mix))
        self.slo: wl.Slo | None = None
        if args.slo_from:
            self.slo = wl.Slo.from_json(json.loads(Path(args.slo_from).read_text())["slo"])
        self.logdir = Path(args.log_dir or tempfile.mkdtemp(prefix="hybridgate-bench-serve-"))
        self.logdir.mkdir(parents=True, exist_ok=True)

    def items_for(self, rate: float) -> tuple[list[wl.WorkItem], list[float]]:
        n = wl.requests_at(rate, self.args.duration, self.args.min_requests, self.args.max_requests)
        items = [self.items[i % len(self.items)] for i in range(n)]
        return items, wl.arrivals(n, rate, self.args.seed)

    async def calibrate(self, client: Client) -> None:
        """Unloaded TTFT at the workload's shortest, middle and longest prompt and the unloaded TPOT."""
        lengths = sorted({min(i.prompt_tokens for i in self.items), max(i.prompt_tokens for i in self.items)})
        if lengths[-1] > 4 * lengths[0]:
            lengths.insert(1, (lengths[0] + lengths[-1]) // 2)
        ttft, tpot = {}, []
        for n in lengths:
            ttft[n], t = await client.probe(n)
            tpot.append(t)
        router = self.settings.router
        self.unloaded = {"ttft_s": {str(k): v for k, v in ttft.items()}, "tpot_s": min(tpot),
                         "decode_tokens_per_s": 1.0 / min(tpot)}
        if self.slo is None:
            self.slo = wl.Slo(router.ttft_slo_s, router.tpot_slo_s, ttft, min(tpot))
        print(f"unloaded: TTFT s by prompt tokens {({k: round(v, 3) for k, v in ttft.items()})}, "
              f"TPOT {min(tpot) * 1e3:.1f} ms", flush=True)

    def start_rate(self) -> float:
        """A rate the layout surely sustains: one request at a time at the workload's mean unloaded e2e."""
        slo = self.slo
        mean_e2e = statistics.mean(slo.ttft_for(i.prompt_tokens) / wl.SLO_FACTOR
                                   + slo.tpot() / wl.SLO_FACTOR * (i.max_tokens - 1) for i in self.items)
        return round(1.0 / mean_e2e, 3)

    async def one_rate(self, client: Client, rate: float, label: str) -> dict:
        items, arrivals = self.items_for(rate)
        outcomes = await client.run(items, arrivals, self.args.time_limit, progress=f"{label} {rate:.3f}/s")
        row = wl.summarize(outcomes, rate, self.slo)
        _print_row(label, row)
        return row

    async def policy_runs(self, client: Client, label: str, rates: list[tuple[float, bool]] | None,
                          capacity_hint: float | None) -> tuple[float | None, list[dict], list[dict]]:
        capacity, cap_runs = None, []
        if self.args.capacity_runs:
            search = wl.CapacitySearch(self.start_rate(), self.args.capacity_runs)  # one start for every policy
            while (rate := search.next_rate()) is not None:
                search.record(await self.one_rate(client, rate, f"{label} capacity"))
            capacity, cap_runs = search.capacity, search.runs
        sweep = []
        for value, relative in rates or []:
            base = capacity if capacity is not None else capacity_hint
            if relative and not base:
                raise ValueError("--rates: multiples of capacity (like 0.5x) need a capacity: give --capacity-runs")
            sweep.append(await self.one_rate(client, value * base if relative else value, f"{label} sweep"))
        if capacity is None:
            capacity = max((r["rate"] for r in sweep if r["attainment"] >= wl.ATTAINMENT_TARGET), default=0.0)
        return capacity, sweep, cap_runs


async def _run_layouts(bench: Bench) -> dict:
    args = bench.args
    rates = wl.parse_rates(args.rates) if args.rates else []
    policies = list(args.compare_policies.split(",")) if args.compare_policies else [bench.settings.router.policy]
    layouts = [s.strip() for s in args.layouts.split(",")] if args.layouts else ["gpu+cpu"]
    threads = args.total_threads or os.cpu_count() or 1
    report: dict = {"machine": describe(), "layouts": {}, "workload": _workload_json(bench), "seed": args.seed}
    first_capacity = None
    absolute = None  # the sweep's rates, fixed by the first policy's capacity for all the others
    for layout in layouts:
        out = report["layouts"].setdefault(layout, {"policies": {}, "threads_total": threads})
        for policy in policies:
            serve_args = serve_args_for(layout, threads, policy, bench.settings) + list(args.serve_arg or [])
            proc = ServeProcess(bench.model, serve_args, bench.logdir / f"serve-{layout}-{policy}.log",
                                args.startup_timeout)
            try:
                client = make_client(args.protocol, proc.target, proc.http_target, bench.prompts)
                if "slo" not in report:
                    await bench.calibrate(client)
                    report["slo"], report["unloaded"] = bench.slo.to_json(), bench.unloaded
                label = f"{layout} {policy}"
                capacity, sweep, cap_runs = await bench.policy_runs(
                    client, label, absolute or rates, first_capacity)
                if absolute is None and rates:
                    absolute = [(r["rate"], False) for r in sweep]
                first_capacity = first_capacity or capacity or None
                out["policies"][policy] = wl.policy_report(policy, capacity, sweep, cap_runs)
                out["policies"][policy]["serve_args"] = serve_args
                print(f"{label}: capacity under SLO {capacity:.3f} requests/s", flush=True)
            finally:
                proc.stop()
    report["policies"] = report["layouts"][layouts[0]]["policies"]
    report["log_dir"] = str(bench.logdir)
    return report


async def _run_target(bench: Bench) -> dict:
    args = bench.args
    client = make_client(args.protocol, args.target, args.target, bench.prompts)
    await bench.calibrate(client)
    rates = wl.parse_rates(args.rates) if args.rates else []
    capacity, sweep, cap_runs = await bench.policy_runs(client, args.target, rates, None)
    name = bench.settings.router.policy
    return {"machine": describe(), "target": args.target, "slo": bench.slo.to_json(), "unloaded": bench.unloaded,
            "workload": _workload_json(bench), "seed": args.seed,
            "policies": {name: wl.policy_report(name, capacity, sweep, cap_runs)}}


def _workload_json(bench: Bench) -> dict:
    args = bench.args
    return {"file": args.workload, "mix": None if args.workload else
            {k: {"weight": w, "prompt_tokens": p, "max_tokens": m} for k, (w, p, m) in wl.parse_mix(args.mix).items()},
            "duration_s": args.duration, "min_requests": args.min_requests, "max_requests": args.max_requests,
            "time_limit_s": args.time_limit}


# --- chaos --------------------------------------------------------------------------------------------


async def _watch_workers(client_target: str, stop: asyncio.Event, events: list) -> None:
    """Poll GetModelInfo every 0.2 s; append (time, number of READY workers) on each change."""
    import grpc

    from hybridgate.v1 import generation_pb2 as pb
    from hybridgate.v1 import generation_pb2_grpc as pb_grpc

    last = None
    async with grpc.aio.insecure_channel(client_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while not stop.is_set():
            try:
                info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
                ready = sum(w.ready for w in info.workers)
            except grpc.aio.AioRpcError:
                ready = -1
            if ready != last:
                events.append((time.perf_counter(), ready))
                last = ready
            await asyncio.sleep(0.2)


def recovery_times(outcomes: list[wl.Outcome], slo: wl.Slo, kills: list[dict], window_s: float) -> None:
    """Fill each kill's `recovered_after_s`: from its restart to the first window start whose arrivals'
    attainment is back to the pre-kill window's (None: never within the run)."""
    def attainment(a: float, b: float) -> float | None:
        inside = [o for o in outcomes if a <= o.arrival_s < b]
        return sum(slo.met(o) for o in inside) / len(inside) if inside else None

    end = max((o.arrival_s for o in outcomes), default=0.0)
    for k in kills:
        before = attainment(k["at_s"] - 4 * window_s, k["at_s"])
        k["attainment_before"] = before
        restart = k.get("restarted_at_s")
        k["recovered_after_s"] = None
        if restart is None or before is None:
            continue
        t = restart - window_s  # a window ending at the restart may already be good (requests queued for it)
        while t + window_s <= end:
            now = attainment(t, t + window_s)
            if now is not None and now >= min(before, wl.ATTAINMENT_TARGET):
                k["recovered_after_s"] = max(0.0, t + window_s - restart)
                break
            t += 0.5


async def _run_chaos(bench: Bench) -> dict:
    args = bench.args
    layout = (args.layouts or "gpu+cpu").split(",")[0]
    threads = args.total_threads or os.cpu_count() or 1
    policy = bench.settings.router.policy
    serve_args = serve_args_for(layout, threads, policy, bench.settings) + list(args.serve_arg or [])
    proc = ServeProcess(bench.model, serve_args, bench.logdir / "serve-chaos.log", args.startup_timeout)
    try:
        client = make_client(args.protocol, proc.target, proc.http_target, bench.prompts)
        await bench.calibrate(client)
        rate = wl.parse_rates(args.rates)[0][0] if args.rates else 0.5 * bench.start_rate()
        n = max(1, round(rate * args.chaos_duration))
        items = [bench.items[i % len(bench.items)] for i in range(n)]
        arrivals = wl.arrivals(n, rate, args.seed)
        kills: list[dict] = []
        watch_stop, ready_events = asyncio.Event(), []
        watcher = asyncio.create_task(_watch_workers(proc.target, watch_stop, ready_events))
        start = time.perf_counter()

        async def killer() -> None:
            k = 0
            while True:
                await asyncio.sleep(args.chaos_kill_every)
                pids = proc.worker_pids()
                if not pids:
                    continue
                pid = pids[k % len(pids)]
                k += 1
                os.kill(pid, signal.SIGKILL)
                kills.append({"at_s": time.perf_counter() - start, "pid": pid})
                print(f"chaos: killed worker pid {pid} at {kills[-1]['at_s']:.1f} s", flush=True)

        killing = asyncio.create_task(killer())
        run = asyncio.create_task(client.run(items, arrivals, args.time_limit, progress="chaos"))
        await asyncio.sleep(arrivals[-1])
        killing.cancel()
        outcomes = await run
        idle = await _wait_idle(proc, args.time_limit)
        watch_stop.set()
        await watcher
        total = ready_events[0][1] if ready_events else 0
        for k in kills:  # restarted: the first time after the kill that every worker is READY again
            at = start + k["at_s"]
            dropped = next((t for t, r in ready_events if t > at and 0 <= r < total), None)
            back = next((t for t, r in ready_events if dropped and t > dropped and r >= total), None)
            k["restarted_at_s"] = back - start if back else None
            k["restart_s"] = back - at if back else None
        recovery_times(outcomes, bench.slo, kills, RECOVERY_WINDOW_S)
        row = wl.summarize(outcomes, rate, bench.slo)
        recovered = [k["recovered_after_s"] for k in kills]
        report = {"machine": describe(), "slo": bench.slo.to_json(), "layout": layout, "policy": policy,
                  "chaos": {"kill_every_s": args.chaos_kill_every, "duration_s": args.chaos_duration, "rate": rate,
                            "requests": n, "lost": row["unfinished"], "errors": row["errors"],
                            "kills": kills, "leaked_blocks": idle["blocks"], "leaked_pinned_bytes": idle["pinned"],
                            "idle": idle["idle"],
                            "max_recovery_s": max((r for r in recovered if r is not None), default=None),
                            "unrecovered": sum(r is None for r in recovered)},
                  "policies": {policy: {**wl.policy_report(policy, None, [row], []), "capacity": None}}}
        c = report["chaos"]
        print(f"chaos: {len(kills)} kills, {n} requests, lost {c['lost']}, errors {c['errors']}, leaked blocks "
              f"{c['leaked_blocks']}, leaked pinned bytes {c['leaked_pinned_bytes']}, recovery after restart "
              f"{[None if r is None else round(r, 1) for r in recovered]} s", flush=True)
        return report
    finally:
        proc.stop()


async def _run_protocols(bench: Bench) -> dict:
    """--compare-protocols: one serve of the first layout, gRPC and HTTP alternately (bench/protocols.py)."""
    from hybridgate.bench import protocols

    args = bench.args
    layout = (args.layouts or "gpu+cpu").split(",")[0].strip()
    threads = args.total_threads or os.cpu_count() or 1
    serve_args = serve_args_for(layout, threads, bench.settings.router.policy, bench.settings) + list(
        args.serve_arg or [])
    proc = ServeProcess(bench.model, serve_args, bench.logdir / f"serve-{layout}-protocols.log", args.startup_timeout)
    try:
        clients = {"grpc": make_client("grpc", proc.target, proc.http_target, bench.prompts),
                   "openai": make_client("openai", proc.target, proc.http_target, bench.prompts)}
        clients["openai"].runs = 1_000  # its prompts differ from the gRPC runs' (no prefix-cache hit between them)
        await clients["grpc"].run([wl.WorkItem("warm-up", 16, 4)], [0.0], args.time_limit)  # both doors warm
        await clients["openai"].run([wl.WorkItem("warm-up", 16, 4)], [0.0], args.time_limit)
        compared = await protocols.run_compare(bench, proc, clients)
    finally:
        proc.stop()
    return {"machine": describe(), "layout": layout, "threads_total": threads, "serve_args": serve_args,
            "compare_protocols": compared, "log_dir": str(bench.logdir)}


async def _wait_idle(proc: ServeProcess, limit_s: float) -> dict:
    """Wait (up to limit_s) until no worker runs or queues anything; then what they still hold."""
    deadline = time.monotonic() + limit_s
    while True:
        m = await asyncio.to_thread(scrape, proc.metrics_url)
        busy = sum(m.get("hybridgate:num_requests_running", {}).values()) + sum(
            m.get("hybridgate:num_requests_waiting", {}).values())
        if busy == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    await asyncio.sleep(0.5)  # one more heartbeat's load report after the last step
    m = await asyncio.to_thread(scrape, proc.metrics_url)
    blocks = sum(m.get("hybridgate:kv_cache_blocks_used", {}).values())
    pinned = sum(m.get("hybridgate:pinned_bytes_in_use", {}).values()) + sum(
        m.get("hybridgate:kv_handoff_pinned_bytes_in_use", {}).values())
    return {"idle": busy == 0, "blocks": int(blocks), "pinned": int(pinned)}


# --- entry --------------------------------------------------------------------------------------------


def run(args) -> dict:
    from hybridgate.config import resolve

    settings = resolve(args).settings
    if args.target and (args.compare_policies or args.layouts or args.chaos_kill_every or args.compare_protocols):
        raise ValueError("--target: --compare-policies, --compare-protocols, --layouts and --chaos-kill-every need "
                         "a serve that bench serve starts itself; leave --target out")
    print(summary(), flush=True)
    bench = Bench(args, settings)
    if args.compare_protocols:
        report = _run_async(_run_protocols(bench))
    elif args.chaos_kill_every:
        report = _run_async(_run_chaos(bench))
    elif args.target:
        report = _run_async(_run_target(bench))
    else:
        report = _run_async(_run_layouts(bench))
    report["machine_after"] = describe()
    report["protocol"] = "grpc,openai" if args.compare_protocols else args.protocol
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot and "layouts" in report:
        from hybridgate.bench.plot import plot_report

        plot_report(report, args.plot, title=f"bench serve: {summary(report['machine'])}")
        print(f"plot: {args.plot}", flush=True)
    return report


def _run_async(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _print_row(label: str, r: dict) -> None:
    fmt = (lambda v, scale=1e3: "-" if v is None else f"{v * scale:.0f}")
    print(f"{label} rate {r['rate']:.3f}/s: {r['requests']} requests, attainment {r['attainment']:.2f}, goodput "
          f"{r['goodput']:.3f}/s, throughput {r['throughput']:.3f}/s, TTFT p50/p99 {fmt(r['ttft_p50'])}/"
          f"{fmt(r['ttft_p99'])} ms (short p99 {fmt(r['short_ttft_p99'])}), TPOT p50 {fmt(r['tpot_p50'])} ms, "
          f"plans {r['plans']}" + (f", errors {r['errors']}" if r["errors"] else "")
          + (f", {r['unfinished']} unfinished" if r["unfinished"] else ""), flush=True)
