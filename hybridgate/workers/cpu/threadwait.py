"""How the CPU kernels' threads wait between parallel regions: chosen once per process, before Numba's
threading layer starts.

Numba runs each `prange` loop as one parallel region of its threading layer
(OpenMP: GNU libgomp with Numba's Linux wheels, Intel or LLVM OpenMP
elsewhere; TBB where it is installed; its own workqueue as the last resort),
and a decode step runs over a hundred regions. Between two regions an OpenMP
thread spins before it sleeps (GNU: 300,000 rounds by default, about a
millisecond or more). On a core that another process keeps busy, a spinning
thread spends its share of that core spinning; the kernel's scheduler then
runs the other process for a whole time slice while the region waits for the
thread, and every region of the step pays it (32 tokens took 2.8-9.8 s on the
default threads against 0.42-0.52 s on one). A thread that sleeps as soon as
its region ends is woken by the next one and, having slept, preempts the
busy process at once (CFS's wake-up preemption). Under heavier load each
region's barrier still waits for a time slice of its slowest thread;
`threadfallback` then measures its way to fewer threads.

- `passive`: OMP_WAIT_POLICY=PASSIVE (GNU: sleep at once), KMP_BLOCKTIME=0
  (Intel/LLVM: the same).
- `active`: OMP_WAIT_POLICY=ACTIVE, with the spinning bounded at the
  runtimes' default lengths (GOMP_SPINCOUNT=300000, KMP_BLOCKTIME=200 ms), so
  an idle worker still goes to sleep.

The runtimes read these variables once, when they load (Numba's first
parallel region, or `numba.set_num_threads`), so `select` must run before.
TBB's workers have no such setting (they spin briefly, then sleep); the
workqueue layer's threads always sleep.

Sources: the GNU libgomp manual (OMP_WAIT_POLICY, GOMP_SPINCOUNT), the LLVM
OpenMP runtime's documentation (KMP_BLOCKTIME), Numba's threading layer
documentation.
"""

from __future__ import annotations

import os
import sys

POLICIES = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"},
}
_VARIABLES = sorted({name for env in POLICIES.values() for name in env})

_selected: str | None = None


def select(policy: str) -> None:
    """Set the wait policy of this process's kernel threads (one of POLICIES).

    Raises ValueError for another name, and RuntimeError when Numba's threading layer already
    started in this process under another policy (the runtime read its variables then; a new
    process is needed). Selecting the policy already in force does nothing.
    """
    global _selected
    if policy not in POLICIES:
        raise ValueError(f"cpu_thread_wait: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == _selected:
        return
    if _layer_started():
        raise RuntimeError(f"cpu_thread_wait: Numba's threads already started in this process "
                           f"({_selected or 'the environment'}'s wait policy); {policy} needs a new process")
    for name in _VARIABLES:  # the setting decides, whatever the environment held
        os.environ.pop(name, None)
    os.environ.update(POLICIES[policy])
    _selected = policy


def selected() -> str | None:
    """The policy `select` set in this process (None: the runtime's defaults or the environment's)."""
    return _selected


def _layer_started() -> bool:
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(parallel is not None and parallel._is_initialized)
