"""The KV hand-off in process: a torch engine (fp32, CPU device) exports over a real ZeroMQ socket,
a Numba engine imports. Imported KV against the Numba runner's own prefill; bad hand-offs refused
by field; parked sequences released, resumed and aborted without leaks."""

from __future__ import annotations

import queue
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from conftest import TIME_FACTOR, bf16_bits
from hybridgate import wire
from hybridgate.models import model_fingerprint
from hybridgate.wire import (
    AddRequest, HandoffExported, HandoffExportFailed, HandoffHeader, HandoffImported, HandoffPart, HandoffRefused,
    HandoffRelease, HandoffReservation, HandoffReserve, HandoffResume, HandoffTarget, MsgType, SamplingParams,
)
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.gpu.export import KVExporter
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.handoff import HandoffIncoming
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROUTER = b"router-1"
PEER = b"gpu-peer"
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fingerprint(gguf_model):
    return model_fingerprint(gguf_model)


@pytest.fixture(scope="module")
def numba_runner(gguf_model):
    # fp32 KV and float32 activations, as the torch sender's: the imported KV is held to the runner's own
    # within 1e-4 (`auto` takes int16 activations on the avx2 path); the 16-bit caches have their own case.
    r = NumbaRunner(gguf_model, kv_cache_memory="96MiB", threads=1, kv_cache_dtype="fp32", activations="f32")
    r.warm_up(progress=False)
    return r


@pytest.fixture(scope="module")
def torch_runner(gguf_model):
    r = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="96MiB")
    r.warm_up()
    return r


@pytest.fixture(scope="module")
def link(torch_runner):
    """(context, endpoint, the CPU side's ROUTER socket, exporter events queue, exporter)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = "inproc://handoff-test"
    sock.bind(endpoint)
    events: queue.Queue = queue.Queue()
    # A small slab: a 100-token hand-off (4.6 MB) streams through 2 buffers of one layer each.
    layer = 2 * 112 * 3 * 64 * 4
    exporter = KVExporter(torch_runner, ctx, events.put, buffer_memory=2 * layer, buffer_bytes=layer)
    yield ctx, endpoint, sock, events, exporter
    exporter.close()
    sock.close(0)
    ctx.term()


@pytest.fixture()
def gpu(torch_runner, fingerprint, link):
    engine = EngineCore(torch_runner, SchedulerConfig(), fingerprint)
    engine.handoffs.exporter = link[4]
    yield engine
    assert engine.allocator.num_used == 0 and not engine.handoffs.parked


@pytest.fixture()
def cpu(numba_runner, fingerprint):
    engine = EngineCore(numba_runner, SchedulerConfig(), fingerprint, prefix_caching=False)
    yield engine
    assert engine.allocator.num_used == 0 and not engine.handoffs.reservations.by_id


def reserve(cpu, rid: str, num_tokens: int) -> str:
    cpu.handoffs.handle(ROUTER, HandoffReserve(rid, num_tokens))
    (client, answer), = cpu.handoffs.take_notices()[0]
    assert client == ROUTER and isinstance(answer, HandoffReservation) and answer.ok, answer
    return answer.token


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(n + 1000 * salt).integers(10, 40000, n)]


def wait_event(events: queue.Queue):
    return events.get(timeout=10 * TIME_FACTOR)


def run_handoff(gpu, cpu, link, prompt: list[int], rid: str, max_tokens: int = 6, params: SamplingParams = GREEDY):
    """Reserve, prefill with export, deliver every message; returns (first token, GPU notices, CPU notices)."""
    _, endpoint, sock, events, _ = link
    token = reserve(cpu, rid, len(prompt) + 1)
    gpu.add(AddRequest(rid, prompt, params, 0, max_tokens, 2, handoff=HandoffTarget(endpoint, token)), ROUTER)
    first = None
    while first is None:
        for seq in gpu.step():
            first = output_of(seq).token_ids[0]
    assert not gpu.scheduler.running and len(gpu.handoffs.parked) == 1  # parked, not scheduled
    cpu_notices = deliver(cpu, sock, events)
    gpu.handoffs.handle(b"", wait_event(events))
    return first, gpu.handoffs.take_notices()[0], cpu_notices


def deliver(cpu, sock, events: queue.Queue | None = None) -> list:
    """Feed the messages on the hand-off socket to the CPU engine (until the exporter reports,
    if `events` is given: on inproc a pinned buffer is free only once the receiver drops its
    frames); the CPU engine's notices."""
    notices = []
    deadline = time.monotonic() + 10 * TIME_FACTOR
    while True:
        if not sock.poll(10 if events is not None and events.empty() else 200 * TIME_FACTOR):
            if events is not None and events.empty() and time.monotonic() < deadline:
                continue
            return notices
        peer, kind, body, *frames = sock.recv_multipart(copy=False)
        cpu.handoffs.handle(peer.bytes, HandoffIncoming(kind.bytes, body.buffer, frames))
        del frames
        notices += cpu.handoffs.take_notices()[0]


def own_prefill_kv(numba_runner, cpu, prompt: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    seq = Sequence(AddRequest("ref", prompt, GREEDY, 0, 2, 2))
    assert cpu.allocator.ensure(seq.block_table, len(prompt))
    try:
        numba_runner.execute(ScheduledBatch([(seq, len(prompt))]))
        return [numba_runner.read_kv(seq.block_table, i, len(prompt)) for i in range(len(numba_runner.k_cache))]
    finally:
        cpu.allocator.release(seq.block_table)


@pytest.mark.parametrize("n", [5, 16, 17, 100])
def test_imported_kv_equals_the_cpu_runners_own(gpu, cpu, link, numba_runner, n):
    prompt = prompt_of(n)
    first, gpu_notices, cpu_notices = run_handoff(gpu, cpu, link, prompt, f"kv{n}")
    (client, exported), = gpu_notices
    assert isinstance(exported, HandoffExported) and exported.nbytes == 30 * 2 * n * 3 * 64 * 4
    assert [type(m) for _, m in cpu_notices] == [HandoffImported] and cpu_notices[0][1].next_token_index == 1
    seq = cpu._by_id[(ROUTER, f"kv{n}")]
    assert seq.imported and seq.num_computed == n and seq.output_ids == [first] and seq.sent == 1
    imported = [numba_runner.read_kv(seq.block_table, i, n) for i in range(30)]
    own = own_prefill_kv(numba_runner, cpu, prompt)
    for layer, ((ki, vi), (ko, vo)) in enumerate(zip(imported, own)):
        for got, want in ((ki, ko), (vi, vo)):
            scale = np.abs(want).max()
            assert np.abs(got - want).max() <= 1e-4 * scale, (layer, np.abs(got - want).max() / scale)
    # The GPU worker holds its blocks until the release; then frees them (idempotently).
    assert gpu.allocator.num_used > 0
    gpu.handoffs.handle(ROUTER, HandoffRelease(f"kv{n}"))
    gpu.handoffs.handle(ROUTER, HandoffRelease(f"kv{n}"))
    assert gpu.allocator.num_used == 0 and gpu.stats.handoff_parked == 0 or gpu.refresh_stats().handoff_parked == 0
    # The CPU worker decodes from token index 1; outputs go to the router that reserved.
    out = []
    while cpu.has_work():
        for s in cpu.step():
            o = output_of(s)
            assert o.token_index == len(out) + 1 and s.client == ROUTER
            out += o.token_ids
    assert len(out) == 5
    stats = cpu.refresh_stats()
    assert stats.handoff_outcomes == {"done": 1} and stats.handoff_bytes_total == exported.nbytes


def test_a_handoff_into_a_bf16_cpu_cache_stores_the_senders_kv_rounded(gpu, link, gguf_model, fingerprint):
    runner = NumbaRunner(gguf_model, kv_cache_memory="16MiB", threads=1, kv_cache_dtype="bf16")
    cpu = EngineCore(runner, SchedulerConfig(), fingerprint, prefix_caching=False)
    assert cpu.handoffs.spec.dtype == "bfloat16"  # the receiver's own dtype; the fp32 sender's frames convert
    prompt = prompt_of(21, salt=5)
    _, gpu_notices, cpu_notices = run_handoff(gpu, cpu, link, prompt, "bf16")
    assert [type(m) for _, m in cpu_notices] == [HandoffImported]
    (_, parked), = gpu.handoffs.parked.items()
    sent = [s * 16 + o for s in parked.seq.block_table for o in range(16)][:21]  # the sender's slots
    seq = cpu._by_id[(ROUTER, "bf16")]
    cache = gpu.runner.cache
    for layer in range(30):
        k, v = runner.read_kv(seq.block_table, layer, 21)
        np.testing.assert_array_equal(bf16_bits(k), bf16_bits(cache.k[layer][sent].numpy()))
        np.testing.assert_array_equal(bf16_bits(v), bf16_bits(cache.v[layer][sent].numpy()))
        assert np.array_equal(k.view(np.uint32) & 0xFFFF, np.zeros_like(k, np.uint32))  # bf16 values, as stored
    gpu.handoffs.handle(ROUTER, HandoffRelease("bf16"))
    out = []
    while cpu.has_work():
        for s in cpu.step():
            out += output_of(s).token_ids
    assert len(out) == 5 and cpu.allocator.num_used == 0


def test_resume_decodes_on_the_gpu_with_the_ids_of_a_plain_run(gpu, cpu, link):
    prompt = prompt_of(40, salt=1)
    gpu.add(AddRequest("plain", prompt, GREEDY, 0, 6, 2), ROUTER)
    plain = []
    while gpu.has_work():
        for s in gpu.step():
            plain += output_of(s).token_ids
    first, gpu_notices, cpu_notices = run_handoff(gpu, cpu, link, prompt, "res")
    cpu.abort(["res"], ROUTER)  # the router gives up on the CPU side
    gpu.handoffs.handle(ROUTER, HandoffResume("res"))
    got = [first]
    while gpu.has_work():
        for s in gpu.step():
            o = output_of(s)
            assert o.token_index == len(got)
            got += o.token_ids
    assert got == plain
    assert gpu.refresh_stats().handoff_outcomes == {"resumed": 1}


def test_abort_while_copying_and_while_parked_frees_everything(gpu, cpu, link):
    _, endpoint, sock, events, exporter = link
    for rid in ("a1", "a2"):
        prompt = prompt_of(33, salt=2)
        token = reserve(cpu, rid, len(prompt) + 1)
        gpu.add(AddRequest(rid, prompt, GREEDY, 0, 6, 2, handoff=HandoffTarget(endpoint, token)), ROUTER)
        while not gpu.handoffs.parked:
            gpu.step()
        if rid == "a1":
            gpu.abort([rid], ROUTER)  # at once: the export may still be copying
            deliver(cpu, sock, events)
            gpu.handoffs.handle(b"", wait_event(events))
        else:
            deliver(cpu, sock, events)
            gpu.handoffs.handle(b"", wait_event(events))
            gpu.abort([rid], ROUTER)
            gpu.abort([rid], ROUTER)  # idempotent
        cpu.abort([rid], ROUTER)
        cpu.abort([rid], ROUTER)
    assert gpu.allocator.num_used == 0 and not gpu.handoffs.parked
    deadline = time.monotonic() + 5 * TIME_FACTOR
    while exporter.pool.stats.bytes_in_use and time.monotonic() < deadline:
        exporter.pool.drain()
        time.sleep(0.01)
    assert exporter.pool.stats.bytes_in_use == 0 and exporter.pool.stats.waits > 0  # streamed through 2 buffers


def test_a_stream_that_ends_at_token_0_is_not_exported(gpu, cpu, link):
    token = reserve(cpu, "one", 9)
    gpu.add(AddRequest("one", prompt_of(8), GREEDY, 0, 1, 2, handoff=HandoffTarget(link[1], token)), ROUTER)
    while gpu.has_work():
        gpu.step()
    (client, msg), = gpu.handoffs.take_notices()[0]
    assert isinstance(msg, HandoffExportFailed) and msg.reason == "finished"
    cpu.abort(["one"], ROUTER)


# --- refusals ------------------------------------------------------------------


def header_for(spec_engine, rid: str, token: str, n: int, **changes) -> HandoffHeader:
    s = spec_engine.handoffs.spec
    h = HandoffHeader(request_id=rid, token=token, fingerprint=s.fingerprint, block_size=s.block_size,
                      num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, dtype="float32",
                      num_tokens=n, rope_basis=wire.ROPE_BASIS, prompt_ids=list(range(1, n + 1)), output_ids=[7],
                      params=GREEDY, seed=0, max_tokens=4, eos_token_id=2, next_token_index=1)
    return msgspec.structs.replace(h, **changes)


def send(cpu, header: HandoffHeader, frames_per_layer=None, nbytes=None, frame_count=None) -> list:
    """Deliver a header and one part of all layers; the CPU engine's (notices, replies)."""
    s = cpu.handoffs.spec
    cpu.handoffs.handle(PEER, HandoffIncoming(MsgType.HANDOFF_KV.value, wire.encode(header)[1], []))
    size = nbytes if nbytes is not None else header.num_tokens * s.num_kv_heads * s.head_dim * 4
    count = frame_count if frame_count is not None else 2 * s.num_layers
    frames = [np.zeros(size, np.uint8).tobytes() for _ in range(count)]
    part = HandoffPart(header.request_id, header.token, 0, s.num_layers)
    cpu.handoffs.handle(PEER, HandoffIncoming(MsgType.HANDOFF_KV_PART.value, wire.encode(part)[1], frames))
    return cpu.handoffs.take_notices()


@pytest.mark.parametrize("field, changes, frames, want", [
    ("fingerprint", {"fingerprint": "sha256:other"}, {}, "sha256:other"),
    ("num_kv_heads", {"num_kv_heads": 4}, {}, "4"),
    ("head_dim", {"head_dim": 128}, {}, "128"),
    ("block_size", {"block_size": 32}, {}, "32"),
    ("dtype", {"dtype": "int8"}, {}, "int8"),
    ("frames", {}, {"nbytes": 100}, "100 bytes"),  # truncated frames
    ("frames", {}, {"frame_count": 59}, "59 frames"),  # a frame missing
    ("frames", {"num_tokens": 9, "prompt_ids": list(range(1, 10))}, {"nbytes": 12 * 3 * 64 * 4}, "9 tokens"),
    ("num_tokens", {"num_tokens": 11}, {}, "11"),  # the count does not match the ids
])
def test_bad_handoffs_are_refused_by_field_and_the_worker_keeps_serving(cpu, field, changes, frames, want):
    used = cpu.allocator.num_used
    token = reserve(cpu, "bad", 13)
    notices, replies = send(cpu, header_for(cpu, "bad", token, 12, **changes), **frames)
    refusal = notices[0][1]
    assert notices[0][0] == ROUTER and isinstance(refusal, HandoffRefused) and refusal.field == field
    assert want in refusal.message and replies[0] == (PEER, refusal)
    assert cpu.allocator.num_used == used and not cpu.handoffs.reservations.by_id  # the reservation is freed
    assert cpu.refresh_stats().handoff_outcomes["refused"] == 1  # (a part after a refused header: "dropped")
    cpu.add(AddRequest("after", [1, 2, 3, 4, 5], GREEDY, 0, 3, 2), ROUTER)
    n = 0
    while cpu.has_work():
        n += sum(len(output_of(s).token_ids) for s in cpu.step())
    assert n == 3


def test_a_wrong_or_spent_token_is_refused_and_spends_nothing(cpu):
    token = reserve(cpu, "tok", 13)
    notices, replies = send(cpu, header_for(cpu, "tok", "0" * 32, 12))
    assert not notices  # no router is told: the sender may be anyone
    assert {r.field for _, r in replies} == {"token"} and "tok" in cpu.handoffs.reservations.by_id
    notices, _ = send(cpu, header_for(cpu, "tok", token, 12))
    assert [type(m) for _, m in notices] == [HandoffImported]
    notices, replies = send(cpu, header_for(cpu, "tok", token, 12))  # spent
    assert not notices and {r.field for _, r in replies} == {"token"}
    cpu.abort(["tok"], ROUTER)
    assert cpu.refresh_stats().handoff_outcomes == {"done": 1, "dropped": 4}


def test_reservations_expire_and_refuse_when_blocks_run_out(cpu):
    cpu.handoffs.handle(ROUTER, HandoffReserve("huge", cpu.runner.max_model_len))
    (_, answer), = cpu.handoffs.take_notices()[0]
    assert not answer.ok and "no free KV blocks" in answer.reason
    reserve(cpu, "exp", 20)
    cpu.handoffs.expire(time.monotonic() + 3600)
    (_, msg), = cpu.handoffs.take_notices()[0]
    assert isinstance(msg, HandoffRefused) and msg.field == "reservation"
    assert cpu.refresh_stats().handoff_outcomes == {"expired": 1}


def test_a_constrained_handoff_rebuilds_its_matcher_on_the_cpu_worker(gpu, cpu, link, tokenizer):
    """The GPU worker samples the first id under the constraint; the CPU worker compiles the grammar, feeds
    its matcher that id, and decodes the rest under it (the text matches the regex, checked with `re`)."""
    import re

    params = SamplingParams(temperature=1.0, seed=5, constraint=wire.Constraint(kind="regex",
                                                                               grammar="start: /[a-z]{3}[0-9]{3}/"))
    first, _, cpu_notices = run_handoff(gpu, cpu, link, prompt_of(20, salt=7), "constrained", 12, params)
    assert [type(m) for _, m in cpu_notices] == [HandoffImported]
    gpu.handoffs.handle(ROUTER, HandoffRelease("constrained"))
    seq = cpu._by_id[(ROUTER, "constrained")]
    out, finish = [], 0
    while cpu.has_work():
        for s in cpu.step():
            o = output_of(s)
            out, finish = out + o.token_ids, o.finish
    assert seq.matcher is None and finish == wire.FinishReason.STOP and not cpu.take_failures()
    assert re.fullmatch(r"[a-z]{3}[0-9]{3}", tokenizer.decode([first, *out]))
