"""The prompt budget of a step that carries decodes: the step-time model over measured rates, and the
scheduler's use of it. Expected values are worked by hand from the formula in the docstrings:
a step of b decodes and p prompt tokens takes decode_s(b) + p * token_s, and the budget is
(factor - 1) * decode_s(b) / token_s, read at b + floor tokens and then at b + that answer."""

from __future__ import annotations

import pytest

from hybridgate.mempool import BlockAllocator
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.rates import MIN_CONTEXT, ContextCost, StepCost
from hybridgate.workers.scheduler import Scheduler, SchedulerConfig
from hybridgate.workers.sequence import Sequence

# Decode steps of 10 ms at batch 1 and 24 ms at 8; prompt steps of 32 tokens in 106 ms, of 256 in 870 ms:
# marginal token costs (0.106 - 0.010) / 31 = 3.0968 ms near 32 tokens, (0.870 - 0.010) / 255 = 3.3725 ms near 256.
DECODE = {1: 0.010, 8: 0.024}
PREFILL = {32: 32 / 0.106, 256: 256 / 0.870}
COST = StepCost(DECODE, PREFILL)


@pytest.mark.parametrize(("batch", "seconds"), [(1, 0.010), (8, 0.024), (4, 0.016), (16, 0.024)])
def test_decode_step_is_linear_between_measured_batches_and_held_beyond(batch, seconds):
    assert COST.decode_s(batch) == pytest.approx(seconds)  # 4: 0.010 + 3 * (0.014 / 7)


@pytest.mark.parametrize(("tokens", "seconds"), [(17, 0.096 / 31), (2, 0.096 / 31), (126, 0.860 / 255),
                                                 (4000, 0.860 / 255)])
def test_token_cost_comes_from_the_step_size_nearest_in_log_scale(tokens, seconds):
    # log2(126) = 6.98 is nearer 8 (256) than 5 (32); log2(17) = 4.09 is nearer 5.
    assert COST.token_s(tokens) == pytest.approx(seconds)


@pytest.mark.parametrize(("decodes", "factor", "floor", "budget"), [
    (1, 4, 16, 16),  # 0.030 / 3.0968 ms = 9.69 tokens: the floor
    (1, 12, 16, 35),  # 0.110 / 3.0968 ms = 35.5, then read again at 36 tokens (near 32): 35
    (1, 40, 16, 115),  # 0.390 / 3.0968 ms = 125.9; read again at 126 tokens (near 256): 0.390 / 3.3725 ms = 115.6
    (4, 4, 8, 15),  # decode step 16 ms: 0.048 / 3.0968 ms = 15.5
])
def test_prefill_budget_keeps_the_step_within_factor_times_the_decode_step(decodes, factor, floor, budget):
    assert COST.prefill_budget(decodes, factor, floor) == budget


def test_a_noisy_table_falls_back_to_the_mean_token_cost():
    # A 32-token step measured at 8.5 ms, faster than the 10 ms decode step: the marginal cost would be
    # negative, so the mean 8.5 ms / 32 = 0.265625 ms is used: 0.030 / 0.265625 ms = 112.9 tokens.
    assert StepCost(DECODE, {32: 32 / 0.0085}).prefill_budget(1, 4, 16) == 112


@pytest.mark.parametrize(("decode", "prefill"), [({}, PREFILL), (DECODE, {}), (DECODE, {1: 80.0})])
def test_no_limit_without_the_figures_the_model_needs(decode, prefill):
    assert StepCost(decode, prefill).prefill_budget(1, 4, 16) is None


def _sched(budget: float, tokens: int = 512, cost: StepCost | None = COST) -> Scheduler:
    sched = Scheduler(SchedulerConfig(8, tokens, mixed_step_budget=budget, min_prefill_chunk=16),
                      BlockAllocator(512, 16), "fp")
    sched.cost = cost
    return sched


def _seq(rid: str, prompt_len: int) -> Sequence:
    return Sequence(AddRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(), 0, 64, 2))


def _decoding(sched: Scheduler) -> Sequence:
    """A sequence whose prompt ran and which has sampled one token: the next step decodes it."""
    s = _seq("decode", 8)
    sched.add(s)
    batch = sched.schedule()
    assert batch.entries == [(s, 8)]
    s.num_computed = 8
    s.append(5)
    return s


@pytest.mark.parametrize(("factor", "chunks"), [(12, [35, 35]), (4, [16, 16]), (0, [511, 489])])
def test_a_long_prompt_beside_a_decode_runs_in_budgeted_chunks(factor, chunks):
    sched = _sched(factor)
    running = _decoding(sched)
    long = _seq("long", 1000)
    sched.add(long)
    for chunk in chunks:
        batch = sched.schedule()
        assert batch.entries == [(running, 1), (long, chunk)]
        running.num_computed += 1
        running.append(6)
        long.num_computed += chunk


def test_a_step_without_decodes_keeps_the_whole_token_budget():
    sched = _sched(4)
    long = _seq("long", 1000)
    sched.add(long)
    assert sched.schedule().entries == [(long, 512)]


def test_no_cost_model_keeps_the_whole_token_budget():
    sched = _sched(4, cost=None)
    running = _decoding(sched)
    sched.add(long := _seq("long", 1000))
    assert sched.schedule().entries == [(running, 1), (long, 511)]


def test_the_floor_never_passes_what_the_token_budget_leaves():
    sched = _sched(4, tokens=10)
    running = _decoding(sched)
    sched.add(long := _seq("long", 1000))
    assert sched.schedule().entries == [(running, 1), (long, 9)]


@pytest.mark.parametrize("bad", [0.5, -1.0])
def test_a_factor_below_one_is_refused_naming_the_setting(bad):
    with pytest.raises(ValueError, match="mixed_step_budget: must be 0 .* or >= 1"):
        SchedulerConfig(mixed_step_budget=bad)


# The context term: token_s near 17 tokens is 3.0968 ms (above); a prompt token at mean context c costs
# token_s * (1 + slope * c), slope fitted from mixed steps as (r - 1) / c with r the measured cost of a
# prompt token over token_s.
TOKEN_S = 0.096 / 31


def test_the_context_slope_is_fitted_from_mixed_steps_at_long_contexts():
    ctx = ContextCost()
    ctx.observe(0.010 + 16 * TOKEN_S * 3, 0.010, 16, TOKEN_S, 1000)  # r = 3 at context 1000: (3 - 1) / 1000
    assert ctx.slope == pytest.approx(0.002)
    ctx.observe(0.010 + 16 * TOKEN_S * 9, 0.010, 16, TOKEN_S, 2000)  # r = 9 at 2000: 0.004
    ctx.observe(0.010 + 16 * TOKEN_S * 0.5, 0.010, 16, TOKEN_S, 1000)  # faster than the model: 0
    assert ctx.slope == pytest.approx(0.002)  # the median of 0.002, 0.004 and 0
    assert ctx.factor(500) == pytest.approx(2.0)


@pytest.mark.parametrize("context", [0.0, MIN_CONTEXT - 1])
def test_short_contexts_leave_the_slope_alone(context):
    ctx = ContextCost()
    ctx.observe(0.010 + 16 * TOKEN_S * 3, 0.010, 16, TOKEN_S, context)
    assert ctx.slope == 0.0 and ctx.factor(4000) == 1.0


def _cost_with_slope(slope_ratio: float, context: float = 1000) -> StepCost:
    cost = StepCost(DECODE, PREFILL)
    cost.context.observe(0.010 + 16 * TOKEN_S * slope_ratio, 0.010, 16, TOKEN_S, context)
    return cost


@pytest.mark.parametrize(("context", "budget"), [
    # slope 0.002. At 1000: 0.110 / (3.0968 ms * (1 + 0.002 * 1001.5)) = 11.83, then read again at
    # p = 11 (still near 32 tokens): 0.110 / (3.0968 ms * (1 + 0.002 * 1005)) = 11.80: 11.
    (1000, 11),
    # At 0: 0.110 / (3.0968 ms * 1.003) = 35.4, then 0.110 / (3.0968 ms * (1 + 0.002 * 17)) = 34.35: 34.
    (0, 34),
    # At 4000: 0.110 / (3.0968 ms * 9.003) = 3.9: the floor, 4.
    (4000, 4),
])
def test_the_budget_shrinks_with_the_prompts_context(context, budget):
    assert _cost_with_slope(3).prefill_budget(1, 12, 4, context) == budget


def test_the_scheduler_sizes_a_chunk_at_the_prompts_context():
    sched = Scheduler(SchedulerConfig(8, 512, mixed_step_budget=12, min_prefill_chunk=4),
                      BlockAllocator(512, 16), "fp")
    sched.cost = _cost_with_slope(3)
    running = _decoding(sched)
    long = _seq("long", 2000)
    sched.add(long)
    assert sched.schedule().entries == [(running, 1), (long, 34)]  # from context 0, as above
    running.num_computed += 1
    running.append(6)
    long.num_computed = 1000  # as if its chunks had run up to here
    assert sched.schedule().entries == [(running, 1), (long, 11)]
