"""Pin a worker process to its cores, and its memory to its NUMA node, before its compute threads start.

Linux threads inherit the affinity mask and the memory policy of the thread
that creates them (sched_setaffinity(2), set_mempolicy(2)). So the worker's
main thread sets both before Numba's threading layer (or torch's pool) starts
and before the weights and the KV cache are touched: every OpenMP thread
created afterwards runs only on the worker's cores, and the pages first
written by any of them come from its node. The threads the worker starts
itself (I/O, registration, export) share the same cores. Threads that exist
already (numpy's OpenBLAS pool starts on import) are moved to the cores one by
one; the memory policy is per thread and set for the main thread only (it
allocates the weights and the KV cache).

The OpenMP threads are not bound one per core (OMP_PROC_BIND): GNU libgomp
then binds the calling thread too, to the first place, and every thread it
later creates (the I/O thread among them) would inherit that one core.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform

from hybridgate.cpuset import worker_cores
from hybridgate.workers.config import EngineConfig

log = logging.getLogger("hybridgate.worker")

MPOL_PREFERRED = 1  # <linux/mempolicy.h>: allocate on the node while it has free pages, else elsewhere
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}  # the kernel's syscall tables (unistd_64.h, asm-generic)


def pin(cpu_cores: str, numa_node: int | None) -> tuple[int, ...] | None:
    """Restrict this process's threads, and those created afterwards, to the cores `--cpu-cores` /
    `--numa-node` name (`cpuset.worker_cores`), and prefer `numa_node`'s memory; returns the cores (None:
    no pinning).

    Call it on the main thread before any compute thread starts. Raises ValueError naming the setting
    for cores or a node that do not exist here; a memory policy that cannot be set is a warning line.
    """
    cores = worker_cores(cpu_cores, numa_node)
    if cores is None:
        return None
    # Every thread there already is (numpy's OpenBLAS starts its pool on import), then the calling one:
    # the threads created afterwards inherit its mask.
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(task), cores)
    os.sched_setaffinity(0, cores)
    if numa_node is not None:
        prefer_node(numa_node)
    return cores


def pin_engine(engine: EngineConfig) -> int | None:
    """`pin` to the engine's --cpu-cores / --numa-node; returns the threads its runner takes: --threads,
    else as many as the cores pinned to (None: the runtime's default)."""
    cores = pin(engine.cpu_cores, engine.numa_node)
    if cores and engine.threads and engine.threads > len(cores):
        # Numba sizes its pool by the affinity mask when it is imported (next): more threads than cores,
        # asked for, must fit in it.
        os.environ["NUMBA_NUM_THREADS"] = str(engine.threads)
    return engine.threads or (len(cores) if cores else None)


def prefer_node(node: int) -> bool:
    """set_mempolicy(MPOL_PREFERRED, {node}) for this thread and those it creates; False (with a warning
    naming what was not done) where the syscall is unknown on this architecture or refused."""
    number = SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        log.warning("--numa-node %d: memory not bound to the node (set_mempolicy's number is unknown on %s); "
                    "the threads are on its cores", node, platform.machine())
        return False
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    # maxnode counts one past the mask's bits: the kernel drops the last one (set_mempolicy(2), libnuma does so)
    if libc.syscall(number, MPOL_PREFERRED, mask, len(mask) * bits + 1) != 0:
        log.warning("--numa-node %d: memory not bound to the node (set_mempolicy: %s); the threads are on its "
                    "cores", node, os.strerror(ctypes.get_errno()))
        return False
    return True

