"""Random-weight GGUF files of a named shape (`shapes`) and quant mix (`mixes`), cached, that llama.cpp loads too.

`bench_model(shape, mix, seed)` returns the file's path, writing it on first use
under `$HYBRIDGATE_CACHE_DIR/bench-models` (default ~/.cache/hybridgate/bench-models),
named by shape, block count, mix, seed and this writer's format version.

What the file holds:
- the shape's hyperparameters in the architecture's GGUF keys, `general.file_type`
  the mix's llama ftype, and the tokenizer of llama.cpp's test vocabulary of the
  same family (`ggml-vocab-llama-bpe.gguf`, `ggml-vocab-qwen2.gguf`, from the
  llama-cpp-python 0.3.36 sdist), its token list padded to the shape's
  vocabulary size with `[PAD{i}]` tokens of type UNUSED as llama.cpp's converter
  pads (convert_hf_to_gguf.py `get_vocab_base`), so both llama.cpp and the
  runners here load it and its text tokenizes as the real model's does;
- every tensor in the type `mixes.assign` gives it (llama.cpp's own choice);
- block-quantized weights as random blocks: random bytes for the codes and
  sub-block scales, and the fp16 block scales (and mins) set so the dequantized
  weights (gguf's dequantizer) have mean about 0 and standard deviation
  `gain / sqrt(columns)` (gain 4 for the embedding and LM head, 2 for Q and K,
  1 otherwise: logits of a few units, no overflow through the blocks). A
  random-weight file measures speed, and two runners on the same file can be
  compared; its values need no quantizer, which for 1-8B parameters in numpy
  would take minutes (and gguf-py has none for K-quants). F16, BF16 and F32
  weights are normal with that deviation; norms 1 + N(0, 0.1); Q/K/V biases N(0, 0.5).
  Expert tensors are 3-D (`[experts, rows, columns]`, experts outermost, as the
  converter stacks them) with each expert's rows drawn like a matrix's; the router
  `ffn_gate_inp` is F32 (the converter's and llama.cpp's choice), so router logits
  have deviation about 1 and each token's choice of experts is spread over them.
- the mixture's keys (`{arch}.expert_count`, `expert_used_count`,
  `expert_feed_forward_length`) and, where the head size is not hidden / heads,
  `attention.key_length` and `value_length`.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np

from hybridgate.bench.mixes import Mix, assign
from hybridgate.bench.shapes import Shape

FORMAT = 1  # bump when the bytes written for a (shape, mix, seed) change
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
VOCAB_PREFIX = "vendor/llama.cpp/models/ggml-vocab-"
_T = gguf.GGMLQuantizationType
# Byte offsets of the fp16 block scale and min (None: the type has no min) in one block (ggml-common.h).
SCALE_AT = {_T.Q4_0: (0, None), _T.Q4_1: (0, 2), _T.Q5_0: (0, None), _T.Q5_1: (0, 2), _T.Q8_0: (0, None),
            _T.Q4_K: (0, 2), _T.Q5_K: (0, 2), _T.Q6_K: (208, None)}
GAINS = {"token_embd.weight": 4.0, "output.weight": 4.0, "attn_q.weight": 2.0, "attn_k.weight": 2.0}


def cache_root() -> Path:
    from hybridgate.config import environment

    return Path(environment("HYBRIDGATE_CACHE_DIR") or Path.home() / ".cache" / "hybridgate") / "bench-models"


def fetch_llama_vocab(folder: Path) -> Path:
    """`folder`, holding llama.cpp's `ggml-vocab-*` test files (with `.inp`/`.out`) taken from the
    llama-cpp-python 0.3.36 sdist (a 77 MB `pip download`, once). Raises RuntimeError with pip's
    message when the download fails."""
    if (folder / ".complete").exists():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp,
               LLAMA_CPP_SDIST]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode or not archives:
            raise RuntimeError(f"`{' '.join(cmd[2:])}` failed: {done.stderr.strip()[-500:]}")
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                _, _, inner = member.name.partition("/")
                if member.isfile() and inner.startswith(VOCAB_PREFIX):
                    (folder / Path(inner).name).write_bytes(tar.extractfile(member).read())
    (folder / ".complete").touch()
    return folder


def vocab_path(name: str) -> Path:
    """`ggml-vocab-{name}.gguf` from llama.cpp's test data (fetched on first use)."""
    path = fetch_llama_vocab(cache_root() / "llama-cpp-0.3.36-vocab") / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        raise ValueError(f"vocabulary {name!r}: {path.name} is not in llama.cpp's test data")
    return path


@functools.lru_cache(maxsize=8)
def vocab_fields(vocab_path: str) -> tuple[tuple[str, Any, int, int | None], ...]:
    """(key, value, GGUFValueType, array item type) of every `tokenizer.*` field of a vocabulary file.

    GGUFReader takes seconds (tens under load) on a 150,000-token vocabulary, so what it read is
    kept as JSON next to the vocabulary, keyed by the file's size and mtime."""
    path = Path(vocab_path)
    st = path.stat()
    cache = path.with_name(f"{path.name}.{st.st_size}.{st.st_mtime_ns}.tokenizer.json")
    try:
        return tuple(tuple(f) for f in msgspec.json.decode(cache.read_bytes()))
    except (OSError, msgspec.DecodeError):
        pass
    reader = gguf.GGUFReader(path)
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = int(field.types[0])
            sub = int(field.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), kind, sub))
    try:
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(out))
        tmp.replace(cache)
    except OSError:  # a read-only cache works, only slower
        pass
    return tuple(tuple(f) for f in out)


def add_vocabulary(writer: gguf.GGUFWriter, path: Path, vocab_size: int) -> None:
    """Write the `tokenizer.*` fields of vocabulary file `path`, its per-token arrays padded to
    `vocab_size` as llama.cpp's converter pads. Raises ValueError when it has more tokens than that."""
    fields = vocab_fields(str(path))
    count = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    if count > vocab_size:
        raise ValueError(f"vocabulary {path.name}: {count} tokens, more than the shape's vocab_size {vocab_size}")
    pad = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(count, vocab_size)],
           "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (vocab_size - count),
           "tokenizer.ggml.scores": [0.0] * (vocab_size - count)}
    for key, value, kind, sub in fields:
        writer.add_key_value(key, list(value) + pad[key] if key in pad else value, gguf.GGUFValueType(kind),
                             sub_type=None if sub is None else gguf.GGUFValueType(sub))


@functools.cache
def _unit(kind: _T) -> tuple[float, float]:
    """(std of weights at scale 1, min/scale ratio that centres them) of random blocks of `kind`,
    measured with gguf's dequantizer on 4096 blocks."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = np.random.default_rng(12345).integers(0, 256, size=(4096, size), dtype=np.uint8)
    at_d, at_m = SCALE_AT[kind]

    def dequant(d: float, m: float) -> np.ndarray:
        b = blocks.copy()
        b[:, at_d : at_d + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if at_m is not None:
            b[:, at_m : at_m + 2] = np.frombuffer(np.float16(m).tobytes(), np.uint8)
        return gguf.quants.dequantize(b, kind)

    ratio = float(-dequant(1.0, 0.0).mean() / dequant(0.0, 1.0).mean()) if at_m is not None else 0.0
    return float(dequant(1.0, ratio).std()), ratio


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: _T, std: float) -> np.ndarray:
    """uint8 `[rows, cols / block * block_bytes]`: random blocks of `kind` whose dequantized weights have
    mean about 0 and deviation about `std` (each block's scale jittered by U(0.5, 1.5))."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    unit, ratio = _unit(kind)
    d = (std / unit) * rng.uniform(0.5, 1.5, size=len(blocks)).astype(np.float32)
    at_d, at_m = SCALE_AT[kind]
    blocks[:, at_d : at_d + 2] = d.astype(np.float16)[:, None].view(np.uint8)
    if at_m is not None:
        blocks[:, at_m : at_m + 2] = (d * ratio).astype(np.float16)[:, None].view(np.uint8)
    return blocks.reshape(rows, -1)


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], type_name: str,
                  rope_freqs: np.ndarray | None) -> tuple[np.ndarray, _T]:
    """(data, GGML type) of one tensor of a bench file, as the module docstring describes."""
    kind = _T[type_name]
    if len(shape) == 1:
        if name == "rope_freqs.weight":
            return rope_freqs, _T.F32
        mean, std = (0.0, 0.5) if name.endswith(".bias") else (1.0, 0.1)
        return (mean + std * rng.standard_normal(shape[0], dtype=np.float32)).astype(np.float32), _T.F32
    std = GAINS.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, 1.0) / np.sqrt(shape[-1])
    if kind in SCALE_AT:  # an expert tensor [experts, rows, cols] as experts x rows rows
        rows = int(np.prod(shape[:-1]))
        return random_blocks(rng, rows, shape[-1], kind, std).reshape(*shape[:-1], -1), kind
    values = np.empty(shape, np.float32)
    for start in range(0, shape[0], 4096):  # in slices: a float32 copy of a large embedding is GBs
        values[start : start + 4096] = rng.standard_normal((min(4096, shape[0] - start), *shape[1:]),
                                                           dtype=np.float32) * np.float32(std)
    if kind == _T.F16:
        return values.astype(np.float16), kind
    if kind == _T.BF16:
        return gguf.quants.quantize(values, kind), kind
    return values, _T.F32


def write_bench_model(path: Path, shape: Shape, m: Mix, seed: int = 0, progress: bool = True) -> Path:
    """Write the bench file of `shape` in mix `m` to `path` (tensors generated and written one at a time)."""
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    tensors = shape.tensors()
    types = assign(m, tensors, shape.layers)
    arch = shape.arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{shape.name} random weights ({m.name}, seed {seed})")
    writer.add_file_type(m.ftype)
    for add, value in [(writer.add_block_count, shape.layers), (writer.add_context_length, shape.context),
                       (writer.add_embedding_length, shape.hidden), (writer.add_feed_forward_length, shape.ffn),
                       (writer.add_head_count, shape.heads), (writer.add_head_count_kv, shape.kv_heads),
                       (writer.add_rope_freq_base, shape.rope_theta), (writer.add_rope_dimension_count, shape.head_dim),
                       (writer.add_layer_norm_rms_eps, shape.rms_norm_eps), (writer.add_vocab_size, shape.vocab_size)]:
        add(value)
    if shape.head_dim != shape.hidden // shape.heads:  # as the converter writes `head_dim` (qwen3)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    add_vocabulary(writer, vocab_path(shape.vocab), shape.vocab_size)
    freqs = shape.rope_scaling.freq_divisors(shape.head_dim, shape.rope_theta) if shape.rope_scaling else None
    sizes = {}
    for name, dims in tensors.items():
        kind = _T[types[name]] if len(dims) >= 2 else _T.F32
        block, size = gguf.GGML_QUANT_SIZES[kind]
        sizes[name] = nbytes = int(np.prod(dims)) // block * size
        if kind in SCALE_AT or kind == _T.BF16:  # raw bytes: the writer takes the byte shape
            rows = int(np.prod(dims[:-1]))
            writer.add_tensor_info(name, (*dims[:-1], nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=kind)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float16 if kind == _T.F16 else np.float32), nbytes)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=path.name, disable=not progress) as bar:
        for name, dims in tensors.items():
            data, _ = random_tensor(rng, name, dims, types[name], freqs)
            writer.write_tensor_data(data)
            bar.update(sizes[name])
    writer.close()
    return path


def bench_model(shape: Shape, m: Mix, seed: int = 0, progress: bool = True, folder: Path | None = None) -> Path:
    """The cached bench file of `shape` (its `layers` in the name) in mix `m`, written on first use."""
    path = (folder or cache_root()) / f"{shape.name}-{shape.layers}l-{m.name}-seed{seed}-v{FORMAT}.gguf"
    return _cached(path, lambda tmp: write_bench_model(tmp, shape, m, seed, progress))


def named_bench_model(shape_name: str, mix_name: str | None = None, seed: int = 0, layers: int | None = None) -> Path:
    """`bench_model` of the shape and mix so named (`shapes.SHAPES`, `mixes.MIXES`; mix default Q4_K_M),
    cut to `layers` blocks when given. Raises ValueError naming an unknown name or a layer count out of range."""
    from hybridgate.bench.mixes import mix
    from hybridgate.bench.shapes import shape

    s = shape(shape_name)
    return bench_model(s.with_layers(layers or s.layers), mix(mix_name or "Q4_K_M"), seed)


def _cached(path: Path, write) -> Path:
    """`path`, made by `write(tmp)` into a temporary file moved into place when it does not exist yet."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize = int(sys.argv[3]), True
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(rc)
"""


def requantize(src: Path, m: Mix, llama_cpp_path: str | None = None, folder: Path | None = None) -> Path:
    """`src` requantized to mix `m` by llama.cpp's own quantizer (`llama_model_quantize` with
    allow_requantize, in a child process that imports llama_cpp, from `llama_cpp_path` first when
    given), cached as `<stem>-requantized-<mix>.gguf`. Raises RuntimeError with the child's last words when it fails."""
    env = dict(os.environ)
    if llama_cpp_path:
        env["PYTHONPATH"] = os.pathsep.join([llama_cpp_path, *filter(None, [env.get("PYTHONPATH")])])

    def write(tmp: Path) -> None:
        done = subprocess.run([sys.executable, "-c", _QUANTIZE, str(src), str(tmp), str(m.ftype)], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"llama.cpp's quantizer ({m.name}, ftype {m.ftype}) failed with exit code "
                               f"{done.returncode}: {(done.stderr or done.stdout).strip()[-600:]}")

    return _cached((folder or cache_root()) / f"{src.stem}-requantized-{m.name}.gguf", write)
