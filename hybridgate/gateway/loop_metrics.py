"""Prometheus series observed on the gateway's event loop, per streamed message: plain additions where
prometheus_client's Histogram and Counter take a lock per observation and walk their buckets."""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString


class _LoopFamily:
    """A labelled family whose children are made on first use and registered with `registry`."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None):
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if registry is not None:
            registry.register(self)

    def _new_child(self):
        raise NotImplementedError

    def labels(self, *values: str):
        """The child of these label values (made on first use). Raises ValueError on a wrong count."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(values)}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child


class LoopHistogram(_LoopFamily):
    """A Prometheus histogram observed on one thread (the event loop), for observations made per streamed
    message: a child's `observe` is a bisect and two additions, where prometheus_client's Histogram takes
    a lock twice and walks the buckets (several times the cost, at tens of thousands of messages a second).

    Used as a prometheus_client `Histogram` with `labelnames` is (`labels(*values).observe(amount)`) and
    exposed exactly as one (`_bucket`, `_count`, `_sum`, `_created` per child, children in the order
    they were made). A scrape on another thread reads the counts without a lock: it may miss the
    observation being made meanwhile, never count one twice.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 *, buckets: Iterable[float], registry: CollectorRegistry | None = None):
        self._bounds = [float(b) for b in buckets]
        if self._bounds != sorted(self._bounds):
            raise ValueError(f"{name}: buckets must be sorted, got {self._bounds}")
        if not self._bounds or self._bounds[-1] != math.inf:
            self._bounds.append(math.inf)
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _LoopHistogramChild:
        return _LoopHistogramChild(self._bounds)

    def observe(self, amount: float) -> None:
        """Of a histogram without labels."""
        self.labels().observe(amount)

    def collect(self) -> list[Metric]:
        family = Metric(self.name, self.documentation, "histogram")
        for values, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, values))
            counts, total = list(child.counts), child.sum
            cumulative = 0
            for bound, count in zip(self._bounds, counts):
                cumulative += count
                family.add_sample(self.name + "_bucket", {**labels, "le": floatToGoString(bound)}, float(cumulative))
            family.add_sample(self.name + "_count", labels, float(cumulative))
            family.add_sample(self.name + "_sum", labels, total)
            family.add_sample(self.name + "_created", labels, child.created)
        return [family]


class _LoopHistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: list[float]):
        self.bounds, self.counts, self.sum, self.created = bounds, [0] * len(bounds), 0.0, time.time()

    def observe(self, amount: float) -> None:
        """Count `amount` in the first bucket whose upper bound is at least it (as Histogram.observe)."""
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class LoopCounter(_LoopFamily):
    """A Prometheus counter counted on one thread (the event loop): `labels(*values).inc(n)` is one
    addition. Exposed as prometheus_client's Counter is (`_total` and `_created` per child); a scrape on
    another thread reads without a lock."""

    def _new_child(self) -> _LoopCounterChild:
        return _LoopCounterChild()

    def collect(self) -> list[Metric]:
        family = Metric(self.name, self.documentation, "counter")
        for values, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, values))
            family.add_sample(self.name + "_total", labels, float(child.value))
            family.add_sample(self.name + "_created", labels, child.created)
        return [family]


class _LoopCounterChild:
    __slots__ = ("value", "created")

    def __init__(self):
        self.value, self.created = 0, time.time()

    def inc(self, amount: int = 1) -> None:
        self.value += amount
