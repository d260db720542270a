"""The element-wise work of a decoder layer, two ways: `EagerOps` (torch ops, the CPU device's path and
the reference) and `FusedOps` (one Triton launch each, `kernels.fused`; CUDA's path). `DecoderModel` runs
one forward over either; the architecture row's RoPE layout and activation are read once, here.

Launches per layer of a Llama-family layer (no biases, no Q/K or post norms) in a mixed step, bf16:

- eager, before the fusions: 33, counted with torch.profiler on the CPU device in bf16 (aten ops that
  compute; views not counted; `tests/component/test_fused_layers.py`): two RMSNorms of 8 ops each
  (to float, pow, mean, add eps, rsqrt, mul, to bf16, mul by the weight), RoPE 7 (4 muls, sub, add,
  stack), the activation and its product 2, two residual adds, 4 matmuls (QKV, output, gate|up, down)
  and attention's 2 Triton kernels (K/V write, paged attention). On CUDA each is at least one kernel.
- fused: 10 by construction: 2 `add_rms_norm`, 1 `rope`, 1 `act_mul`, the 4 matmuls and attention's 2
  (a split-KV decode adds its combine). The same test counts them through a thin wrapper around each
  kernel entry point, so the number cannot grow unseen. Qwen 2's QKV bias adds one add; Q/K norms
  (Qwen 3, Gemma 3) and Gemma's post norms ride in the `rope` and `add_rms_norm` launches.
"""

from __future__ import annotations

import torch

from hybridgate.models import Activation, ModelConfig, RopeLayout
from hybridgate.workers.gpu.layers import ACTIVATIONS, ROTATIONS, rms_norm


class EagerOps:
    """Torch ops (`hybridgate.workers.gpu.layers`); new tensors out, nothing updated in place."""

    def __init__(self, config: ModelConfig):
        self.eps = config.rms_norm_eps
        self._rotate = ROTATIONS[config.rope_layout]
        self._act = ACTIVATIONS[config.arch.activation]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 post_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(r, weight), r) with r = residual + (rms_norm(x, post_weight) or x), or r = x without a
        residual: x, residual `[tokens, hidden]`, weights `[hidden]`."""
        if post_weight is not None:
            x = rms_norm(x, post_weight, self.eps)
        residual = x if residual is None else residual + x
        return rms_norm(residual, weight, self.eps), residual

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             norm_weight: torch.Tensor | None = None) -> torch.Tensor:
        """qk `[tokens, heads + kv_heads, head_dim]` rotated (each head RMS-normed first with norm_weight
        `[heads + kv_heads, head_dim]`); cos, sin `[tokens, head_dim / 2]`."""
        if norm_weight is not None:
            qk = rms_norm(qk, norm_weight, self.eps)
        return self._rotate(qk, cos, sin)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up `[tokens, ffn]` of gate_up `[tokens, 2 * ffn]` (the row's product: `ACTIVATIONS`)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate, up)


class FusedOps:
    """`EagerOps`' calls, one Triton launch each (`kernels.fused`); `add_norm` updates the residual in
    place and `rope` rotates qk in place (both are the forward's own intermediates)."""

    def __init__(self, config: ModelConfig):
        from hybridgate.workers.gpu.kernels import fused

        self.eps, self._kernels = config.rms_norm_eps, fused
        layouts = {RopeLayout.PAIRS: fused.ROTATE_PAIRS, RopeLayout.HALVES: fused.ROTATE_HALVES}
        self._layout = layouts[config.rope_layout]
        self._act = {Activation.SILU: fused.SILU, Activation.GELU_TANH: fused.GELU_TANH,
                     Activation.SWIGLU_OAI: fused.SWIGLU_OAI}[config.arch.activation]

    def add_norm(self, x, residual, weight, post_weight=None):
        return self._kernels.add_rms_norm(x, residual, weight, self.eps, post_weight)

    def rope(self, qk, cos, sin, norm_weight=None):
        return self._kernels.rope(qk, cos, sin, self._layout, norm_weight, self.eps)

    def act_mul(self, gate_up):
        return self._kernels.act_mul(gate_up, self._act)
