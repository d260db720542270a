"""Sizing the KV cache: `--kv-cache-memory` as bytes or a fraction of what is free."""

from __future__ import annotations

from hybridgate.workerconf import parse_memory  # noqa: F401 (declared with the setting it checks)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux)."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def num_blocks_for(value: str | float | int | None, block_bytes: int, available: int, gpu: bool) -> int:
    budget = parse_memory(value, gpu)
    nbytes = budget * available if budget <= 1 else budget
    if value is None and not gpu:
        nbytes = min(nbytes, 0.2 * available)
    return max(1, int(nbytes // block_bytes))
