"""What the router measures of its gpu->cpu hand-offs: outcomes, seconds from export to import, bytes per
second (exported by the gateway; `hybridgate.router.handoff` fills them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridgate.router.costmodel import HandoffRate

OUTCOMES = ("done", "refused", "aborted", "resumed")
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class HandoffMetrics:
    """What the router measures of its hand-offs (exported by the gateway, direction="gpu_to_cpu").

    outcomes: hand-offs by outcome (done, refused, aborted, resumed).
    seconds: HandoffExported's arrival to HandoffImported's arrival, in a
    histogram with upper bounds `SECONDS_BUCKETS` (cumulative counts made at export);
    rate: the bytes of each over those seconds, whose moving median prices the next
    hand-offs (`costmodel.HandoffRate`).
    """

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(SECONDS_BUCKETS))
    seconds_sum: float = 0.0
    seconds_count: int = 0
    rate: HandoffRate = field(default_factory=HandoffRate)

    @classmethod
    def summed(cls, parts: list[HandoffMetrics]) -> HandoffMetrics:
        """The counts of several routers' hand-offs together (a gateway of several models); no rate."""
        out = cls()
        for part in parts:
            for outcome, n in part.outcomes.items():
                out.outcomes[outcome] = out.outcomes.get(outcome, 0) + n
            out.bucket_counts = [a + b for a, b in zip(out.bucket_counts, part.bucket_counts)]
            out.seconds_sum += part.seconds_sum
            out.seconds_count += part.seconds_count
        return out

    def observe(self, seconds: float, nbytes: int = 0) -> None:
        self.rate.observe(nbytes, seconds)
        for i, bound in enumerate(SECONDS_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1
        self.seconds_sum += seconds
        self.seconds_count += 1
