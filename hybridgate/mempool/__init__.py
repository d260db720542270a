"""Host memory: the KV block allocator and the pinned buffer pool (no torch import here)."""

from hybridgate.mempool.blocks import (
    DEFAULT_BLOCK_SIZE, AllocatorStats, BlockAllocator, block_hash, prefix_block_hashes,
)
from hybridgate.mempool.pinned import PinnedBuffer, PinnedPool, PoolStats, aligned_slab

__all__ = [
    "AllocatorStats", "BlockAllocator", "DEFAULT_BLOCK_SIZE", "PinnedBuffer", "PinnedPool", "PoolStats",
    "aligned_slab", "block_hash", "prefix_block_hashes",
]
