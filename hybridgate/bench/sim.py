"""`hybridgate bench sim`: a discrete-event simulation of a worker layout, driving the real policy objects.

Each simulated worker is the engine's continuous-batching loop
(hybridgate/workers/scheduler.py, reduced to its timing): a step runs every
decoding sequence (one token each), then the prefills in progress, then admits
waiting requests first come first served, within the step's token budget
(`max_num_batched_tokens`) and batch cap (`max_num_seqs`); KV blocks are
allocated as tokens are computed and, when they run out, the newest running
sequence is preempted and recomputed later, as the real scheduler does. A
step's duration comes from the worker's calibration profile
(`Profile`: decode step seconds by batch, prefill tokens/s by step tokens,
measured by `bench engine --profile-out` or derived from published figures)
through the same interpolation the cost model uses
(`hybridgate.router.costmodel.step_s`).

At each arrival the policy (the same `hybridgate.router.policy` object
`serve` uses) gets `WorkerLoad`s built from the simulated state and returns a
plan; a `gpu->cpu` plan prefills on the GPU worker and, at the first token,
moves the sequence to the CPU worker after the KV copy time
(`costmodel.handoff_s`), where it decodes the rest. The simulation is
deterministic for a seed; its figures (`workload.summarize`) have the same
JSON shape as `bench serve`'s.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from hybridgate.bench.workload import Outcome, Slo, WorkItem
from hybridgate.router import costmodel as cm
from hybridgate.router.costmodel import WorkerLoad
from hybridgate.router.policy import PlacementRequest, Policy
from hybridgate.workers.config import SchedulerConfig

PROFILE_FIELDS = ("kind", "decode_step_s", "prefill_tokens_per_s", "blocks_total", "block_size", "max_num_seqs",
                  "max_num_batched_tokens")


@dataclass(frozen=True)
class Profile:
    """A worker model: `decode_step_s` {batch: seconds per step}, `prefill_tokens_per_s` {step tokens:
    tokens/s}, KV capacity `blocks_total` × `block_size` tokens, the scheduler's caps, and what one
    token of KV weighs (`kv_bytes_per_token`, for hand-off copies). `source` says where the figures
    come from."""

    name: str
    kind: str
    decode_step_s: dict[int, float]
    prefill_tokens_per_s: dict[int, float]
    blocks_total: int
    block_size: int = 16
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    kv_bytes_per_token: int = 0
    source: str = ""

    @classmethod
    def load(cls, spec: str) -> Profile:
        """A profile by file path or by the name of a shipped one (hybridgate/bench/data/profile-NAME.json).
        Raises ValueError naming the file and the missing field."""
        path = Path(spec)
        if not path.exists():
            shipped = resources.files("hybridgate.bench") / "data" / f"profile-{spec}.json"
            if not shipped.is_file():
                names = sorted(p.name[len("profile-"):-len(".json")]
                               for p in (resources.files("hybridgate.bench") / "data").iterdir()
                               if p.name.startswith("profile-"))
                raise ValueError(f"--layout: no profile file {spec!r} and no shipped profile of that name "
                                 f"(shipped: {', '.join(names)})")
            text, where = shipped.read_text(), f"profile-{spec}.json"
        else:
            text, where = path.read_text(), str(path)
        d = json.loads(text)
        d = d.get("profile", d)  # a `bench engine --json` report carries its profile under "profile"
        missing = [f for f in PROFILE_FIELDS if f not in d]
        if missing:
            raise ValueError(f"{where}: a worker profile needs {', '.join(missing)}")
        if d["kind"] not in ("gpu", "cpu"):
            raise ValueError(f"{where}: kind must be gpu or cpu, got {d['kind']!r}")
        return cls(name=d.get("name", spec), kind=d["kind"],
                   decode_step_s={int(k): float(v) for k, v in d["decode_step_s"].items()},
                   prefill_tokens_per_s={int(k): float(v) for k, v in d["prefill_tokens_per_s"].items()},
                   blocks_total=int(d["blocks_total"]), block_size=int(d["block_size"]),
                   max_num_seqs=int(d["max_num_seqs"]), max_num_batched_tokens=int(d["max_num_batched_tokens"]),
                   kv_bytes_per_token=int(d.get("kv_bytes_per_token", 0)), source=str(d.get("source", "")))


def parse_layout(text: str) -> list[Profile]:
    """"h200*1+epyc32*8" → the profiles, one per worker. Raises ValueError naming --layout."""
    out = []
    for part in text.split("+"):
        name, _, count = part.strip().partition("*")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"--layout: a count after * must be an integer, got {part!r}") from None
        if n < 1:
            raise ValueError(f"--layout: a count must be >= 1, got {part!r}")
        out += [Profile.load(name)] * n
    return out


@dataclass(eq=False)
class _Seq:
    """A sequence as the scheduler counts it: `computed` of `prompt + generated` tokens have KV."""

    outcome: Outcome
    prompt: int
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    handoff_to: int | None = None  # the CPU worker a gpu->cpu plan moves it to after its first token

    @property
    def whole_tokens(self) -> int:
        """Prompt and every token it may generate."""
        return self.prompt + self.outcome.item.max_tokens

    @property
    def final_tokens(self) -> int:
        """Tokens it holds KV for at its end here: the whole sequence, or a hand-off's prompt and first token."""
        return self.prompt + 1 if self.handoff_to is not None else self.whole_tokens

    @property
    def remaining(self) -> int:
        return self.prompt + self.generated - self.computed

    @property
    def prefilling(self) -> bool:
        """Not a decode: the prompt (or, after a preemption, prompt and output) still to compute."""
        return not (self.generated and self.remaining == 1)


@dataclass(eq=False)
class _Worker:
    profile: Profile
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    blocks_free: int = 0
    busy: bool = False
    incoming: int = 0  # gpu->cpu sequences placed here and not imported yet (the router counts them as decodes)
    incoming_blocks: int = 0  # the blocks those will hold at their end
    preemptions: int = 0
    batch: list = field(default_factory=list)  # (seq, tokens) of the step in flight

    def __post_init__(self) -> None:
        self.blocks_free = self.profile.blocks_total
        self._rates = WorkerLoad(0, self.profile.name, self.profile.kind, decode_step_s=self.profile.decode_step_s,
                                 prefill_tokens_per_s=self.profile.prefill_tokens_per_s)

    @property
    def committed(self) -> int:
        """Blocks its sequences hold at their end, as the engine reports it (`EngineStats.blocks_committed`)."""
        return sum(self.blocks_for(s.final_tokens) for s in (*self.waiting, *self.running)) + self.incoming_blocks

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.profile.block_size)

    def load(self, index: int) -> WorkerLoad:
        p = self.profile
        return WorkerLoad(
            index=index, name=f"{p.name}-{index}", kind=p.kind, inflight=len(self.waiting) + len(self.running),
            queued_prefill_tokens=sum(s.remaining for s in (*self.waiting, *self.running) if s.prefilling),
            waiting=len(self.waiting), decoding=sum(not s.prefilling for s in self.running) + self.incoming,
            blocks_free=self.blocks_free, blocks_total=p.blocks_total, block_size=p.block_size,
            blocks_committed=self.committed,
            max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
            prefill_tokens_per_s=p.prefill_tokens_per_s, decode_step_s=p.decode_step_s,
            takes_handoff=p.kind == "cpu", kv_bytes_per_token=p.kv_bytes_per_token)

    def _ensure(self, seq: _Seq, tokens: int) -> bool:
        need = self.blocks_for(tokens) - seq.blocks
        if need <= 0:
            return True
        if need > self.blocks_free:
            return False
        self.blocks_free -= need
        seq.blocks += need
        return True

    def release(self, seq: _Seq) -> None:
        self.blocks_free += seq.blocks
        seq.blocks = 0

    def schedule(self) -> list[tuple[_Seq, int]]:
        """The next step's batch, as `Scheduler.schedule` builds it (decodes, prefills in progress, admissions)."""
        p, batch = self.profile, []
        budget = p.max_num_batched_tokens
        preempted = False
        for seq in [s for s in self.running if not s.prefilling]:
            if not budget or seq not in self.running:
                continue
            while not self._ensure(seq, seq.computed + 1):
                batched = {id(b) for b, _ in batch}  # the newest not already in this step, as the scheduler does
                self.preempt(next((s for s in reversed(self.running) if id(s) not in batched), self.running[-1]))
                preempted = True
                if seq not in self.running:
                    break
            if seq in self.running:
                batch.append((seq, 1))
                budget -= 1
        for seq in [s for s in self.running if s.prefilling]:
            n = min(seq.remaining, budget)
            if n and self._ensure(seq, seq.computed + n):
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget and not preempted and len(self.running) < p.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.remaining, budget) if seq.prefilling else 1
            if not self._ensure(seq, seq.computed + n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def preempt(self, seq: _Seq) -> None:
        """Its blocks back; prompt and output are recomputed when it is admitted again."""
        self.running.remove(seq)
        self.release(seq)
        seq.computed = 0
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def step_seconds(self, batch: list[tuple[_Seq, int]]) -> float:
        tokens = sum(n for _, n in batch)
        return cm.step_s(self._rates, tokens, len(batch))


class Simulation:
    """One run: `workers` (profiles), the policy, the outcomes of the items placed at their arrival offsets."""

    def __init__(self, profiles: list[Profile], policy: Policy, frontend_s: float = 0.0):
        self.workers = [_Worker(p) for p in profiles]
        self.policy = policy
        self.frontend_s = frontend_s  # client and gateway time on the way of every request (`frontend_latency`)
        self._events: list = []
        self._order = itertools.count()
        self.now = 0.0

    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, payload))

    def run(self, items: list[WorkItem], arrivals: list[float], time_limit_s: float) -> list[Outcome]:
        """Every item's outcome; a request not finished `time_limit_s` after the last arrival is cut off."""
        outcomes = [Outcome(item, t) for item, t in zip(items, arrivals)]
        for i, t in enumerate(arrivals):
            self._push(t, "arrive", i)
        stop_at = (arrivals[-1] if arrivals else 0.0) + time_limit_s
        handlers = {"arrive": lambda i: self._arrive(outcomes[i]), "step": self._step_done,
                    "import": lambda arg: self._import(*arg)}
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            if t > stop_at:
                break
            self.now = t
            handlers[kind](payload)
        return outcomes

    def _arrive(self, outcome: Outcome) -> None:
        item = outcome.item
        loads = [w.load(i) for i, w in enumerate(self.workers)]
        request = PlacementRequest(item.prompt_tokens, item.max_tokens, (item.prompt_tokens,) * len(loads))
        plan = self.policy.place(request, loads)
        outcome.plan = plan.route
        seq = _Seq(outcome, item.prompt_tokens)
        if plan.route == "gpu->cpu":
            seq.handoff_to = plan.workers[1]
            target = self.workers[seq.handoff_to]
            target.incoming += 1
            target.incoming_blocks += target.blocks_for(seq.whole_tokens)
        worker = self.workers[plan.workers[0]]
        if not cm.fits(loads[plan.workers[0]], item.prompt_tokens + item.max_tokens):
            outcome.ended, outcome.error = True, "RESOURCE_EXHAUSTED"
            return
        worker.waiting.append(seq)
        self._kick(plan.workers[0])

    def _kick(self, index: int) -> None:
        w = self.workers[index]
        if w.busy:
            return
        w.batch = w.schedule()
        if w.batch:
            w.busy = True
            self._push(self.now + w.step_seconds(w.batch), "step", index)

    def _step_done(self, index: int) -> None:
        w = self.workers[index]
        w.busy = False
        for seq, n in w.batch:
            seq.computed += n
            if seq.remaining > 0:  # a prefill chunk with more to come
                continue
            seq.generated += 1  # the step sampled the next token
            o = seq.outcome
            if o.ttft_s is None:
                o.ttft_s = self.now - o.arrival_s + self.frontend_s
            o.tokens = seq.generated
            if seq.generated >= o.item.max_tokens:
                o.e2e_s, o.ended = self.now - o.arrival_s + self.frontend_s, True
                w.running.remove(seq)
                w.release(seq)
            elif seq.handoff_to is not None:
                w.running.remove(seq)
                w.release(seq)
                target, seq.handoff_to = seq.handoff_to, None
                copy = cm.handoff_s(w.profile.kv_bytes_per_token, seq.computed)
                self._push(self.now + copy, "import", (target, seq))
        w.batch = []
        self._kick(index)

    def _import(self, index: int, seq: _Seq) -> None:
        # The CPU worker takes the sequence with its KV: nothing to prefill, its next step decodes it.
        w = self.workers[index]
        w.incoming -= 1
        w.incoming_blocks -= w.blocks_for(seq.whole_tokens)
        w.waiting.append(seq)
        self._kick(index)


def slo_grid(prompt_lengths: list[int], points: int = 9) -> list[int]:
    """Up to `points` prompt lengths spread evenly in log scale over the workload's range, ends included."""
    lo, hi = min(prompt_lengths), max(prompt_lengths)
    if hi <= lo:
        return [lo]
    return sorted({round(lo * (hi / lo) ** (k / (points - 1))) for k in range(points)})


def unloaded_slo(profiles: list[Profile], prompt_lengths: list[int], ttft_s: float | None,
                 tpot_s: float | None) -> Slo:
    """The SLOs the cost policy derives for this layout: unloaded TTFT of the fastest worker per length,
    unloaded decode step of the fastest worker (fixed values win)."""
    loads = [_Worker(p).load(i) for i, p in enumerate(profiles)]
    ttft = {n: min(cm.unloaded_ttft_s(w, n) for w in loads) for n in slo_grid(prompt_lengths)}
    return Slo(ttft_s, tpot_s, ttft, min(cm.unloaded_tpot_s(w) for w in loads))


def frontend_latency(text: str, profiles: list[Profile], report: dict | None) -> float:
    """`--frontend-latency`: seconds, or "auto": the report's unloaded TTFT at its shortest probe (`bench serve
    --json`, its "unloaded" TTFTs by prompt length) less the layout's own unloaded TTFT there, at least 0: the
    shortest prompt, where the prefill is least of it and a profile's prefill rate errs least in seconds.
    Raises ValueError naming the flag."""
    if text != "auto":
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"--frontend-latency: seconds or 'auto', got {text!r}") from None
        if not value >= 0:
            raise ValueError(f"--frontend-latency: must be >= 0 seconds, got {text!r}")
        return value
    probes = ((report or {}).get("unloaded") or {}).get("ttft_s")
    if not probes:
        raise ValueError("--frontend-latency auto: needs --slo-from a bench serve report with its unloaded probes")
    loads = [_Worker(p).load(i) for i, p in enumerate(profiles)]
    shortest = min(probes, key=int)
    return max(0.0, probes[shortest] - min(cm.unloaded_ttft_s(w, int(shortest)) for w in loads))


def simulate(profiles: list[Profile], policy_name: str, items: list[WorkItem], rate: float, seed: int,
             slo: Slo, time_limit_s: float, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
             frontend_s: float = 0.0) -> dict:
    """The figures (`workload.summarize`) of one simulated run at `rate` with a fresh policy object;
    `frontend_s` is added to every TTFT and e2e latency."""
    from hybridgate.bench.workload import arrivals, summarize
    from hybridgate.router.policy import make_policy

    policy = make_policy(policy_name, ttft_slo_s, tpot_slo_s, seed=seed)
    outcomes = Simulation(profiles, policy, frontend_s).run(items, arrivals(len(items), rate, seed), time_limit_s)
    return summarize(outcomes, rate, slo)


def run(args) -> dict:
    """`hybridgate bench sim`: per layout and policy, a capacity search and a sweep, as `bench serve` reports."""
    from hybridgate.bench import workload as wl
    from hybridgate.config import resolve

    router = resolve(args).settings.router
    if not args.layouts:
        raise ValueError("--layouts: give at least one layout, e.g. h200-llama8b*1+epyc32-llama8b*8")
    layouts = [s.strip() for s in args.layouts.split(",")]
    profiles = {name: parse_layout(name) for name in layouts}
    items = wl.file_items(args.workload) if args.workload else wl.builtin_items(args.max_requests, args.seed,
                                                                               wl.parse_mix(args.mix))
    source = json.loads(Path(args.slo_from).read_text()) if args.slo_from else None
    if source is not None:
        slo = wl.Slo.from_json(source["slo"])
    else:
        slo = unloaded_slo(profiles[layouts[0]], [i.prompt_tokens for i in items], router.ttft_slo_s, router.tpot_slo_s)
    policies = args.compare_policies.split(",") if args.compare_policies else [router.policy]
    rates = wl.parse_rates(args.rates) if args.rates else []

    frontend = {name: frontend_latency(args.frontend_latency, ps, source) for name, ps in profiles.items()}

    def one(layout: str, policy: str, rate: float) -> dict:
        n = wl.requests_at(rate, args.duration, args.min_requests, args.max_requests)
        chosen = [items[i % len(items)] for i in range(n)]
        return simulate(profiles[layout], policy, chosen, rate, args.seed, slo, args.time_limit,
                        router.ttft_slo_s, router.tpot_slo_s, frontend[layout])

    start = 1.0 / statistics.mean(slo.ttft_for(i.prompt_tokens) / wl.SLO_FACTOR
                                  + slo.tpot() / wl.SLO_FACTOR * (i.max_tokens - 1) for i in items)
    report: dict = {"slo": slo.to_json(), "seed": args.seed, "layouts": {}, "frontend_latency_s": frontend,
                    "profiles": {p.name: p.source for ps in profiles.values() for p in ps}}
    first_capacity, absolute = None, None
    for layout in layouts:
        out = report["layouts"].setdefault(layout, {"policies": {}})
        for policy in policies:
            search = wl.CapacitySearch(start, args.capacity_runs)  # one start for all: the same path when equal
            while (rate := search.next_rate()) is not None:
                search.record(one(layout, policy, rate))
            base = first_capacity or search.capacity
            if rates and absolute is None:
                if any(rel for _, rel in rates) and not base:
                    raise ValueError("--rates: multiples of capacity need a capacity above 0 (more --capacity-runs)")
                absolute = [v * base if rel else v for v, rel in rates]
            sweep = [one(layout, policy, r) for r in absolute or []]
            first_capacity = first_capacity or search.capacity or None
            out["policies"][policy] = wl.policy_report(policy, search.capacity, sweep, search.runs)
            print(f"{layout} {policy}: capacity under SLO {search.capacity:.3f} requests/s, goodput "
                  f"{out['policies'][policy]['goodput']:.3f}/s, TTFT p50 {_ms(out['policies'][policy]['ttft_p50'])} "
                  f"ms, plans {out['policies'][policy]['plans']}", flush=True)
    report["policies"] = report["layouts"][layouts[0]]["policies"]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from hybridgate.bench.plot import plot_report

        plot_report(report, args.plot, title="bench sim")
        print(f"plot: {args.plot}", flush=True)
    return report


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"
