"""The built-in workload mix: `--mix` parsing and the seeded draws (hybridgate/bench/workload.py)."""

import pytest

from hybridgate.bench import workload as wl
from hybridgate.bench.workload import builtin_items, parse_mix


def test_the_default_draws_do_not_change_with_a_class_of_weight_zero():
    # The three classes of the documented default, written out here: the workloads of earlier reports
    # (docs/results/placement-*/*.json, seed 0) must come out the same whatever classes were added since.
    three = {"short": (0.7, (16, 96), (16, 48)), "summary": (0.15, (1000, 4000), (16, 32)),
             "long": (0.15, (16, 96), (128, 256))}
    assert builtin_items(200, seed=0) == builtin_items(200, seed=0, mix=three)
    assert builtin_items(200, seed=0, mix=parse_mix("short=0.7,summary=0.15,long=0.15")) == \
        builtin_items(200, seed=0, mix=three)


def test_document_is_drawn_only_when_named_and_within_its_ranges():
    assert all(i.cls != "document" for i in builtin_items(500, seed=1))
    items = builtin_items(300, seed=1, mix=parse_mix("document=1"))
    assert {i.cls for i in items} == {"document"}
    assert all(6000 <= i.prompt_tokens <= 10000 and 6000 <= i.max_tokens <= 10000 for i in items)
    assert min(i.prompt_tokens for i in items) < 6500 and max(i.max_tokens for i in items) > 9500


def test_mix_errors_name_the_class_or_the_weight():
    with pytest.raises(ValueError, match="class must be one of short, summary, long, document, got 'chat'"):
        parse_mix("chat=1")
    with pytest.raises(ValueError, match="weight of document must be >= 0"):
        parse_mix("document=-1")
    with pytest.raises(ValueError, match="at least one class needs a weight above 0"):
        parse_mix("short=0,document=0")


def test_the_decode_rate_comes_from_token_counts_and_their_arrival_times():
    """A worker that decodes 100 ids/s, its 12 ids delivered in two messages of 6 (a door that fell
    behind coalesced them): the rate is 100/s. (tokens - 1) / (e2e - TTFT) said 183/s; with a first
    message of 11 ids it said 1,100/s (the 463x ratio of a busy machine's full suite)."""
    made = [0.10 + 0.01 * i for i in range(12)]  # when the worker made id i
    o = wl.Outcome(wl.WorkItem("x", 8, 12), 0.0, ttft_s=made[5], e2e_s=made[11], tokens=12,
                   marks=[(made[5], 6), (made[11], 12)])
    assert o.decode_tokens_per_s == pytest.approx(100.0)
    assert 1 / o.tpot_s == pytest.approx(183.3, rel=1e-3)  # the old figure, for the record
    skewed = wl.Outcome(wl.WorkItem("x", 8, 12), 0.0, ttft_s=made[10], e2e_s=made[11], tokens=12,
                        marks=[(made[10], 11), (made[11], 12)])
    assert skewed.decode_tokens_per_s == pytest.approx(100.0) and 1 / skewed.tpot_s == pytest.approx(1100.0)
    one = wl.Outcome(wl.WorkItem("x", 8, 12), 0.0, ttft_s=0.2, e2e_s=0.2, tokens=12, marks=[(0.2, 12)])
    assert one.decode_tokens_per_s is None  # all in one message: nothing to time
