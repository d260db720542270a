"""KV hand-off pieces without a model: frame conversion, header checks, the pinned pool's waits,
test pauses, worker settings, and the metric names on /metrics."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from hybridgate import wire
from hybridgate.mempool import PinnedPool
from hybridgate.wire import HandoffHeader, SamplingParams
from hybridgate.workers.handoff import HandoffRefusal, KVSpec, PauseHooks, Reservations, check_header, frames_to_float32
from hybridgate.workers.handoff_checks import KVLayout, decode_header

SPEC = KVSpec("fp", 16, 2, 3, 64)


VOCAB = 64


def header(**changes) -> HandoffHeader:
    h = HandoffHeader(request_id="r", token="t", fingerprint="fp", block_size=16, num_layers=2, num_kv_heads=3,
                      head_dim=64, dtype="float32", num_tokens=5, rope_basis=wire.ROPE_BASIS, prompt_ids=[1, 2, 3, 4, 5],
                      output_ids=[9], params=SamplingParams(), seed=1, max_tokens=4, eos_token_id=2,
                      next_token_index=1)
    return msgspec.structs.replace(h, **changes)


def test_frames_convert_bf16_and_fp16_exactly():
    want = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32)
    bf16 = (want.view(np.uint32) >> 16).astype("<u2")  # truncation: exactly representable after the round trip
    exact_bf16 = (bf16.astype(np.uint32) << 16).view(np.float32)
    got = frames_to_float32([bf16.tobytes()], header(dtype="bfloat16"), SPEC)[0]
    np.testing.assert_array_equal(got, exact_bf16)
    fp16 = want.astype("<f2")
    got = frames_to_float32([fp16.tobytes()], header(dtype="float16"), SPEC)[0]
    np.testing.assert_array_equal(got, fp16.astype(np.float32))
    with pytest.raises(HandoffRefusal, match="frame 0 has 100 bytes") as exc:
        frames_to_float32([b"x" * 100], header(), SPEC)
    assert exc.value.field == "frames"


@pytest.mark.parametrize("changes, field", [
    ({"fingerprint": "other"}, "fingerprint"), ({"num_layers": 3}, "num_layers"), ({"dtype": "float64"}, "dtype"),
    ({"rope_basis": "rotate-half"}, "rope_basis"), ({"num_tokens": 4}, "num_tokens"),
    ({"output_ids": [], "num_tokens": 4}, "output_ids"), ({"max_tokens": 1}, "output_ids"), ({"next_token_index": 0}, "next_token_index"),
    # what the ADD guard refuses, a hand-off may not import either (it used to build the sequence unchecked)
    ({"prompt_ids": [1, 2, 3, 4, VOCAB]}, "prompt_ids"), ({"output_ids": [VOCAB]}, "output_ids"),
    ({"params": SamplingParams(temperature=-1.0)}, "temperature"), ({"eos_token_id": VOCAB}, "eos_token_id"),
    ({"seed": -1}, "seed"),
])
def test_header_checks_name_the_field_and_both_values(changes, field):
    check_header(header(), SPEC, 100, VOCAB)
    with pytest.raises(HandoffRefusal) as exc:
        check_header(header(**changes), SPEC, 100, VOCAB)
    assert exc.value.field == field
    value = next(iter(changes.values()))
    if isinstance(value, str):
        assert repr(value) in exc.value.message


def test_a_mixed_shape_header_names_each_sent_layers_shape_and_old_headers_stay_valid():
    # Model layer 2 shares another's K/V (gemma4's last layers do): layers 0, 1 and 3 are sent, of two shapes.
    layout = KVLayout((0, 1, 3), ((2, 16), (1, 64), (2, 16)), "float32")
    spec = KVSpec.of("fp", 16, layout)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (3, 0, 0)
    assert [spec.model_layer(j) for j in range(3)] == [0, 1, 3]
    mixed = header(num_layers=3, num_kv_heads=0, head_dim=0, layer_shapes=[(2, 16), (1, 64), (2, 16)])
    assert wire.decode(wire.encode(mixed)) == mixed
    check_header(mixed, spec, 100, VOCAB)
    for changes, field in (({"layer_shapes": [(2, 16), (2, 16), (2, 16)]}, "layer_shapes"),
                           ({"layer_shapes": []}, "layer_shapes"), ({"num_layers": 5}, "num_layers"),
                           ({"num_kv_heads": 2, "head_dim": 16, "layer_shapes": []}, "num_kv_heads")):
        with pytest.raises(HandoffRefusal) as exc:
            check_header(msgspec.structs.replace(mixed, **changes), spec, 100, VOCAB)
        assert exc.value.field == field
    # A header written before layer_shapes existed: every layer sent is [num_kv_heads, head_dim].
    old = msgspec.structs.asdict(header())
    del old["layer_shapes"]
    assert decode_header(msgspec.msgpack.encode(old)) == header()
    check_header(decode_header(msgspec.msgpack.encode(old)), SPEC, 100, VOCAB)
    # Frames of sent layers 1 and 2 (a part from layer 1 on), each in its own layer's shape.
    rng = np.random.default_rng(1)
    want = [rng.standard_normal((5, *shape)).astype(np.float32) for shape in ((1, 64), (1, 64), (2, 16), (2, 16))]
    got = frames_to_float32([w.tobytes() for w in want], mixed, spec, first_layer=1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(HandoffRefusal, match=r"frame 0 has 640 bytes, 5 tokens of float32 make 1280 \(sent layer "
                                             r"1: \(1, 64\)\)"):
        frames_to_float32([want[2].tobytes(), want[3].tobytes()], mixed, spec, first_layer=1)


def test_a_token_matches_only_its_reservation():
    rs = Reservations(timeout_s=30)
    r = rs.add(b"c", "req", 10, [])
    assert len(r.token) == 32 and rs.match("req", r.token) is r
    for rid, token in (("req", "0" * 32), ("other", r.token)):
        with pytest.raises(HandoffRefusal, match="wrong, spent or expired"):
            rs.match(rid, token)
    assert rs.expired(time.monotonic()) == [] and rs.expired(time.monotonic() + 31) == [r]


def test_pool_waits_for_a_buffer_instead_of_allocating():
    pool = PinnedPool(1024, 2)
    a, b = pool.acquire(wait_s=1), pool.acquire(wait_s=1)
    done = []
    pool.release(a, lambda: bool(done))
    with pytest.raises(TimeoutError, match="no free pinned buffer"):
        pool.acquire(wait_s=0.05)
    done.append(1)
    c = pool.acquire(wait_s=1)
    assert c.index == a.index and pool.stats.waits == 1 and pool.stats.fallbacks == 0
    pool.release(b), pool.release(c)
    assert pool.stats.bytes_in_use == 0 and pool.stats.peak_bytes == 2048


def test_pause_hooks_parse_and_seed():
    slept = []
    hooks = PauseHooks("exporting:0.01,imported:0.02", seed="7", sleep=slept.append)
    assert hooks.seconds == {"exporting": 0.01, "imported": 0.02}
    hooks.pause("reserved")  # not configured: no pause
    hooks.pause("exporting")
    hooks.pause("imported")
    draws = random.Random(7)  # the seed's fractions, in the order of the pauses
    assert slept == [0.01 * draws.random(), 0.02 * draws.random()]
    with pytest.raises(ValueError, match="unknown state 'nope'"):
        PauseHooks("nope:1")
    assert PauseHooks("", seed=None).seconds == {}


def test_worker_settings():
    from hybridgate.workers.process import WorkerConfig

    cpu = WorkerConfig("m", "ipc:///tmp/w", kind="cpu")
    assert cpu.resolved_handoff_endpoint == "ipc:///tmp/w.handoff"
    assert WorkerConfig("m", "tcp://127.0.0.1:5000", kind="cpu").resolved_handoff_endpoint == ""
    assert WorkerConfig("m", "ipc:///tmp/w", kind="gpu").resolved_handoff_endpoint == ""
    assert cpu.handoff_buffer_bytes == 256 << 20 and not cpu.cache_imported_kv
    with pytest.raises(ValueError, match="handoff_buffer_memory"):
        WorkerConfig("m", "ipc:///tmp/w", handoff_buffer_memory="0.5")
    with pytest.raises(ValueError, match="handoff_endpoint"):
        WorkerConfig("m", "ipc:///tmp/w", kind="cpu", handoff_endpoint="/tmp/x")


def test_metric_names():
    from prometheus_client import generate_latest

    from hybridgate.gateway.metrics import GatewayMetrics
    from hybridgate.wire import EngineStats

    gpu = EngineStats(handoff_bytes_total=94, handoff_copy_seconds_total=0.5, handoff_copy_hidden_seconds_total=0.4,
                      handoff_outcomes={"done": 2, "resumed": 1}, handoff_pool_waits=3, handoff_parked=1)
    cpu = EngineStats(handoff_bytes_total=94, handoff_reservations=2, handoff_recomputed=1)
    clients = [SimpleNamespace(stats=gpu, endpoint="g", kind="gpu"), SimpleNamespace(stats=cpu, endpoint="c", kind="cpu")]
    text = generate_latest(GatewayMetrics(lambda: clients).registry).decode()
    for line in [
        'hybridgate:kv_handoff_bytes_total{direction="gpu_to_cpu",side="export",worker="g"} 94.0',
        'hybridgate:kv_handoff_bytes_total{direction="gpu_to_cpu",side="import",worker="c"} 94.0',
        'hybridgate:kv_handoff_copy_seconds_total{direction="gpu_to_cpu",side="export",worker="g"} 0.5',
        'hybridgate:kv_handoff_copy_hidden_seconds_total{direction="gpu_to_cpu",side="export",worker="g"} 0.4',
        'hybridgate:kv_handoff_worker_total{direction="gpu_to_cpu",outcome="resumed",side="export",worker="g"} 1.0',
        'hybridgate:kv_handoff_pinned_waits_total{worker="g"} 3.0',
        'hybridgate:kv_handoff_parked_sequences{worker="g"} 1.0',
        'hybridgate:kv_handoff_reservations{worker="c"} 2.0',
        'hybridgate:kv_handoff_recomputed_total{worker="c"} 1.0',
    ]:
        assert line in text


def test_imported_sequences_are_preempted_last_and_counted_when_recomputed():
    from hybridgate.mempool import BlockAllocator
    from hybridgate.wire import AddRequest
    from hybridgate.workers.scheduler import Scheduler, SchedulerConfig
    from hybridgate.workers.sequence import Sequence, SequenceStatus

    sched = Scheduler(SchedulerConfig(8, 100), BlockAllocator(5, 4), "fp")

    def running(rid: str, n: int, imported: bool) -> Sequence:
        s = Sequence(AddRequest(rid, list(range(10, 10 + n)), SamplingParams(), 0, 50, 2))
        sched.allocator.ensure(s.block_table, n)
        s.num_computed, s.imported, s.cacheable = n, imported, not imported
        s.output_ids.append(7)
        sched.unpark(s)
        return s

    running("other", 8, False)  # 2 full blocks: its next token needs a third
    plain = running("plain", 4, False)  # 1 block, room for its next token
    imp = running("imp", 6, True)  # 2 blocks, room for its next token; now 0 blocks are free
    batch = sched.schedule()  # other needs a block: plain goes, though imp is the newest
    assert [s.request_id for s in batch.sequences] == ["other", "imp"]
    assert plain.status == SequenceStatus.WAITING and imp.status == SequenceStatus.RUNNING
    assert sched.stats.recomputed_imports == 0 and sched.allocator.by_hash == {}  # imported KV never cached
    sched.preempt(imp)
    assert sched.stats.recomputed_imports == 1


def test_the_export_queue_is_bounded_and_one_more_export_fails_at_once():
    """An export past the queue's bound fails at once (the sequence decodes where it is), counted."""
    import torch
    import zmq

    from hybridgate.workers.gpu.export import KVExporter
    from hybridgate.workers.handoff import ExportJob

    cache = SimpleNamespace(k=[torch.zeros(4, 16, 3, 64)], block_size=16, config=SimpleNamespace(kv_layers=(0,)))
    runner = SimpleNamespace(cache=cache, model=SimpleNamespace(device=torch.device("cpu")), max_model_len=64)
    events, ctx = [], zmq.Context()
    exporter = KVExporter(runner, ctx, events.append, buffer_memory=1 << 20, max_jobs=2)
    exporter.stopping.set()  # the sender thread takes nothing from here on
    exporter.thread.join(5)
    try:
        for rid in ("a", "b", "c"):
            exporter.submit(ExportJob((b"c", rid), "ipc:///nowhere", header(request_id=rid), [0]))
        assert [(e.key, e.kind) for e in events] == [((b"c", "c"), "failed")]
        assert "2 exports are queued" in events[0].reason
        assert exporter.refusals.counts() == {"kv_export": 1}
    finally:
        exporter.close()
        ctx.term()


def test_an_export_packs_layers_of_two_shapes_into_its_parts_and_sends_no_shared_layer():
    """12 layers own K/V, alternating 2 heads of 16 and 1 head of 64 (gemma4's sliding and full layers differ
    so), and model layer 6 shares layer 4's: parts of 2 layers of both shapes. Each frame received must be its
    layer's slots of the sequence's blocks, read from the cache tensors by numpy indexing."""
    import torch
    import zmq

    from conftest import TIME_FACTOR
    from hybridgate.workers.gpu.export import KVExporter, StepTimeline
    from hybridgate.workers.handoff import ExportJob
    from hybridgate.workers.handoff_checks import decode_part

    bs, slots, cpu = 16, 6 * 16, torch.device("cpu")
    owners = [i for i in range(13) if i != 6]
    shapes = [(2, 16) if j % 2 == 0 else (1, 64) for j in range(len(owners))]
    g = torch.Generator().manual_seed(0)
    own = {i: [torch.randn(slots, *shape, generator=g) for _ in "KV"] for i, shape in zip(owners, shapes)}
    source = [4 if i == 6 else i for i in range(13)]
    cache = SimpleNamespace(k=[own[i][0] for i in source], v=[own[i][1] for i in source], block_size=bs,
                            config=SimpleNamespace(kv_layers=tuple(owners)))
    runner = SimpleNamespace(cache=cache, model=SimpleNamespace(device=cpu), max_model_len=slots,
                             timeline=StepTimeline(cpu))
    spec = KVSpec.of("fp", bs, KVLayout(tuple(owners), tuple(shapes), "float32"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("inproc://mixed-export")
    events = []
    exporter = KVExporter(runner, ctx, events.append, buffer_memory=1 << 20)
    n, table = 37, [4, 0, 2]
    h = header(num_layers=spec.num_layers, num_kv_heads=0, head_dim=0, layer_shapes=list(spec.layer_shapes),
               num_tokens=n, prompt_ids=list(range(1, n + 1)))
    try:
        exporter.submit(ExportJob((b"c", "r"), "inproc://mixed-export", h, table))
        assert sock.poll(int(5000 * TIME_FACTOR))
        got_header = decode_header(sock.recv_multipart()[2])
        check_header(got_header, spec, slots, VOCAB)
        arrays, parts = [], []
        while len(arrays) < 2 * spec.num_layers:
            assert sock.poll(int(5000 * TIME_FACTOR))
            _, _, body, *frames = sock.recv_multipart()
            part = decode_part(body)
            parts.append((part.first_layer, part.num_layers))
            arrays += frames_to_float32(frames, got_header, spec, part.first_layer)
        deadline = time.monotonic() + 5 * TIME_FACTOR
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        exporter.close()
        sock.close(0)
        ctx.term()
    assert parts == [(j, 2) for j in range(0, 12, 2)]  # about 10 parts: 2 layers each, one of each shape
    sent = [b * bs + o for b in table for o in range(bs)][:n]
    for j, layer in enumerate(owners):
        np.testing.assert_array_equal(arrays[2 * j], cache.k[layer][sent].numpy())
        np.testing.assert_array_equal(arrays[2 * j + 1], cache.v[layer][sent].numpy())
    (event,) = events
    assert event.kind == "sent" and event.nbytes == 2 * n * 4 * sum(h * d for h, d in shapes)
    exporter.pool.drain()  # the context is closed: ZeroMQ holds no frame of any buffer
    assert exporter.pool.stats.bytes_in_use == 0
