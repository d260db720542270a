"""Read a GGUF model file: its `ModelConfig` and a table of tensor views.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Parsing is
done by the `gguf` package (`GGUFReader`, a memory map); nothing here copies
tensor bytes. GGUFReader builds a field object per token string (about 4 s
for the default model's 98,000 vocabulary and merge strings), so what it parsed
(metadata, tensor types, shapes and offsets) is kept as JSON in a header cache,
keyed by the file's path, size and mtime; later loads read that and map the
tensor bytes with numpy (about 0.2 s).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np

from hybridgate.config import environment
from hybridgate.models.architectures import ARCHITECTURES, REFUSED_ARCHITECTURES, Architecture, RopeLayout
from hybridgate.models.gguf_metadata import ModelLoadError, read_header
from hybridgate.models.layer_layout import check_tensors, expected_tensors, layer_fields, refuse_layout

__all__ = ["GGUFModel", "ModelConfig", "ModelLoadError", "TensorView", "expected_tensors", "load_gguf"]

log = logging.getLogger("hybridgate.models")

HEADER_CACHE_FORMAT = 2

# Tensor types the project's runners can read; any other fails at load.
SUPPORTED_TENSOR_TYPES = frozenset(
    gguf.GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# rope.scaling.type values served; llama.cpp writes "linear" (position / factor), "yarn", "longrope".
SUPPORTED_ROPE_SCALING = ("none", "linear", "yarn")


_POSITIVE_FIELDS = (
    "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
    "head_dim", "max_model_len", "rope_theta", "rms_norm_eps", "vocab_size",
)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only model, read from GGUF metadata.

    `arch` is the family's row (`hybridgate.models.architectures`); the fields
    after it are derived from the row and the file, per layer where they vary
    (tuples indexed by layer), so runners read data and never a family's name.
    Attention widths: Q is `num_heads * head_dim`, K and V `num_kv_heads *
    head_dim` each; `hidden_size` may differ from `num_heads * head_dim`
    (qwen3, gemma).
    """

    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # key_length = value_length
    max_model_len: int
    rope_theta: float  # the file's rope.freq_base (global layers)
    rms_norm_eps: float
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    tie_word_embeddings: bool
    arch: Architecture = ARCHITECTURES["llama"]
    attention_scale: float = 0.0  # multiplies Q.K; 0 means 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) after scaling; 0: none
    final_softcap: float = 0.0  # the same on the final logits; 0: none
    embedding_scale: float = 1.0  # token embeddings are multiplied by it (gemma: sqrt(hidden))
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = full causal attention
    layer_rope_theta: tuple[float, ...] = ()  # per layer: RoPE base
    layer_rope_scale: tuple[float, ...] = ()  # per layer: position multiplier (linear scaling: 1/factor)
    rope_freq_factors: tuple[float, ...] = ()  # [head_dim / 2] divisors of RoPE frequencies; () = none
    rope_attn_factor: float = 1.0  # cos and sin multiplied by it (LongRoPE's attention factor)
    # per layer, per query head: a logit in each softmax's denominator (`attn_sinks`, gpt-oss); () = none
    attention_sinks: tuple[tuple[float, ...], ...] = ()
    num_experts: int = 0  # experts per block (`arch.moe`); 0: a dense FFN
    experts_per_token: int = 0  # experts chosen for each token (expert_used_count)
    expert_intermediate_size: int = 0  # each expert's FFN width (expert_feed_forward_length)
    shared_expert_intermediate_size: int = 0  # the shared expert's FFN width; 0: none
    expert_weight_scale: float = 1.0  # the chosen experts' weights times this
    # `<arch>.pooling_type` (llama.cpp's numbers, `hybridgate.wire.PoolingType`): how an embedding model pools
    # its final hidden states; 0 (none) when absent, as in generation models.
    pooling_type: int = 0
    # Per layer where the file varies them (gemma4), else the scalars above for every layer:
    layer_head_dims: tuple[int, ...] = ()  # key = value head size (gemma4's sliding layers: key_length_swa)
    layer_kv_heads: tuple[int, ...] = ()  # KV heads (`attention.head_count_kv` as an array)
    # the layer whose K/V each layer attends over: itself, or the earlier layer it shares them with
    # (`attention.shared_kv_layers`); only a layer that is its own source has K/V weights and a KV cache
    layer_kv_source: tuple[int, ...] = ()
    layer_intermediate_sizes: tuple[int, ...] = ()  # dense FFN width (`feed_forward_length` as an array)
    layer_output_scales: tuple[float, ...] = ()  # the block's output times this (`layer_output_scale`)
    layer_rope_factors: tuple[bool, ...] = ()  # whether `rope_freq_factors` divide the layer's frequencies
    layer_qkv: tuple[tuple[str, ...], ...] = ()  # GGUF tensors whose rows make the layer's Q | K | V

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}"
            )
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ModelLoadError(f"model config: {name} {getattr(self, name)} outside vocab of {self.vocab_size}")
        defaults = {"layer_windows": 0, "layer_rope_theta": self.rope_theta, "layer_rope_scale": 1.0,
                    "layer_head_dims": self.head_dim, "layer_kv_heads": self.num_kv_heads,
                    "layer_kv_source": None, "layer_intermediate_sizes": self.intermediate_size,
                    "layer_output_scales": 1.0, "layer_rope_factors": True, "layer_qkv": self.arch.qkv_tensors}
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, tuple(range(self.num_layers)) if value is None else
                                   (value,) * self.num_layers)
            if len(getattr(self, name)) != self.num_layers:
                raise ModelLoadError(f"model config: {name} has {len(getattr(self, name))} entries, "
                                     f"expected block_count {self.num_layers}")
        if not self.attention_scale:
            object.__setattr__(self, "attention_scale", self.head_dim ** -0.5)
        if self.moe is not None and not 0 < self.experts_per_token <= self.num_experts:
            raise ModelLoadError(f"model config: expert_used_count {self.experts_per_token} must be in "
                                 f"1..expert_count {self.num_experts}")
        if self.attention_sinks and {len(s) for s in self.attention_sinks} != {self.num_heads} or \
                len(self.attention_sinks) not in (0, self.num_layers):
            raise ModelLoadError(f"model config: attention_sinks must be block_count {self.num_layers} rows of "
                                 f"head_count {self.num_heads}")
        if self.rope_freq_factors and {d for d, f in zip(self.layer_head_dims, self.layer_rope_factors) if f} - \
                {self.head_dim}:
            raise ModelLoadError(f"model config: RoPE frequency factors of head_dim {self.head_dim} on layers of "
                                 f"head sizes {sorted(set(self.layer_head_dims))}")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelLoadError(f"model config: {len(self.rope_freq_factors)} RoPE frequency factors, "
                                 f"expected head_dim / 2 = {self.head_dim // 2}")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def moe(self):
        """The row's `MixtureOfExperts` where this file has experts; None: every FFN is dense."""
        return self.arch.moe if self.arch.moe is not None and (self.num_experts or not self.arch.moe.optional) \
            else None

    @property
    def layer_rope(self) -> tuple[tuple[float, float, int, bool], ...]:
        """Per layer, the key of its cos/sin table: (RoPE base, position scale, head size, whether
        `rope_freq_factors` divide its frequencies)."""
        factors = [f and bool(self.rope_freq_factors) for f in self.layer_rope_factors]
        return tuple(zip(self.layer_rope_theta, self.layer_rope_scale, self.layer_head_dims, factors))

    def owns_kv(self, layer: int) -> bool:
        """Whether `layer` computes and caches its own K/V (else it reads `layer_kv_source[layer]`'s)."""
        return self.layer_kv_source[layer] == layer

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that own a KV cache, in order."""
        return tuple(i for i in range(self.num_layers) if self.owns_kv(i))

    def per_layer_kv(self, make) -> list:
        """One object per layer: `make(layer)` for each layer that owns K/V (`kv_layers`), in order; a layer
        that shares another's gets that layer's object, so nothing is made for it and what its source stores
        is what it reads (both runners' KV caches)."""
        own = {i: make(i) for i in self.kv_layers}
        return [own[j] for j in self.layer_kv_source]

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token adds to the cache, over the layers that own one."""
        return sum(2 * self.layer_kv_heads[i] * self.layer_head_dims[i] for i in self.kv_layers)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_layout(self) -> RopeLayout:
        return self.arch.rope_layout


@dataclass(frozen=True)
class TensorView:
    """One tensor of the file, as a view on the memory map (no copy).

    `shape` is row-major (outermost first; GGUF lists dims innermost first), so a
    weight matrix is `[rows, cols]` = `[out_features, in_features]`. `data` is the
    raw bytes, uint8 `[rows, bytes_per_row]` (a 1-D tensor has one row).
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape`, by gguf's reference dequantizer (a copy)."""
        if self.ggml_type == gguf.GGMLQuantizationType.F32:
            return np.array(self.data.view(np.float32).reshape(self.shape))  # a plain ndarray, not a memmap
        # a plain ndarray view: gguf splits the rows into groups of 16, and a memmap's groups each pay numpy's
        # memmap bookkeeping
        values = gguf.quants.dequantize(np.asarray(self.data), self.ggml_type)
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


@dataclass(frozen=True)
class GGUFModel:
    """A loaded GGUF file: path, config, raw metadata and tensor views."""

    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, TensorView]
    mapping: np.ndarray = dataclasses.field(repr=False)  # uint8 memory map of the whole file


def _check_types(infos) -> None:
    """Name the first tensor whose GGML type no runner reads (unknown types are refused by the reader)."""
    for name, kind, *_ in infos:
        if gguf.GGMLQuantizationType(kind) not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ModelLoadError(f"tensor {name!r}: unsupported GGUF tensor type "
                                 f"{gguf.GGMLQuantizationType(kind).name} (supported: {supported})")


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
    return meta[key]


def _config(meta: dict[str, Any], tensors: dict[str, TensorView]) -> ModelConfig:
    arch = _require(meta, "general.architecture")
    row = ARCHITECTURES.get(arch)
    if arch in REFUSED_ARCHITECTURES:
        raise ModelLoadError(f"general.architecture {arch!r} is not supported: {REFUSED_ARCHITECTURES[arch]}")
    if row is None:
        raise ModelLoadError(f"general.architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    key = lambda name: _require(meta, f"{arch}.{name}")  # noqa: E731
    opt = lambda name, default: meta.get(f"{arch}.{name}", default)  # noqa: E731
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(opt("attention.key_length", hidden // heads))
    if int(opt("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF metadata {arch}.attention.value_length={opt('attention.value_length', 0)} "
                             f"differs from key_length {head_dim} (not supported)")
    rope_dim = int(opt("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"GGUF metadata {arch}.rope.dimension_count={rope_dim} (partial RoPE) is not supported")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("tensor 'token_embd.weight' is missing")
    layers = int(key("block_count"))
    refuse_layout(row, meta)
    key("feed_forward_length")
    windows = _layer_values(row, meta, layers)
    shapes = layer_fields(row, meta, tensors, layers, head_dim, windows["layer_windows"])
    factors, context, attn_factor = _rope_factors(row, meta, tensors, int(key("context_length")), head_dim)
    hidden_scaled = layers in row.hidden_scale_block_counts
    caps = {name: float(opt(name, default)) for name, default in
            (("attn_logit_softcapping", row.attn_softcap), ("final_logit_softcapping", row.final_softcap))
            if name in row.softcap_keys or default}
    return ModelConfig(
        architecture=arch,
        name=str(meta.get("general.name", "")),
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=shapes.pop("intermediate_size"),
        num_heads=heads,
        num_kv_heads=shapes.pop("num_kv_heads"),
        head_dim=head_dim,
        max_model_len=context,
        rope_theta=float(opt("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        vocab_size=int(opt("vocab_size", tensors["token_embd.weight"].shape[0])),
        bos_token_id=int(_require(meta, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_require(meta, "tokenizer.ggml.eos_token_id")),
        tie_word_embeddings="output.weight" not in tensors,
        arch=row,
        attention_scale=row.attention_scale or float(hidden // heads if hidden_scaled else head_dim) ** -0.5,
        attn_softcap=caps.get("attn_logit_softcapping", 0.0),
        final_softcap=caps.get("final_logit_softcapping", 0.0),
        embedding_scale=float(np.sqrt(np.float32(hidden))) if row.scale_embeddings else 1.0,
        **windows,
        **shapes,
        rope_freq_factors=factors,
        rope_attn_factor=attn_factor,
        attention_sinks=tuple(tuple(float(v) for v in tensors[f"blk.{i}.attn_sinks.weight"].dequantize().reshape(-1))
                              for i in range(layers) if row.attn_sinks and f"blk.{i}.attn_sinks.weight" in tensors),
        **_expert_values(row, meta),
        pooling_type=int(opt("pooling_type", 0)),
    )


def _expert_values(row: Architecture, meta: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` from `{arch}.expert_*` metadata (none for a dense row, or a
    file without experts of a row whose experts are optional)."""
    if row.moe is None or row.moe.optional and f"{row.name}.expert_count" not in meta:
        return {}
    key = lambda name: int(_require(meta, f"{row.name}.{name}"))  # noqa: E731
    return {
        "num_experts": key("expert_count"),
        "experts_per_token": key("expert_used_count"),
        "expert_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length") if row.moe.shared_expert else 0,
        "expert_weight_scale": float(meta.get(f"{row.name}.expert_weights_scale", row.moe.weight_scale)),
    }


def _layer_values(row: Architecture, meta: dict[str, Any], layers: int) -> dict[str, tuple]:
    """Per-layer window, RoPE base and RoPE position scale (llama.cpp's swa pattern and swa RoPE)."""
    arch = row.name
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none") or "none"
    if scaling not in SUPPORTED_ROPE_SCALING:
        raise ModelLoadError(f"GGUF metadata {arch}.rope.scaling.type={scaling!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})")
    scale = 1.0 / float(_require(meta, f"{arch}.rope.scaling.factor")) if scaling == "linear" else 1.0  # yarn: factors
    window = int(meta.get(f"{arch}.attention.sliding_window", row.default_window)) if row.swa_pattern else 0
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", row.swa_pattern)  # newer files: int or per layer
    slides = [bool(pattern[i]) for i in range(layers)] if isinstance(pattern, list) else \
        [dataclasses.replace(row, swa_pattern=int(pattern)).is_sliding(i) for i in range(layers)]
    sliding = [window > 0 and s for s in slides]
    swa_theta = float(meta.get(f"{arch}.rope.freq_base_swa", row.swa_rope_theta))
    local = (swa_theta, 1.0) if swa_theta else (theta, scale)
    return {
        "layer_windows": tuple(window if s else 0 for s in sliding),
        "layer_rope_theta": tuple(local[0] if s else theta for s in sliding),
        "layer_rope_scale": tuple(local[1] if s else scale for s in sliding),
    }


def _rope_factors(row: Architecture, meta: dict[str, Any], tensors: dict[str, TensorView],
                  context: int, head_dim: int) -> tuple[tuple[float, ...], int, float]:
    """(RoPE frequency divisors, served context, cos/sin factor).

    Llama 3's `rope_freqs.weight` (its converter's llama3 scaling, applied as
    llama.cpp's `freq_factors`). Phi-3 LongRoPE: served up to
    `rope.scaling.original_context_length` with `rope_factors_short` (the
    factors llama.cpp and transformers use at that length) and the file's
    `rope.scaling.attn_factor`. YaRN (`rope.scaling.type` yarn): `_yarn_factors`.
    """
    arch = row.name
    name, attn_factor = "rope_freqs.weight", 1.0
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        return _yarn_factors(row, meta, head_dim), context, _yarn_attention_factor(row, meta)
    if row.long_rope and "rope_factors_short.weight" in tensors:
        name = "rope_factors_short.weight"
        original = int(_require(meta, f"{arch}.rope.scaling.original_context_length"))
        if original < context:
            log.info("%s: LongRoPE file served up to its original context %d (of %d)", arch, original, context)
        context = min(context, original)
        attn_factor = float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0))
    if name not in tensors:
        return (), context, attn_factor
    return tuple(float(f) for f in tensors[name].dequantize().reshape(-1)), context, attn_factor


def _yarn_factors(row: Architecture, meta: dict[str, Any], d: int) -> tuple[float, ...]:
    """YaRN (Peng et al. 2023) as RoPE frequency divisors `[d / 2]`, as transformers computes it
    (`_compute_yarn_parameters`): dimension pair i keeps its frequency below the correction range and is divided
    by `factor` above it, linearly between (the range from `yarn_beta_fast` 32 and `yarn_beta_slow` 1 rotations
    over the original context, floored and ceiled where the row says `yarn_truncate`, as llama.cpp always
    does). Raises ModelLoadError for a missing factor or original context length."""
    arch = row.name
    factor = float(_require(meta, f"{arch}.rope.scaling.factor"))
    original = int(_require(meta, f"{arch}.rope.scaling.original_context_length"))
    base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    fast, slow = (float(meta.get(f"{arch}.rope.scaling.yarn_beta_{n}", v)) for n, v in (("fast", 32.0), ("slow", 1.0)))
    dim = lambda rotations: d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = dim(fast), dim(slow)
    if row.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramps = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(d // 2)]  # 0: extrapolate, 1: interpolate
    return tuple(1.0 / (r / factor + 1.0 - r) for r in ramps)


def _yarn_attention_factor(row: Architecture, meta: dict[str, Any]) -> float:
    """YaRN's cos/sin factor 0.1 ln(factor) + 1 (transformers' `yarn_get_mscale`; 1 for factor <= 1)."""
    factor = float(_require(meta, f"{row.name}.rope.scaling.factor"))
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def header_cache_dir() -> Path:
    """$HYBRIDGATE_CACHE_DIR/gguf, default ~/.cache/hybridgate/gguf."""
    root = environment("HYBRIDGATE_CACHE_DIR") or Path.home() / ".cache" / "hybridgate"
    return Path(root) / "gguf"


def _header_cache_path(path: Path) -> Path:
    from importlib.metadata import version

    st = path.stat()
    key = f"{HEADER_CACHE_FORMAT}:{version('gguf')}:{path.resolve()}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    return header_cache_dir() / (hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + ".json")


def _read_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, list[int], int, int]], np.ndarray]:
    """(metadata, [(name, type, shape, offset, bytes)], memory map), from the cache or GGUFReader."""
    cache = _header_cache_path(path)
    try:
        metadata, infos = msgspec.json.decode(cache.read_bytes())
        return metadata, [tuple(i) for i in infos], np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, msgspec.DecodeError, ValueError, TypeError):
        pass
    metadata, infos = read_header(path)
    _check_types(infos)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode([metadata, infos]))
        tmp.replace(cache)
    except OSError as exc:  # a read-only home works, only slower
        log.debug("GGUF header cache not written: %s", exc)
    return metadata, infos, np.memmap(path, dtype=np.uint8, mode="r")


def _tensor_views(infos, mapping: np.ndarray) -> dict[str, TensorView]:
    views = {}
    for name, kind, shape, offset, nbytes in infos:
        if offset + nbytes > mapping.shape[0]:
            raise ModelLoadError(f"the file is truncated: tensor {name!r} ends at byte {offset + nbytes:,}, "
                                 f"the file has {mapping.shape[0]:,} (an incomplete download or copy?)")
        shape = tuple(shape)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        views[name] = TensorView(name, gguf.GGMLQuantizationType(kind), shape,
                                 mapping[offset : offset + nbytes].reshape(rows, -1))
    return views


def load_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file: validated `ModelConfig`, metadata and tensor views.

    Raises:
        ModelLoadError: the file is missing or not GGUF; a metadata key is
            missing or unsupported (named); a tensor has an unknown or
            unsupported type, or a wrong shape (named).
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a GGUF file" if path.is_dir() else "does not exist"
        raise ModelLoadError(f"model file {str(path)!r} {what}")
    metadata, infos, mapping = _read_header(path)
    tensors = _tensor_views(infos, mapping)
    config = _config(metadata, tensors)
    check_tensors(config, tensors)
    return GGUFModel(path=path, config=config, metadata=metadata, tensors=tensors, mapping=mapping)
