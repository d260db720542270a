"""The gRPC door's own encoding of a streamed response against protobuf's: the same bytes, and the same message
when parsed back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgate.gateway.convert import ResponseEncoder, delta_to_proto
from hybridgate.router.deltas import Delta, Timings, Usage
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.wire import FinishReason, TokenLogprobs

RID = "0123456789abcdef0123456789abcdef"

# Ids of every varint length protobuf writes for a uint32 (1 to 5 bytes), token indexes and texts on both
# sides of the 16 KiB that the encoder hands to protobuf.
ids = st.lists(st.one_of(st.integers(0, 300), st.integers(0, (1 << 32) - 1)), max_size=6)
texts = st.one_of(st.text(max_size=40), st.builds(lambda c, n: c * n, st.characters(), st.integers((1 << 14) - 5, (1 << 14) + 2)))
indexes = st.one_of(st.integers(0, 200), st.integers(0, (1 << 32) - 1))


@settings(max_examples=300, deadline=None)
@given(index=indexes, text=texts, token_ids=ids)
def test_a_plain_delta_encodes_to_protobufs_bytes(index, text, token_ids):
    delta = Delta(RID, index, text, token_ids)
    got = ResponseEncoder(RID).encode(delta)
    assert got == delta_to_proto(delta).SerializeToString()
    msg = pb.GenerateResponse.FromString(got)
    assert (msg.request_id, msg.token_index, msg.text, list(msg.token_ids)) == (RID, index, text, token_ids)


def test_one_id_of_each_varint_length_encodes_as_protobuf_does():
    encode = ResponseEncoder(RID).encode
    for token_id in (0, 1, 127, 128, 16383, 16384, (1 << 21) - 1, 1 << 21, (1 << 28) - 1, 1 << 28, (1 << 32) - 1):
        delta = Delta(RID, 5, " x", [token_id])
        assert encode(delta) == delta_to_proto(delta).SerializeToString(), token_id


def test_deltas_the_encoder_leaves_to_protobuf_come_out_as_protobufs():
    usage, timings = Usage(3, 4, 1), Timings(1.5, 2.5, 9.0)
    deltas = [Delta(RID, 3, "end", [2], FinishReason.LENGTH, usage, timings, route="cpu (cpu-0)"),
              Delta(RID, 3, "a", [2], logprobs=(TokenLogprobs(-0.25, [2, 5], [-0.25, -2.0]),)),
              Delta(RID, 3, "a", [2], reasoning="thinking"),
              Delta("another-request", 3, "a", [2]),  # not the call's request id
              Delta("", 3, "a", [2])]
    encoder = ResponseEncoder(RID)
    for delta in deltas:
        assert encoder.encode(delta) == delta_to_proto(delta).SerializeToString()
    calls_delta = deltas[0]
    assert pb.GenerateResponse.FromString(encoder.encode(calls_delta)).usage.completion_tokens == 4


def test_a_call_without_a_request_id_is_encoded_by_protobuf():
    delta = Delta("", 0, "a", [7])
    assert ResponseEncoder("").encode(delta) == delta_to_proto(delta).SerializeToString() == b"\x1a\x01a\x22\x01\x07"
