"""Wire messages: typed round trips of all 19 types (a property test), type byte first, nothing pickled,
bad input rejected."""

from __future__ import annotations

import types
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _strategy(tp) -> st.SearchStrategy:
    """Values of the annotation `tp` that msgpack carries exactly: ints in its int64/uint64 range,
    floats without NaN (which equals nothing), Structs built field by field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{f: _strategy(hints[f]) for f in tp.__struct_fields__})
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_strategy(a) for a in args])
    if origin is tuple and Ellipsis not in args:  # a fixed-length tuple, e.g. tuple[int, int]
        return st.tuples(*(_strategy(a) for a in args))
    if origin in (list, tuple):
        return st.lists(_strategy(args[0]), max_size=4).map(origin)
    if origin is dict:
        return st.dictionaries(_strategy(args[0]), _strategy(args[1]), max_size=4)
    return {int: st.integers(-(2**63), 2**64 - 1), float: st.floats(allow_nan=False), str: st.text(max_size=8),
            bool: st.booleans(), type(None): st.none(), bytes: st.binary(max_size=8)}[tp]


ALL_TYPES = sorted(wire.MESSAGE_TYPES.items(), key=lambda kv: kv[0].value)


def test_every_message_type_is_covered_once():
    assert len(ALL_TYPES) == len(MsgType) == 19
    assert len({cls for _, cls in ALL_TYPES}) == 19


@pytest.mark.parametrize(("kind", "cls"), ALL_TYPES, ids=[cls.__name__ for _, cls in ALL_TYPES])
@settings(max_examples=40)
@given(data=st.data())
def test_every_message_type_round_trips(kind, cls, data):
    msg = data.draw(_strategy(cls))
    frames = wire.encode(msg)
    assert frames[0] == kind.value
    back = wire.decode(frames)
    assert type(back) is cls and back == msg
    # Decoded without our classes, the body is plain msgpack data (no pickle, no extension types).
    assert isinstance(msgspec.msgpack.decode(frames[1]), (dict, list))


@pytest.mark.parametrize("kind", list(MsgType), ids=[k.name for k in MsgType])
@settings(max_examples=40)
@given(body=st.binary(max_size=64))
def test_any_body_decodes_to_its_type_or_raises_value_error(kind, body):
    try:
        msg = wire.decode([kind.value, body])
    except ValueError:
        return
    assert type(msg) is wire.MESSAGE_TYPES[kind]


def test_the_per_step_structs_are_left_out_of_the_cycle_collector():
    """One SeqOutput is decoded and one Delta made per sequence and step: untracked (gc=False), decoded too."""
    import gc

    from hybridgate.router.deltas import Delta

    out = SeqOutput("r", 0, [5, 6], logprobs=[wire.TokenLogprobs(-0.5)])
    decoded = wire.decode(wire.encode(Outputs([out], EngineStats()))).outputs[0]
    assert decoded == out
    assert not gc.is_tracked(out) and not gc.is_tracked(decoded)
    assert not gc.is_tracked(Delta("r", 0, "a", [5]))
