"""Named model shapes for random-weight bench files: the tensor shapes of the models users run.

Each row is one Hugging Face `config.json` as llama.cpp's converter writes it
into GGUF (`convert_hf_to_gguf.py`: `LlamaModel`, `Qwen2Model`): the same
architecture, block count, widths, heads, vocabulary size and tied or separate
LM head, so a bench file's matmuls have exactly the real model's shapes.
Sources (the models' `config.json` on huggingface.co):
- meta-llama/Llama-3.2-1B: 16 layers, hidden 2048, FFN 8192, 32 heads / 8 KV
  heads, head dim 64, vocabulary 128,256, tied, RoPE base 500,000 with llama3
  scaling (factor 32, low 1, high 4, original context 8192), eps 1e-5.
- meta-llama/Llama-3.2-3B: 28 layers, 3072, 8192, 24 / 8 heads, head dim 128, tied, factor 32.
- meta-llama/Llama-3.1-8B: 32 layers, 4096, 14336, 32 / 8 heads, head dim 128, untied, factor 8.
- Qwen/Qwen2.5-0.5B: 24 layers, hidden 896, FFN 4864, 14 / 2 heads, head dim 64,
  vocabulary 151,936, tied, Q/K/V biases, RoPE base 1e6, eps 1e-6.
- Qwen/Qwen2.5-1.5B: 28 layers, 1536, 8960, 12 / 2 heads, head dim 128, tied.
- Qwen/Qwen3-30B-A3B (`Qwen3MoeForCausalLM`, llama.cpp's `qwen3moe`: `Qwen3MoeModel` in the
  converter): 48 layers, hidden 2048, 32 / 4 heads, head dim 128 (so Q is 4096 wide, twice the
  hidden size), 128 experts of FFN width 768 (`moe_intermediate_size`), 8 chosen per token
  (`num_experts_per_tok`, `norm_topk_prob` true), no shared expert, every layer sparse
  (`decoder_sparse_step` 1, `mlp_only_layers` []), `intermediate_size` 6144 (written as
  `feed_forward_length`, read by no layer), vocabulary 151,936, untied, RoPE base 1e6, eps 1e-6,
  QK-norm, context 40,960.
The vocabulary (`vocab`) names llama.cpp's test vocabulary of the same tokenizer
(`models/ggml-vocab-{vocab}.gguf`), whose tokenizer metadata the bench file carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tables load with the command line; numpy and the GGUF loader when a file is made
    import numpy as np

    from hybridgate.models.gguf_file import ModelConfig


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3's RoPE frequency scaling (`rope_scaling.rope_type == "llama3"` in config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int

    def freq_divisors(self, head_dim: int, theta: float) -> np.ndarray:
        """float32 `[head_dim / 2]`: the `rope_freqs.weight` llama.cpp's converter writes (frequency i is
        divided by it): 1 for wavelengths under original_context / high_freq_factor, `factor` above
        original_context / low_freq_factor, and the smooth interpolation between (Meta's
        `apply_scaling` in llama-models, reference/llama3 `rope_scaling`)."""
        import numpy as np

        freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        wavelen = 2 * math.pi / freqs
        smooth = (self.original_context / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                                           - self.low_freq_factor)
        mid = 1.0 / ((1 - smooth) / self.factor + smooth)
        out = np.where(wavelen < self.original_context / self.high_freq_factor, 1.0,
                       np.where(wavelen > self.original_context / self.low_freq_factor, self.factor, mid))
        return out.astype(np.float32)


@dataclass(frozen=True)
class Shape:
    """One model's hyperparameters, in `ModelConfig`'s terms."""

    name: str
    arch: str  # an `ARCHITECTURES` key
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    rope_theta: float
    rms_norm_eps: float
    context: int
    vocab: str  # llama.cpp test vocabulary (ggml-vocab-{vocab}.gguf)
    rope_scaling: Llama3RopeScaling | None = None
    source: str = ""
    experts: int = 0  # routed experts per block (`num_experts`); 0: a dense FFN
    experts_used: int = 0  # experts chosen per token (`num_experts_per_tok`)
    expert_ffn: int = 0  # each expert's FFN width (`moe_intermediate_size`)

    def with_layers(self, layers: int) -> Shape:
        """The same matrices in fewer blocks (tests, quick runs); raises ValueError outside 1..layers."""
        if not 1 <= layers <= self.layers:
            raise ValueError(f"layers: expected 1 to {self.layers} for shape {self.name!r}, got {layers}")
        return self if layers == self.layers else replace(self, layers=layers)

    def tiny(self) -> Shape:
        """The same family, tied or separate LM head, RoPE and GQA group at widths a CPU runs in seconds
        (tests of the benches): 2 blocks, 2 KV heads of 16, the group's query heads, hidden = query width,
        FFN 2x hidden, a vocabulary of 512; named `<name>-tiny`. A mixture of experts keeps its experts:
        at most 16 of them, at most 4 chosen per token, each as wide as the hidden size."""
        group = self.heads // self.kv_heads
        hidden = 2 * group * 16
        experts = {} if not self.experts else dict(experts=min(self.experts, 16), expert_ffn=hidden,
                                                   experts_used=min(self.experts_used, 4))
        return replace(self, name=f"{self.name}-tiny", layers=2, hidden=hidden, ffn=2 * hidden,
                       heads=2 * group, kv_heads=2, head_dim=16, vocab_size=512, **experts)

    def config(self, bos: int = 0, eos: int = 0) -> ModelConfig:
        from hybridgate.models.architectures import ARCHITECTURES
        from hybridgate.models.gguf_file import ModelConfig

        return ModelConfig(self.arch, self.name, self.layers, self.hidden, self.ffn, self.heads, self.kv_heads,
                           self.head_dim, self.context, self.rope_theta, self.rms_norm_eps, self.vocab_size, bos, eos,
                           self.tied, ARCHITECTURES[self.arch], num_experts=self.experts,
                           experts_per_token=self.experts_used, expert_intermediate_size=self.expert_ffn)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Name -> row-major shape (`[out, in]` for matrices) of every tensor of the file, in GGUF's
        order (token embedding, Llama 3's `rope_freqs`, the blocks in order, output norm, LM head)."""
        from hybridgate.models.gguf_file import expected_tensors

        shapes = expected_tensors(self.config())
        if self.rope_scaling:
            shapes["rope_freqs.weight"] = (self.head_dim // 2,)

        def order(name: str) -> tuple[int, int]:
            if name.startswith("blk."):
                return (2, int(name.split(".")[1]))
            return ({"token_embd.weight": 0, "rope_freqs.weight": 1, "output_norm.weight": 3}.get(name, 4), 0)

        return {n: shapes[n] for n in sorted(shapes, key=order)}  # stable: a block keeps its tensors' order

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.tensors().values())


_LLAMA3 = dict(arch="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, context=131072,
               vocab="llama-bpe")
_QWEN25 = dict(arch="qwen2", vocab_size=151936, tied=True, rope_theta=1000000.0, rms_norm_eps=1e-6, context=32768,
               vocab="qwen2")

SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-3.2-1b", layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64, tied=True,
              rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192), source="meta-llama/Llama-3.2-1B", **_LLAMA3),
        Shape("llama-3.2-3b", layers=28, hidden=3072, ffn=8192, heads=24, kv_heads=8, head_dim=128, tied=True,
              rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192), source="meta-llama/Llama-3.2-3B", **_LLAMA3),
        Shape("llama-3.1-8b", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, tied=False,
              rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192), source="meta-llama/Llama-3.1-8B", **_LLAMA3),
        Shape("qwen2.5-0.5b", layers=24, hidden=896, ffn=4864, heads=14, kv_heads=2, head_dim=64,
              source="Qwen/Qwen2.5-0.5B", **_QWEN25),
        Shape("qwen2.5-1.5b", layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2, head_dim=128,
              source="Qwen/Qwen2.5-1.5B", **_QWEN25),
        Shape("qwen3-30b-a3b", arch="qwen3moe", layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4,
              head_dim=128, vocab_size=151936, tied=False, rope_theta=1000000.0, rms_norm_eps=1e-6, context=40960,
              vocab="qwen2", experts=128, experts_used=8, expert_ffn=768, source="Qwen/Qwen3-30B-A3B"),
    )
}


def shape(name: str) -> Shape:
    """The row named `name`; raises ValueError naming the known shapes."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, got {name!r}") from None
