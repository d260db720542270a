"""What a benchmark ran on: a figure holds only as a ratio on one machine, so every report says which."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The x86 vector features that decide which kernels and which speeds a figure belongs to.
_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16")


def describe() -> dict:
    """The CPU model, core count, vector features and load average of this machine.

    Returns {"cpu_model": str, "cpus": int, "features": [str], "isa": "avx512"|"avx2"|"other",
    "loadavg_1m": float}; fields that cannot be read (not Linux) are empty.
    """
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        model = platform.processor()
    features = [f for f in _FEATURES if f in flags]
    isa = "avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if "avx2" in flags else "other"
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {"cpu_model": model, "cpus": os.cpu_count(), "features": features, "isa": isa,
            "loadavg_1m": round(load, 2)}


def summary(info: dict | None = None) -> str:
    """One line for a benchmark's output, e.g. `machine: 2 cpus, avx512 (AMD EPYC ...), load 0.4`."""
    info = info or describe()
    return f"machine: {info['cpus']} cpus, {info['isa']} ({info['cpu_model'] or 'unknown CPU'}), load {info['loadavg_1m']}"
