"""End to end: the gpu->cpu KV hand-off between real worker processes, through real gateways.

One layout for the module (each process loads the model once): a GPU worker
(the torch runner, fp32 on this CPU), a CPU worker (Numba) with a KV cache of
66 blocks (room for the 1,000-token identity prompts, not for the 1,100-token
one the refusal test sends), and two gateways sharing both:
"a" holds every hand-off state for a seeded moment (the abort storm's
windows), "b" holds EXPORTED long enough for a CPU worker to be killed in it.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from procs import HYBRIDGATE, Proc, stub
from hybridgate.wire import AddRequest, SamplingParams

SEED = 20261201
CPU_KV = "24MiB"  # 0.35 MiB per 16-token block (fp16, 30 layers, 3 KV heads of 64): 68 blocks, 1,088 tokens
STORY = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps aloud while the sea "
         "below turned from green to grey. Nobody in the village remembered when the lamp had last failed, "
         "but everyone agreed that the keeper would notice first. ")
HANDOFF_STATES = ("RESERVING", "PREFILLING", "EXPORTED", "IMPORTED", "DECODING_ON_CPU")


# --- the layout -------------------------------------------------------------------------


class Gateway(Proc):
    def __init__(self, tmp, name: str, endpoints: list[str], env: dict[str, str]):
        args = ["gateway", "--port", "0", "--metrics-port", "0", "--allow-client-routes"]
        for ep in endpoints:
            args += ["--worker", ep]
        super().__init__(args, tmp / f"{name}.log", env)
        port = self.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
        self.target = f"127.0.0.1:{port}"
        self.metrics_url = self.wait_for(r"metrics on (http://\S+)").group(1)


@pytest.fixture(scope="module")
def layout(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("handoff")
    gpu_ep, cpu_ep = f"ipc://{tmp}/gpu.sock", f"ipc://{tmp}/cpu.sock"
    gpu = Proc(["worker", "--kind", "gpu", "--endpoint", gpu_ep, "--threads", "1"], tmp / "gpu.log")
    cpu = Proc(["worker", "--kind", "cpu", "--endpoint", cpu_ep, "--threads", "1", "--kv-cache-memory", CPU_KV,
                "--handoff-endpoint", f"ipc://{tmp}/cpu-handoff.sock"], tmp / "cpu.log")
    pause = "HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE"
    a = Gateway(tmp, "a", [gpu_ep, cpu_ep], {pause: f"all:0.45:{SEED}"})
    b = Gateway(tmp, "b", [gpu_ep, cpu_ep], {pause: f"EXPORTED:{4 * TIME_FACTOR}:{SEED}"})
    procs = [a, b, gpu, cpu]
    try:
        for g in (a, b):
            g.wait_for(r"hybridgate: READY \((gpu, cpu|cpu, gpu) workers\)", timeout=180)
        yield {"a": a, "b": b, "gpu": gpu, "cpu": cpu}
    finally:
        for p in procs:
            p.stop()


def generate(target: str, prompt: str, route: str, **fields) -> list[pb.GenerateResponse]:
    return list(stub(target).Generate(pb.GenerateRequest(prompt=prompt, route=route, **fields),
                                      timeout=120 * TIME_FACTOR))


def ids_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def prompt_of(tokenizer, n: int) -> tuple[str, list[int]]:
    """Raw prompt text whose token count is exactly n (a cut of STORY that re-encodes to n ids)."""
    ids = tokenizer.encode(STORY * (n // 40 + 2))
    for k in range(n, n + 8):
        text = tokenizer.decode(ids[:k])
        again = tokenizer.encode(text)
        if len(again) == n:
            return text, again
    raise AssertionError(f"no cut of the story encodes to {n} tokens")


def worker_metrics(url: str) -> dict[tuple[str, str], float]:
    """{(sample name, worker endpoint): value} of the per-worker samples."""
    out = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode()):
        for s in family.samples:
            if "worker" in s.labels and "outcome" not in s.labels:
                out[(s.name, s.labels["worker"])] = s.value
    return out


def router_outcomes(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode()):
        for s in family.samples:
            if s.name == "hybridgate:kv_handoff_total":
                out[s.labels["outcome"]] = s.value
    return out


# --- identity -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_runner(gguf_model):
    from hybridgate.workers.cpu.runner import NumbaRunner

    runner = NumbaRunner(gguf_model, kv_cache_memory="128MiB", threads=1)  # no engine: no prefix cache
    runner.warm_up(progress=False)
    return runner


_PREFILLED: dict[str, list[int]] = {"prompt": []}  # the prompt whose full blocks hold KV in blocks 0, 1, ...


def teacher_forced(runner, prompt_ids: list[int], ids: list[int], params: SamplingParams, seed: int):
    """The CPU worker's own choice at every index i >= 1 given prompt + ids[:i], and its top-2 gap.

    Returns (reference ids for indexes 1.., their top-2 gaps): the gap is between the two largest
    scores the sampler compares (logits at temperature 0; logits / T + Gumbel noise otherwise).
    The KV of the prompt's full blocks is computed once per prompt (both temperatures share it):
    the runner's own KV, never a worker's prefix cache.
    """
    from hybridgate.workers.sampling import apply_repetition_penalty, gumbel_noise, sample_row
    from hybridgate.workers.scheduler import ScheduledBatch
    from hybridgate.workers.sequence import Sequence

    full = len(prompt_ids) // runner.block_size * runner.block_size
    if _PREFILLED["prompt"] != prompt_ids[:full]:
        _PREFILLED["prompt"] = []
        if full:
            prefix = Sequence(AddRequest("prefix", prompt_ids[:full], params, seed, 1, -1))
            prefix.block_table = list(range(full // runner.block_size))
            runner.forward(ScheduledBatch([(prefix, full)]))
        _PREFILLED["prompt"] = prompt_ids[:full]
    seq = Sequence(AddRequest("ref", prompt_ids + ids[:1], params, seed, len(ids) + 1, -1))
    seq.block_table = list(range((len(prompt_ids) + len(ids)) // runner.block_size + 1))
    seq.num_computed = full
    logits = runner.forward(ScheduledBatch([(seq, seq.num_tokens - full)]))[0]
    refs, gaps = [], []
    for i in range(1, len(ids)):
        seen = prompt_ids + ids[:i]
        refs.append(sample_row(logits, params, seed, i, seen if params.repetition_penalty != 1.0 else ()))
        x = apply_repetition_penalty(np.array(logits, np.float64), seen, params.repetition_penalty)
        if params.temperature > 0:
            x = x / params.temperature + gumbel_noise(seed, i, x.shape[0])
        top2 = np.sort(x)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        seq.num_computed = seq.num_tokens
        seq.output_ids.append(ids[i])
        logits = runner.forward(ScheduledBatch([(seq, 1)]))[0]
    return refs, gaps


NEAR_TIES: list[tuple[int, float, int]] = []  # (prompt tokens, temperature, index) where the reference's gap < 1e-3


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("n", [5, 16, 17, 100, 1000])
def test_identity(layout, tokenizer, cpu_runner, n, temperature):
    prompt, prompt_ids = prompt_of(tokenizer, n)
    fields = dict(temperature=temperature, seed=SEED + n, max_tokens=12, ignore_eos=True)
    # The solo run first: the hand-off's prefill then comes from the GPU worker's prefix cache, so
    # the CPU worker's reservation does not wait for a long prefill on these shared cores.
    solo = generate(layout["a"].target, prompt, "gpu", **{**fields, "max_tokens": 1})
    handoff = generate(layout["a"].target, prompt, "gpu->cpu", **fields)
    ids = ids_of(handoff)
    assert handoff[-1].route.startswith("gpu->cpu ("), handoff[-1].route
    assert ids[0] == ids_of(solo)[0]  # token 0 is the GPU worker's
    indexes = [m.token_index for m in handoff]
    assert indexes == [sum(len(m.token_ids) for m in handoff[:k]) for k in range(len(handoff))]  # no gap or repeat
    assert len(ids) == 12 and "".join(m.text for m in handoff) == tokenizer.decode(ids)
    params = SamplingParams(temperature=temperature, seed=SEED + n, ignore_eos=True)
    refs, gaps = teacher_forced(cpu_runner, prompt_ids, ids, params, SEED + n)
    ties = [i + 1 for i, g in enumerate(gaps) if g < 1e-3]
    NEAR_TIES.extend((n, temperature, i) for i in ties)
    mismatched = [i + 1 for i, (r, t) in enumerate(zip(refs, ids[1:])) if r != t and i + 1 not in ties]
    assert not mismatched, f"hand-off ids differ from the CPU worker's own at indexes {mismatched}"


def test_identity_near_ties_reported():
    # The issue asks how many positions had a reference top-2 gap below 1e-3 (expected none).
    print(f"near ties (gap < 1e-3): {len(NEAR_TIES)} {NEAR_TIES}")
    assert len(NEAR_TIES) <= 2


def test_cli_sends_the_route(layout):
    out = subprocess.run([HYBRIDGATE, "generate", "--target", layout["a"].target, "--route", "gpu->cpu",
                          "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "Once upon a time"],
                         capture_output=True, text=True, timeout=120 * TIME_FACTOR)
    assert out.returncode == 0, out.stderr
    assert re.search(r"route=gpu->cpu \(\S+ -> \S+\)\]", out.stderr), out.stderr
    bad = subprocess.run([HYBRIDGATE, "generate", "--target", layout["a"].target, "--route", "tpu", "hi"],
                         capture_output=True, text=True, timeout=60 * TIME_FACTOR)
    assert bad.returncode == 1 and "INVALID_ARGUMENT: route: must be one of auto, gpu, cpu, gpu->cpu" in bad.stderr


# --- abort storm ------------------------------------------------------------------------------


def test_abort_storm_leaves_nothing_behind(layout, tokenizer):
    a = layout["a"]
    rng = random.Random(SEED)
    before = worker_metrics(a.metrics_url)
    log_start = len(a.text())
    prompts = [prompt_of(tokenizer, n)[0] for n in (20, 40, 60)]
    moments = [rng.uniform(0.0, 2.0) * TIME_FACTOR for _ in range(100)]  # seeded: when each is cancelled

    # Eight calls in ten are cancelled at a seeded moment: the early windows. The late ones close before a
    # 48-id decode ends on a fast machine (the CPU worker decodes ahead while the EXPORTED and IMPORTED pauses
    # hold the router), so those calls decode 200 ids and are cancelled on their first CPU output (the
    # IMPORTED pause, at least 0.225 s, holds the state then) or 0.6 s after it (past the longest pause).
    late = {8: 0.0, 9: 0.6}

    def one(k: int) -> None:
        prompt, max_tokens = (prompts[0], 200) if k % 10 in late else (prompts[k % 3], 48)
        call = stub(a.target).Generate(pb.GenerateRequest(prompt=prompt, route="gpu->cpu", max_tokens=max_tokens,
                                                          ignore_eos=True, temperature=0.8, seed=k))
        timer = threading.Timer(late.get(k % 10, moments[k]), call.cancel)
        if k % 10 not in late:
            timer.start()
        try:
            for i, _ in enumerate(call):
                if i == 1 and k % 10 in late:  # message 0 is the GPU's token 0, message 1 the CPU's first
                    timer.start()
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED, exc
        finally:
            timer.cancel()

    with ThreadPoolExecutor(6) as pool:  # 6 x 7 blocks (60 + 48 ids), or 14 (20 + 200), within the CPU's 68
        list(pool.map(one, range(100)))
    aborted_in = Counter(re.findall(r"hand-off \w+ aborted in (\w+)", a.text()[log_start:]))
    assert all(aborted_in[s] > 0 for s in HANDOFF_STATES), aborted_in  # the pauses opened every window

    def clean() -> dict:
        m = worker_metrics(a.metrics_url)
        return {k: v for k, v in m.items() if k[0] in (
            "hybridgate:kv_cache_bytes", "hybridgate:kv_handoff_pinned_bytes_in_use",
            "hybridgate:kv_handoff_parked_sequences", "hybridgate:kv_handoff_reservations",
            "hybridgate:num_requests_running") and v != 0}

    deadline = time.monotonic() + 10 * TIME_FACTOR
    while clean() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert clean() == {}
    after = worker_metrics(a.metrics_url)
    for (name, worker), value in after.items():
        if name == "hybridgate:engine_tokens_after_abort_total":
            assert value - before.get((name, worker), 0) <= 100  # at most one step per aborted request
    print(f"abort storm: aborted in {dict(aborted_in)}")


# --- failures ----------------------------------------------------------------------------------


def test_cpu_refusal_runs_as_gpu_and_the_route_says_so(layout, tokenizer):
    prompt, _ = prompt_of(tokenizer, 1100)  # 69 blocks: more KV than the CPU worker's whole cache
    fields = dict(temperature=0, max_tokens=4, ignore_eos=True)
    refused_before = router_outcomes(layout["a"].metrics_url).get("refused", 0)
    reference = ids_of(generate(layout["a"].target, prompt, "gpu", **fields))
    got = generate(layout["a"].target, prompt, "gpu->cpu", **fields)
    assert got[-1].route.startswith("gpu (hand-off refused: "), got[-1].route
    assert ids_of(got) == reference
    assert router_outcomes(layout["a"].metrics_url)["refused"] == refused_before + 1


def test_two_gateways_each_get_only_their_own_hand_offs(layout, tokenizer):
    prompts = {name: [prompt_of(tokenizer, n)[0] for n in (24 + i, 48 + i)] for i, name in enumerate("ab")}
    fields = dict(temperature=0, max_tokens=8, ignore_eos=True)
    solo = {(g, p): ids_of(generate(layout[g].target, p, "gpu", **fields)) for g in "ab" for p in prompts[g]}
    with ThreadPoolExecutor(4) as pool:
        jobs = {(g, p): pool.submit(generate, layout[g].target, p, "gpu->cpu", **fields) for g in "ab"
                for p in prompts[g]}
        for (g, p), job in jobs.items():
            got = job.result()
            assert got[-1].route.startswith("gpu->cpu ("), got[-1].route
            assert ids_of(got)[0] == solo[(g, p)][0] and len(ids_of(got)) == 8


def test_cpu_worker_killed_between_export_and_confirmation_finishes_on_the_gpu(layout, tokenizer):
    # Last in the module: it kills the CPU worker. Gateway b holds EXPORTED for seconds.
    b = layout["b"]
    prompt, _ = prompt_of(tokenizer, 30)
    fields = dict(temperature=0, max_tokens=16, ignore_eos=True)
    reference = ids_of(generate(b.target, prompt, "gpu", **fields))
    call = stub(b.target).Generate(pb.GenerateRequest(prompt=prompt, route="gpu->cpu", **fields),
                                   timeout=120 * TIME_FACTOR)
    first = next(call)
    b.wait_for(rf"hand-off {first.request_id}: EXPORTED", timeout=30)
    layout["cpu"].popen.send_signal(signal.SIGKILL)
    rest = list(call)
    assert ids_of([first, *rest]) == reference
    assert rest[-1].route.startswith("gpu (hand-off resumed: "), rest[-1].route
    assert router_outcomes(b.metrics_url)["resumed"] >= 1
