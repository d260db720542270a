"""The built-in workload mix: `--mix` parsing and the seeded draws (hybridgate/bench/workload.py)."""

import pytest

from hybridgate.bench.workload import builtin_items, parse_mix


def test_the_default_draws_do_not_change_with_a_class_of_weight_zero():
    # The three classes of the documented default, written out here: the workloads of earlier reports
    # (docs/placement-*.json, seed 0) must come out the same whatever classes were added since.
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
