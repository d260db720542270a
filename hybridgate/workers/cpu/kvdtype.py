"""The element formats of the CPU worker's KV cache (`--kv-cache-dtype`): fp32, fp16, bf16.

A 16-bit cache halves the KV memory per token, so the same `--kv-cache-memory`
holds twice the blocks, and halves the bytes attention reads per step. Values
are rounded to nearest, ties to even, when written (by `rope_and_store` and
the hand-off import) and widened exactly to float32 when read, so attention
runs in float32 on the rounded K and V.

Numba has no float16 arrays, so the 16-bit caches hold bit patterns and the
kernels tell the two formats apart by the integer type of the array: int16
holds IEEE 754 binary16, uint16 holds bfloat16 (the top half of a float32).
Numba compiles one specialisation per storage type, so the format is chosen
once, when the runner allocates its cache (`simd.kv_encode`, and the loads of
`simd.qk_rows*` / `simd.pv_rows*`). Sources: IEEE 754-2008 (binary16);
Intel's BF16 whitepaper (document 338302) for bfloat16's round to nearest even.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np



@dataclass(frozen=True)
class KvDtype:
    """One cache element format."""

    name: str  # the setting's value: fp32, fp16, bf16
    wire: str  # its name in `kv_layout()` and hand-off headers (wire.HANDOFF_DTYPES)
    storage: type  # numpy dtype of the cache arrays
    widen: Callable[[np.ndarray], np.ndarray]  # storage → float32 (exact)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.storage).itemsize


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


KV_DTYPES = {
    "fp32": KvDtype("fp32", "float32", np.float32, lambda a: a.astype(np.float32)),
    "fp16": KvDtype("fp16", "float16", np.int16, lambda a: a.view(np.float16).astype(np.float32)),
    "bf16": KvDtype("bf16", "bfloat16", np.uint16, _bf16_to_f32),
}



def kv_dtype(name: str) -> KvDtype:
    """The format named `name`; ValueError naming `--kv-cache-dtype` for any other."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"--kv-cache-dtype: must be one of {', '.join(KV_DTYPES)}, got {name!r}") from None
