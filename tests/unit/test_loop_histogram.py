"""The gateway's per-message histogram against prometheus_client's own Histogram on the same observations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from hybridgate.gateway.metrics import _LATENCY_BUCKETS, GatewayMetrics, LoopHistogram

# Bucket bounds themselves, values beside them, zero, negatives and values past the last bound.
AMOUNTS = st.one_of(st.sampled_from(_LATENCY_BUCKETS), st.floats(-1.0, 200.0, allow_nan=False),
                    st.sampled_from([0.0, 0.005000001, 0.0049999, 80.0, 1e9]))
NAME = "hybridgate:inter_token_latency_seconds"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", 'c"\\']), AMOUNTS), max_size=60))
def test_exposition_equals_prometheus_client_histogram(observations):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(NAME, "ITL.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=theirs)
    loop = LoopHistogram(NAME, "ITL.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=ours)
    for model, amount in observations:
        reference.labels(model).observe(amount)
        loop.labels(model).observe(amount)
        # the creation times differ by the microseconds between the two
        loop.labels(model).created = reference.labels(model)._created
    assert generate_latest(ours) == generate_latest(theirs)


def test_without_labels_too():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(NAME, "ITL.", buckets=(0.1, 1.0), registry=theirs)
    loop = LoopHistogram(NAME, "ITL.", buckets=(0.1, 1.0), registry=ours)
    for amount in (0.05, 0.1, 0.5, 3.0):
        reference.observe(amount)
        loop.observe(amount)
    loop.labels().created = reference._created
    assert generate_latest(ours) == generate_latest(theirs)


def test_the_vllm_series_repeat_the_itl_observations():
    metrics = GatewayMetrics(lambda: [], model=("tiny", "f" * 64))
    for itl in (0.003, 0.015, 0.015, 3.0):
        metrics.of("tiny").itl.observe(itl)
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:inter_token_latency_seconds_bucket{le="0.02",model_name="tiny"} 3.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="tiny"} 4.0' in text
    assert 'hybridgate:inter_token_latency_seconds_bucket{le="+Inf",model_name="tiny"} 4.0' in text
