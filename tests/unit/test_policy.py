"""Placement policies and the cost model on synthetic load reports (values worked out by hand)."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest

from hybridgate.router import costmodel as cm
from hybridgate.router.costmodel import WorkerLoad
from hybridgate.router.errors import UnavailableError
from hybridgate.router.handoff import HandoffMetrics
from hybridgate.router.placement import Placer, _Pending
from hybridgate.router.policy import CostPolicy, PlacementRequest, PowerOfTwo, PrefixAffinity, make_policy
from hybridgate.wire import EngineStats, Hello, WorkerState

# A fast prefiller (2,000 tokens/s, 30 ms decode steps) and a slow one (200 tokens/s, 15 ms steps).
FAST_PREFILL = dict(prefill_tokens_per_s={32: 2000.0, 512: 2000.0}, decode_step_s={1: 0.03, 8: 0.05})
SLOW_PREFILL = dict(prefill_tokens_per_s={32: 200.0, 512: 200.0}, decode_step_s={1: 0.015, 8: 0.04})


def request(prompt: int, max_tokens: int = 16, uncached=None, n: int = 2) -> PlacementRequest:
    return PlacementRequest(prompt, max_tokens, tuple(uncached) if uncached else (prompt,) * n)


def test_ttft_is_the_queue_and_the_prompt_in_budget_chunks():
    w = WorkerLoad(0, "w", "cpu", queued_prefill_tokens=3000, prefill_tokens_per_s={512: 1000.0},
                   decode_step_s={1: 0.01}, max_num_batched_tokens=2048)
    # 4,000 tokens at 1,000 tokens/s whatever the chunking: 2,048 + 1,952 tokens.
    assert cm.ttft_s(w, 1000) == pytest.approx(4.0)
    # With 48 decodes running, chunks are 2,000 prompt tokens + 48 decodes, still 1,000 tokens/s a step:
    # two steps of 2,048 tokens = 4.096 s.
    busy = WorkerLoad(0, "w", "cpu", queued_prefill_tokens=3000, decoding=48, max_num_batched_tokens=2048,
                      prefill_tokens_per_s={512: 1000.0}, decode_step_s={1: 0.01})
    assert cm.ttft_s(busy, 1000) == pytest.approx(4.096)


def test_decode_step_interpolates_between_measured_batches_and_extrapolates_above():
    w = WorkerLoad(0, "w", "cpu", decode_step_s={1: 0.010, 8: 0.024})
    assert cm.step_s(w, 4, 4) == pytest.approx(0.016)  # 0.010 + 3/7 * 0.014
    assert cm.step_s(w, 15, 15) == pytest.approx(0.038)  # slope 0.002 s per sequence past 8


def test_cost_sends_a_long_prompt_to_the_worker_that_prefills_fastest():
    policy = CostPolicy()
    gpu_fast = [WorkerLoad(0, "gpu-0", "gpu", **FAST_PREFILL), WorkerLoad(1, "cpu-0", "cpu", **SLOW_PREFILL)]
    plan = policy.place(request(4000, max_tokens=8), gpu_fast)
    assert (plan.route, plan.workers) == ("gpu", (0,))
    assert plan.ttft_s == pytest.approx(2.0)  # 4,000 tokens at 2,000 tokens/s
    # The measured figures decide, not the kind: here the CPU worker prefills faster.
    cpu_fast = [WorkerLoad(0, "gpu-0", "gpu", **SLOW_PREFILL), WorkerLoad(1, "cpu-0", "cpu", **FAST_PREFILL)]
    assert policy.place(request(4000, max_tokens=8), cpu_fast).workers == (1,)


def test_cost_sends_a_short_chat_to_an_idle_cpu_worker_while_the_gpu_worker_is_busy():
    workers = [WorkerLoad(0, "gpu-0", "gpu", queued_prefill_tokens=6000, decoding=8, waiting=3, **FAST_PREFILL),
               WorkerLoad(1, "cpu-0", "cpu", **SLOW_PREFILL)]
    plan = CostPolicy(ttft_slo_s=0.5).place(request(20, max_tokens=32), workers)
    assert (plan.route, plan.workers, plan.spilled) == ("cpu", (1,), False)
    assert plan.ttft_s == pytest.approx(0.1)  # 20 tokens at 200 tokens/s
    # Both idle: both meet the SLOs, and the chat goes to the worker that finishes it first: 0.01 s +
    # 31 x 0.03 s on the fast prefiller against 0.1 s + 31 x 0.015 s here, so the CPU worker still.
    idle = [WorkerLoad(0, "gpu-0", "gpu", **FAST_PREFILL), WorkerLoad(1, "cpu-0", "cpu", **SLOW_PREFILL)]
    assert CostPolicy(ttft_slo_s=0.5).place(request(20, max_tokens=32), idle).route == "cpu"
    # Under the default TTFT SLO (3 x 0.01 s, the fast prefiller's unloaded TTFT) only the GPU worker meets it.
    assert CostPolicy().place(request(20, max_tokens=32), idle).route == "gpu"


def test_cost_spills_to_the_cpu_tier_when_no_plan_meets_the_slo():
    # The GPU worker's queue is 40 s deep; the CPU worker's 2,000 queued tokens take 10 s: both miss a
    # 1 s TTFT SLO, and the request runs on the CPU tier instead of being rejected.
    workers = [WorkerLoad(0, "gpu-0", "gpu", queued_prefill_tokens=80_000, **FAST_PREFILL),
               WorkerLoad(1, "cpu-0", "cpu", queued_prefill_tokens=2000, **SLOW_PREFILL)]
    plan = CostPolicy(ttft_slo_s=1.0).place(request(20, max_tokens=16), workers)
    assert (plan.route, plan.spilled, plan.meets_slo) == ("cpu", True, False)
    assert plan.ttft_s == pytest.approx(2020 / 200)


def test_default_slos_are_three_times_the_fastest_unloaded_figures():
    workers = [WorkerLoad(0, "gpu-0", "gpu", **FAST_PREFILL), WorkerLoad(1, "cpu-0", "cpu", **SLOW_PREFILL)]
    ttft, tpot = CostPolicy().slos(request(1000), workers)
    assert ttft == pytest.approx(3 * 1000 / 2000) and tpot == pytest.approx(3 * 0.015)


def test_power_of_two_never_picks_the_more_loaded_of_its_two_samples():
    workers = [WorkerLoad(i, f"w{i}", "cpu", inflight=load) for i, load in enumerate((0, 5, 10, 15))]
    policy = PowerOfTwo(seed=7)
    picks = collections.Counter(policy.place(request(10, n=4), workers).workers[0] for _ in range(600))
    # The most loaded worker is the more loaded of every pair it is in; worker i is picked when the
    # other sample is more loaded: 3, 2, 1 and 0 pairs of the 6.
    assert picks[3] == 0
    assert picks[0] / 600 == pytest.approx(3 / 6, abs=0.07)
    assert picks[1] / 600 == pytest.approx(2 / 6, abs=0.07)
    assert picks[2] / 600 == pytest.approx(1 / 6, abs=0.07)


def test_prefix_affinity_follows_the_longest_prefix_unless_the_load_is_imbalanced():
    policy = PrefixAffinity(cache_threshold=0.5, balance_abs=32, balance_rel=1.5)
    balanced = [WorkerLoad(0, "w0", "cpu", inflight=3), WorkerLoad(1, "w1", "cpu", inflight=5)]
    assert policy.place(request(1000, uncached=(1000, 200)), balanced).workers == (1,)
    # 40 more in flight on w1: past both thresholds (40 > 32 and 45 > 1.5 x 5): the least loaded.
    imbalanced = [WorkerLoad(0, "w0", "cpu", inflight=5), WorkerLoad(1, "w1", "cpu", inflight=45)]
    assert policy.place(request(1000, uncached=(1000, 200)), imbalanced).workers == (0,)
    # A match below half the prompt is no reason to go there.
    assert policy.place(request(1000, uncached=(1000, 600)), balanced).workers == (0,)


class FakeClient:
    def __init__(self, name: str, kind: str, kv_dtype: str = "", handoff_endpoint: str = "", **stats):
        self.name, self.endpoint, self.kind, self.state = name, name, kind, WorkerState.READY
        self.hello = Hello(kind, "fp", 64, 8192, 0, True, name=name, kv_dtype=kv_dtype,
                           handoff_endpoint=handoff_endpoint)
        self.stats = EngineStats(blocks_total=1000, max_num_seqs=64, max_num_batched_tokens=2048, **stats)


def test_placer_counts_its_own_unanswered_requests_and_remembers_the_prefixes_it_sent():
    gpu = FakeClient("gpu-0", "gpu", prefill_tokens_per_s={512: 1000.0}, decode_step_s={1: 0.02})
    cpu = FakeClient("cpu-0", "cpu", prefill_tokens_per_s={512: 500.0}, decode_step_s={1: 0.02})
    placer = Placer(make_policy("cost", ttft_slo_s=100.0), "fp", kv_values_per_token=0)
    prompt = list(range(3, 1003))  # 1,000 tokens: 62 full blocks usable for the prefix record
    # One token each (no decode to keep off the GPU worker), so the TTFT alone decides.
    first = placer.place([gpu, cpu], {}, prompt, 1)
    assert first.clients == (gpu,) and first.uncached_tokens == 1000
    # The same prompt again: this router sent those blocks to gpu-0, so only 1000 - 62 * 16 = 8 tokens are
    # uncached there. With 1,000 of its own tokens still queued on gpu-0 (no report yet), TTFT there is
    # 1,008 / 1,000 s against 1,000 / 500 s on cpu-0.
    second = placer.place([gpu, cpu], {gpu: [_Pending(1000)]}, prompt, 1)
    assert second.clients == (gpu,) and second.uncached_tokens == 8
    assert second.plan.ttft_s == pytest.approx(1.008)
    # Three such prompts queued there (3,000 tokens: 3 s) and a fresh prompt goes to cpu-0 (2 s).
    other = list(range(5000, 6000))
    third = placer.place([gpu, cpu], {gpu: [_Pending(1000)] * 2}, other, 1)
    assert third.clients == (cpu,) and third.plan.ttft_s == pytest.approx(2.0)


def test_cost_prefills_on_the_fast_prefiller_and_decodes_a_long_generation_on_the_cpu_worker():
    # gpu-0 prefills 10x faster but decodes at 60 ms a step; cpu-0 decodes at 15 ms. For 2,000 prompt tokens and
    # 256 new tokens: gpu 1 + 255 x 0.06 = 16.3 s, cpu 10 + 255 x 0.015 = 13.8 s, gpu->cpu 1 + 255 x 0.015 +
    # the copy of 2,000 tokens x 92,160 bytes at 2 GB/s (0.09 s) = 4.9 s.
    workers = [WorkerLoad(0, "gpu-0", "gpu", prefill_tokens_per_s={512: 2000.0}, decode_step_s={1: 0.06},
                          kv_bytes_per_token=92_160),
               WorkerLoad(1, "cpu-0", "cpu", prefill_tokens_per_s={512: 200.0}, decode_step_s={1: 0.015},
                          takes_handoff=True)]
    req = PlacementRequest(2000, 256, (2000, 2000))
    plan = CostPolicy(ttft_slo_s=20.0, tpot_slo_s=1.0).place(req, workers)
    assert (plan.route, plan.workers) == ("gpu->cpu", (0, 1))
    assert plan.e2e_s(256) == pytest.approx(1 + 255 * 0.015 + 2000 * 92_160 / 2e9)


def test_the_deadline_check_uses_the_fastest_plans_predicted_ttft():
    # Both workers 3,000 tokens deep: the fastest plan's TTFT is 3,020 / 2,000 s, whatever the policy picks.
    gpu = FakeClient("gpu-0", "gpu", queued_prefill_tokens=3000, prefill_tokens_per_s={512: 2000.0},
                     decode_step_s={1: 0.02})
    cpu = FakeClient("cpu-0", "cpu", queued_prefill_tokens=3000, prefill_tokens_per_s={512: 200.0},
                     decode_step_s={1: 0.02})
    placed = Placer(make_policy("round_robin"), "fp", 0).place([cpu, gpu], {}, list(range(3, 23)), 4, 0.05)
    assert placed.clients == (cpu,) and placed.fastest_ttft_s == pytest.approx(3020 / 2000)


def test_cost_keeps_a_cpu_decode_only_with_room_below_the_tpot_slo():
    # The CPU worker would decode at 90 ms a step against a 100 ms TPOT SLO: within it, but the requests placed
    # after this one join the same batch, so only a step of at most 80 ms (TPOT_HEADROOM) counts as meeting it.
    workers = [WorkerLoad(0, "gpu-0", "gpu", prefill_tokens_per_s={512: 2000.0}, decode_step_s={1: 0.03}),
               WorkerLoad(1, "cpu-0", "cpu", prefill_tokens_per_s={512: 200.0}, decode_step_s={1: 0.09},
                          takes_handoff=True)]
    req = PlacementRequest(20, 64, (20, 20))
    assert CostPolicy(ttft_slo_s=1.0, tpot_slo_s=0.1).place(req, workers).route == "gpu"
    # At 75 ms the CPU tier takes the decode, and the GPU worker only prefills (no GPU decode slot held).
    faster = [workers[0], replace(workers[1], decode_step_s={1: 0.075})]
    assert CostPolicy(ttft_slo_s=1.0, tpot_slo_s=0.1).place(req, faster).route in ("cpu", "gpu->cpu")


def test_cost_keeps_a_sequence_off_a_gpu_cache_its_running_sequences_are_promised():
    # The CPU worker decodes at 90 ms a step, outside 80% of the 100 ms TPOT SLO, so only the `gpu` plan meets
    # the SLOs. 4,000 + 4,000 tokens need 500 blocks: 800 of the GPU worker's 1,000 are free now.
    gpu = WorkerLoad(0, "gpu-0", "gpu", blocks_free=800, blocks_total=1000, **FAST_PREFILL)
    cpu = WorkerLoad(1, "cpu-0", "cpu", blocks_free=5000, blocks_total=5000, takes_handoff=True,
                     prefill_tokens_per_s={512: 200.0}, decode_step_s={1: 0.09})
    req = PlacementRequest(4000, 4000, (4000, 4000))
    policy = CostPolicy(ttft_slo_s=10.0, tpot_slo_s=0.1)
    assert policy.place(req, [gpu, cpu]).route == "gpu"
    # Its running sequences will hold 900 blocks at their ends (200 are still to be written): 500 more would
    # preempt them on the way. No plan meets the SLOs now, and the one that fits every cache's promises takes it:
    # the GPU worker prefills into free blocks it gets back at the hand-off, the CPU worker decodes.
    promised = replace(gpu, blocks_committed=900)
    plan = policy.place(req, [promised, cpu])
    assert (plan.route, plan.workers, plan.meets_slo) == ("gpu->cpu", (0, 1), False)
    # Without 250 free blocks for the prompt on the GPU worker, the CPU worker prefills it as well.
    full = replace(promised, blocks_free=200)
    assert policy.place(req, [full, cpu]).route == "cpu"
    # The GPU worker alone: it takes the request anyway (its scheduler preempts or queues), never a rejection.
    assert policy.place(request(4000, 4000, n=1), [promised]).route == "gpu"


def test_placer_counts_the_blocks_its_own_requests_are_promised():
    gpu = FakeClient("gpu-0", "gpu", prefill_tokens_per_s={512: 1000.0}, decode_step_s={1: 0.02},
                     blocks_committed=100)
    placer = Placer(make_policy("cost"), "fp", kv_values_per_token=0)
    # The report says 100 blocks; this router's two requests not yet reported hold 1,000 + 600 tokens at their
    # ends: 63 + 38 = 101 blocks, the larger figure.
    loads = placer._load(0, gpu, [_Pending(500, False, 1000), _Pending(300, False, 600)])
    assert loads.blocks_committed == 101
    assert placer._load(0, gpu, []).blocks_committed == 100


# --- every placement through the Placer (issue 29, item 2) ---------------------------------------

def test_placer_leaves_out_excluded_workers_and_prices_a_resume_with_the_ids_already_streamed():
    gpu = FakeClient("gpu-0", "gpu", prefill_tokens_per_s={512: 1000.0}, decode_step_s={1: 0.02})
    cpu = FakeClient("cpu-0", "cpu", prefill_tokens_per_s={512: 500.0}, decode_step_s={1: 0.02})
    placer = Placer(make_policy("cost", ttft_slo_s=100.0), "fp", kv_values_per_token=0)
    prompt, streamed = list(range(3, 1003)), list(range(2000, 2032))
    # One token each (no decode to keep off the GPU worker), so the TTFT alone decides.
    assert placer.place([gpu, cpu], {}, prompt, 1).clients == (gpu,)
    # gpu-0 was lost: the resume prefills the prompt and the 32 ids streamed (1,032 tokens at 500 tokens/s).
    moved = placer.place([gpu, cpu], {}, prompt, 1, exclude={gpu}, streamed=streamed)
    assert moved.clients == (cpu,) and moved.uncached_tokens == 1032
    assert moved.plan.ttft_s == pytest.approx(1032 / 500)
    # Back on gpu-0, the 62 prompt blocks it was sent are cached there: 1,032 - 62 x 16 = 40 tokens to compute.
    back = placer.place([gpu, cpu], {}, prompt, 1, exclude={cpu}, streamed=streamed)
    assert back.clients == (gpu,) and back.uncached_tokens == 40
    assert placer.place([gpu, cpu], {}, prompt, 1, kind="cpu").clients == (cpu,)
    with pytest.raises(UnavailableError, match="no gpu worker is ready"):
        placer.place([gpu, cpu], {}, prompt, 1, exclude=[gpu], kind="gpu")
    cpu.state = WorkerState.SUSPECT
    with pytest.raises(UnavailableError, match="no worker is ready"):
        placer.place([gpu, cpu], {}, prompt, 1, exclude=[gpu])


def handoff_pair(kv_dtype: str) -> tuple[FakeClient, FakeClient]:
    """A GPU worker 10x faster at prefill and 4x slower at decode than a CPU worker that takes hand-offs."""
    gpu = FakeClient("gpu-0", "gpu", kv_dtype=kv_dtype, prefill_tokens_per_s={512: 2000.0}, decode_step_s={1: 0.06})
    cpu = FakeClient("cpu-0", "cpu", kv_dtype="float32", handoff_endpoint="ipc:///h", prefill_tokens_per_s={512: 200.0},
                     decode_step_s={1: 0.015})
    return gpu, cpu


SMOLLM2_KV_VALUES = 2 * 30 * 3 * 64  # K and V of one token: 2 x layers x KV heads x head dim


@pytest.mark.parametrize("kv_dtype, size", [("bfloat16", 2), ("float16", 2), ("float32", 4)])
def test_a_handoff_copy_is_priced_at_the_exporting_workers_reported_kv_dtype(kv_dtype, size):
    gpu, cpu = handoff_pair(kv_dtype)
    placer = Placer(CostPolicy(ttft_slo_s=20.0, tpot_slo_s=1.0), "fp", kv_values_per_token=SMOLLM2_KV_VALUES)
    plan = placer.place([gpu, cpu], {}, list(range(3, 2003)), 256).plan
    assert (plan.route, plan.workers) == ("gpu->cpu", (0, 1))
    # The CPU worker's step plus 2,000 tokens' KV at 2 GB/s spread over the 255 tokens after the first.
    assert plan.tpot_s == pytest.approx(0.015 + 2000 * SMOLLM2_KV_VALUES * size / 2e9 / 255)


def test_the_handoff_rate_is_the_moving_median_of_measured_imports_seeded_by_the_constant():
    metrics = HandoffMetrics()
    assert metrics.rate.bytes_per_s() == cm.HANDOFF_BYTES_PER_S
    for seconds in (1.0, 0.25, 2.0):  # 1 GB each: 1, 4 and 0.5 GB/s
        metrics.observe(seconds, nbytes=10**9)
    metrics.observe(0.5)  # a hand-off whose bytes are unknown measures no rate
    assert metrics.rate.bytes_per_s() == pytest.approx(1e9)
    gpu, cpu = handoff_pair("bfloat16")
    placer = Placer(CostPolicy(ttft_slo_s=20.0, tpot_slo_s=1.0), "fp", SMOLLM2_KV_VALUES, handoff_rate=metrics.rate)
    plan = placer.place([gpu, cpu], {}, list(range(3, 2003)), 256).plan
    assert plan.tpot_s == pytest.approx(0.015 + 2000 * SMOLLM2_KV_VALUES * 2 / 1e9 / 255)
    rate = cm.HandoffRate(window=4)
    for bps in (1, 2, 3, 100, 100, 100):
        rate.observe(bps, 1.0)
    assert rate.bytes_per_s() == 100  # only the last 4 count


def test_a_move_is_never_planned_as_a_handoff():
    gpu, cpu = handoff_pair("bfloat16")
    placer = Placer(CostPolicy(ttft_slo_s=20.0, tpot_slo_s=1.0), "fp", kv_values_per_token=SMOLLM2_KV_VALUES)
    moved = placer.place([gpu, cpu], {}, list(range(3, 2003)), 256, streamed=[7], handoff=False)
    assert moved.route in ("gpu", "cpu") and len(moved.clients) == 1


def test_scheduler_limits_come_only_from_the_workers_report():
    unreported = FakeClient("cpu-0", "cpu", prefill_tokens_per_s={512: 1000.0, 4096: 2000.0},
                            decode_step_s={1: 0.01, 8: 0.024})
    unreported.stats = EngineStats(prefill_tokens_per_s={512: 1000.0, 4096: 2000.0}, decode_step_s={1: 0.01, 8: 0.024},
                                   decoding=99)
    placer = Placer(make_policy("cost"), "fp", kv_values_per_token=0)
    load = placer._load(0, unreported, [])
    assert (load.max_num_seqs, load.max_num_batched_tokens) == (0, 0)
    # No step budget reported: 4,000 tokens in one step at the rate interpolated at 4,000 (not 2,048-token chunks).
    idle = replace(load, decoding=0)
    assert cm.ttft_s(idle, 4000) == pytest.approx(4000 / (1000 + 1000 * 3488 / 3584))
    # No batch cap reported: 100 sequences decode together (extrapolated 0.002 s a sequence past 8).
    assert cm.tpot_s(load) == pytest.approx(0.024 + 0.002 * 92)
    reported = FakeClient("cpu-1", "cpu")
    assert placer._load(0, reported, []).max_num_seqs == 64


def test_placer_drops_a_workers_record_with_the_worker():
    gpu = FakeClient("gpu-0", "gpu", prefill_tokens_per_s={512: 1000.0}, decode_step_s={1: 0.02})
    placer = Placer(make_policy("least_loaded"), "fp", kv_values_per_token=0)
    prompt = list(range(3, 1003))
    placer.place([gpu], {}, prompt, 4)
    placer.sent(gpu)
    assert placer.inflight(gpu) == 1 and placer.place([gpu], {}, prompt, 4).uncached_tokens == 8
    placer.drop(gpu)
    assert placer.inflight(gpu) == 0 and placer.place([gpu], {}, prompt, 4).uncached_tokens == 1000


def test_placer_counts_its_own_requests_waiting_and_decoding():
    gpu = FakeClient("gpu-0", "gpu", prefill_tokens_per_s={512: 1000.0}, decode_step_s={1: 0.02})
    placer = Placer(make_policy("cost"), "fp", kv_values_per_token=0)
    # Two not started (their prompts still to prefill: 500 + 300 tokens), one decoding; ends of 17, 16 and 33
    # tokens: 2 + 1 + 3 blocks of 16.
    load = placer._load(0, gpu, iter([_Pending(500, False, 17), _Pending(40, True, 16), _Pending(300, False, 33)]))
    assert (load.waiting, load.decoding, load.queued_prefill_tokens, load.blocks_committed) == (2, 1, 800, 6)
