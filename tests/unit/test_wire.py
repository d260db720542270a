"""Wire messages: typed round trips, type byte first, nothing pickled, bad input rejected."""

from __future__ import annotations

import msgspec
import pytest

from hybridgate import wire
from hybridgate.wire import (
    Abort, AddRequest, Connect, EngineStats, Hello, Load, MsgType, Outputs, Ready, RequestError, SamplingParams,
    SeqOutput,
)

MESSAGES = [
    Connect("router-1"),
    Hello(kind="gpu", fingerprint="ab" * 32, max_num_seqs=64, max_model_len=8192, pid=42, ready=False),
    Ready("cpu"),
    AddRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=("x",), seed=2**64 - 1), 2**64 - 1, 17, 2),
    Abort(["r1", "r2"]),
    Outputs([SeqOutput("r1", 3, [5, 6], finish=3, queue_ms=1.5)], EngineStats(steps=4, batch_size_counts={1: 2, 8: 2})),
    Load(EngineStats(kv_cache_bytes=123)),
    RequestError("r1", "boom"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=[type(m).__name__ for m in MESSAGES])
def test_round_trip(msg):
    frames = wire.encode(msg)
    assert len(frames[0]) == 1 and MsgType(frames[0])
    assert wire.decode(frames) == msg
    # The body is msgpack, readable without our classes (no pickle opcodes).
    assert isinstance(msgspec.msgpack.decode(frames[1]), (dict, list))


def test_unknown_type_byte():
    with pytest.raises(ValueError, match="unknown message type"):
        wire.decode([b"Z", b"\x80"])


def test_body_of_the_wrong_type_is_rejected():
    with pytest.raises(ValueError, match="bad ABORT"):
        wire.decode([MsgType.ABORT.value, msgspec.msgpack.encode({"request_ids": "not-a-list"})])
    with pytest.raises(ValueError, match="bad ADD"):
        wire.decode([MsgType.ADD.value, wire.encode(Connect("x"))[1]])


def test_missing_body():
    with pytest.raises(ValueError, match="frames"):
        wire.decode([MsgType.READY.value])
