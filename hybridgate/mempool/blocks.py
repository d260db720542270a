"""The KV block allocator: fixed-size blocks, ref counts, prefix caching by chained hashes.

Paged KV cache after vLLM (Kwon et al., SOSP 2023, "PagedAttention"); prefix
caching by chained block hashes as in vLLM's automatic prefix caching. A block's
hash covers its parent's hash, its token ids and the model fingerprint, with
BLAKE2b (RFC 7693), so equal hashes mean equal prefixes of the same model and
one user's KV cannot be served for another prefix by a collision.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_BLOCK_SIZE = 16
_ROOT = bytes(32)


def block_hash(parent: bytes | None, token_ids: Sequence[int], fingerprint: str) -> bytes:
    """32-byte BLAKE2b of (parent hash, model fingerprint, token ids as little-endian uint32)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(parent or _ROOT)
    h.update(fingerprint.encode())
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], fingerprint: str, block_size: int = DEFAULT_BLOCK_SIZE,
                        num_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` (the first `num_blocks` of them if given).

    The router calls this too, for cache-affine placement.
    """
    full = len(token_ids) // block_size if num_blocks is None else num_blocks
    out, parent = [], None
    for i in range(full):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], fingerprint)
        out.append(parent)
    return out


@dataclass
class AllocatorStats:
    used: int = 0
    free: int = 0
    cached: int = 0  # free blocks that still hold a cached prefix (evictable)
    hits: int = 0  # blocks served from the prefix cache
    evictions: int = 0


class BlockAllocator:
    """Blocks of `block_size` token slots; a sequence holds a block table (list of block ids).

    A block with ref count 0 is free; if it holds a registered prefix it stays
    findable (evictable, LRU order) until a new allocation needs it.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.evictions = 0

    # --- counts --------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.num_used, self.num_free, len(self._evictable), self.hits, self.evictions)

    def blocks_needed(self, table: Sequence[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table))

    # --- allocation ----------------------------------------------------------

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            del self.by_hash[self.hash_of[block]]
            self.hash_of[block] = None
            self.evictions += 1
        self.ref[block] = 1
        return block

    def ensure(self, table: list[int], num_tokens: int) -> bool:
        """Grow `table` in place to hold `num_tokens` slots; False (table unchanged) if blocks run out."""
        need = self.blocks_needed(table, num_tokens)
        if need > self.num_free:
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block of `table` and empty it (idempotent on an empty table)."""
        # Newly freed blocks go behind older ones (LRU), tail before head, so a
        # cached prefix is evicted from its end and its start stays findable.
        for block in reversed(table):
            self.ref[block] -= 1
            if self.ref[block] < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            if self.ref[block] == 0:
                if self.hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        table.clear()

    def fork(self, table: Sequence[int]) -> list[int]:
        """A new table sharing every block of `table` (copy-on-write is the caller's)."""
        for block in table:
            self._acquire(block)
        return list(table)

    def _acquire(self, block: int) -> None:
        if self.ref[block] == 0:
            self._evictable.pop(block, None)
        self.ref[block] += 1

    # --- prefix cache --------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`, each with a reference taken."""
        if not self.prefix_caching:
            return []
        found = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            self._acquire(block)
            found.append(block)
        self.hits += len(found)
        return found

    def register(self, block: int, h: bytes) -> None:
        """Mark a full block as holding the prefix `h` (first writer wins on duplicates)."""
        if self.prefix_caching and self.hash_of[block] is None and h not in self.by_hash:
            self.hash_of[block] = h
            self.by_hash[h] = block

    def check(self) -> None:
        """Raise RuntimeError if an invariant does not hold (for tests)."""
        free, evictable = set(self._free), set(self._evictable)
        if free & evictable or len(free) != len(self._free):
            raise RuntimeError("a block is on both free lists or twice on one")
        for b in range(self.num_blocks):
            if self.ref[b] < 0:
                raise RuntimeError(f"block {b} has ref count {self.ref[b]}")
            if (self.ref[b] == 0) != (b in free or b in evictable):
                raise RuntimeError(f"block {b}: ref {self.ref[b]} but free={b in free} evictable={b in evictable}")
            if b in evictable and self.hash_of[b] is None:
                raise RuntimeError(f"evictable block {b} has no hash")
        for h, b in self.by_hash.items():
            if self.hash_of[b] != h:
                raise RuntimeError(f"hash table points at block {b} which holds another prefix")
