"""llama.cpp's quant mixes as data: which GGML type each tensor of a file gets under a `--quant` name.

The rules are those of llama.cpp's quantizer (src/llama-quant.cpp of
llama-cpp-python 0.3.36's vendored llama.cpp: `llama_tensor_get_type`,
`llama_tensor_get_type_impl`, `tensor_type_fallback`), for dense models of the
families here (not Falcon) and their mixtures of experts:
- Only weights of two or more dimensions whose name ends in `weight` and not
  `_norm.weight` are quantized, and never an expert router (`ffn_gate_inp.weight`,
  `tensor_allows_quantization`); the rest keep their type (F32, as the converter
  writes routers).
- Experts (the 3-D `ffn_{gate,up,down}_exps`) fall in the category of their name's
  `ffn_gate`, `ffn_up`, `ffn_down` and get the dense tensor's rules, one type for all
  the experts of a tensor. With more than one expert `layer_info` reads the layer
  from the tensor's name (`blk.N.`) rather than counting tensors, so Q4_K_M's
  `use_more_bits(layer, n_layers)` gives `ffn_down_exps` Q6_K in the same layers as
  a dense `ffn_down`. Models of exactly 8 experts (Mixtral) get extra rules (attn_k,
  attn_v Q8_0, ...) that are not written here: `assign` refuses them.
- Every quantized tensor starts at the mix's default type (`ftype`'s).
- The LM head (`output.weight`, or `token_embd.weight` when the embeddings are
  tied): Q8_0 when its columns are not a multiple of the default type's block,
  else Q6_K unless the default is Q8_0 (which it keeps). An untied token
  embedding keeps the default.
- Q4_K_M and Q5_K_M give "more bits" (Q6_K) to `attn_v` and `ffn_down` of the
  layers where `use_more_bits(i, n)`: the first eighth, the last eighth, and
  every third layer between (`i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2`;
  for attn_v, `i` counts attn_v tensors in the loader's order, which is the layer).
- Fallback for rows that do not fit the type's block (columns not a multiple
  of 256 for K-quants): Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 if even that
  does not fit.
F16 and BF16 mixes store every quantizable weight in that type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# llama.cpp's category of a tensor (llama-quant.cpp `tensor_get_category`): whole names first, then the
# first name part that matches (only the categories the rules here read).
NAMED = {"output.weight": "output", "token_embd.weight": "token_embd"}
CATEGORIES = (("attn_qkv.weight", "attn_v"), ("attn_v.weight", "attn_v"), ("ffn_down", "ffn_down"))
KEPT = ("ffn_gate_inp.weight",)  # name parts tensor_allows_quantization never quantizes (of the families here)

FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # tensor_type_fallback, for the types used here


@dataclass(frozen=True)
class Mix:
    """One `llama_ftype`: its default type and the categories it gives more bits to."""

    name: str
    ftype: int  # llama.h LLAMA_FTYPE_MOSTLY_*, as llama_model_quantize takes it
    default: str  # GGML type name
    more_bits: dict[str, str] = field(default_factory=dict)  # category -> type on use_more_bits layers

    @property
    def quantized(self) -> bool:
        return self.default not in ("F16", "BF16", "F32")


MIXES: dict[str, Mix] = {
    m.name: m
    for m in (
        Mix("Q4_K_M", 15, "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"}),
        Mix("Q5_K_M", 17, "Q5_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"}),
        Mix("Q6_K", 18, "Q6_K"),
        Mix("Q8_0", 7, "Q8_0"),
        Mix("Q4_0", 2, "Q4_0"),
        Mix("Q5_0", 8, "Q5_0"),
        Mix("F16", 1, "F16"),
        Mix("BF16", 32, "BF16"),
    )
}


def mix(name: str) -> Mix:
    """The mix named `name`; raises ValueError naming the known ones."""
    try:
        return MIXES[name]
    except KeyError:
        raise ValueError(f"quant mix: expected one of {', '.join(MIXES)}, got {name!r}") from None


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's `use_more_bits(i_layer, n_layers)` (C integer division)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _block(type_name: str) -> int:
    import gguf  # here: the tables load with the command line

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def _category(name: str) -> str:
    return NAMED.get(name) or next((c for part, c in CATEGORIES if part in name), "other")


def _fallback(type_name: str, cols: int) -> str:
    if cols % _block(type_name) == 0:
        return type_name
    type_name = FALLBACK.get(type_name, type_name)
    return type_name if cols % _block(type_name) == 0 else "F16"


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def assign(m: Mix, tensors: dict[str, tuple[int, ...]], n_layers: int) -> dict[str, str]:
    """GGML type name of every tensor of `tensors` (name -> row-major shape) under mix `m`.

    Tensors that are not quantized get "F32" (the bench files write them so). Raises ValueError for a
    model of exactly 8 experts (llama.cpp's rules for it are not in this table)."""
    tied = "output.weight" not in tensors
    experts = {s[0] for n, s in tensors.items() if n.endswith("ffn_gate_inp.weight")}
    if experts == {8}:
        raise ValueError("quant mix: models of 8 experts get llama.cpp's extra rules for n_expert == 8, "
                         "not in this table")
    # The loader's order (llama-model-loader.h weight_name_comparer): by block (others first), then name.
    names = sorted(tensors, key=lambda n: (_layer(n), n))
    n_attn_v = sum(_category(n) == "attn_v" for n in names)
    out, i_attn_v = {}, 0
    for name in names:
        shape = tensors[name]
        if len(shape) < 2 or not name.endswith("weight") or name.endswith("_norm.weight") or \
                any(part in name for part in KEPT):
            out[name] = "F32"
            continue
        cols, category, kind = shape[-1], _category(name), m.default
        if not m.quantized:
            out[name] = kind
            continue
        if category == "output" or (tied and category == "token_embd"):
            kind = "Q8_0" if cols % _block(kind) else kind if kind == "Q8_0" else "Q6_K"
        elif category == "attn_v":
            if category in m.more_bits and use_more_bits(i_attn_v, n_attn_v):
                kind = m.more_bits[category]
            i_attn_v += 1
        elif category in m.more_bits and use_more_bits(_layer(name), n_layers):
            kind = m.more_bits[category]
        out[name] = _fallback(kind, cols)
    return {n: out[n] for n in tensors}
