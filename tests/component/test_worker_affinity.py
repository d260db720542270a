"""A pinned CPU worker's threads run only on its cores: in a fresh interpreter (Numba's threads start once per
process), the worker's start-up (`build_runner`, then the runner's warm-up, which runs its parallel kernels)
and a thread it starts afterwards (as its I/O thread), every thread's mask read back from
/proc/self/task/*/status, as the kernel reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

from hybridgate.cpuset import format_cpulist, parse_cpulist

SCRIPT = """
import glob, json, logging, sys, threading
logging.basicConfig(level=logging.INFO, format="%(message)s")
from hybridgate.workers.config import EngineConfig, WorkerConfig
from hybridgate.workers.process import build_runner
engine = EngineConfig(cpu_cores=sys.argv[2], threads=int(sys.argv[3]) or None, cpu_thread_fallback=False)
runner, _ = build_runner(WorkerConfig(model_path=sys.argv[1], engine=engine))
runner.warm_up()  # the kernels' parallel regions: the OpenMP threads exist from here on
io = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
io.start()
masks = {}
for path in glob.glob("/proc/self/task/*/status"):
    fields = dict(line.split(":\\t", 1) for line in open(path).read().splitlines() if ":\\t" in line)
    masks[path.split("/")[4]] = fields["Cpus_allowed_list"]
import numba
print(json.dumps({"threads": runner.threads, "layer": numba.threading_layer(), "masks": masks}))
"""


def _run(model_path, cores: str, threads: int) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_path), cores, str(threads)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_every_thread_of_a_pinned_cpu_worker_runs_on_its_core(model_path):
    core = max(os.sched_getaffinity(0))  # not core 0, which an unpinned thread's mask also holds
    # Two threads on one core: the OpenMP pool has a thread of its own to inherit (or escape) the mask.
    got, log = _run(model_path, str(core), threads=2)
    assert got["threads"] == 2
    assert len(got["masks"]) >= 3, got  # the main thread, the pool's second thread, the "I/O" thread
    assert {parse_cpulist(mask) for mask in got["masks"].values()} == {(core,)}, got
    assert f"threads 2 on cores {core}" in log


def test_a_pinned_worker_takes_a_thread_per_core_and_says_so(model_path):
    cores = tuple(sorted(os.sched_getaffinity(0)))
    got, log = _run(model_path, format_cpulist(cores), threads=0)
    assert got["threads"] == len(cores)
    assert {parse_cpulist(mask) for mask in got["masks"].values()} == {cores}, got
    assert f"threads {len(cores)} on cores {format_cpulist(cores)}" in log
