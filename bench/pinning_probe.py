"""What pinning a CPU worker's threads to its cores changes: batch-1 decode tokens/s of real CPU workers on the
default model, two at once pinned to cores 0 and 1 or unpinned, and one beside a busy neighbour (`yes`) pinned
or not. Scenarios alternate over rounds; each process reports the median of its repeats (48 new tokens after a
32-token prompt, greedy, thread fallback off), and the summary is the median over rounds.

    python bench/pinning_probe.py ROUNDS [--json FILE]

Needs at least two cores (cores 0 and 1). Each worker is built as `hybridgate worker` builds it
(`build_runner`: pinned before its threads start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPEATS = 8
SCENARIOS = {  # name: ([(cpulist or "" for unpinned, threads) per worker], busy neighbour)
    "two_pinned_0_1_t1": ([("0", 1), ("1", 1)], False),
    "two_unpinned_t1": ([("", 1), ("", 1)], False),
    "busy_pinned_core1_t1": ([("1", 1)], True),
    "busy_unpinned_t1": ([("", 1)], True),
    "busy_unpinned_t2": ([("", 2)], True),
    "idle_pinned_core1_t1": ([("1", 1)], False),
}


def child(cores: str, threads: int, start_at: float, repeats: int) -> None:
    """One worker's decode tokens/s, from `start_at` (wall time) on, as a JSON line."""
    from hybridgate.models import default_model_path, model_fingerprint
    from hybridgate.wire import AddRequest, SamplingParams
    from hybridgate.workers.config import EngineConfig, WorkerConfig
    from hybridgate.workers.engine import EngineCore
    from hybridgate.workers.process import build_runner
    from hybridgate.workers.scheduler import SchedulerConfig

    engine = EngineConfig(cpu_cores=cores, threads=threads or None, cpu_thread_fallback=False)
    runner, model = build_runner(WorkerConfig(model_path=str(default_model_path()), engine=engine))
    fingerprint = model_fingerprint(model)
    runner.warm_up()

    def decode() -> float:
        core = EngineCore(runner, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048), fingerprint, False)
        core.add(AddRequest("r", list(range(100, 132)), SamplingParams(temperature=0, ignore_eos=True), 0, 49, -1))
        core.step()  # the prompt
        start = time.perf_counter()
        while core.has_work():
            core.step()
        return 48 / (time.perf_counter() - start)

    decode()
    while time.time() < start_at:
        time.sleep(0.01)
    rates = [decode() for _ in range(repeats)]
    print(json.dumps({"cores": cores, "threads": runner.threads, "median": statistics.median(rates), "rates": rates}))


def run(workers: list[tuple[str, int]], busy: bool) -> list[float]:
    neighbour = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
    start = time.time() + 6  # every worker loaded and warm by then
    procs = [subprocess.Popen([sys.executable, __file__, "--child", cores, str(threads), str(start), str(REPEATS)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=os.environ)
             for cores, threads in workers]
    out = [json.loads(p.communicate()[0].strip().splitlines()[-1])["median"] for p in procs]
    if neighbour:
        neighbour.kill()
        neighbour.wait()
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rounds", type=int, help="rounds over the scenarios (each round runs every scenario once)")
    parser.add_argument("--json", help="write the summary and every round here")
    args = parser.parse_args()
    rounds: dict[str, list[list[float]]] = {name: [] for name in SCENARIOS}
    for r in range(args.rounds):
        for name, (workers, busy) in SCENARIOS.items():
            rounds[name].append(run(workers, busy))
            print(r, name, [round(x, 1) for x in rounds[name][-1]], flush=True)
    summary = {name: [statistics.median(rnd[i] for rnd in got) for i in range(len(got[0]))] for name, got in rounds.items()}
    from hybridgate.bench.machine import describe

    doc = {"benchmark": "cpu pinning", "command": " ".join(["python", *sys.argv]), "machine": describe(),
           "unit": "decode tokens/s per worker (batch 1)", "summary": summary, "rounds": rounds}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
