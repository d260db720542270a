"""Two real worker processes and the wire protocol of the KV hand-off, driven as a router would
(`hybridgate.bench.handoff.BenchRouter`): token 0 from the GPU worker, the rest from the CPU worker,
the GPU worker's blocks freed after the release; a bad header on the hand-off socket refused by field
while the CPU worker keeps serving."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

import pytest
import zmq

from conftest import TIME_FACTOR
from hybridgate import wire
from hybridgate.bench.handoff import BenchRouter, start_worker
from hybridgate.workers.cpu import isa
from hybridgate.wire import HandoffHeader, HandoffRefused, HandoffReservation, HandoffReserve, SamplingParams


@pytest.fixture(scope="module")
def workers(tmp_path_factory, model_path):
    folder = tmp_path_factory.mktemp("ho")
    endpoints = {"gpu": f"ipc://{folder}/gpu", "cpu": f"ipc://{folder}/cpu"}
    args = SimpleNamespace(kv_cache_memory="128MiB", model=str(model_path), threads=1, device="cpu",
                           handoff_buffer_memory="64MiB")
    procs = {k: start_worker(k, e, args, folder / f"{k}.log") for k, e in endpoints.items()}
    ctx = zmq.Context()
    router = BenchRouter(ctx, endpoints)
    try:
        router.wait_ready(240 * TIME_FACTOR)
    except TimeoutError:
        raise AssertionError("\n".join((folder / f"{k}.log").read_text() for k in procs)) from None
    yield router, ctx
    for link in router.links.values():
        link.sock.close(0)
    ctx.term()
    for p in procs.values():
        p.terminate()
        try:
            p.wait(10 * TIME_FACTOR)
        except subprocess.TimeoutExpired:
            p.kill()


def test_token_0_on_the_gpu_worker_the_rest_on_the_cpu_worker(workers):
    router, _ = workers
    prompt = list(range(100, 140))
    plain, _ = router.plain("gpu", "plain", prompt, 2, 60 * TIME_FACTOR)
    rec = router.handoff("ho", prompt, 4, 60 * TIME_FACTOR)
    assert rec["sources"] == ["gpu", "cpu", "cpu", "cpu"]
    assert rec["ids"][:2] == plain  # token 1 is the CPU worker's, from the imported KV
    assert rec["exported"].nbytes == 30 * 2 * 40 * 3 * 64 * 4
    gpu = router.fresh_stats("gpu")
    deadline = time.monotonic() + 10 * TIME_FACTOR
    while (gpu.handoff_parked or gpu.blocks_used) and time.monotonic() < deadline:
        gpu = router.fresh_stats("gpu")
    assert gpu.handoff_parked == 0 and gpu.blocks_used == 0 and gpu.handoff_outcomes == {"done": 1}
    cpu = router.fresh_stats("cpu")
    assert cpu.handoff_outcomes == {"done": 1} and cpu.handoff_reservations == 0
    # HELLO names the CPU worker's kernel path (the best this CPU runs, as LLVM reports its features).
    assert router.links["cpu"].hello.cpu_isa == isa.best(isa.host_features())
    assert router.links["gpu"].hello.cpu_isa == ""


def test_a_bad_header_is_refused_by_field_and_the_cpu_worker_keeps_serving(workers):
    router, ctx = workers
    router.send("cpu", HandoffReserve("bad", 9))
    while True:
        _, msg, _ = router.poll(30 * TIME_FACTOR)
        if isinstance(msg, HandoffReservation):
            break
    assert msg.ok
    sender = ctx.socket(zmq.DEALER)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(router.links["cpu"].hello.handoff_endpoint)
    header = HandoffHeader(request_id="bad", token=msg.token, fingerprint="sha256:not-this-model", block_size=16,
                           num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", num_tokens=8,
                           rope_basis=wire.ROPE_BASIS, prompt_ids=list(range(1, 9)), output_ids=[5],
                           params=SamplingParams(), seed=0, max_tokens=4, eos_token_id=2, next_token_index=1)
    sender.send_multipart(wire.encode(header))
    assert sender.poll(30_000 * TIME_FACTOR)
    reply = wire.decode(sender.recv_multipart())
    sender.close(0)
    assert isinstance(reply, HandoffRefused) and reply.field == "fingerprint" and "not-this-model" in reply.message
    while True:
        _, msg, _ = router.poll(30 * TIME_FACTOR)
        if isinstance(msg, HandoffRefused):
            break
    assert msg == reply
    ids, _ = router.plain("cpu", "after", [1, 2, 3, 4, 5], 3, 60 * TIME_FACTOR)
    assert len(ids) == 3
    assert router.fresh_stats("cpu").handoff_reservations == 0
