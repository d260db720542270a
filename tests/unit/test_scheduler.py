"""The scheduler as a pure state machine, driven with fake model outputs."""

from __future__ import annotations

import pytest

from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.scheduler import Scheduler, SchedulerConfig
from hybridgate.workers.sequence import Sequence, SequenceStatus


def seq(rid: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(AddRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(), 0, max_tokens, 2))


def run_step(scheduler: Scheduler, token: int = 7):
    """Pretend the model ran the step: every scheduled sequence computes its tokens and samples `token`."""
    batch = scheduler.schedule()
    for s, n in batch.prefills:
        s.num_computed += n
    for s in batch.decodes:
        s.num_computed += 1
    for s in batch.sequences:
        s.append(token)
        if s.status.finished:
            scheduler.finish(s, s.status)
    return batch


def test_status_order():
    assert not SequenceStatus.RUNNING.finished
    assert all(s.finished for s in SequenceStatus if s >= SequenceStatus.FINISHED_STOPPED)


def test_new_prompts_join_between_steps_and_finished_leave():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100))
    a = seq("a", 5, max_tokens=2)
    sched.add(a)
    assert run_step(sched).sequences == [a]  # prefill of a
    b = seq("b", 5, max_tokens=3)
    sched.add(b)
    batch = run_step(sched)
    assert batch.decodes == [a] and batch.prefills == [(b, 5)]  # one step mixes a decode and a prefill
    assert a.status == SequenceStatus.FINISHED_LENGTH and sched.running == [b]


def test_token_budget_and_max_num_seqs():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=12))
    for rid in "abc":
        sched.add(seq(rid, 5))
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.prefills] == ["a", "b"]  # 10 tokens; c waits (max_num_seqs)
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_long_prompt_runs_alone_rather_than_never():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8))
    sched.add(seq("long", 50))
    assert [n for _, n in sched.schedule().prefills] == [50]


def test_eos_finishes_unless_ignored():
    s = seq("a", 3, max_tokens=10)
    s.append(2)
    assert s.status == SequenceStatus.FINISHED_EOS
    t = Sequence(AddRequest("b", [1], SamplingParams(ignore_eos=True), 0, 10, 2))
    t.append(2)
    assert not t.status.finished


def test_finish_removes_waiting_or_running():
    sched = Scheduler(SchedulerConfig())
    a, b = seq("a", 3), seq("b", 3)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not sched.has_work()


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
