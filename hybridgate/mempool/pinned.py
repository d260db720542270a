"""A pool of host buffers carved from one preallocated slab.

On a CUDA machine the slab is page-locked torch memory and a buffer's
completion check is a CUDA event recorded after the copy that reads it; on
the CPU it is 64-byte-aligned numpy memory and the check is immediate. Both
are injected, so nothing here imports torch. A buffer returns to the free
list only once its check says the device (or a ZeroMQ send) is done with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import time

import numpy as np

ALIGN = 64


def aligned_slab(nbytes: int) -> np.ndarray:
    """uint8 `[nbytes]` starting on a 64-byte boundary (the CPU slab allocator)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset : offset + nbytes]


@dataclass
class PoolStats:
    bytes_in_use: int = 0
    peak_bytes: int = 0
    # requests served outside the slab: it was exhausted, or they were larger than a buffer (`PinnedBuffer.fit`)
    fallbacks: int = 0
    buffers_in_use: int = 0
    waits: int = 0  # acquire(wait_s=...) calls that found no free buffer and waited


class PinnedBuffer:
    """A slice of the slab (or a fallback allocation); `array(dtype, n)` views it, `fit(dtype, n)` too
    when it is large enough."""

    __slots__ = ("memory", "index", "done", "stats")

    def __init__(self, memory: np.ndarray, index: int | None, stats: PoolStats | None = None):
        self.memory, self.index, self.stats = memory, index, stats
        self.done: Callable[[], bool] = lambda: True

    def fit(self, dtype, count: int) -> np.ndarray:
        """`array(dtype, count)`, or a one-off (pageable) array when the buffer is too small, counted as a
        fallback in its pool's stats: a request larger than a buffer means the pool was sized too small."""
        dtype = np.dtype(dtype)
        if count * dtype.itemsize <= self.memory.nbytes:
            return self.array(dtype, count)
        if self.stats is not None:
            self.stats.fallbacks += 1
        return np.empty(count, dtype)

    def array(self, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        if count * dtype.itemsize > self.memory.nbytes:
            raise ValueError(f"buffer of {self.memory.nbytes} bytes cannot hold {count} x {dtype}")
        return self.memory[: count * dtype.itemsize].view(dtype)


class PinnedPool:
    """Fixed-size buffers over one slab, with a free list.

    `slab_allocator(nbytes)` returns a uint8 numpy view of the slab (pinned on
    CUDA machines). `acquire()` never blocks: with the slab exhausted it
    returns a one-off buffer and counts a fallback.
    """

    def __init__(self, buffer_bytes: int, num_buffers: int, slab_allocator: Callable[[int], np.ndarray] = aligned_slab):
        if buffer_bytes < 1 or num_buffers < 1:
            raise ValueError(f"buffer_bytes and num_buffers must be >= 1, got {buffer_bytes} and {num_buffers}")
        self.buffer_bytes = -(-buffer_bytes // ALIGN) * ALIGN
        self.slab = slab_allocator(self.buffer_bytes * num_buffers)
        self._free = list(range(num_buffers - 1, -1, -1))
        self._pending: list[PinnedBuffer] = []  # released, waiting for their completion check
        self.stats = PoolStats()

    def acquire(self, wait_s: float | None = None) -> PinnedBuffer:
        """A free buffer. Without `wait_s`, never blocks: with the slab exhausted it returns a
        one-off buffer and counts a fallback. With `wait_s`, never allocates: it polls the
        pending buffers' checks until one is free (counting a wait).

        Raises:
            TimeoutError: `wait_s` passed with every buffer still in use.
        """
        self._reclaim()
        if wait_s is not None and not self._free:
            self.stats.waits += 1
            deadline = time.monotonic() + wait_s
            while not self._free:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no free pinned buffer within {wait_s} s "
                                       f"({self.stats.buffers_in_use} of {len(self.slab) // self.buffer_bytes} in use)")
                time.sleep(0.0002)
                self._reclaim()
        self.stats.buffers_in_use += 1
        if not self._free:
            self.stats.fallbacks += 1
            return PinnedBuffer(aligned_slab(self.buffer_bytes), None)  # counted already: no stats
        i = self._free.pop()
        self.stats.bytes_in_use += self.buffer_bytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_in_use)
        return PinnedBuffer(self.slab[i * self.buffer_bytes : (i + 1) * self.buffer_bytes], i, self.stats)

    def release(self, buf: PinnedBuffer, done: Callable[[], bool] | None = None) -> None:
        """Give `buf` back; it is reused only once `done()` is true (default: now)."""
        buf.done = done or (lambda: True)
        self._pending.append(buf)
        self._reclaim()

    def _reclaim(self) -> None:
        still = []
        for buf in self._pending:
            if not buf.done():
                still.append(buf)
                continue
            self.stats.buffers_in_use -= 1
            if buf.index is not None:
                self._free.append(buf.index)
                self.stats.bytes_in_use -= self.buffer_bytes
        self._pending = still

    @property
    def num_buffers(self) -> int:
        return len(self.slab) // self.buffer_bytes

    @property
    def num_free(self) -> int:
        self._reclaim()
        return len(self._free)

    def drain(self) -> None:
        """Reclaim every buffer whose check is done (call when idle)."""
        self._reclaim()
