"""Embedding requests' bookkeeping in the worker: which rows a step pools, the sum across chunks and after a
preemption, the prefix cache only for last-token pooling, and the ADD's check of the pooling field. Values
are hand-worked or numpy's."""

from __future__ import annotations

import numpy as np
import pytest

from hybridgate.mempool import BlockAllocator
from hybridgate.wire import AddRequest, InvalidFieldError, PoolingType, SamplingParams
from hybridgate.workers import pooling
from hybridgate.workers.guard import check_add
from hybridgate.workers.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hybridgate.workers.sequence import Sequence


def embed(rid: str, prompt: list[int], kind: PoolingType) -> Sequence:
    return Sequence(AddRequest(rid, prompt, SamplingParams(temperature=0), 0, 1, -1, pooling=int(kind)))


def generation(rid: str, prompt: list[int]) -> Sequence:
    return Sequence(AddRequest(rid, prompt, SamplingParams(temperature=0), 0, 4, -1))


def test_pool_plan_rows_per_chunk():
    # A 3-token decode-like generation row, then embeddings of 10 tokens in chunks of 6 and 4.
    gen, mean, cls, last = generation("g", [1, 2, 3]), *(embed(k.name, list(range(10)), k) for k in
                                                          (PoolingType.MEAN, PoolingType.CLS, PoolingType.LAST))
    rows, plan = pooling.pool_plan(ScheduledBatch([(gen, 3), (mean, 6), (cls, 6), (last, 6)]))
    assert rows.tolist() == [3, 4, 5, 6, 7, 8, 9]  # mean's 6 rows, then cls's first; last none yet
    assert [(s.request_id, o, c) for s, o, c in plan] == [("MEAN", 0, 6), ("CLS", 6, 1), ("LAST", 7, 0)]
    for s in (mean, cls, last):
        s.num_computed = 6
    rows, plan = pooling.pool_plan(ScheduledBatch([(mean, 4), (cls, 4), (last, 4)]))
    assert rows.tolist() == [0, 1, 2, 3, 11]  # mean's 4 rows, no cls row, last's final row (8 + 3)
    assert [(o, c) for _, o, c in plan] == [(0, 4), (4, 0), (4, 1)]


def test_mean_across_chunks_and_a_recomputation():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((10, 8)).astype(np.float32)  # final-norm states of positions 0..9
    seq = embed("m", list(range(10)), PoolingType.MEAN)
    for first, n in ((0, 6), (6, 4)):
        seq.num_computed = first
        rows, plan = pooling.pool_plan(ScheduledBatch([(seq, n)]))
        pooling.accumulate(seq, pooling.partial_sums(hidden[first + rows], plan)[seq])
    seq.num_computed = 0  # preempted: recomputed from position 0, the old sum dropped
    rows, plan = pooling.pool_plan(ScheduledBatch([(seq, 10)]))
    pooling.accumulate(seq, pooling.partial_sums(hidden[rows], plan)[seq])
    got = np.frombuffer(pooling.embedding_bytes(seq), "<f4")
    np.testing.assert_allclose(got, hidden.mean(0), rtol=1e-6, atol=1e-7)


def test_only_last_token_pooling_takes_prefix_cache_hits():
    sched = Scheduler(SchedulerConfig(8, 100), BlockAllocator(16, 4), "fp")
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks cacheable
    first = generation("a", prompt)
    sched.add(first)
    batch = sched.schedule()
    first.num_computed = 13
    sched.after_step(batch)
    sched.finish(first, first.status)
    for kind, cached in ((PoolingType.MEAN, 0), (PoolingType.CLS, 0), (PoolingType.LAST, 12)):
        s = embed(kind.name, prompt, kind)
        sched.add(s)
        assert sched.schedule().entries == [(s, 13 - cached)], kind.name
        sched.finish(s, s.status)


def test_the_add_check_names_a_bad_pooling():
    bad = AddRequest("r", [1, 2], SamplingParams(), 0, 1, -1, pooling=4)  # RANK: not served
    with pytest.raises(InvalidFieldError) as e:
        check_add(bad, 100, 64)
    assert e.value.field == "pooling" and "[0, 1, 2, 3]" in str(e.value)
