"""Model families as data: one frozen row per GGUF `general.architecture`.

What differs between the decoder-only families both runners serve is written
here once, as llama.cpp's `llm_arch` tables (src/llama-arch.cpp, the hparams
of src/llama-model.cpp) and transformers' per-model config classes do it; the
forward passes read the row (through `ModelConfig`) and never test a name.

Sources, per field:
- RoPE layout: llama.cpp `llama_model_rope_type`: LLAMA is `LLAMA_ROPE_TYPE_NORM`
  (adjacent pairs (x[2i], x[2i+1]); its converter permuted Q/K rows so that this
  equals Hugging Face's rotate-half on the original weights), QWEN2, QWEN3,
  GEMMA2, GEMMA3 and PHI3 are `LLAMA_ROPE_TYPE_NEOX` (x[i], x[i + d/2]; weights
  not permuted).
- Sliding windows: llama.cpp `hparams.set_swa_pattern(n)`: layer `il` slides when
  `il % n < n - 1` (gemma2: n = 2, even layers slide; gemma3: n = 6, five
  sliding then one global). A token attends to itself and the `window - 1`
  before it (`LLAMA_SWA_TYPE_STANDARD`; transformers' `sliding_window_overlay`).
  gemma3's sliding layers use RoPE base 10000 and scale 1
  (`rope_freq_base_train_swa`); its global layers the file's `rope.freq_base`
  and `rope.scaling`. llama.cpp disables Phi-3's window (ggml-org/llama.cpp#13676),
  so `phi3` has none here either.
- Softcaps: gemma2 `f_attn_logit_softcapping` 50 and `f_final_logit_softcapping`
  30 unless the file says otherwise (`gemma2.attn_logit_softcapping`,
  `gemma2.final_logit_softcapping`); gemma3 only a final cap when the file has one.
- Attention scale: 1/sqrt(key_length), except Gemma 2/3 27B (46 and 62 blocks),
  where llama.cpp (after gemma_pytorch's config) uses 1/sqrt(hidden / heads).
- Gemma: embeddings scaled by sqrt(hidden); norms before and after attention and
  the FFN; GELU (tanh approximation) gated FFN. The GGUF converter already added
  1 to Gemma's norm weights, so every norm here is plain `w * x / rms(x)`.
- Phi-3: Q, K, V fused in `attn_qkv` (rows Q then K then V); `ffn_up` holds the
  gate rows then the up rows (llama.cpp `LLM_FFN_SWIGLU` on one tensor;
  transformers' `Phi3MLP` chunks it the same way).
- Mixture-of-experts (`MixtureOfExperts`): llama.cpp `llm_graph_context::build_moe_ffn`
  (src/llama-graph.cpp): router logits `ffn_gate_inp` · x; probabilities by the gating
  function; the top `expert_used_count` chosen on the probabilities plus the optional
  selection bias `exp_probs_b` (which only chooses, never weighs); the chosen weights
  renormalised to sum 1 where the row says so, then times the weight scale; each chosen
  expert a gated FFN over its slice of the 3-D `ffn_{gate,up,down}_exps` (or fused
  `ffn_gate_up_exps`); shared experts (`ffn_*_shexp`) added for every token, through a
  sigmoid of `ffn_gate_inp_shexp` · x where the row has that gate (qwen2moe).
  qwen3moe: softmax over all experts, top 8, renormalised (src/models/qwen3moe.cpp;
  transformers' `Qwen3MoeTopKRouter` with `norm_topk_prob`), QK-norm as qwen3.
- gpt-oss (llama.cpp src/models/openai-moe-iswa.cpp, `LLM_ARCH_OPENAI_MOE`; transformers'
  `GptOssForCausalLM`): NEOX RoPE; biases on Q, K, V and the output projection; a learned logit per
  head (`attn_sinks`) that joins each query's softmax denominator and no value (`build_attn`'s
  sinks; transformers' eager attention concatenates it as a last column, then drops it); even
  layers slide (`set_swa_pattern(2)`, the window from `{arch}.attention.sliding_window`, which
  llama.cpp requires); the FFN's norm is `post_attention_norm` (GGUF's name for transformers'
  `post_attention_layernorm`, a pre-FFN norm here, not gemma's post norm); experts with biases
  (`ffn_gate_inp.bias` on the router's logits, `ffn_{gate,up,down}_exps.bias`), chosen as the top 4
  logits then a softmax over those (`SOFTMAX_WEIGHT`), through the clamped SwiGLU (`SWIGLU_OAI`:
  ggml_swiglu_oai, transformers' `GptOssExperts._apply_gate`); YaRN RoPE (factor 32 over 4096 positions) with
  the correction range unrounded, as transformers' `GptOssConfig` (`truncate: False`) and OpenAI's reference
  code compute it (llama.cpp rounds it, `ggml_rope_yarn_corr_dims`).
- gemma4 (llama.cpp src/models/gemma4.cpp and `llama_model_gemma4::load_arch_hparams`; its converter
  `Gemma4Model`): gemma3's layout with the sliding layers named per layer by the file
  (`attention.sliding_window_pattern`, an array), their own head size (`attention.key_length_swa`), KV heads
  (`attention.head_count_kv` as an array) and RoPE base (`rope.freq_base_swa`); `rope_freqs` ("proportional
  RoPE": 1 on the rotated pairs, 1e30 on the others) on the full layers only; V RMS-normed without a weight;
  attention scale 1; the last `attention.shared_kv_layers` layers own no K/V and attend over the last earlier
  layer of their kind that does (`ModelConfig.layer_kv_source`); V = K where a layer has no `attn_v`
  (attention_k_eq_v); an FFN width per layer (`feed_forward_length` as an array); an optional
  `layer_output_scale` multiplying each block's output; the final softcap from the file. The MoE files
  (26B-A4B) run a dense FFN beside the experts, a router on the normed residual and a scale per expert
  (`MixtureOfExperts.beside_dense`). Per-layer embeddings (E2B, E4B) are refused.
- Refused families (`REFUSED_ARCHITECTURES`): named with the reason, so a file of one
  fails at load in one line rather than as an unknown name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RopeLayout(str, Enum):
    """Which elements of a head RoPE rotates together."""

    PAIRS = "pairs"  # (x[2i], x[2i+1]): llama.cpp LLAMA_ROPE_TYPE_NORM
    HALVES = "halves"  # (x[i], x[i + d/2]): llama.cpp LLAMA_ROPE_TYPE_NEOX, HF rotate_half


class Activation(str, Enum):
    """The gate's nonlinearity of the gated FFN: act(gate) * up."""

    SILU = "silu"  # SwiGLU (Shazeer 2020)
    GELU_TANH = "gelu_tanh"  # GeGLU with GELU's tanh approximation (ggml_gelu; HF gelu_pytorch_tanh)
    # gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) · g · sigmoid(alpha · g), with
    # SWIGLU_OAI_LIMIT and SWIGLU_OAI_ALPHA (ggml_swiglu_oai's arguments in llama.cpp's graph)
    SWIGLU_OAI = "swiglu_oai"


SWIGLU_OAI_LIMIT = 7.0
SWIGLU_OAI_ALPHA = 1.702


class Gating(str, Enum):
    """How the router's logits become expert probabilities (llama.cpp `llama_expert_gating_func_type`)."""

    SOFTMAX = "softmax"  # softmax over all experts, then the top k (Mixtral, Qwen MoE)
    SIGMOID = "sigmoid"  # each expert's sigmoid, then the top k (DeepSeek V3)
    TOPK_SOFTMAX = "topk_softmax"  # the top k logits, then softmax over those k (gpt-oss: SOFTMAX_WEIGHT)


@dataclass(frozen=True)
class MixtureOfExperts:
    """A family's sparse FFN, read by both runners; counts and widths come from the file's metadata
    (`{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length`).

    Tensors per block (`[out, in]` per expert, experts outermost): `ffn_gate_inp` `[experts, hidden]`
    (the router), `ffn_gate_exps` and `ffn_up_exps` `[experts, expert_ffn, hidden]` (or one
    `ffn_gate_up_exps` `[experts, 2 expert_ffn, hidden]`, gate rows first), `ffn_down_exps`
    `[experts, hidden, expert_ffn]`.
    """

    gating: Gating = Gating.SOFTMAX
    selection_bias: bool = False  # `exp_probs_b` [experts] added to the probabilities to choose, not to weigh
    normalize: bool = False  # the chosen k weights divided by their sum
    weight_scale: float = 1.0  # the chosen weights times this (`{arch}.expert_weights_scale` overrides)
    fused_gate_up: bool = False  # `ffn_gate_up_exps` instead of `ffn_gate_exps` + `ffn_up_exps`
    shared_expert: bool = False  # `ffn_{gate,up,down}_shexp`, width `{arch}.expert_shared_feed_forward_length`
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(`ffn_gate_inp_shexp` · x)
    # `.bias` of the router (`ffn_gate_inp.bias` [experts], added to its logits) and of each expert
    # (`{name}.bias` [experts, rows] of each expert tensor: added to that matmul's output) (gpt-oss)
    biases: bool = False
    optional: bool = False  # a file of the family may have no experts (no `{arch}.expert_count`): a dense model
    # Gemma 4 (llama.cpp src/models/gemma4.cpp): the block's dense FFN (`ffn_norm` in, `post_ffw_norm_1` out) runs
    # beside the experts (`pre_ffw_norm_2` in, `post_ffw_norm_2` out); their sum goes through `post_ffw_norm`
    beside_dense: bool = False
    # the router reads rms_norm(residual) / sqrt(hidden) · `ffn_gate_inp.scale` [hidden], not the experts' input
    router_input_norm: bool = False
    expert_scales: bool = False  # `ffn_down_exps.scale` [experts]: each expert's output times its scale

    @property
    def expert_tensors(self) -> tuple[str, ...]:
        return ("ffn_gate_up_exps",) if self.fused_gate_up else ("ffn_gate_exps", "ffn_up_exps")


@dataclass(frozen=True)
class Architecture:
    """One model family's layout, read by every runner.

    Tensor names are GGUF's (`blk.{i}.` + name + `.weight`/`.bias`).
    """

    name: str
    rope_layout: RopeLayout
    activation: Activation = Activation.SILU
    qkv_tensors: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")  # one name: fused Q|K|V rows
    gate_up_tensors: tuple[str, ...] = ("ffn_gate", "ffn_up")  # one name: fused gate|up rows
    qkv_bias: bool = False  # `.bias` of each qkv tensor (qwen2)
    output_bias: bool = False  # `attn_output.bias` [hidden] (gpt-oss)
    attn_sinks: bool = False  # `attn_sinks.weight` [heads]: a logit per head in each softmax's denominator
    ffn_norm: str = "ffn_norm"  # the FFN's input norm (gpt-oss: `post_attention_norm`)
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE: attn_q_norm, attn_k_norm [head_dim]
    post_norms: bool = False  # post_attention_norm and post_ffw_norm on the sublayers' outputs (gemma2/3)
    scale_embeddings: bool = False  # token embeddings times sqrt(hidden) (gemma)
    swa_pattern: int = 0  # 0: no window; n: layer il slides iff il % n < n - 1 (llama.cpp set_swa_pattern)
    default_window: int = 0  # window when the file names none (gemma2: 4096); 0: the file must name it
    swa_rope_theta: float = 0.0  # RoPE base of sliding layers (gemma3: 10000); 0: the file's freq_base
    attn_softcap: float = 0.0  # default attention-logit cap (0: none)
    final_softcap: float = 0.0  # default final-logit cap (0: none)
    softcap_keys: tuple[str, ...] = ()  # `{arch}.` metadata keys read over those defaults
    hidden_scale_block_counts: tuple[int, ...] = ()  # block counts whose scale is 1/sqrt(hidden/heads)
    long_rope: bool = False  # rope_factors_long/short tensors and original_context_length (phi3 LongRoPE)
    yarn_truncate: bool = True  # YaRN's correction range floored and ceiled (transformers' `truncate`; gpt-oss: not)
    moe: MixtureOfExperts | None = None  # every block's FFN is this mixture of experts; None: a dense FFN
    k_eq_v: bool = False  # a layer without `attn_v` takes V = K, before K's norm and RoPE (gemma4 attention_k_eq_v)
    v_norm: bool = False  # each V head RMS-normed without a weight before it is stored (gemma4)
    attention_scale: float = 0.0  # multiplies Q·K; 0: 1/sqrt(head_dim) (gemma4: 1, its Q/K norms set the scale)
    swa_rope_factors: bool = True  # the file's `rope_freqs` apply to sliding layers too (gemma4: full layers only)
    optional_layer_tensors: tuple[str, ...] = ()  # `blk.{i}.` tensors a file may hold (`layer_output_scale.weight`)
    # `{arch}.` metadata keys whose non-zero value names a layout these runners refuse, and why
    refused_keys: tuple[tuple[str, str], ...] = ()

    @property
    def fused_qkv(self) -> bool:
        return len(self.qkv_tensors) == 1

    @property
    def fused_gate_up(self) -> bool:
        return len(self.gate_up_tensors) == 1

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` uses the sliding window (llama.cpp `llama_hparams::set_swa_pattern`)."""
        n = self.swa_pattern
        return n > 0 and layer % n < n - 1


_GEMMA = dict(rope_layout=RopeLayout.HALVES, activation=Activation.GELU_TANH, post_norms=True,
              scale_embeddings=True)

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", RopeLayout.PAIRS),
        Architecture("qwen2", RopeLayout.HALVES, qkv_bias=True),
        Architecture("qwen3", RopeLayout.HALVES, qk_norm=True),
        Architecture("gemma2", **_GEMMA, swa_pattern=2, default_window=4096, attn_softcap=50.0,
                     final_softcap=30.0, hidden_scale_block_counts=(46,),
                     softcap_keys=("attn_logit_softcapping", "final_logit_softcapping")),
        Architecture("gemma3", **_GEMMA, qk_norm=True, swa_pattern=6, swa_rope_theta=10000.0,
                     hidden_scale_block_counts=(62,), softcap_keys=("final_logit_softcapping",)),
        Architecture("gemma4", **_GEMMA, qk_norm=True, k_eq_v=True, v_norm=True, swa_pattern=6, attention_scale=1.0,
                     swa_rope_factors=False, softcap_keys=("final_logit_softcapping",),
                     optional_layer_tensors=("layer_output_scale.weight",),
                     refused_keys=(("embedding_length_per_layer_input", "its per-layer embeddings (the E2B and E4B "
                                    "models' per_layer_token_embd) are not implemented"),),
                     moe=MixtureOfExperts(Gating.SOFTMAX, normalize=True, fused_gate_up=True, optional=True,
                                          beside_dense=True, router_input_norm=True, expert_scales=True)),
        Architecture("phi3", RopeLayout.HALVES, qkv_tensors=("attn_qkv",), gate_up_tensors=("ffn_up",),
                     long_rope=True),
        Architecture("qwen3moe", RopeLayout.HALVES, qk_norm=True,
                     moe=MixtureOfExperts(Gating.SOFTMAX, normalize=True)),
        Architecture("gpt-oss", RopeLayout.HALVES, activation=Activation.SWIGLU_OAI, qkv_bias=True,
                     output_bias=True, attn_sinks=True, ffn_norm="post_attention_norm", swa_pattern=2,
                     yarn_truncate=False,
                     moe=MixtureOfExperts(Gating.TOPK_SOFTMAX, biases=True)),
    )
}

_RECURRENT = "its linear-attention layers (Gated DeltaNet) carry a recurrent state that needs a state cache"
# Families llama.cpp names that these runners refuse, and why (one line at load).
REFUSED_ARCHITECTURES: dict[str, str] = {
    "qwen35": _RECURRENT,
    "qwen35moe": _RECURRENT,
    "qwen3next": _RECURRENT,
    "gemma3n": "its per-layer embeddings, AltUp and Laurel blocks are not implemented",
    "llama4": "its chunked attention with layers without RoPE (iRoPE) and its interleaved experts are not "
              "implemented",
    "granitehybrid": "its Mamba-2 layers carry a recurrent state that needs a state cache",
    "lfm2": "its short-convolution layers carry a convolution state that needs a state cache",
}
