"""Prometheus metrics of the gateway and, through the router's clients, of the engines."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

from hybridgate.gateway.loop_metrics import LoopCounter, LoopHistogram
from hybridgate.router.handoff_metrics import SECONDS_BUCKETS

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ERROR_BUCKETS = (-10.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS_MAX = 1 << 17  # the token histograms' last bucket when no max model length is given
LAG_INTERVAL_S = 0.02  # the lag probe's period: 50 wake-ups a second, about 1 ms of CPU


class ModelSeries:
    """One served model's children of the per-request series (labelled `model_name`, as vLLM labels them)."""

    def __init__(self, metrics: GatewayMetrics, name: str):
        self.name = name
        self.ttft, self.itl, self.e2e = (h.labels(name) for h in (metrics.ttft, metrics.itl, metrics.e2e))
        self.prompt_tokens, self.generation_tokens = (c.labels(name) for c in (metrics.prompt_tokens,
                                                                                metrics.generation_tokens))
        self._prompt_hist, self._generation_hist = (h.labels(name) for h in (metrics.request_prompt_tokens,
                                                                             metrics.request_generation_tokens))
        self._success, self._rejected = metrics.success, metrics.rejected
        self._close_errors = metrics.stream_close_errors.labels(name)
        # streamed(tokens): `tokens` generated ids went out to a client; the counter's own `inc`, one call
        # per streamed message.
        self.streamed: Callable[[int], None] = self.generation_tokens.inc

    def first_token(self, prompt_tokens: int) -> None:
        """A request's first output: its prompt was prefilled (vLLM counts prompt tokens then)."""
        self.prompt_tokens.inc(prompt_tokens)

    def finished(self, reason: str, prompt_tokens: int | None = None, generation_tokens: int | None = None) -> None:
        """A request ended with finish reason `reason` (stop, length, eos, abort), its prompt and generated
        token counts observed where known."""
        self._success.labels(reason, self.name).inc()
        if prompt_tokens is not None:
            self._prompt_hist.observe(prompt_tokens)
        if generation_tokens is not None:
            self._generation_hist.observe(generation_tokens)

    def rejected(self, reason: str) -> None:
        """A request was refused with RESOURCE_EXHAUSTED for `reason`."""
        self._rejected.labels(reason, self.name).inc()

    def close_failed(self) -> None:
        """Leaving a request's stream raised (its abort may not have reached its worker)."""
        self._close_errors.inc()


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: the buckets of vLLM's token histograms
    (vllm/v1/metrics/loggers.py, build_1_2_5_buckets, over the max model length)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


class GatewayMetrics:
    """Per-request histograms and counters, labelled by served model, plus engine counters read from worker
    clients. `of(name)` gives a model's series."""

    def __init__(self, clients: Callable[[], Iterable] | None = None, wire_errors: Callable[[], int] | None = None,
                 handoff: Callable[[], object] | None = None, redis_up: Callable[[], bool | None] | None = None,
                 response_cache=None, model: tuple[str, str] | None = None,
                 models: Sequence[tuple[str, str, Callable[[], Iterable]]] = (), constraint_check=None,
                 max_model_len: int = TOKEN_BUCKETS_MAX):
        """`model`: (served name, fingerprint) of the one model whose workers `clients` gives; `models`:
        (served name, fingerprint, its clients) of each served model, for a gateway of several (then
        `clients` is every model's workers). Each is exported as `hybridgate:model_info` and under
        vLLM's names (vllm_metrics.py). `constraint_check`: the routers' `ConstraintCheck` (one, or a list),
        whose counters are exported summed. `max_model_len`: the longest of the models', the token
        histograms' last bucket."""
        self.registry = CollectorRegistry()
        if model is not None and clients is not None and not models:
            models = [(model[0], model[1], clients)]
        elif model is not None and not models:
            models = [(model[0], model[1], lambda: ())]
        if models:
            self.registry.register(_ModelInfoCollector([(name, fp) for name, fp, _ in models]))
        per_model = ["model_name"]
        self.ttft = Histogram("hybridgate:time_to_first_token_seconds", "Time to first token (TTFT), seconds.",
                              per_model, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = LoopHistogram("hybridgate:inter_token_latency_seconds", "Inter-token latency (ITL), seconds, of "
                                 "streams through both doors (gRPC and HTTP).", per_model, buckets=_LATENCY_BUCKETS,
                                 registry=self.registry)  # observed per streamed message
        self.e2e = Histogram("hybridgate:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                             per_model, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter("hybridgate:request_success", "Finished requests by finish reason.",
                               ["finished_reason", "model_name"], registry=self.registry)
        self.prompt_tokens = LoopCounter("hybridgate:prompt_tokens", "Prompt tokens of the requests that got their "
                                         "first token.", per_model, registry=self.registry)
        self.generation_tokens = LoopCounter("hybridgate:generation_tokens", "Generated tokens streamed to clients.",
                                             per_model, registry=self.registry)
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = LoopHistogram("hybridgate:request_prompt_tokens", "Prompt tokens of each "
                                                   "finished request.", per_model, buckets=tokens, registry=self.registry)
        self.request_generation_tokens = LoopHistogram("hybridgate:request_generation_tokens", "Generated tokens of "
                                                       "each finished request.", per_model, buckets=tokens,
                                                       registry=self.registry)
        self.placements = Counter("hybridgate:placements", "Requests placed, by policy and plan.",
                                  ["policy", "plan"], registry=self.registry)
        self.ttft_error = Histogram("hybridgate:ttft_prediction_error_seconds",
                                    "Observed minus predicted TTFT of each placed request, seconds.",
                                    buckets=_ERROR_BUCKETS, registry=self.registry)
        self.spills = Counter("hybridgate:spills", "Requests no plan could serve within the SLOs, placed on "
                              "the CPU tier instead of being rejected.", registry=self.registry)
        # reason: max_inflight_requests (this gateway's limit), worker_queue_full (every worker's waiting
        # queue at --max-num-waiting), worker_memory (no worker had the memory or KV blocks)
        self.rejected = Counter("hybridgate:requests_rejected", "Requests refused with RESOURCE_EXHAUSTED, by reason.",
                                ["reason", "model_name"], registry=self.registry)
        self.stream_close_errors = Counter("hybridgate:stream_close_errors", "Streams whose close (the abort "
                                           "sent to their worker) raised after their response ended; each is "
                                           "logged at WARNING.", per_model, registry=self.registry)
        self._series: dict[str, ModelSeries] = {}
        self.loop_lag = Histogram("hybridgate:event_loop_lag_seconds",
                                  f"How late the gateway's event loop ran a timer due every {LAG_INTERVAL_S:g} s "
                                  "(time spent by other work on the loop), seconds.",
                                  buckets=_LAG_BUCKETS, registry=self.registry)
        if clients is not None:
            self.registry.register(_EngineCollector(clients, wire_errors))
        if models:  # the same figures under vLLM's names (vllm_metrics.py)
            from hybridgate.vllm_metrics import VllmCollector

            self.registry.register(VllmCollector([(name, c) for name, _, c in models],
                                                 (self.ttft, self.itl, self.e2e, self.success, self.prompt_tokens,
                                                  self.generation_tokens, self.request_prompt_tokens,
                                                  self.request_generation_tokens)))
        if handoff is not None:
            self.registry.register(_HandoffRouterCollector(handoff))
        if redis_up is not None:
            self.registry.register(_RedisCollector(redis_up))
        if response_cache is not None:
            self.registry.register(_ResponseCacheCollector(response_cache))
        if constraint_check is not None:
            self.registry.register(_ConstraintCheckCollector(constraint_check))

    def of(self, model_name: str) -> ModelSeries:
        """The per-request series of the served model `model_name` (made once, then reused)."""
        series = self._series.get(model_name)
        if series is None:
            series = self._series[model_name] = ModelSeries(self, model_name)
        return series

    async def watch_loop_lag(self, interval_s: float = LAG_INTERVAL_S) -> None:
        """Runs until cancelled: each period, how much later than asked the loop woke this task
        (a handler that holds the loop for 100 ms shows as a 0.1 s sample)."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(interval_s)
            self.loop_lag.observe(max(0.0, loop.time() - start - interval_s))

    def observe_placement(self, placement, observed_ttft_s: float) -> None:
        """One finished request's placement (a `hybridgate.router.placement.Placement`)."""
        self.placements.labels(placement.policy, placement.route).inc()
        self.ttft_error.observe(observed_ttft_s - placement.plan.ttft_s)
        if placement.plan.spilled:
            self.spills.inc()


class _ModelInfoCollector:
    """`hybridgate:model_info`: 1 per served model, its name and fingerprint as labels."""

    def __init__(self, models: Sequence[tuple[str, str]]):
        self._models = list(models)

    def collect(self):
        info = InfoMetricFamily("hybridgate:model", "A served model: its name and fingerprint.",
                                labels=["model_name", "fingerprint"])
        for name, fingerprint in self._models:
            info.add_metric([name, fingerprint], {})
        yield info


def chained(*clients: Callable[[], Iterable]) -> Callable[[], list]:
    """One clients callable over several routers' (every worker of every served model)."""
    return lambda: list(itertools.chain.from_iterable(c() for c in clients))


class _RedisCollector:
    """`redis_up`: 1 while this gateway's last Redis call succeeded, 0 after one failed (absent without Redis)."""

    def __init__(self, up: Callable[[], bool | None]):
        self._up = up

    def collect(self):
        up = self._up()
        if up is None:  # no Redis configured, or not tried yet
            return
        yield GaugeMetricFamily("hybridgate:redis_up", "Whether the last Redis call succeeded (1) or not (0).",
                                value=float(up))


class _ResponseCacheCollector:
    """The response cache's counters (`hybridgate.router.response_cache.ResponseCache`) and the bytes it holds,
    summed over the caches of the gateway's models (one, or a list)."""

    def __init__(self, cache):
        self._caches = cache if isinstance(cache, list) else [cache]

    def collect(self):
        cs = self._caches
        yield CounterMetricFamily("hybridgate:response_cache_hits", "Deterministic requests answered by a replay "
                                  "of a cached answer.", value=sum(c.hits for c in cs))
        yield CounterMetricFamily("hybridgate:response_cache_misses", "Deterministic requests that started a "
                                  "generation (no cached answer, none in flight).", value=sum(c.misses for c in cs))
        yield CounterMetricFamily("hybridgate:response_cache_coalesced", "Deterministic requests that joined an "
                                  "identical generation in flight (single-flight).", value=sum(c.coalesced for c in cs))
        yield GaugeMetricFamily("hybridgate:response_cache_bytes", "Bytes of cached answers held (memory), or "
                                "written by this gateway and not yet expired (redis).",
                                value=sum(c.store.bytes for c in cs))


class _ConstraintCheckCollector:
    """The gateway's check of output constraints and tool grammars before any token
    (`hybridgate.router.constraints.ConstraintCheck`): compiles, cache hits, refusals, compile time, summed over
    the checks of the gateway's models (one, or a list)."""

    _ROWS = (  # (metric, ConstraintCheck attribute, help)
        ("compiles", "compiles", "Distinct grammars compiled by the gateway's check before their requests ran "
         "(its cache's misses)."),
        ("cache_hits", "hits", "Constrained requests whose grammar's verdict was cached or being compiled already."),
        ("refused", "refused", "Constrained requests refused (400 / INVALID_ARGUMENT): their grammar cannot be "
         "enforced."),
        ("compile_seconds", "compile_seconds", "Time the gateway's check spent compiling grammars, on threads "
         "off the event loop."),
    )

    def __init__(self, check):
        self._checks = check if isinstance(check, list) else [check]

    def collect(self):
        for metric, attribute, help_ in self._ROWS:
            yield CounterMetricFamily(f"hybridgate:constraint_check_{metric}", help_,
                                      value=sum(getattr(c, attribute) for c in self._checks))


class _EngineCollector:
    """Engine counters as each worker last reported them (heartbeat or outputs)."""

    def __init__(self, clients: Callable[[], Iterable], wire_errors: Callable[[], int] | None = None):
        self._wire_errors = wire_errors
        self._clients = clients

    def collect(self):
        steps = CounterMetricFamily("hybridgate:engine_steps", "Engine steps run.", labels=["worker"])
        after = CounterMetricFamily("hybridgate:engine_tokens_after_abort",
                                    "Tokens sampled after their request's abort arrived.", labels=["worker"])
        kv = GaugeMetricFamily("hybridgate:kv_cache_bytes", "KV-cache bytes held by live sequences.", labels=["worker"])
        blocks = GaugeMetricFamily("hybridgate:kv_cache_blocks_used", "KV blocks held by live sequences (free "
                                   "cached blocks excluded); 0 on an idle worker that leaks none.", labels=["worker"])
        committed = GaugeMetricFamily("hybridgate:kv_cache_blocks_committed", "KV blocks held now plus those the "
                                      "worker's sequences still need to reach max_tokens, as it last reported; above "
                                      "its cache's blocks, running sequences will be preempted.", labels=["worker"])
        pinned = GaugeMetricFamily("hybridgate:pinned_bytes_in_use", "The runner's pinned host buffer bytes held "
                                   "now (hand-off buffers are kv_handoff_pinned_bytes_in_use).", labels=["worker"])
        fallbacks = CounterMetricFamily("hybridgate:pinned_fallbacks", "Steps whose inputs the runner staged in "
                                        "pageable memory instead of its pinned buffers (all in use, or the step "
                                        "larger than a buffer).", labels=["worker"])
        running = GaugeMetricFamily("hybridgate:num_requests_running", "Sequences running.", labels=["worker"])
        waiting = GaugeMetricFamily("hybridgate:num_requests_waiting", "Requests queued on the worker, not yet "
                                    "running.", labels=["worker"])
        prefill = CounterMetricFamily("hybridgate:engine_prefill_tokens", "Prompt tokens run (prefix-cache hits "
                                      "excluded, recomputation included).", labels=["worker"])
        queued = GaugeMetricFamily("hybridgate:queued_prefill_tokens", "Prompt tokens not yet computed (waiting "
                                   "sequences and prefills in progress), as the worker last reported.",
                                   labels=["worker"])
        by_size = CounterMetricFamily("hybridgate:engine_steps_by_batch_size", "Engine steps by sequences per step.",
                                      labels=["worker", "batch_size"])
        batch = HistogramMetricFamily("hybridgate:engine_batch_size", "Sequences per engine step.", labels=["worker"])
        hits = CounterMetricFamily("hybridgate:kernel_cache_hits", "CPU kernels loaded from the on-disk cache at start.",
                                   labels=["worker"])
        misses = CounterMetricFamily("hybridgate:kernel_cache_misses",
                                     "CPU kernels compiled because the on-disk cache lacked them.", labels=["worker"])
        # side="worker": messages each worker refused (its LOAD stats); the router's own refusals
        # of worker messages join this family with side="router" (one family, two sides).
        wire_errors = CounterMetricFamily("hybridgate:wire_decode_errors",
                                          "Messages refused as malformed or inconsistent, by the side that refused them.",
                                          labels=["worker", "side"])
        sends_lost = CounterMetricFamily("hybridgate:router_sends_lost", "Messages to a worker that the router "
                                         "queued for sending and that then failed (each logged at WARNING).",
                                         labels=["worker"])
        refusals = CounterMetricFamily("hybridgate:worker_queue_refusals", "Messages a worker refused because one "
                                       "of its queues was at its bound (inbox: ADDs, answered queue_full and placed "
                                       "elsewhere; kv_export: hand-offs decoded where they are).",
                                       labels=["worker", "queue"])
        handoff, constraints = _HandoffFamilies(), _ConstraintFamilies()
        for client in self._clients():
            # The worker's stable name (HELLO, or kind-index under serve); the endpoint may be a temporary path.
            s, name = client.stats, getattr(client, "name", None) or client.endpoint
            handoff.add(name, getattr(client, "kind", None), s)
            constraints.add(name, s)
            steps.add_metric([name], s.steps)
            after.add_metric([name], s.tokens_after_abort)
            kv.add_metric([name], s.kv_cache_bytes)
            blocks.add_metric([name], s.blocks_used)
            committed.add_metric([name], s.blocks_committed)
            pinned.add_metric([name], s.pinned_bytes_in_use)
            fallbacks.add_metric([name], s.pinned_fallbacks)
            running.add_metric([name], s.running)
            waiting.add_metric([name], s.waiting)
            queued.add_metric([name], s.queued_prefill_tokens)
            prefill.add_metric([name], s.prefill_tokens)
            hits.add_metric([name], s.kernel_cache_hits)
            misses.add_metric([name], s.kernel_cache_misses)
            wire_errors.add_metric([name, "worker"], s.wire_decode_errors)
            sends_lost.add_metric([name], getattr(client, "sends_lost", 0))  # the in-process client sends none
            for queue, count in sorted(s.queue_refusals.items()):
                refusals.add_metric([name, queue], count)
            for n, c in sorted(s.batch_size_counts.items()):
                by_size.add_metric([name, str(n)], c)
            buckets = [(str(b), sum(c for n, c in s.batch_size_counts.items() if n <= b)) for b in _BATCH_BUCKETS]
            buckets.append(("+Inf", sum(s.batch_size_counts.values())))
            batch.add_metric([name], buckets, sum(n * c for n, c in s.batch_size_counts.items()))
        if self._wire_errors is not None:  # the router's own refusals of worker messages, in the same family
            wire_errors.add_metric(["", "router"], self._wire_errors())
        yield from (steps, after, kv, blocks, committed, pinned, fallbacks, running, waiting, queued, prefill, by_size,
                    batch, hits, misses, wire_errors, refusals, sends_lost)
        yield from handoff.families()
        yield from constraints.families()


class _ConstraintFamilies:
    """The workers' structured-output counters (EngineStats: constrained_*, grammar_*, mask_*)."""

    _ROWS = (  # (metric, EngineStats field, family, help)
        ("constrained_requests", "constrained_requests", CounterMetricFamily, "Constrained sequences admitted."),
        ("constrained_running", "constrained_running", GaugeMetricFamily,
         "Constrained sequences scheduled now (waiting or running)."),
        ("waiting_for_grammar", "waiting_for_grammar", GaugeMetricFamily,
         "Sequences waiting for their grammar to compile (outside every batch)."),
        ("grammar_compiles", "grammar_compiles", CounterMetricFamily, "Grammars compiled (grammar cache misses)."),
        ("grammar_compile_errors", "grammar_compile_errors", CounterMetricFamily,
         "Grammars refused (answered invalid_constraint)."),
        ("grammar_compile_seconds", "grammar_compile_seconds_total", CounterMetricFamily,
         "Time compiling grammars, off the engine loop."),
        ("grammar_cache_hits", "grammar_cache_hits", CounterMetricFamily,
         "Constrained sequences whose grammar was compiled or compiling already."),
        ("constraint_mask_fills", "mask_fills", CounterMetricFamily,
         "Sequence-steps whose token bitmask was filled."),
        ("constraint_mask_fill_seconds", "mask_fill_seconds_total", CounterMetricFamily,
         "Time filling token bitmasks (beside the forward pass), summed over sequence-steps."),
        ("constraint_mask_wait_seconds", "mask_wait_seconds_total", CounterMetricFamily,
         "Time sampling waited for bitmasks after the forward pass."),
    )

    def __init__(self):
        self._families = [(field, family(f"hybridgate:{metric}", help_, labels=["worker"]))
                          for metric, field, family, help_ in self._ROWS]

    def add(self, worker: str, s) -> None:
        for field, family in self._families:
            family.add_metric([worker], getattr(s, field, 0))

    def families(self):
        return [family for _, family in self._families]


class _HandoffFamilies:
    """The workers' KV hand-off counters (EngineStats.handoff_*), labelled gpu_to_cpu. `side` is
    "export" on GPU workers and "import" on CPU workers (each hand-off's bytes count on both)."""

    def __init__(self):
        d = ["worker", "direction", "side"]
        self.bytes = CounterMetricFamily("hybridgate:kv_handoff_bytes", "KV hand-off bytes exported or imported.",
                                         labels=d)
        self.copy = CounterMetricFamily("hybridgate:kv_handoff_copy_seconds",
                                        "Time of the export's gathers into pinned buffers.", labels=d)
        self.hidden = CounterMetricFamily("hybridgate:kv_handoff_copy_hidden_seconds",
                                          "Export copy time that ran while a compute step was in flight.", labels=d)
        self.export = CounterMetricFamily("hybridgate:kv_handoff_export_seconds",
                                          "Export start to the last part queued, summed.", labels=d)
        self.imports = CounterMetricFamily("hybridgate:kv_handoff_import_seconds",
                                           "Header received to imported, summed.", labels=d)
        self.outcomes = CounterMetricFamily("hybridgate:kv_handoff_worker", "KV hand-offs by outcome, as each "
                                            "worker saw them (the router's count is hybridgate:kv_handoff_total).",
                                            labels=[*d, "outcome"])
        self.pool_bytes = GaugeMetricFamily("hybridgate:kv_handoff_pinned_bytes_in_use",
                                            "Pinned hand-off buffer bytes held now.", labels=["worker"])
        self.pool_peak = GaugeMetricFamily("hybridgate:kv_handoff_pinned_peak_bytes",
                                           "Most pinned hand-off buffer bytes held at once.", labels=["worker"])
        self.replies_lost = CounterMetricFamily("hybridgate:kv_handoff_replies_lost", "Refusals a CPU worker "
                                                "could not send back to a hand-off's sender (each logged at "
                                                "WARNING).", labels=["worker"])
        self.pool_waits = CounterMetricFamily("hybridgate:kv_handoff_pinned_waits",
                                              "Exports that waited for a free pinned buffer.", labels=["worker"])
        self.parked = GaugeMetricFamily("hybridgate:kv_handoff_parked_sequences",
                                        "Exported sequences parked on a GPU worker.", labels=["worker"])
        self.reservations = GaugeMetricFamily("hybridgate:kv_handoff_reservations",
                                              "Live hand-off reservations on a CPU worker.", labels=["worker"])
        self.recomputed = CounterMetricFamily("hybridgate:kv_handoff_recomputed",
                                              "Imported sequences preempted and recomputed.", labels=["worker"])

    def add(self, worker: str, kind: str | None, s) -> None:
        labels = [worker, "gpu_to_cpu", {"gpu": "export", "cpu": "import"}.get(kind or "", "")]
        self.bytes.add_metric(labels, s.handoff_bytes_total)
        self.copy.add_metric(labels, s.handoff_copy_seconds_total)
        self.hidden.add_metric(labels, s.handoff_copy_hidden_seconds_total)
        self.export.add_metric(labels, s.handoff_export_seconds_total)
        self.imports.add_metric(labels, s.handoff_import_seconds_total)
        for outcome, n in sorted(s.handoff_outcomes.items()):
            self.outcomes.add_metric([*labels, outcome], n)
        self.pool_bytes.add_metric([worker], s.handoff_pool_bytes_in_use)
        self.pool_peak.add_metric([worker], s.handoff_pool_peak_bytes)
        self.pool_waits.add_metric([worker], s.handoff_pool_waits)
        self.parked.add_metric([worker], s.handoff_parked)
        self.reservations.add_metric([worker], s.handoff_reservations)
        self.recomputed.add_metric([worker], s.handoff_recomputed)
        self.replies_lost.add_metric([worker], s.handoff_replies_lost)

    def families(self):
        return (self.bytes, self.copy, self.hidden, self.export, self.imports, self.outcomes, self.pool_bytes,
                self.pool_peak, self.pool_waits, self.parked, self.reservations, self.recomputed, self.replies_lost)


class _HandoffRouterCollector:
    """The router's view of its hand-offs (`hybridgate.router.handoff.HandoffMetrics`), gpu_to_cpu."""

    def __init__(self, metrics: Callable[[], object]):
        self._metrics = metrics

    def collect(self):
        m = self._metrics()
        total = CounterMetricFamily("hybridgate:kv_handoff", "KV hand-offs by outcome, as the router owns them: "
                                    "done = import confirmed; refused = ran on the GPU worker; resumed = resumed "
                                    "on the GPU worker after export; aborted = cancelled or lost before import.",
                                    labels=["direction", "outcome"])
        for outcome, n in m.outcomes.items():
            total.add_metric(["gpu_to_cpu", outcome], n)
        seconds = HistogramMetricFamily("hybridgate:kv_handoff_seconds",
                                        "KV hand-off time, export start (HandoffExported) to import confirmed "
                                        "(HandoffImported), as the router sees its messages, seconds.",
                                        labels=["direction"])
        buckets = [(str(b), c) for b, c in zip(SECONDS_BUCKETS, m.bucket_counts)]
        buckets.append(("+Inf", m.seconds_count))
        seconds.add_metric(["gpu_to_cpu"], buckets, m.seconds_sum)
        yield from (total, seconds)
