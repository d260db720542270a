"""This machine's memory read bandwidth, probed beside the timings it bounds.

`bench engine --kind cpu` divides a decode step's weight bytes by the measured read
bandwidth to say how far the step is from its memory bound. On a shared host that
bandwidth moves by 2x within minutes (a 2-core Zen 4 VM read 22.7 to 57.3 GB/s on the
same code), so one probe at the end of a run says little about the steps timed before
it. `BandwidthProbe` keeps a child process that holds the probe's array (outside the
bench's own peak RSS) and sums it on request, so each timed step can be paired with a
probe taken just before it.

Run as a module it is that child: one line on stdin per probe, the GB/s on stdout.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from hybridgate.run.children import end_stdin_child


class _Prober:
    """The read rate in GB/s of a parallel sum over a float32 array of `mib` MiB (larger than the caches)
    on `threads` Numba threads: `measure(repeats)`, the median over that many sums."""

    def __init__(self, mib: int, threads: int):
        import numba
        import numpy as np

        numba.set_num_threads(threads)

        @numba.njit(parallel=True, fastmath=True)
        def total(a):
            s = np.float32(0.0)
            for i in numba.prange(a.shape[0]):
                s += a[i]
            return s

        self.total = total
        self.a = np.ones(mib << 18, dtype=np.float32)
        total(self.a)  # compile, and touch every page once

    def measure(self, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.total(self.a)
            times.append(time.perf_counter() - start)
        return self.a.nbytes / statistics.median(times) / 1e9


class BandwidthProbe:
    """A child process probing the read bandwidth on request (`measure`, GB/s, the median of 3 sums of
    `mib` MiB on `threads` threads); `close` (or leaving the `with` block) ends it. The child runs only
    while a probe is asked for, so it does not compete with the timings around it."""

    def __init__(self, mib: int, threads: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridgate.bench.bandwidth", str(mib), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()  # ready: its array allocated and its sum compiled

    def _answer(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bandwidth probe's process ended (exit code {self.proc.wait()})")
        return line.strip()

    def measure(self) -> float:
        self.proc.stdin.write("probe\n")
        self.proc.stdin.flush()
        return float(self._answer())

    def close(self) -> None:
        end_stdin_child(self.proc)

    def __enter__(self) -> BandwidthProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(mib: int, threads: int) -> None:
    prober = _Prober(mib, threads)
    print("ready", flush=True)
    for _ in sys.stdin:
        print(prober.measure(3), flush=True)



def report_bandwidth(out: dict, paired: list[tuple[float, float]]) -> None:
    """The read bandwidth probed before each of our batch-1 steps, and the step over its memory bound: the
    median over the repeats of (probe GB/s · step ms / weight bytes), each step against the probe just
    before it. A spread of the probes over 20% is printed as a warning (a shared host's bandwidth moves)."""
    probes = [g for g, _ in paired]
    out["read_bandwidth_probes_gb_per_s"] = probes
    out["decode_step_ms_c1_runs"] = [ms for _, ms in paired]
    out["read_bandwidth_gb_per_s"] = statistics.median(probes)
    out["step_over_bandwidth_bound"] = statistics.median(
        g * ms * 1e6 / out["weight_bytes_read_per_step"] for g, ms in paired)
    out["read_bandwidth_spread"] = max(probes) / min(probes)
    print(f"read bandwidth: {out['read_bandwidth_gb_per_s']:.1f} GB/s with {out['threads']} threads (probed before "
          f"each step); the decode step takes {out['step_over_bandwidth_bound']:.2f}x the time its weights take "
          "to read", flush=True)
    if out["read_bandwidth_spread"] > 1.2:
        print(f"warning: the read bandwidth moved {out['read_bandwidth_spread']:.2f}x between probes "
              f"({', '.join(f'{g:.1f}' for g in probes)} GB/s): a shared host; each step is set against the probe "
              "just before it", flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
