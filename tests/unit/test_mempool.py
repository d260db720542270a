"""Block allocator invariants under random operations; prefix cache; pinned pool."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgate.mempool import BlockAllocator, PinnedPool, block_hash, prefix_block_hashes

FP = "f" * 64


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "append", "fork", "free", "cache", "lookup"]),
                          st.integers(0, 7), st.integers(1, 40)), max_size=80),
       st.booleans())
def test_invariants_under_random_operations(ops, caching):
    alloc = BlockAllocator(num_blocks=24, block_size=4, prefix_caching=caching)
    tables: list[list[int]] = []
    for op, i, n in ops:
        if op == "alloc":
            t: list[int] = []
            if alloc.ensure(t, n):
                tables.append(t)
            else:
                assert t == []
        elif op == "append" and tables:
            t = tables[i % len(tables)]
            before = list(t)
            ok = alloc.ensure(t, len(t) * 4 + n)
            assert t[: len(before)] == before and (ok or t == before)
        elif op == "fork" and tables:
            tables.append(alloc.fork(tables[i % len(tables)]))
        elif op == "free" and tables:
            alloc.release(tables.pop(i % len(tables)))
        elif op == "cache" and tables:
            t = tables[i % len(tables)]
            for k, h in enumerate(prefix_block_hashes(list(range(n, n + 4 * len(t))), FP, 4)):
                alloc.register(t[k], h)
        elif op == "lookup":
            found = alloc.lookup(prefix_block_hashes(list(range(n, n + 4 * (i + 1))), FP, 4))
            tables.append(found)
        alloc.check()
        referenced = {b for t in tables for b in t}
        assert all(alloc.ref[b] > 0 for b in referenced)
        assert sum(alloc.ref) == sum(len(t) for t in tables)
        assert alloc.num_used == len(referenced)
    for t in tables:
        alloc.release(t)
    alloc.check()
    assert alloc.num_used == 0 and alloc.num_free == 24


def test_prefix_cache_hit_eviction_and_lru():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    a, b = [], []
    alloc.ensure(a, 4)
    hashes_a = prefix_block_hashes([1, 2, 3, 4], FP, 2)
    for blk, h in zip(a, hashes_a):
        alloc.register(blk, h)
    alloc.release(a)
    assert alloc.stats().cached == 2 and alloc.num_free == 4
    hit = alloc.lookup(hashes_a)
    assert len(hit) == 2 and alloc.hits == 2
    head = hit[0]
    alloc.release(hit)
    alloc.ensure(b, 6)  # needs 3 blocks: 2 never used, then evicts the LRU cached block (the tail)
    assert alloc.evictions == 1
    assert alloc.lookup(hashes_a) == [head]  # the head of the prefix survived


def test_hash_chains_and_depends_on_model():
    h1 = prefix_block_hashes(list(range(32)), FP, 16)
    assert len(h1) == 2 and h1[1] == block_hash(h1[0], range(16, 32), FP)
    assert prefix_block_hashes(list(range(32)), "e" * 64, 16) != h1
    assert prefix_block_hashes([0, *range(1, 32)], FP, 16) == h1
    assert prefix_block_hashes([99, *range(1, 32)], FP, 16)[1] != h1[1]  # a different parent changes the child


def test_lookup_is_off_without_prefix_caching():
    alloc = BlockAllocator(num_blocks=2, block_size=2, prefix_caching=False)
    t = []
    alloc.ensure(t, 2)
    alloc.register(t[0], b"x" * 32)
    alloc.release(t)
    assert alloc.lookup([b"x" * 32]) == []


def test_pinned_pool_reuse_waits_for_completion():
    pool = PinnedPool(buffer_bytes=100, num_buffers=2)
    assert pool.buffer_bytes == 128 and pool.slab.ctypes.data % 64 == 0
    a, b = pool.acquire(), pool.acquire()
    assert pool.stats.bytes_in_use == 256 and pool.stats.peak_bytes == 256
    done = [False]
    pool.release(a, lambda: done[0])
    c = pool.acquire()  # a is still in flight: fallback
    assert c.index is None and pool.stats.fallbacks == 1
    done[0] = True
    pool.release(c)
    d = pool.acquire()
    assert d.index == a.index
    arr = d.array(np.int64, 16)
    arr[:] = 7
    assert arr.ctypes.data % 64 == 0
    with pytest.raises(ValueError, match="cannot hold"):
        d.array(np.int64, 17)
    pool.release(b), pool.release(d)
    assert pool.stats.bytes_in_use == 0 and pool.stats.buffers_in_use == 0
