"""Random weights of a named shape made on the device from a seed, and transformers' model on the same tensors.

`bench engine --kind gpu --shape NAME` measures the torch runner at a real model's
shapes where no file of them can travel (an 8B model is 16 GB in bf16): every
tensor is drawn on the device by a generator seeded with the crc32 of
`{seed}/{the tensor's GGUF name}`, so a tensor does not depend on the order the loader asks
for them, and the same seed gives the same weights on the same device kind.
Scales follow `model_files` (the random GGUF writer): matrices normal with
standard deviation `gain / sqrt(columns)` (gain 4 for the embedding and LM head,
2 for Q and K, 1 otherwise), norms 1 + N(0, 0.1), Q/K/V biases N(0, 0.5).

`transformers_twin` builds the family's Hugging Face class (`HF_FAMILIES`: a
row per architecture) on the meta device and assigns it the runner's own
tensors (views, no copy) except Q and K of a `pairs`-RoPE family, whose rows
llama.cpp's converter permuted (`convert_hf_to_gguf.py`, `LlamaModel.permute`)
and which are un-permuted here (a copy of those two matrices), so its
rotate-half RoPE computes the same function.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field, replace

import torch

from hybridgate.bench.model_files import GAINS
from hybridgate.bench.shapes import Shape
from hybridgate.models.architectures import RopeLayout
from hybridgate.models.gguf_file import ModelConfig

NORM_STD, BIAS_STD = 0.1, 0.5


@dataclass(frozen=True)
class HFFamily:
    """How one architecture's tensors and config map to transformers' model of the family."""

    model_class: str  # in `transformers`
    config_extra: dict = field(default_factory=dict)  # fixed config fields of the family


HF_FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily("LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    "qwen2": HFFamily("Qwen2ForCausalLM", {"use_sliding_window": False}),
}


@dataclass
class RandomModel:
    """What the torch runner reads of a model, for random weights: config, metadata (none: no tokenizer),
    a fingerprint naming shape and seed, and `load(name)`, each tensor made on `device` in `dtype`."""

    shape: Shape
    seed: int
    device: torch.device
    dtype: torch.dtype
    config: ModelConfig = field(init=False)
    metadata: dict = field(default_factory=dict)
    path: str = ""

    def __post_init__(self) -> None:
        config = self.shape.config()
        if self.shape.rope_scaling is not None:  # Llama 3: the divisors llama.cpp's rope_freqs.weight holds
            divisors = self.shape.rope_scaling.freq_divisors(self.shape.head_dim, self.shape.rope_theta)
            config = replace(config, rope_freq_factors=tuple(float(d) for d in divisors))
        self.config = config
        self.shapes = self.shape.tensors()
        self.fingerprint = hashlib.sha256(f"random:{self.shape}:{self.seed}".encode()).hexdigest()

    def load(self, name: str) -> torch.Tensor:
        """The tensor `name` (a GGUF name), row-major, `dtype` on `device`; KeyError for a name the shape lacks."""
        dims = self.shapes[name]
        # 32 bits: the CPU generator (mt19937) keeps only the low 32 bits of a seed
        g = torch.Generator(device=self.device).manual_seed(zlib.crc32(f"{self.seed}/{name}".encode()))
        t = torch.randn(dims, generator=g, device=self.device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t.mul_(NORM_STD).add_(1.0)
        elif name.endswith(".bias"):
            t.mul_(BIAS_STD)
        else:
            t.mul_(_gain(name) / dims[-1] ** 0.5)
        return t.to(self.dtype)


def _gain(name: str) -> float:
    """The `model_files.GAINS` entry of a GGUF tensor name (`blk.3.attn_q.weight` -> `attn_q.weight`)."""
    return GAINS.get(name.split(".", 2)[2] if name.startswith("blk.") else name, 1.0)


def hf_config(shape: Shape, dtype: torch.dtype):
    """transformers' config of `shape`'s family (`HF_FAMILIES`), RoPE parameters included (Llama 3's `llama3`
    scaling from the shape's row). Raises ValueError for a family without a row."""
    import transformers

    family = HF_FAMILIES.get(shape.arch)
    if family is None:
        raise ValueError(f"shape: transformers' twin exists for {', '.join(HF_FAMILIES)} families, "
                         f"not {shape.arch!r} ({shape.name})")
    rope = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        s = shape.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_context)
    cls = getattr(transformers, family.model_class)
    return cls, cls.config_class(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.context, rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tied, rope_parameters=rope, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        dtype=dtype, **family.config_extra)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Q or K rows `[heads * head_dim, ...]` from llama.cpp's order (each head's rotated pairs adjacent) back to
    Hugging Face's (pairs half a head apart): the inverse of `LlamaModel.permute` in convert_hf_to_gguf.py."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _state_dict(model, shape: Shape) -> dict[str, torch.Tensor]:
    """transformers' parameter names -> the runner's tensors (`[out, in]` views of its `[in, out]` weights)."""
    c = model.config
    q, kv, ffn = c.q_dim, c.kv_dim, c.intermediate_size
    pairs = c.rope_layout == RopeLayout.PAIRS
    fix_q = (lambda t: unpermute_rows(t, c.num_heads)) if pairs else (lambda t: t)  # noqa: E731
    fix_k = (lambda t: unpermute_rows(t, c.num_kv_heads)) if pairs else (lambda t: t)  # noqa: E731
    state = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.out_norm,
             "lm_head.weight": model.lm_head}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wqkv = layer.w_qkv.t()  # [q + 2 kv, hidden]
        state.update({
            p + "input_layernorm.weight": layer.attn_norm, p + "post_attention_layernorm.weight": layer.ffn_norm,
            p + "self_attn.q_proj.weight": fix_q(wqkv[:q]), p + "self_attn.k_proj.weight": fix_k(wqkv[q:q + kv]),
            p + "self_attn.v_proj.weight": wqkv[q + kv:], p + "self_attn.o_proj.weight": layer.wo.t(),
            p + "mlp.gate_proj.weight": layer.w_gate_up.t()[:ffn], p + "mlp.up_proj.weight": layer.w_gate_up.t()[ffn:],
            p + "mlp.down_proj.weight": layer.w_down.t()})
        if layer.b_qkv is not None:
            b = layer.b_qkv
            state.update({p + "self_attn.q_proj.bias": fix_q(b[:q]), p + "self_attn.k_proj.bias": fix_k(b[q:q + kv]),
                          p + "self_attn.v_proj.bias": b[q + kv:]})
    return state


def transformers_twin(model, shape: Shape):
    """transformers' causal LM of `shape`'s family on the tensors of `model` (a `DecoderModel` of `shape`'s
    config), SDPA attention, eval mode, on the model's device and dtype. Raises ValueError for a family
    `HF_FAMILIES` lacks, and RuntimeError (transformers') where a parameter name does not map."""
    cls, config = hf_config(shape, model.dtype)
    with torch.device("meta"):
        twin = cls._from_config(config, attn_implementation="sdpa", dtype=model.dtype)
    twin.load_state_dict(_state_dict(model, shape), strict=True, assign=True)
    # The rotary tables are buffers made at construction (left on the meta device): made again on the device.
    for name, module in list(twin.named_modules()):
        if hasattr(module, "inv_freq"):
            parent_name, _, attr = name.rpartition(".")
            with torch.device(model.device):
                setattr(twin.get_submodule(parent_name) if parent_name else twin, attr, type(module)(config))
    return twin.eval()
