"""Read a Llama-architecture GGUF file: its `ModelConfig` and a table of tensor views.

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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np

from hybridgate.config import environment

log = logging.getLogger("hybridgate.models")

HEADER_CACHE_FORMAT = 1

# Tensor types the project's runners can read; any other fails at load.
SUPPORTED_TENSOR_TYPES = frozenset(
    gguf.GGMLQuantizationType[name]
    for name in ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")
)
SUPPORTED_ARCHITECTURES = ("llama",)


_POSITIVE_FIELDS = (
    "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
    "head_dim", "max_model_len", "rope_theta", "rms_norm_eps", "vocab_size",
)


class ModelLoadError(ValueError):
    """A model file is missing, malformed, or uses something this project does not support."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-architecture model, read from GGUF metadata."""

    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.hidden_size != self.num_heads * self.head_dim:
            raise ModelLoadError(
                f"model config: embedding_length {self.hidden_size} != head_count {self.num_heads}"
                f" x head dim {self.head_dim}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}"
            )
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ModelLoadError(f"model config: {name} {getattr(self, name)} outside vocab of {self.vocab_size}")


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
        values = gguf.quants.dequantize(self.data, self.ggml_type)
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


@dataclass(frozen=True)
class GGUFModel:
    """A loaded GGUF file: path, config, raw metadata and tensor views."""

    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, TensorView]
    mapping: np.ndarray = dataclasses.field(repr=False)  # uint8 memory map of the whole file


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that names the tensor when its type is unknown or unsupported."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            name = bytes(field.parts[1]).decode("utf-8", "replace")
            raw = int(field.parts[4][0])
            try:
                kind = gguf.GGMLQuantizationType(raw)
            except ValueError:
                raise ModelLoadError(f"tensor {name!r}: unknown GGUF tensor type {raw}") from None
            if kind not in SUPPORTED_TENSOR_TYPES:
                supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
                raise ModelLoadError(
                    f"tensor {name!r}: unsupported GGUF tensor type {kind.name} (supported: {supported})"
                )
        super()._build_tensors(start_offs, fields)


def _read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        out[key] = value
    return out


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
    return meta[key]


def _config(meta: dict[str, Any], tensors: dict[str, TensorView]) -> ModelConfig:
    arch = _require(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"general.architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
    key = lambda name: _require(meta, f"{arch}.{name}")  # noqa: E731
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelLoadError(f"GGUF metadata {arch}.rope.scaling.type={scaling!r} is not supported")
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"GGUF metadata {arch}.rope.dimension_count={rope_dim} (partial RoPE) is not supported")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("tensor 'token_embd.weight' is missing")
    vocab = int(meta.get(f"{arch}.vocab_size", tensors["token_embd.weight"].shape[0]))
    return ModelConfig(
        architecture=arch,
        name=str(meta.get("general.name", "")),
        num_layers=int(key("block_count")),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_model_len=int(key("context_length")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        vocab_size=vocab,
        bos_token_id=int(_require(meta, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_require(meta, "tokenizer.ggml.eos_token_id")),
        tie_word_embeddings="output.weight" not in tensors,
    )


def _check_tensors(config: ModelConfig, tensors: dict[str, TensorView]) -> None:
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    expected = {"token_embd.weight": (config.vocab_size, h), "output_norm.weight": (h,)}
    for i in range(config.num_layers):
        p = f"blk.{i}."
        expected |= {
            p + "attn_norm.weight": (h,),
            p + "attn_q.weight": (h, h),
            p + "attn_k.weight": (kv, h),
            p + "attn_v.weight": (kv, h),
            p + "attn_output.weight": (h, h),
            p + "ffn_norm.weight": (h,),
            p + "ffn_gate.weight": (config.intermediate_size, h),
            p + "ffn_up.weight": (config.intermediate_size, h),
            p + "ffn_down.weight": (h, config.intermediate_size),
        }
    if not config.tie_word_embeddings:
        expected["output.weight"] = (config.vocab_size, h)
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelLoadError(f"tensor {name!r} is missing")
        if tensors[name].shape != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {list(tensors[name].shape)}, expected {list(shape)}")


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
    try:
        reader = _CheckedReader(path, "r")
    except ModelLoadError:
        raise
    except (ValueError, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    metadata = _read_metadata(reader)
    infos = [(t.name, int(t.tensor_type), [int(d) for d in reversed(t.shape.tolist())], int(t.data_offset),
              int(t.n_bytes)) for t in reader.tensors]
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode([metadata, infos]))
        tmp.replace(cache)
    except OSError as exc:  # a read-only home works, only slower
        log.debug("GGUF header cache not written: %s", exc)
    return metadata, infos, reader.data


def _tensor_views(infos, mapping: np.ndarray) -> dict[str, TensorView]:
    views = {}
    for name, kind, shape, offset, nbytes in infos:
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
        raise ModelLoadError(f"model file {str(path)!r} does not exist")
    metadata, infos, mapping = _read_header(path)
    tensors = _tensor_views(infos, mapping)
    config = _config(metadata, tensors)
    _check_tensors(config, tensors)
    return GGUFModel(path=path, config=config, metadata=metadata, tensors=tensors, mapping=mapping)
