"""The receiving worker's checks of a KV hand-off: its header against this worker's KV cache and an ADD's
limits, and its K and V frames' sizes (converted to float32). `hybridgate.workers.handoff` uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from hybridgate.wire import HANDOFF_DTYPES, ROPE_BASIS, AddRequest, HandoffHeader, HandoffPart, InvalidFieldError
from hybridgate.workers.guard import check_add

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_HEADER_DECODER = msgspec.msgpack.Decoder(HandoffHeader)
_PART_DECODER = msgspec.msgpack.Decoder(HandoffPart)


def decode_header(body) -> HandoffHeader:
    """Raises HandoffRefusal("header", ...) on a body that is not a header."""
    try:
        return _HEADER_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise HandoffRefusal("header", f"not a hand-off header: {exc}") from None


def decode_part(body) -> HandoffPart:
    try:
        return _PART_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise HandoffRefusal("part", f"not a hand-off part: {exc}") from None


class HandoffRefusal(ValueError):
    """A hand-off that does not fit this worker; `field` names what did not match."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class KVSpec:
    """What a worker's KV cache holds: the header fields a hand-off must match."""

    fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def frame_bytes(self, num_tokens: int, dtype: str | None = None) -> int:
        """Bytes of one K or V frame `[num_tokens, kv_heads, head_dim]`."""
        return num_tokens * self.num_kv_heads * self.head_dim * _ITEMSIZE[dtype or self.dtype]


def imported_request(header: HandoffHeader) -> AddRequest:
    """The request a hand-off carries, as the ADD that would have started it on this worker."""
    return AddRequest(header.request_id, list(header.prompt_ids), header.params, header.seed, header.max_tokens,
                      header.eos_token_id, first_token_index=header.next_token_index - len(header.output_ids))


def check_header(header: HandoffHeader, spec: KVSpec, max_model_len: int, vocab_size: int) -> None:
    """Raise HandoffRefusal naming the first field of `header` that does not match `spec`, or that
    an ADD could not carry: the request goes through the ADD guard (`workers.guard.check_add`: ids
    in the vocabulary, sampling fields, seed, lengths), and its output ids must be in the vocabulary.

    The receiver's own dtype does not matter: any of HANDOFF_DTYPES converts.
    """
    for name in ("fingerprint", "block_size", "num_layers", "num_kv_heads", "head_dim"):
        got, want = getattr(header, name), getattr(spec, name)
        if got != want:
            raise HandoffRefusal(name, f"the hand-off has {got!r}, this worker {want!r}")
    if header.dtype not in HANDOFF_DTYPES:
        raise HandoffRefusal("dtype", f"the hand-off has {header.dtype!r}, this worker takes one of {HANDOFF_DTYPES}")
    if header.rope_basis != ROPE_BASIS:
        raise HandoffRefusal("rope_basis", f"the hand-off has {header.rope_basis!r}, this worker {ROPE_BASIS!r}")
    expect = len(header.prompt_ids) + len(header.output_ids) - 1
    if header.num_tokens != expect or header.num_tokens < 1:
        raise HandoffRefusal("num_tokens", f"the hand-off has {header.num_tokens}, its ids make {expect} "
                             "(prompt + output - 1, at least 1)")
    if not header.output_ids or len(header.output_ids) >= header.max_tokens:
        raise HandoffRefusal("output_ids", f"{len(header.output_ids)} ids: need at least 1 and fewer than "
                             f"max_tokens {header.max_tokens}")
    if header.next_token_index < len(header.output_ids):
        raise HandoffRefusal("next_token_index", f"{header.next_token_index} is below its {len(header.output_ids)} "
                             "output ids")
    if header.num_tokens + 1 > max_model_len:
        raise HandoffRefusal("num_tokens", f"{header.num_tokens} + 1 exceeds this worker's max model length "
                             f"{max_model_len}")
    try:
        check_add(imported_request(header), vocab_size, max_model_len)
    except InvalidFieldError as exc:
        raise HandoffRefusal(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    bad = [t for t in header.output_ids if not 0 <= t < vocab_size]
    if bad:
        raise HandoffRefusal("output_ids", f"every id must be in [0, {vocab_size}), got {bad[0]}")


def frames_to_float32(frames: list, header: HandoffHeader, spec: KVSpec) -> list[np.ndarray]:
    """float32 `[num_tokens, kv_heads, head_dim]` of each frame (bf16 and fp16 converted).

    Raises:
        HandoffRefusal("frames", ...): a frame's size is not num_tokens x kv_heads x head_dim of dtype.
    """
    want = spec.frame_bytes(header.num_tokens, header.dtype)
    shape = (header.num_tokens, spec.num_kv_heads, spec.head_dim)
    out = []
    for i, frame in enumerate(frames):
        mv = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
        if mv.nbytes != want:
            raise HandoffRefusal("frames", f"frame {i} has {mv.nbytes} bytes, {header.num_tokens} tokens of "
                                 f"{header.dtype} make {want}")
        if header.dtype == "float32":
            arr = np.frombuffer(mv, dtype="<f4")
        elif header.dtype == "float16":
            arr = np.frombuffer(mv, dtype="<f2").astype(np.float32)
        else:  # bfloat16: the high half of a float32
            arr = (np.frombuffer(mv, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        out.append(arr.reshape(shape))
    return out
