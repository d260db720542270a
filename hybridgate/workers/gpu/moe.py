"""The mixture-of-experts FFN on the torch runner: the router's choice, then one matmul per active expert.

Routing follows llama.cpp's `build_moe_ffn` (src/llama-graph.cpp) as the architecture row's
`MixtureOfExperts` says: gating, selection bias, renormalisation, weight scale. Ties in the scores
choose the lower expert index (a stable descending sort), so both runners choose alike.

The experts run as sorted tokens and one matmul pair per active expert: the (token, slot) pairs
sorted by expert, each active expert's rows gathered, multiplied by its gate|up and down weights,
weighted and scattered back with `index_add_`. Simple, exact in fp32 and testable on a CPU torch
device; its per-expert counts come back to the host, so a step that routes through it cannot be
captured in a CUDA graph (the runner captures none for such a model). A Triton fused-MoE kernel
(one launch over the expert-sorted rows, as vLLM's `fused_moe`) is the later GPU path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridgate.models import Gating, MixtureOfExperts

# Probabilities from the router's float32 logits `[tokens, experts]`; TOPK_SOFTMAX chooses on the logits.
GATES: dict[Gating, Callable[[torch.Tensor], torch.Tensor]] = {
    Gating.SOFTMAX: lambda logits: logits.softmax(-1),
    Gating.SIGMOID: torch.sigmoid,
    Gating.TOPK_SOFTMAX: lambda logits: logits,
}
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the chosen weights' sum from below before it divides


def route(logits: torch.Tensor, moe: MixtureOfExperts, k: int, scale: float = 1.0,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts and their weights, per token.

    Args:
        logits: router logits `[tokens, experts]` (any float dtype; computed on in float32).
        moe: the architecture row's gating, renormalisation and selection-bias flags.
        k: experts chosen per token (`expert_used_count`).
        scale: the chosen weights' multiplier (`ModelConfig.expert_weight_scale`).
        bias: float32 `[experts]` added to the probabilities to choose only (`exp_probs_b`), or None.
    Returns:
        weights float32 `[tokens, k]`, experts int64 `[tokens, k]` (best first; ties: the lower index).
    """
    probs = GATES[moe.gating](logits.float())  # [tokens, experts]
    scores = probs if bias is None else probs + bias
    experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # [tokens, k]
    weights = probs.gather(-1, experts)
    if moe.gating == Gating.TOPK_SOFTMAX:
        weights = weights.softmax(-1)
    if moe.normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    return weights * scale if scale != 1.0 else weights, experts


def experts_ffn(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's chosen experts of weight · down_e(act(gate_e x, up_e x)).

    x `[tokens, hidden]`; weights float32 and experts int64 `[tokens, k]` (`route`); gate_up
    `[experts, hidden, 2 expert_ffn]` (gate columns first), down `[experts, expert_ffn, hidden]`
    (both `[in, out]` per expert, in x's dtype); act: the gated product (`layers.ACTIVATIONS`); the
    biases `[experts, 2 expert_ffn]` and `[experts, hidden]` or None (gpt-oss). Returns `[tokens, hidden]`
    in x's dtype.
    """
    k = experts.shape[1]
    flat = experts.reshape(-1)  # [tokens · k]: slot j of token t at t · k + j
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    pair_weights = weights.reshape(-1)[order].to(x.dtype)
    rows = order // k  # [tokens · k]: the token of each sorted pair
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        token = rows[start : start + n]
        h = x[token] @ gate_up[e]  # [n, 2 expert_ffn]
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        y = act(*h.chunk(2, dim=-1)) @ down[e]  # [n, hidden]
        if down_bias is not None:
            y = y + down_bias[e]
        out.index_add_(0, token, y * pair_weights[start : start + n, None])
        start += n
    return out


def shared_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None,
                  act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The shared expert every token runs: down(act(gate x, up x)), times sigmoid(gate_inp · x) when the row has
    that gate (llama.cpp src/models/qwen2moe.cpp). x `[tokens, hidden]`; gate_up `[hidden, 2 shared_ffn]`, down
    `[shared_ffn, hidden]` in x's dtype; gate float32 `[hidden]` or None. Returns `[tokens, hidden]`."""
    y = act(*(x @ gate_up).chunk(2, dim=-1)) @ down
    return y if gate is None else y * torch.sigmoid(x.float() @ gate).to(x.dtype)[:, None]
