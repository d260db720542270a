"""The workloads, arrivals and figures shared by `bench serve` (real processes) and `bench sim` (simulation).

A workload is a seeded sequence of `WorkItem`s (prompt tokens, max tokens, a
class name) drawn from a built-in mix or read from a JSON-lines file; a run at
an offered rate sends its first n items at open-loop Poisson arrival times
(exponential gaps of mean 1/rate, seeded), so every policy and layout sees the
same requests at the same times. Figures per rate (`summarize`):

- throughput: completed requests per second over the run (first arrival to
  last finish), and output tokens per second;
- attainment: the fraction of requests that met both their TTFT and TPOT SLO
  (an error or a timeout meets neither); goodput = offered rate × attainment
  (DistServe's metric, Zhong et al., OSDI 2024);
- p50/p90/p99 of TTFT, TPOT ((e2e − TTFT) / (tokens − 1)) and e2e, all
  requests and short ones apart; the plan mix.

Capacity under SLO: the highest offered rate whose attainment is at least
0.9, found by doubling from a start rate and then bisecting (`find_capacity`).

SLOs: fixed seconds when given, else per request 3 × the unloaded TTFT for its
prompt length (interpolated over a few measured lengths) and 3 × the unloaded
TPOT, as the cost policy defines its defaults (hybridgate/router/policy.py).
"""

from __future__ import annotations

import bisect
import json
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hybridgate.router.policy import SLO_FACTOR

ATTAINMENT_TARGET = 0.9  # capacity under SLO: at least 90% of requests meet both (DistServe)
SHORT_PROMPT_TOKENS = 256  # a request of at most this many prompt tokens counts as short

# class → (weight, prompt tokens range, max tokens range): short chats, long-prompt summaries, long generations,
# and (weight 0 unless `--mix` names it) documents written from long contexts, the regime where a GPU worker's
# KV cache, not its speed, caps the requests it holds (README, Placement).
BUILTIN_MIX: dict[str, tuple[float, tuple[int, int], tuple[int, int]]] = {
    "short": (0.7, (16, 96), (16, 48)),
    "summary": (0.15, (1000, 4000), (16, 32)),
    "long": (0.15, (16, 96), (128, 256)),
    "document": (0.0, (6000, 10000), (6000, 10000)),
}


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: `cls` names its class (short, summary, long, or the file's)."""

    cls: str
    prompt_tokens: int
    max_tokens: int


@dataclass
class Outcome:
    """What one request did; seconds from its own arrival. `ended`: a final message or an error status
    came (False: the call was cut off at the run's time limit, or ended with neither: lost)."""

    item: WorkItem
    arrival_s: float  # offset from the run's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    plan: str = ""
    error: str = ""  # the gRPC status name, or "" when it finished
    ended: bool = False
    # (seconds from its arrival, ids received so far) for each message that brought ids, when the
    # client can count them (gRPC's token_index; HTTP's continuous usage)
    marks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The ids that came after the first message's, over the time from that message to the one that
        brought the last id. Tokens coalesced into one message arrive together, so a first message that
        holds several (a slow reader) neither counts them as decoded after it nor shrinks the time, as
        (tokens - 1) / (e2e - TTFT) does. None with fewer than two messages that brought ids."""
        if len(self.marks) < 2:
            return None
        (t0, n0), (t1, n1) = self.marks[0], self.marks[-1]
        return (n1 - n0) / (t1 - t0) if n1 > n0 and t1 > t0 else None


@dataclass(frozen=True)
class Slo:
    """Per-request objectives: fixed seconds, or `SLO_FACTOR` × unloaded figures.

    `unloaded_ttft_s`: prompt tokens → unloaded TTFT seconds (interpolated linearly,
    flat outside); `unloaded_tpot_s`: seconds per output token alone.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    unloaded_ttft_s: Mapping[int, float] = field(default_factory=dict)
    unloaded_tpot_s: float | None = None

    def ttft_for(self, prompt_tokens: int) -> float:
        if self.ttft_s is not None:
            return self.ttft_s
        if not self.unloaded_ttft_s:
            raise ValueError("--ttft-slo: no fixed TTFT SLO and no unloaded TTFT measured to derive one")
        keys = sorted(self.unloaded_ttft_s)
        if prompt_tokens <= keys[0] or len(keys) == 1:
            base = self.unloaded_ttft_s[keys[0]]
        elif prompt_tokens >= keys[-1]:
            base = self.unloaded_ttft_s[keys[-1]]
        else:
            i = bisect.bisect_left(keys, prompt_tokens)
            a, b = keys[i - 1], keys[i]
            ya, yb = self.unloaded_ttft_s[a], self.unloaded_ttft_s[b]
            base = ya + (yb - ya) * (prompt_tokens - a) / (b - a)
        return SLO_FACTOR * base

    def tpot(self) -> float:
        if self.tpot_s is not None:
            return self.tpot_s
        if self.unloaded_tpot_s is None:
            raise ValueError("--tpot-slo: no fixed TPOT SLO and no unloaded TPOT measured to derive one")
        return SLO_FACTOR * self.unloaded_tpot_s

    def met(self, o: Outcome) -> bool:
        if not o.ended or o.error or o.ttft_s is None:
            return False
        return o.ttft_s <= self.ttft_for(o.item.prompt_tokens) and (o.tpot_s is None or o.tpot_s <= self.tpot())

    def to_json(self) -> dict:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "factor": SLO_FACTOR,
                "unloaded_ttft_s": {str(k): v for k, v in sorted(self.unloaded_ttft_s.items())},
                "unloaded_tpot_s": self.unloaded_tpot_s}

    @classmethod
    def from_json(cls, d: Mapping) -> Slo:
        return cls(d.get("ttft_s"), d.get("tpot_s"), {int(k): v for k, v in d.get("unloaded_ttft_s", {}).items()},
                   d.get("unloaded_tpot_s"))


def parse_mix(text: str | None) -> dict[str, tuple[float, tuple[int, int], tuple[int, int]]]:
    """The built-in mix with the weights of "short=0.7,summary=0.15,long=0.15" (classes it names)."""
    mix = dict(BUILTIN_MIX)
    if not text:
        return mix
    weights = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in BUILTIN_MIX:
            raise ValueError(f"--mix: class must be one of {', '.join(BUILTIN_MIX)}, got {name!r}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"--mix: weight of {name} must be a number, got {value!r}") from None
        if weights[name] < 0:
            raise ValueError(f"--mix: weight of {name} must be >= 0, got {value}")
    if not any(weights.values()):
        raise ValueError("--mix: at least one class needs a weight above 0")
    return {name: (weights.get(name, 0.0), p, m) for name, (_, p, m) in mix.items()}


def builtin_items(n: int, seed: int, mix: Mapping | None = None,
                  max_prompt_tokens: int | None = None) -> list[WorkItem]:
    """n items drawn from `mix` (default `BUILTIN_MIX`) with `random.Random(seed)`; prompts capped at
    `max_prompt_tokens` (a small model's context)."""
    mix = mix or BUILTIN_MIX
    rng = random.Random(seed)
    names = [k for k in mix if mix[k][0] > 0]
    weights = [mix[k][0] for k in names]
    out = []
    for _ in range(n):
        name = rng.choices(names, weights)[0]
        _, (p_lo, p_hi), (m_lo, m_hi) = mix[name]
        prompt = rng.randint(p_lo, p_hi)
        if max_prompt_tokens is not None:
            prompt = min(prompt, max_prompt_tokens)
        out.append(WorkItem(name, prompt, rng.randint(m_lo, m_hi)))
    return out


def file_items(path: str | Path) -> list[WorkItem]:
    """Items of a JSON-lines file, one object a line: {"prompt_tokens": N, "max_tokens": M, "class": "name"}
    ("class" optional). Raises ValueError naming the line and the field."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            p, m = int(d["prompt_tokens"]), int(d["max_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--workload {path}:{lineno}: needs integer prompt_tokens and max_tokens "
                             f"({exc})") from None
        if p < 1 or m < 1:
            raise ValueError(f"--workload {path}:{lineno}: prompt_tokens and max_tokens must be >= 1")
        out.append(WorkItem(str(d.get("class", "file")), p, m))
    if not out:
        raise ValueError(f"--workload {path}: no requests in the file")
    return out


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival offsets (seconds) of n requests at `rate` per second; the first at 0."""
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def requests_at(rate: float, duration_s: float, min_requests: int, max_requests: int) -> int:
    """How many requests a run at `rate` sends: rate × duration, within [min_requests, max_requests]."""
    return max(min_requests, min(max_requests, round(rate * duration_s)))


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by the nearest-rank method; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def _quantiles(prefix: str, values: list[float]) -> dict[str, float | None]:
    return {f"{prefix}_p{q}": percentile(values, q / 100) for q in (50, 90, 99)}


def summarize(outcomes: list[Outcome], rate: float, slo: Slo) -> dict:
    """The figures of one run at offered `rate` (see the module docstring); times in seconds."""
    done = [o for o in outcomes if o.ended and not o.error]
    met = sum(slo.met(o) for o in outcomes)
    start = min((o.arrival_s for o in outcomes), default=0.0)
    end = max((o.arrival_s + o.e2e_s for o in done if o.e2e_s is not None), default=start)
    span = max(end - start, 1e-9)
    short = [o for o in done if o.item.prompt_tokens <= SHORT_PROMPT_TOKENS]
    attainment = met / len(outcomes) if outcomes else 0.0
    out = {
        "rate": rate, "requests": len(outcomes), "completed": len(done),
        "errors": dict(Counter(o.error for o in outcomes if o.ended and o.error)),
        "unfinished": sum(not o.ended for o in outcomes),
        "throughput": len(done) / span, "output_tokens_per_s": sum(o.tokens for o in done) / span,
        "attainment": attainment, "goodput": rate * attainment,
        **_quantiles("ttft", [o.ttft_s for o in done if o.ttft_s is not None]),
        **_quantiles("tpot", [o.tpot_s for o in done if o.tpot_s is not None]),
        **_quantiles("e2e", [o.e2e_s for o in done if o.e2e_s is not None]),
        **_quantiles("short_ttft", [o.ttft_s for o in short if o.ttft_s is not None]),
        "plans": dict(Counter(o.plan or "-" for o in done)),
    }
    return out


class CapacitySearch:
    """Capacity under SLO: double from `start_rate` while attainment >= 0.9, then bisect between the last
    good and the first bad rate, `steps` runs in all (fewer once they are within 5%).

        search = CapacitySearch(0.1, 5)
        while (rate := search.next_rate()) is not None:
            search.record(run_at(rate))
        search.capacity  # 0.0 when even the start rate misses
    """

    def __init__(self, start_rate: float, steps: int):
        self.rate, self.steps = start_rate, steps
        self.capacity, self.bad = 0.0, None
        self.runs: list[dict] = []

    def next_rate(self) -> float | None:
        if len(self.runs) >= self.steps:
            return None
        if self.bad is not None and self.capacity and self.bad - self.capacity < 0.05 * self.bad:
            return None
        return self.rate

    def record(self, run: dict) -> None:
        """The figures (`summarize`) of the run at the rate `next_rate` gave."""
        self.runs.append(run)
        if run["attainment"] >= ATTAINMENT_TARGET:
            self.capacity = max(self.capacity, run["rate"])
        else:
            self.bad = run["rate"] if self.bad is None else min(self.bad, run["rate"])
        if self.bad is None:
            self.rate = self.rate * 2
        elif not self.capacity:
            self.rate = self.bad / 2
        else:
            self.rate = (self.capacity + self.bad) / 2


def parse_rates(text: str) -> list[tuple[float, bool]]:
    """"0.25x,0.5x,1x" or "0.2,0.4" → [(value, relative to capacity)]. Raises ValueError naming --rates."""
    out = []
    for part in text.split(","):
        part = part.strip()
        relative = part.endswith("x")
        try:
            value = float(part[:-1] if relative else part)
        except ValueError:
            raise ValueError(f"--rates: each rate is a number or a multiple of capacity like 0.5x, "
                             f"got {part!r}") from None
        if not value > 0:
            raise ValueError(f"--rates: each rate must be > 0, got {part!r}")
        out.append((value, relative))
    return out


def policy_report(name: str, capacity: float | None, sweep: list[dict], capacity_runs: list[dict]) -> dict:
    """The JSON of one policy: capacity, the sweep, and the headline figures of the run nearest the capacity."""
    runs = sweep or capacity_runs
    headline = max((r for r in runs if r["attainment"] >= ATTAINMENT_TARGET), key=lambda r: r["rate"],
                   default=runs[0] if runs else {})
    keys = ("throughput", "attainment", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90",
            "tpot_p99", "e2e_p50", "e2e_p90", "e2e_p99", "short_ttft_p99", "plans", "rate")
    return {"policy": name, "capacity": capacity, **{k: headline.get(k) for k in keys},
            "goodput": max((r["goodput"] for r in runs), default=None), "headline_rate": headline.get("rate"),
            "sweep": sweep, "capacity_runs": capacity_runs}
