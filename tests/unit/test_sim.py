"""bench sim: the simulated engine against step times worked out by hand, and its JSON's figures."""

from __future__ import annotations

import json

import pytest

from hybridgate.bench import sim
from hybridgate.bench import workload as wl
from hybridgate.bench.sim import Profile, Simulation
from hybridgate.cli import build_parser
from hybridgate.router.policy import make_policy
from bench_checks import check_report

# 1,000 prompt tokens/s whatever the step size; decode steps of 20 ms alone, 30 ms at batch 2 and above.
FLAT = Profile("flat", "cpu", decode_step_s={1: 0.02, 2: 0.03}, prefill_tokens_per_s={16: 1000.0, 2048: 1000.0},
               blocks_total=1000, max_num_batched_tokens=512)


def run(profiles, policy, items, arrivals, limit=100.0):
    return Simulation(profiles, make_policy(policy)).run(items, arrivals, limit)


def test_one_request_alone_takes_its_prefill_then_one_decode_step_per_token():
    (o,) = run([FLAT], "cost", [wl.WorkItem("x", 1000, 5)], [0.0])
    # 1,000 tokens in chunks of 512 + 488 at 1,000 tokens/s: 1.0 s; the last chunk samples token 1.
    assert o.ttft_s == pytest.approx(1.0)
    assert o.e2e_s == pytest.approx(1.0 + 4 * 0.02) and o.tokens == 5 and o.ended and not o.error
    assert o.tpot_s == pytest.approx(0.02)


def test_a_request_behind_a_long_prefill_waits_for_the_budget_left_by_it():
    a, b = run([FLAT], "cost", [wl.WorkItem("x", 1000, 2), wl.WorkItem("y", 12, 1)], [0.0, 0.1])
    # Step 1 (0-0.512 s): a's first 512 tokens. Step 2: a's last 488 and b's 12 in one 500-token step (0.5 s).
    assert a.ttft_s == pytest.approx(1.012)
    assert b.ttft_s == pytest.approx(1.012 - 0.1)
    # Step 3: a's one decode, alone (b finished at its first token): 20 ms.
    assert a.e2e_s == pytest.approx(1.032)


def test_cost_keeps_short_requests_off_the_worker_busy_with_a_long_prompt():
    fast = Profile("fast", "gpu", decode_step_s={1: 0.02}, prefill_tokens_per_s={16: 4000.0}, blocks_total=1000)
    slow = Profile("slow", "cpu", decode_step_s={1: 0.02}, prefill_tokens_per_s={16: 200.0}, blocks_total=1000)
    items = [wl.WorkItem("summary", 4000, 2), wl.WorkItem("short", 20, 4)]
    long_one, short = run([fast, slow], "cost", items, [0.0, 0.01])
    # The summary prefills on the fast prefiller and its one more token decodes on the CPU worker (no GPU decode
    # slot held); the short one avoids the 0.99 s of queue there: 0.1 s on the CPU worker.
    assert long_one.plan == "gpu->cpu" and short.plan == "cpu"
    assert short.ttft_s == pytest.approx(20 / 200)
    # least_loaded puts the short one on the idle CPU worker as well, but the long one on the GPU worker
    # only because it comes first; reversed, the summary lands on the slow prefiller.
    first, second = run([fast, slow], "least_loaded", items[::-1], [0.0, 0.01])
    assert (first.plan, second.plan) == ("gpu", "cpu") and second.ttft_s == pytest.approx(4000 / 200, rel=0.01)


def test_kv_exhaustion_preempts_the_newest_and_every_request_still_finishes():
    tiny = Profile("tiny", "cpu", decode_step_s={1: 0.01}, prefill_tokens_per_s={16: 1000.0}, blocks_total=6,
                   block_size=16)
    items = [wl.WorkItem("x", 30, 20)] * 3  # 50 tokens = 4 blocks each; 6 blocks hold one at a time with room
    outcomes = run([tiny], "cost", items, [0.0, 0.0, 0.0])
    assert all(o.ended and o.tokens == 20 for o in outcomes)


def test_a_gpu_to_cpu_plan_decodes_on_the_cpu_worker_after_the_copy():
    gpu = Profile("g", "gpu", decode_step_s={1: 0.05}, prefill_tokens_per_s={16: 10000.0}, blocks_total=1000,
                  kv_bytes_per_token=2_000_000)
    cpu = Profile("c", "cpu", decode_step_s={1: 0.01}, prefill_tokens_per_s={16: 100.0}, blocks_total=1000,
                  kv_bytes_per_token=2_000_000)
    (o,) = run([gpu, cpu], "cost", [wl.WorkItem("long", 1000, 101)], [0.0])
    assert o.plan == "gpu->cpu"
    # 0.1 s prefill on the GPU worker, 1 s of copy (2 GB at 2 GB/s), then 100 CPU steps of 10 ms.
    assert o.ttft_s == pytest.approx(0.1) and o.e2e_s == pytest.approx(0.1 + 1.0 + 1.0)


def test_capacity_search_doubles_then_bisects():
    search, good_up_to = wl.CapacitySearch(1.0, 6), 5.0
    while (rate := search.next_rate()) is not None:
        search.record({"rate": rate, "attainment": 1.0 if rate <= good_up_to else 0.5})
    assert [r["rate"] for r in search.runs] == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0]
    assert search.capacity == 5.0


def test_default_slos_follow_the_unloaded_figures():
    slo = wl.Slo(unloaded_ttft_s={100: 0.1, 1100: 1.1}, unloaded_tpot_s=0.02)
    assert slo.ttft_for(600) == pytest.approx(3 * 0.6) and slo.tpot() == pytest.approx(0.06)
    assert wl.Slo(ttft_s=0.5, tpot_s=0.1, unloaded_ttft_s={1: 9.0}).ttft_for(10) == 0.5


def test_bench_sim_json_holds_every_figure(tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt_tokens": p, "max_tokens": m}) for p, m in
                                  [(20, 8), (1500, 4), (30, 64)]) + "\n")
    out = tmp_path / "sim.json"
    args = build_parser().parse_args(
        ["bench", "sim", "--layouts", "smollm2-gpu-t1+smollm2-cpu-t1", "--workload", str(workload), "--seed", "1",
         "--rates", "0.5x,1x", "--capacity-runs", "3", "--duration", "20", "--min-requests", "5",
         "--max-requests", "30", "--compare-policies", "cost,least_loaded", "--json", str(out),
         "--plot", str(tmp_path / "sim.png")])
    sim.run(args)
    report = json.loads(out.read_text())
    check_report(report, ["cost", "least_loaded"])
    assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_hands_off_rather_than_overcommit_a_gpu_cache():
    # The GPU worker's cache holds 40 blocks of 16: one 200 + 200-token sequence (25 blocks) at a time. The CPU
    # worker's 90 ms step is outside 80% of the 100 ms TPOT SLO, so a CPU decode never meets the SLOs.
    gpu = Profile("gpu", "gpu", decode_step_s={1: 0.01}, prefill_tokens_per_s={16: 10_000.0}, blocks_total=40)
    cpu = Profile("cpu", "cpu", decode_step_s={1: 0.09}, prefill_tokens_per_s={16: 200.0}, blocks_total=1000)
    items = [wl.WorkItem("x", 200, 200)] * 2
    simulation = Simulation([gpu, cpu], make_policy("cost", ttft_slo_s=10.0, tpot_slo_s=0.1))
    first, second = simulation.run(items, [0.0, 0.05], 100.0)
    # At 0.05 s the first holds 13 blocks (204 tokens) and 27 are free: room for the second's 25 now, but
    # not for both sequences at their ends. The second is prefilled there and decoded on the CPU worker.
    assert (first.plan, second.plan) == ("gpu", "gpu->cpu")
    assert simulation.workers[0].preemptions == 0 and first.ended and second.ended
    # The first's 200 tokens at one 10 ms step each after its 20 ms prefill: nothing preempted it.
    assert first.e2e_s == pytest.approx(0.02 + 199 * 0.01, rel=0.02)


def test_the_frontend_latency_adds_to_ttft_and_e2e_and_auto_takes_it_from_the_shortest_probe():
    (o,) = Simulation([FLAT], make_policy("cost"), frontend_s=0.03).run([wl.WorkItem("x", 1000, 5)], [0.0], 100.0)
    # The 1.0 s prefill and 4 decode steps of 20 ms, 30 ms later at both ends; TPOT unchanged.
    assert o.ttft_s == pytest.approx(1.03) and o.e2e_s == pytest.approx(1.03 + 4 * 0.02)
    assert o.tpot_s == pytest.approx(0.02)
    # A serve report measured 0.05 s unloaded at 20 prompt tokens, where FLAT prefills in 0.02 s; the long
    # probe (2,000 tokens: 4.1 s measured against 2.0 s here) is not where the front end shows.
    report = {"unloaded": {"ttft_s": {"2000": 4.1, "20": 0.05}}}
    assert sim.frontend_latency("auto", [FLAT], report) == pytest.approx(0.03)
    assert sim.frontend_latency("0.25", [FLAT], None) == 0.25
    with pytest.raises(ValueError, match="--frontend-latency auto: needs --slo-from"):
        sim.frontend_latency("auto", [FLAT], None)
    with pytest.raises(ValueError, match="--frontend-latency: must be >= 0"):
        sim.frontend_latency("-1", [FLAT], None)
