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
class KVLayout:
    """A runner's KV cache as a hand-off sends it: the layers that own K/V (`ModelConfig.kv_layers`), in
    order (a layer sharing another's K/V is not sent: its source is), each one's (KV heads, head dim) per
    token, and the cache's element type (its name in `wire.HANDOFF_DTYPES`)."""

    layers: tuple[int, ...]  # model layer index of each sent layer
    shapes: tuple[tuple[int, int], ...]  # (KV heads, head dim) of each sent layer
    dtype: str

    @classmethod
    def of(cls, config, dtype: str) -> KVLayout:
        """The layout of a cache of `config` (a `ModelConfig`) holding `dtype` elements."""
        layers = config.kv_layers
        return cls(layers, tuple((config.layer_kv_heads[i], config.layer_head_dims[i]) for i in layers), dtype)

    @property
    def largest(self) -> tuple[int, int]:
        """(KV heads, head dim) of the sent layer with the most values per token."""
        return max(self.shapes, key=lambda s: s[0] * s[1])


@dataclass(frozen=True)
class KVSpec:
    """What a worker's KV cache holds: the header fields a hand-off must match (`wire.HandoffHeader`), and
    the model layer each sent layer is. layer_shapes (): every sent layer is `[num_kv_heads, head_dim]`
    (a model whose owning layers share one shape); layers (): sent layer j is model layer j."""

    fingerprint: str
    block_size: int
    num_layers: int  # layers sent: those that own K/V
    num_kv_heads: int  # 0 where layer_shapes gives them
    head_dim: int
    dtype: str = "float32"
    layer_shapes: tuple[tuple[int, int], ...] = ()
    layers: tuple[int, ...] = ()

    @classmethod
    def of(cls, fingerprint: str, block_size: int, layout: KVLayout) -> KVSpec:
        """The spec of a cache of `layout`: one shape in the header where every sent layer has it."""
        if len(set(layout.shapes)) == 1:
            (heads, dim), = set(layout.shapes)
            return cls(fingerprint, block_size, len(layout.layers), heads, dim, layout.dtype, (), layout.layers)
        return cls(fingerprint, block_size, len(layout.layers), 0, 0, layout.dtype, layout.shapes, layout.layers)

    def shape(self, j: int) -> tuple[int, int]:
        """(KV heads, head dim) of sent layer j."""
        return self.layer_shapes[j] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    def model_layer(self, j: int) -> int:
        """The model layer that sent layer j is."""
        return self.layers[j] if self.layers else j

    def frame_bytes(self, num_tokens: int, dtype: str | None = None, layer: int = 0) -> int:
        """Bytes of sent layer `layer`'s K or V frame `[num_tokens, kv_heads, head_dim]`."""
        heads, dim = self.shape(layer)
        return num_tokens * heads * dim * _ITEMSIZE[dtype or self.dtype]


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
    for name in ("fingerprint", "block_size", "num_layers", "num_kv_heads", "head_dim", "layer_shapes"):
        got, want = getattr(header, name), getattr(spec, name)
        if name == "layer_shapes":
            got = tuple(map(tuple, got))
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


def frames_to_float32(frames: list, header: HandoffHeader, spec: KVSpec, first_layer: int = 0) -> list[np.ndarray]:
    """float32 `[num_tokens, kv_heads, head_dim]` of each frame (bf16 and fp16 converted): K then V of
    each sent layer from `first_layer` on, each in that layer's shape (`spec.shape`).

    Raises:
        HandoffRefusal("frames", ...): a frame's size is not num_tokens x its layer's kv_heads x head_dim
        of dtype.
    """
    out = []
    for i, frame in enumerate(frames):
        layer = first_layer + i // 2
        want = spec.frame_bytes(header.num_tokens, header.dtype, layer)
        mv = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
        if mv.nbytes != want:
            raise HandoffRefusal("frames", f"frame {i} has {mv.nbytes} bytes, {header.num_tokens} tokens of "
                                 f"{header.dtype} make {want} (sent layer {layer}: {spec.shape(layer)})")
        if header.dtype == "float32":
            arr = np.frombuffer(mv, dtype="<f4")
        elif header.dtype == "float16":
            arr = np.frombuffer(mv, dtype="<f2").astype(np.float32)
        else:  # bfloat16: the high half of a float32
            arr = (np.frombuffer(mv, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        out.append(arr.reshape(header.num_tokens, *spec.shape(layer)))
    return out
