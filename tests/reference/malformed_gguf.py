"""Malformed GGUF files for the refusal tests: a tiny valid file (tiny_gguf.write_tiny_llama)
copied key by key and tensor by tensor with `gguf.GGUFWriter`, one thing changed.

Each fault names what a loader must refuse, with the name it must say:
- "architecture": `general.architecture` = "nosucharch" (its hyperparameter keys renamed along);
- "pre_tokenizer": `tokenizer.ggml.pre` = "nosuchpre";
- "tokenizer_model": `tokenizer.ggml.model` = "nosuchmodel";
- "tensor_type": `blk.0.attn_q.weight` stored as Q8_1 (a GGML type no runner reads);
- "missing_tensor": `blk.1.ffn_down.weight` left out.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tiny_gguf import write_tiny_llama

FAULTS = {  # fault -> the name its refusal must say
    "architecture": "nosucharch",
    "pre_tokenizer": "nosuchpre",
    "tokenizer_model": "nosuchmodel",
    "tensor_type": "Q8_1",
    "missing_tensor": "blk.1.ffn_down.weight",
}
_ARCH_KEY = "general.architecture"


def write_malformed(path: Path, fault: str) -> Path:
    """A tiny Llama GGUF at `path` with `fault` (a key of FAULTS); returns `path`."""
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r}: expected one of {', '.join(FAULTS)}")
    source = write_tiny_llama(path.with_suffix(".valid.gguf"), heads=4, kv_heads=2)
    reader = gguf.GGUFReader(source)
    arch = "nosucharch" if fault == "architecture" else reader.fields[_ARCH_KEY].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == _ARCH_KEY:
            continue
        value = field.contents()
        if fault == "pre_tokenizer" and key == "tokenizer.ggml.pre":
            value = FAULTS[fault]
        if fault == "tokenizer_model" and key == "tokenizer.ggml.model":
            value = FAULTS[fault]
        if fault == "architecture" and key.startswith("llama."):
            key = arch + key.removeprefix("llama")
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if fault == "missing_tensor" and tensor.name == FAULTS[fault]:
            continue
        shape = [int(d) for d in reversed(tensor.shape.tolist())]  # row-major, outermost first
        if fault == "tensor_type" and tensor.name == "blk.0.attn_q.weight":
            # The loader refuses the type before reading a byte: zero blocks of the right size do.
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            blocks = np.zeros((shape[0], shape[1] // block * size), np.uint8)
            writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
            continue
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_shape=shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source.unlink()
    return path
