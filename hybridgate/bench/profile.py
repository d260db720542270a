"""`bench gateway --profile FILE`: the gateway process profiled over the measured runs only.

Two profilers, both switched on just before a measured run and off just after it,
so that neither the gateway's start nor the warm-up runs count:

- `cprofile`: the gateway runs under a launcher (`python -m
  hybridgate.bench.profiled OUT -- ARGS`, a module of its own: it imports the CLI, which imports this one), which runs `hybridgate ARGS` with a
  `cProfile.Profile` that SIGUSR1 enables and SIGUSR2 disables, on the main
  thread: the event loop's, where both doors, the router and the output pump
  run (grpc's C core threads are not Python). The pstats file is written when
  the gateway exits; read it with `python -m pstats OUT`.
- `callgrind`: the gateway runs under `valgrind --tool=callgrind
  --instr-atstart=no`; `callgrind_control -i on|off` brackets each measured
  run and `callgrind_control --dump` writes that run's counts to `FILE.N`
  (N = 1, 2, ... in run order; read one with `callgrind_annotate FILE.N`).
  Instructions executed (the event Ir) count every thread of the process,
  grpc's C core included, and do not depend on what else the machine runs,
  so instructions per streamed token is the figure to compare between
  changes on a busy machine. Valgrind runs the gateway about 50 times slower:
  keep the step time long enough (`--step-ms`) that it still sends one
  message per token, and read `messages_per_token` in the report.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PROFILERS = ("cprofile", "callgrind")
SWITCH_S = 0.2  # the gateway's loop wakes at least every 20 ms (its lag probe): time for a signal to be handled


class CProfile:
    """The cProfile launcher's command and its switches (the module docstring)."""

    def __init__(self, path: str):
        self.path = path

    def command(self, args: list[str]) -> list[str]:
        """`hybridgate ARGS` under the launcher."""
        return [sys.executable, "-m", "hybridgate.bench.profiled", self.path, "--", *args]

    def start(self, pid: int) -> None:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(SWITCH_S)

    def stop(self, pid: int) -> dict:
        os.kill(pid, signal.SIGUSR2)
        time.sleep(SWITCH_S)
        return {}


class Callgrind:
    """valgrind's callgrind around the gateway; each measured run's instruction count (the module docstring).

    Raises RuntimeError naming the missing program when valgrind or callgrind_control is not installed.
    """

    def __init__(self, path: str):
        for program in ("valgrind", "callgrind_control"):
            if shutil.which(program) is None:
                raise RuntimeError(f"--profiler callgrind needs {program} (Debian: apt-get install valgrind)")
        self.path = path
        self._dumps = 0

    def command(self, args: list[str]) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.path}",
                "--quiet", sys.executable, "-m", "hybridgate.cli", *args]

    def start(self, pid: int) -> None:
        self._control(pid, "--instr=on")

    def stop(self, pid: int, timeout_s: float = 120.0) -> dict:
        """Switch counting off and dump this run: {"instructions": Ir of every thread, "file": the dump}."""
        self._control(pid, "--instr=off")
        self._dumps += 1
        dump = Path(f"{self.path}.{self._dumps}")
        self._control(pid, f"--dump=run-{self._dumps}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            total = _totals(dump)
            if total is not None:
                return {"instructions": total, "file": str(dump)}
            time.sleep(0.2)
        raise RuntimeError(f"callgrind wrote no {dump} within {timeout_s:g} s")

    @staticmethod
    def _control(pid: int, option: str) -> None:
        subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True, timeout=120)


def _totals(dump: Path) -> int | None:
    """The `totals:` line of a complete callgrind dump (None while it is absent or still being written)."""
    try:
        text = dump.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    return None


def make(profiler: str, path: str) -> CProfile | Callgrind:
    """The profiler named `profiler` (one of PROFILERS) writing to `path`."""
    return CProfile(path) if profiler == "cprofile" else Callgrind(path)
