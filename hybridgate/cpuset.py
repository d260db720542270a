"""Which cores a worker's threads run on: Linux cpulists, NUMA nodes' cores, and serve's disjoint split.

Data only (stdlib, no syscall that changes anything): the settings check
`--cpu-cores` and `--numa-node` with it, `serve` splits the cores among its
workers with it, and the worker pins itself to the result
(`hybridgate.workers.affinity`).

A cpulist is the kernel's list format (Documentation/admin-guide/cputopology.rst,
cpuset(7) "List format"): comma-separated core numbers and inclusive ranges,
e.g. "0-3,8". The kernel's strided form ("0-7:2/4") is not accepted.
"""

from __future__ import annotations

import os
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str, setting: str = "--cpu-cores") -> tuple[int, ...]:
    """The sorted cores of a cpulist ("0-3,8" → (0, 1, 2, 3, 8)).

    Raises:
        ValueError: naming `setting` and the format, for bad syntax or an empty list.
    """
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"{setting}: expected a cpulist such as 0-3,8 (cores and ranges, comma-separated), "
                             f"got {text!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"{setting}: {part!r} in {text!r} is not a range of cores (N-M with 0 <= N <= M)")
        cores.update(range(low, high + 1))
    return tuple(sorted(cores))


def format_cpulist(cores: tuple[int, ...] | set[int] | frozenset[int]) -> str:
    """The shortest cpulist of `cores` without strides ((0, 1, 2, 3, 8) → "0-3,8")."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def text_of(cores: list[int]) -> str:
    """"core 5 is" / "cores 4-5 are", for messages."""
    return f"core {cores[0]} is" if len(cores) == 1 else f"cores {format_cpulist(cores)} are"


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask, not the machine's count: a container or
    `taskset` may allow fewer)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def node_cores(node: int, root: Path = NODE_ROOT) -> tuple[int, ...]:
    """The cores of NUMA node `node`, from `root`/nodeN/cpulist.

    Raises:
        ValueError: naming --numa-node and the nodes that exist, for a node that does not.
    """
    path = root / f"node{node}" / "cpulist"
    try:
        text = path.read_text().strip()
    except OSError:
        nodes = sorted(int(p.name[4:]) for p in root.glob("node*") if p.name[4:].isdigit())
        exist = f"nodes here: {format_cpulist(nodes)}" if nodes else f"no node under {root}"
        raise ValueError(f"--numa-node: node {node} does not exist ({exist})") from None
    if not text:
        raise ValueError(f"--numa-node: node {node} has no cores (a memory-only node); name a node with cores")
    return parse_cpulist(text, setting=str(path))


def worker_cores(cpu_cores: str, numa_node: int | None, available: tuple[int, ...] | None = None,
                 root: Path = NODE_ROOT) -> tuple[int, ...] | None:
    """The cores named by `--cpu-cores` and `--numa-node` (None: neither is set, no pinning).

    `--numa-node` alone: the node's cores this process may run on; with `--cpu-cores`, those cores,
    which must lie in the node.

    Raises:
        ValueError: naming the setting and the limit: a bad cpulist, cores outside `available` (default:
            this process's affinity mask), a node that does not exist, cores outside the node.
    """
    available = available_cores() if available is None else available
    cores = parse_cpulist(cpu_cores) if cpu_cores else None
    if cores is not None:
        outside = sorted(set(cores) - set(available))
        if outside:
            raise ValueError(f"--cpu-cores: {text_of(outside)} not available to this process "
                             f"(it may run on {format_cpulist(available)})")
    if numa_node is None:
        return cores
    node = node_cores(numa_node, root)
    if cores is not None:
        outside = sorted(set(cores) - set(node))
        if outside:
            raise ValueError(f"--cpu-cores: {text_of(outside)} not on --numa-node {numa_node} "
                             f"(its cores: {format_cpulist(node)})")
        return cores
    usable = tuple(c for c in node if c in set(available))
    if not usable:
        raise ValueError(f"--numa-node: none of node {numa_node}'s cores ({format_cpulist(node)}) is available to "
                         f"this process (it may run on {format_cpulist(available)})")
    return usable


def split(cores: tuple[int, ...], workers: int) -> list[tuple[int, ...]] | None:
    """`cores` cut into `workers` contiguous, disjoint slices, the larger ones first ((0..4), 2 →
    [(0, 1, 2), (3, 4)]); None when there are fewer cores than workers (they cannot all have one)."""
    if workers < 1 or len(cores) < workers:
        return None
    size, extra = divmod(len(cores), workers)
    out, start = [], 0
    for i in range(workers):
        end = start + size + (i < extra)
        out.append(tuple(cores[start:end]))
        start = end
    return out
