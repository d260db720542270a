"""The scheduler as a pure state machine over a block allocator, driven with fake model outputs."""

from __future__ import annotations

import pytest

from hybridgate.mempool import BlockAllocator
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.scheduler import Scheduler, SchedulerConfig
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.workers.sequence import FINISH_OF_STATUS, Sequence, SequenceStatus


def seq(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 10) -> Sequence:
    return Sequence(AddRequest(rid, list(range(first, first + prompt_len)), SamplingParams(), 0, max_tokens, 2))


def make(num_blocks=64, max_num_seqs=8, budget=100, block_size=4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget), BlockAllocator(num_blocks, block_size), "fp")


def run_step(sched: Scheduler, token: int = 7):
    """Pretend the model ran the step: tokens computed, a token sampled where the prompt is done."""
    batch = sched.schedule()
    for s, n in batch.entries:
        s.num_computed += n
    sched.after_step(batch)
    for s, _ in batch.entries:
        if s.num_computed == s.num_tokens:
            s.append(token)
            if s.status.finished:
                sched.finish(s, s.status)
    return batch


# DESIGN.md: a sequence ends on EOS (unless ignore_eos), on a stop id, or at max_tokens; the reasons are
# the proto's FinishReason (stop 1, length 2, eos 3, abort 4).
@pytest.mark.parametrize(("appended", "params", "reason"), [
    ([5, 2], SamplingParams(), pb.FINISH_REASON_EOS),
    ([5, 2, 6, 7], SamplingParams(ignore_eos=True), pb.FINISH_REASON_LENGTH),
    ([5, 9], SamplingParams(stop_token_ids=(9,)), pb.FINISH_REASON_STOP),
    ([5, 6, 7, 8], SamplingParams(), pb.FINISH_REASON_LENGTH),
])
def test_a_sequence_finishes_on_eos_stop_id_or_max_tokens_and_not_before(appended, params, reason):
    s = Sequence(AddRequest("r", [1, 2, 3], params, 0, 4, 2))
    s.status = SequenceStatus.RUNNING
    for i, token in enumerate(appended):
        assert s.status == SequenceStatus.RUNNING and not s.status.finished, (i, s.status)
        s.append(token)
    assert s.status.finished and int(FINISH_OF_STATUS[s.status]) == reason and len(s.output_ids) == len(appended)


def test_an_aborted_sequence_finishes_with_abort():
    sched = make()
    a = seq("a", 6)
    sched.add(a)
    run_step(sched)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.status.finished and int(FINISH_OF_STATUS[a.status]) == pb.FINISH_REASON_ABORT
    assert sched.allocator.stats().used == 0


def test_new_prompts_join_between_steps_and_finished_leave():
    sched = make()
    a = seq("a", 5, max_tokens=2)
    sched.add(a)
    assert run_step(sched).sequences == [a]
    b = seq("b", 5, max_tokens=3, first=60)
    sched.add(b)
    batch = run_step(sched)
    assert batch.entries == [(a, 1), (b, 5)]  # one step mixes a decode and a prefill
    assert a.status == SequenceStatus.FINISHED_LENGTH and sched.running == [b]
    while sched.has_work():
        run_step(sched)
    assert sched.allocator.num_used == 0


def test_chunked_prefill_keeps_decodes_going():
    sched = make(budget=8)
    a = seq("a", 3, max_tokens=50)
    sched.add(a)
    run_step(sched)
    long = seq("long", 40, first=100)
    sched.add(long)
    steps = []
    while long.num_computed < len(long.prompt_ids):
        steps.append(run_step(sched))
    assert all(b.num_tokens <= 8 for b in steps)
    assert all((a, 1) in b.entries for b in steps)  # the decode runs in every step of the chunked prefill
    assert [n for b in steps for s, n in b.entries if s is long] == [7, 7, 7, 7, 7, 5]


def test_budget_and_max_num_seqs():
    sched = make(max_num_seqs=2, budget=12)
    for rid in "abc":
        sched.add(seq(rid, 5))
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.entries] == [("a", 5), ("b", 5)]  # c waits: max_num_seqs
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_prefix_cache_serves_full_blocks_but_the_last_token():
    sched = make(block_size=4)
    a = seq("a", 13, max_tokens=1)
    sched.add(a)
    run_step(sched)
    assert a.status.finished and sched.allocator.stats().cached >= 3
    for n, cached in ((13, 12), (12, 8), (14, 12)):  # 4 * floor((n - 1) / 4)
        b = seq(f"b{n}", n, max_tokens=1)
        sched.add(b)
        batch = run_step(sched)
        assert b.cached_tokens == cached and batch.entries == [(b, n - cached)]


def test_preemption_when_blocks_run_out_then_recompute():
    sched = make(num_blocks=6, block_size=4)
    a, b = seq("a", 8, max_tokens=12), seq("b", 8, max_tokens=12, first=50)
    sched.add(a), sched.add(b)
    run_step(sched)  # 4 blocks used
    for _ in range(30):
        if not sched.has_work():
            break
        run_step(sched)
        sched.allocator.check()
    assert sched.stats.preemptions > 0
    assert a.status.finished and b.status.finished and len(a.output_ids) == len(b.output_ids) == 12
    assert sched.allocator.num_used == 0


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_a_waiting_sequence_past_its_deadline_is_dropped_unrun():
    sched = make(budget=8)
    busy = seq("busy", 40, max_tokens=2)
    late = Sequence(AddRequest("late", list(range(100, 105)), SamplingParams(), 0, 4, 2, deadline_s=0.05))
    sched.add(busy)
    sched.add(late)
    run_step(sched)  # the budget of 8 goes to busy's prompt; late waits
    assert sched.expire(late.arrival + 0.04) == []  # not yet past
    assert sched.expire(late.arrival + 0.06) == [late]
    assert late.status == SequenceStatus.FINISHED_ABORTED and late not in sched.waiting and not late.block_table
    while sched.has_work():
        assert all(s is busy for s in run_step(sched).sequences)
    assert late.num_computed == 0 and sched.allocator.num_used == 0
