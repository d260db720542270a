"""Sizing the KV cache: `--kv-cache-memory` as bytes or a fraction of what is free."""

from __future__ import annotations


def parse_memory(value: str | float | int | None, gpu: bool) -> float:
    """Bytes ("2GiB", "512MiB", "1e9") or a fraction in (0, 1] of free device memory after
    weights (GPU) or of available memory (CPU). Default: 0.9 on a GPU; 1 GiB on a CPU
    (about 23,000 tokens of the default model), which `num_blocks_for` caps at 0.2 of available.

    Raises:
        ValueError: naming `--kv-cache-memory` and what it accepts.
    """
    if value is None:
        return 0.9 if gpu else float(1 << 30)
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = value.strip()
        units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
        scale = next((u for u in units if text.endswith(u)), None)
        try:
            number = float(text[: -len(scale)] if scale else text) * (units[scale] if scale else 1)
        except ValueError:
            raise ValueError(f"--kv-cache-memory: expected bytes (e.g. 2GiB) or a fraction in (0, 1], got {value!r}") from None
    if number <= 0 or (1 < number < 1 << 20):
        raise ValueError(f"--kv-cache-memory: expected bytes (at least 1 MiB) or a fraction in (0, 1], got {value!r}")
    return number


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
