"""Fuzz a live worker's socket: no frame may kill it, and each refused message is counted.

A real `hybridgate worker --kind cpu` process; raw zmq DEALERs send it
random bytes, truncated frames, every type byte with a malformed body,
oversized bodies, ADDs with out-of-vocabulary ids or out-of-range fields, and
valid but inconsistent messages (duplicate ADDs of a live request, aborts of
unknown ids and of another router's request). Afterwards the process is
alive, its I/O thread still sends heartbeats, the refusal counter in its LOAD
stats equals the number of refused messages sent, every refused ADD whose id
was readable was answered with a RequestError, and requests (one running
through the fuzz, one after it) get the reference greedy ids.
"""

from __future__ import annotations

import math
import time
import uuid

import msgspec
import zmq
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from conftest import TIME_FACTOR, golden_json
from hybridgate import wire
from hybridgate.wire import Abort, AddRequest, Connect, Load, MsgType, Outputs, RequestError, SamplingParams
from hybridgate.workers.io_thread import max_frame_bytes
from procs import Proc

GREEDY = golden_json("greedy.json")["france"]
VOCAB = 49152
MAX_MODEL_LEN = 8192
MAX_FRAME = max_frame_bytes(MAX_MODEL_LEN)
MIN_CASES = 2000
LIVE_ID = "live-request"

# Every type a worker takes from a router (the KV hand-off's too: they go to its engine).
INBOUND = {t.value: wire.MESSAGE_TYPES[t] for t in (MsgType.CONNECT, MsgType.ADD, MsgType.ABORT, MsgType.HANDOFF_RESERVE,
                                                    MsgType.HANDOFF_RELEASE, MsgType.HANDOFF_RESUME)}

# What the worker must do with a message: refuse it (count it), refuse and answer it with a
# RequestError, or take it (not counted).
REFUSED, ANSWERED, TAKEN = "refused", "answered", "taken"


def decodes(kind: bytes, body: bytes) -> bool:
    try:
        msgspec.msgpack.decode(body, type=INBOUND[kind])
        return True
    except (msgspec.DecodeError, ValueError):
        return False


def add(rid: str = "fuzz", ids=(5, 6, 7), max_tokens: int = 4, **params) -> AddRequest:
    fields = {k: params.pop(k) for k in ("seed", "eos_token_id", "first_token_index") if k in params}
    return AddRequest(rid, list(ids), SamplingParams(**{"temperature": 0, **params}), fields.get("seed", 0), max_tokens,
                      fields.get("eos_token_id", 2), fields.get("first_token_index", 0))


def readable(frames: list[bytes]) -> bool:
    """A message the worker would take, or an ADD whose request id it could read (and answer)."""
    if len(frames) != 2 or frames[0] not in INBOUND:
        return False
    if decodes(*frames):
        return True
    try:
        return frames[0] == MsgType.ADD.value and bool(msgspec.msgpack.decode(frames[1], type=RequestId))
    except (msgspec.DecodeError, ValueError):
        return False


class RequestId(msgspec.Struct):
    request_id: str


random_bytes = st.lists(st.binary(max_size=64), min_size=1, max_size=4).filter(lambda f: not readable(f)).map(
    lambda frames: (frames, REFUSED))


@st.composite
def truncated(draw):
    msg = draw(st.sampled_from([Connect("r"), add(), Abort(["a", "b"])]))
    kind, body = wire.encode(msg)
    if draw(st.booleans()):
        return [kind], REFUSED  # the body frame is missing
    return [kind, body[: draw(st.integers(0, len(body) - 1))]], REFUSED


@st.composite
def malformed_body(draw):
    kind = bytes([draw(st.integers(0, 255))])
    body = draw(st.binary(max_size=48))
    if readable([kind, body]):
        body = b"\xc1" + body  # 0xc1 is never used in msgpack: the body cannot decode
    return [kind, body], REFUSED


@st.composite
def oversized(draw):
    kind = draw(st.sampled_from([*INBOUND, b"O"]))
    return [kind, b"\x00" * (MAX_FRAME + draw(st.integers(1, 4096)))], REFUSED


@st.composite
def extra_frames(draw):
    kind, body = wire.encode(draw(st.sampled_from([Connect("r"), Abort(["x"])])))
    return [kind, body, *draw(st.lists(st.binary(max_size=8), min_size=1, max_size=3))], REFUSED


BAD_ADDS = [
    lambda d: add(ids=[5, d(st.integers(VOCAB, 2**63 - 1)), 7]),
    lambda d: add(ids=[d(st.integers(-(2**63), -1))]),
    lambda d: add(ids=[]),
    lambda d: add(ids=[1] * 10, max_tokens=MAX_MODEL_LEN),
    lambda d: add(temperature=d(st.one_of(st.floats(max_value=-1e-9), st.just(math.nan)))),
    lambda d: add(top_p=d(st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001), st.just(math.nan)))),
    lambda d: add(top_k=d(st.integers(-(2**63), -2))),
    lambda d: add(repetition_penalty=d(st.one_of(st.floats(max_value=0.0), st.just(math.nan)))),
    lambda d: add(max_tokens=d(st.integers(-(2**31), 0))),
    lambda d: add(seed=d(st.integers(-(2**63), -1))),
    lambda d: add(eos_token_id=d(st.one_of(st.integers(VOCAB, 2**40), st.integers(-(2**40), -2)))),
    lambda d: add(first_token_index=d(st.integers(-(2**40), -1))),
    lambda d: add(stop=("x",) * 17),
    lambda d: add(rid=""),
]


@st.composite
def bad_add(draw):
    make = draw(st.sampled_from(BAD_ADDS))
    msg = make(draw)
    msg = msgspec.structs.replace(msg, request_id=msg.request_id and f"bad-{uuid.uuid4().hex[:8]}")
    return wire.encode(msg), ANSWERED if msg.request_id else REFUSED


def duplicate_add():
    return st.just((wire.encode(add(LIVE_ID, GREEDY["prompt_ids"][:12], 4000, ignore_eos=True)), REFUSED))


aborts = st.lists(st.one_of(st.text(max_size=20).map(lambda s: f"unknown-{s}"), st.just("victim")),
                  min_size=1, max_size=5).map(lambda ids: (wire.encode(Abort(ids)), TAKEN))

messages = st.one_of(random_bytes, truncated(), malformed_body(), extra_frames(), bad_add(), duplicate_add(),
                     aborts, oversized())
batches = st.lists(messages, min_size=8, max_size=12)


class Dealer:
    def __init__(self, ctx: zmq.Context, endpoint: str, name: str):
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, name.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(endpoint)
        self.loads: list[wire.EngineStats] = []
        self.errors: list[RequestError] = []
        self.ids: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    def send(self, msg) -> None:
        self.socket.send_multipart(wire.encode(msg))

    def drain(self, timeout_s: float = 0.0) -> None:
        """Read what has arrived, waiting at most timeout_s for the first message."""
        while self.socket.poll(timeout_s * 1e3):
            timeout_s = 0.0
            msg = wire.decode(self.socket.recv_multipart())
            if isinstance(msg, Load):
                self.loads.append(msg.stats)
            elif isinstance(msg, RequestError):
                self.errors.append(msg)
            elif isinstance(msg, Outputs):
                self.loads.append(msg.stats)
                for out in msg.outputs:
                    ids = self.ids.setdefault(out.request_id, [])
                    assert out.token_index == len(ids)
                    ids += out.token_ids
                    if out.finish:
                        self.finished.add(out.request_id)

    def wait(self, condition, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s * TIME_FACTOR
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.drain(0.05)


def greedy_request(rid: str) -> AddRequest:
    return AddRequest(rid, GREEDY["prompt_ids"], SamplingParams(temperature=0), 0, 16, 2)


def test_no_frame_kills_a_worker_and_each_is_counted(tmp_path, model_path):
    endpoint = f"ipc://{tmp_path}/w.sock"
    worker = Proc(["worker", "--kind", "cpu", "--threads", "1", "--endpoint", endpoint, "--max-num-seqs", "8"],
                  tmp_path / "worker.log")
    ctx = zmq.Context()
    try:
        worker.wait_for(r"hybridgate worker: READY \(", timeout=180)
        fuzzer, victim = Dealer(ctx, endpoint, "fuzzer"), Dealer(ctx, endpoint, "victim-router")
        for d in (fuzzer, victim):
            d.send(Connect(d.socket.getsockopt(zmq.IDENTITY).decode()))
        fuzzer.wait(lambda: fuzzer.loads, "a heartbeat")
        # A request that runs through the whole fuzz (its duplicates are refused), and another
        # router's request that the fuzzer tries to abort (it must not be able to).
        fuzzer.send(add(LIVE_ID, GREEDY["prompt_ids"][:12], 4000, ignore_eos=True))
        victim.send(greedy_request("victim"))
        sent = {REFUSED: 0, ANSWERED: 0, TAKEN: 0}

        @settings(max_examples=260, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(batches)
        @example([([b"X", b"\xc1"], REFUSED)])  # the ABORT whose body is not msgpack (issue 9)
        def fuzz(batch):
            for frames, expect in batch:
                fuzzer.socket.send_multipart(frames)
                sent[expect] += 1
            fuzzer.drain()

        fuzz()
        cases = sum(sent.values())
        print(f"fuzz: {cases} messages sent ({sent[REFUSED]} to refuse, {sent[ANSWERED]} to refuse with an "
              f"answer, {sent[TAKEN]} to take)")
        assert cases >= MIN_CASES and sent[REFUSED] > 1000 and sent[ANSWERED] > 100

        refused = sent[REFUSED] + sent[ANSWERED]
        fuzzer.wait(lambda: fuzzer.loads[-1].wire_decode_errors >= refused, f"{refused} refusals counted")
        beats = len(fuzzer.loads)
        fuzzer.wait(lambda: len(fuzzer.loads) >= beats + 3, "heartbeats after the fuzz")
        assert fuzzer.loads[-1].wire_decode_errors == refused
        assert sorted(e.code for e in fuzzer.errors) == ["invalid_request"] * sent[ANSWERED]
        assert worker.popen.poll() is None

        victim.wait(lambda: "victim" in victim.finished, "the other router's request")
        assert victim.ids["victim"] == GREEDY["ids"] and not victim.errors
        fuzzer.send(Abort([LIVE_ID]))
        after = Dealer(ctx, endpoint, "after-router")
        after.send(greedy_request("after"))
        after.wait(lambda: "after" in after.finished, "a request after the fuzz")
        assert after.ids["after"] == GREEDY["ids"] and not after.errors
        assert worker.popen.poll() is None and "Traceback" not in worker.text()
    finally:
        ctx.destroy(0)
        assert worker.stop() == 0, worker.text()[-3000:]
