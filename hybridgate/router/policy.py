"""Placement policies: one interface, five policies (`--policy`).

A policy gets a `PlacementRequest` (prompt length, its uncached length on
each worker, max_tokens, deadline) and the READY workers' `WorkerLoad`s, and
returns a `Plan`: the route (`gpu`, `cpu` or `gpu->cpu`), the workers, and the
predicted TTFT and TPOT (hybridgate/router/costmodel.py), whichever policy chose
it, so every placement can be compared with what it observed.

- `round_robin`: the next worker in turn.
- `least_loaded`: the fewest requests in flight from this router (GPU first on
  ties); what the router did before policies.
- `power_of_two`: two workers drawn at random, the less loaded of the two
  (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001).
- `prefix_affinity`: the worker holding the longest cached prefix of the
  prompt, by the router's own record of the block hashes it sent to each
  worker, unless the load is imbalanced, then the least loaded (the rule of
  SGLang's cache-aware router: imbalance when max − min > `balance_abs` and
  max > `balance_rel` × min; a match below `cache_threshold` of the prompt
  also goes to the least loaded).
- `cost` (the default): predicts TTFT and TPOT of every plan on every
  eligible worker and takes, among the plans that meet both SLOs and fit the
  decoding worker's KV cache beside what its sequences are promised (each to
  its max_tokens, `WorkerLoad.blocks_committed`: a plan that only fits the
  blocks free now preempts running sequences later, as they grow), the
  cheapest: the one that holds a GPU worker's
  decode slots for the fewest seconds (a `gpu` plan: TPOT × its remaining
  tokens; `cpu` and `gpu->cpu`: none), so the GPU keeps its batch and its
  steps for the work only it does fast, prefill, while the CPU tier decodes
  whatever it can within the SLOs (the division of labour of Splitwise and
  DistServe, with the CPU tier as the decode pool); among equally cheap plans
  the one that finishes soonest (TTFT + TPOT × the remaining tokens). When
  none does, the plan that finishes soonest among those that keep every
  cache's promises (among all when none does): on a CPU worker that is a
  spill, never a rejection. Default SLOs scale with the request, as Splitwise (Patel
  et al., ISCA 2024) and Sarathi-Serve define theirs: TTFT SLO = 3 × the
  unloaded TTFT of the fastest worker for this prompt, TPOT SLO = 3 × the
  fastest unloaded decode step. Until every worker has reported measured
  figures, `cost` places as `least_loaded` does.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from hybridgate.router import costmodel as cm
from hybridgate.router.config import POLICIES
from hybridgate.router.costmodel import WorkerLoad

SLO_FACTOR = 3.0
# A plan meets the TPOT SLO when its predicted TPOT is within this fraction of it. The prediction is the step at
# the batch the worker has now; the requests placed after this one join that batch too, so a batch filled to the
# SLO's edge ends above it for everyone in it. The room left absorbs what arrives during the generation.
TPOT_HEADROOM = 0.8


@dataclass(frozen=True)
class PlacementRequest:
    """What a policy knows of a request. `uncached_tokens[i]`: prompt tokens not cached on workers[i]
    (the router's estimate); `deadline_s`: seconds left, None for none; `handoff_bytes_per_s`: the
    rate a gpu->cpu hand-off copies at (costmodel.HandoffRate); `handoff`: whether gpu->cpu plans
    may be made (a request moved after its first placement runs on one worker)."""

    prompt_tokens: int
    max_tokens: int
    uncached_tokens: tuple[int, ...]
    deadline_s: float | None = None
    handoff_bytes_per_s: float = cm.HANDOFF_BYTES_PER_S
    handoff: bool = True


@dataclass(frozen=True)
class Plan:
    """A placement: `route` is "gpu", "cpu" or "gpu->cpu"; `workers` are indexes into the loads
    given to the policy (one, or the GPU then the CPU worker of a hand-off); seconds predicted."""

    route: str
    workers: tuple[int, ...]
    ttft_s: float
    tpot_s: float
    spilled: bool = False
    meets_slo: bool = True

    def e2e_s(self, max_tokens: int) -> float:
        return self.ttft_s + self.tpot_s * max(0, max_tokens - 1)


class Policy(Protocol):
    name: str

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> Plan:
        """The plan for `request` over `workers` (non-empty, all READY)."""


def predict(request: PlacementRequest, workers: Sequence[WorkerLoad], i: int) -> Plan:
    """The one-worker plan on workers[i], with its predictions."""
    w = workers[i]
    return Plan(w.kind, (i,), cm.ttft_s(w, request.uncached_tokens[i]), cm.tpot_s(w))


def all_plans(request: PlacementRequest, workers: Sequence[WorkerLoad]) -> list[Plan]:
    """Every one-worker plan, and (when `request.handoff`) gpu->cpu from each GPU worker to its best
    hand-off target, the copy priced at that GPU worker's KV bytes per token."""
    plans = [predict(request, workers, i) for i in range(len(workers))]
    cpus = [i for i, w in enumerate(workers) if w.kind == "cpu" and w.takes_handoff]
    if cpus and request.handoff:
        target = min(cpus, key=lambda i: cm.tpot_s(workers[i]))
        cpu, steps = workers[target], max(1, request.max_tokens - 1)
        drain = cm.prefill_s(cpu, cpu.queued_prefill_tokens, cpu.decoding)  # the CPU's queue runs first
        for p in plans[: len(workers)]:
            gpu = workers[p.workers[0]]
            if gpu.kind != "gpu" or request.max_tokens <= 1:
                continue
            copy = cm.handoff_s(gpu.kv_bytes_per_token, request.prompt_tokens, request.handoff_bytes_per_s)
            plans.append(Plan("gpu->cpu", (p.workers[0], target), p.ttft_s,
                              cm.tpot_s(cpu) + (copy + max(0.0, drain - p.ttft_s)) / steps))
    return plans


def gpu_decode_s(plan: Plan, max_tokens: int) -> float:
    """Seconds a plan holds a GPU worker's decode slot: TPOT × the tokens after the first for a `gpu` plan;
    0 for `cpu` and `gpu->cpu` (the GPU worker only prefills)."""
    return plan.tpot_s * max(0, max_tokens - 1) if plan.route == "gpu" else 0.0


def _least_loaded(workers: Sequence[WorkerLoad], candidates: Sequence[int]) -> int:
    return min(candidates, key=lambda i: (workers[i].inflight, workers[i].kind != "gpu", i))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> Plan:
        return predict(request, workers, next(self._turn) % len(workers))


class LeastLoaded:
    name = "least_loaded"

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> Plan:
        return predict(request, workers, _least_loaded(workers, range(len(workers))))


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> Plan:
        sample = self._rng.sample(range(len(workers)), min(2, len(workers)))
        return predict(request, workers, _least_loaded(workers, sample))


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.5) -> None:
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> Plan:
        loads = [w.inflight for w in workers]
        hi, lo = max(loads), min(loads)
        everyone = range(len(workers))
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return predict(request, workers, _least_loaded(workers, everyone))
        cached = [request.prompt_tokens - request.uncached_tokens[i] for i in everyone]
        best = max(everyone, key=lambda i: (cached[i], -workers[i].inflight))
        if cached[best] < self.cache_threshold * request.prompt_tokens:
            return predict(request, workers, _least_loaded(workers, everyone))
        return predict(request, workers, best)


class CostPolicy:
    """`ttft_slo_s` / `tpot_slo_s`: fixed objectives in seconds; None: 3 × the unloaded figures."""

    name = "cost"

    def __init__(self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> None:
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s

    def slos(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> tuple[float, float]:
        """(TTFT SLO, TPOT SLO) of this request, seconds."""
        ttft = self.ttft_slo_s or SLO_FACTOR * min(cm.unloaded_ttft_s(w, request.prompt_tokens) for w in workers)
        tpot = self.tpot_slo_s or SLO_FACTOR * min(cm.unloaded_tpot_s(w) for w in workers)
        return ttft, tpot

    @staticmethod
    def _fits(request: PlacementRequest, workers: Sequence[WorkerLoad], plan: Plan) -> bool:
        """The decoding worker's cache can take the whole sequence beside what it has promised; a
        hand-off's GPU worker needs free blocks for the prompt only, held until the copy."""
        total = request.prompt_tokens + request.max_tokens
        if not cm.fits_committed(workers[plan.workers[-1]], total):
            return False
        return plan.route != "gpu->cpu" or cm.fits_now(workers[plan.workers[0]], request.prompt_tokens + 1)

    def place(self, request: PlacementRequest, workers: Sequence[WorkerLoad]) -> Plan:
        if not all(w.prefill_tokens_per_s and w.decode_step_s for w in workers):
            # A worker without figures yet (started with rate measurement off, or an in-process
            # engine): nothing to predict with, so the fewest in flight, as least_loaded.
            return predict(request, workers, _least_loaded(workers, range(len(workers))))
        total = request.prompt_tokens + request.max_tokens
        plans = [p for p in all_plans(request, workers) if all(cm.fits(workers[i], total) for i in p.workers)]
        if not plans:  # no worker's cache can hold it: let the first one refuse it with its own message
            return predict(request, workers, 0)
        ttft_slo, tpot_slo = self.slos(request, workers)
        decodes = request.max_tokens > 1  # a one-token request has no TPOT to meet
        good = [p for p in plans if p.ttft_s <= ttft_slo and (not decodes or p.tpot_s <= TPOT_HEADROOM * tpot_slo)
                and self._fits(request, workers, p)]
        if good:
            return min(good, key=lambda p: (gpu_decode_s(p, request.max_tokens), p.e2e_s(request.max_tokens),
                                            p.route != "cpu"))
        # Nothing meets the SLOs: no rejection; the plan that finishes soonest, the CPU tier first on ties, among
        # those that fit beside what each cache has promised (overcommitting a cache preempts what runs there).
        plans = [p for p in plans if self._fits(request, workers, p)] or plans
        best = min(plans, key=lambda p: (p.e2e_s(request.max_tokens), p.route != "cpu"))
        return replace(best, spilled=best.route == "cpu", meets_slo=False)


def make_policy(name: str, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                seed: int | None = None) -> Policy:
    """The policy named `name` (one of POLICIES). Raises ValueError naming the choices."""
    makers = {"cost": lambda: CostPolicy(ttft_slo_s, tpot_slo_s), "least_loaded": LeastLoaded,
              "round_robin": RoundRobin, "power_of_two": lambda: PowerOfTwo(seed),
              "prefix_affinity": PrefixAffinity}
    if name not in makers:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {name!r}")
    return makers[name]()
