"""What a benchmark ran on: a figure holds only as a ratio on one machine, so every report says which."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The x86 vector features that decide which kernels and which speeds a figure belongs to.
_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16")


def describe(cpuinfo: str | None = None) -> dict:
    """The CPU model, core count, vector features and load average of this machine.

    cpuinfo: the text of /proc/cpuinfo (read when None). Returns {"cpu_model": str, "cpu_family": int | None,
    "cpu_model_id": int | None, "cpus": int, "features": [str], "isa": "avx512"|"avx2"|"other",
    "loadavg_1m": float}; fields that cannot be read (not Linux) are empty or None. The family and model
    numbers name the microarchitecture where a VM's model name does not ("AMD EPYC": family 23 model 1 is
    Zen 1, 25 model 1 Zen 3; Intel family 6 model 207 Emerald Rapids).
    """
    model, flags, numbers = "", set(), {}
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        text, model = "", platform.processor()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        elif key in ("cpu family", "model") and key not in numbers and value.strip().isdigit():
            numbers[key] = int(value)
    features = [f for f in _FEATURES if f in flags]
    isa = "avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if "avx2" in flags else "other"
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {"cpu_model": model, "cpu_family": numbers.get("cpu family"), "cpu_model_id": numbers.get("model"),
            "cpus": os.cpu_count(), "features": features, "isa": isa, "loadavg_1m": round(load, 2)}


def summary(info: dict | None = None) -> str:
    """One line for a benchmark's output, e.g. `machine: 2 cpus, avx512 (AMD EPYC ...), load 0.4`."""
    info = info or describe()
    family = (f", family {info['cpu_family']} model {info['cpu_model_id']}"
              if info.get("cpu_family") is not None and info.get("cpu_model_id") is not None else "")
    return (f"machine: {info['cpus']} cpus, {info['isa']} ({info['cpu_model'] or 'unknown CPU'}{family}), "
            f"load {info['loadavg_1m']}")
