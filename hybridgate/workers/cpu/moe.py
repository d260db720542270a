"""The mixture-of-experts FFN on the Numba runner: a step's tokens grouped by expert over GGUF blocks.

Each expert is the quant matrices of its slice of the file's 3-D tensors (`ffn_gate_exps` and
`ffn_up_exps` rows fused into one gate|up matrix, `ffn_down_exps`), built by `quant.quant_matrix`
like any dense weight: the experts stay in the file's quantization (Q8_0 and Q4_1 split into codes
and float32 scales as the dense matrices are), none is dequantized at load. A step routes every
token (`route`), sorts the (token, slot) pairs by expert and runs each chosen expert once on the
rows routed to it, so an expert's weights are read once per step whatever its number of tokens,
and an expert no token chose is not read at all (batch-1 decode reads `expert_used_count` of them;
a one-token step skips the grouping and runs its experts in index order: the same sums, fewer numpy calls).
Experts of the super-block types (Q4_K, Q5_K, Q6_K on the avx2 and avx512 paths) are stacked at load, and a
step without prompt rows runs them in two parallel regions instead (`moe_stack`: the same bits).
The expert matmuls take float32 or int16 activations as the table gives their type (`matmul`), and a
step's prompt rows go to the prompt kernels (`matmul_prompt`: int8 or AMX where the type has them) in
whichever experts they chose, so which kernel computes a row is fixed by its request, as in a dense FFN.

Routing after llama.cpp's `build_moe_ffn` (src/llama-graph.cpp), the row's `MixtureOfExperts`:
gating, selection bias, renormalisation (its sum clamped from below as llama.cpp does), weight
scale; ties in the scores choose the lower expert index (a stable sort), as `gpu.moe.route` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridgate.models import GGUFModel, Gating, MixtureOfExperts
from hybridgate.workers.cpu import moe_stack
from hybridgate.workers.cpu.fused import concat_rows, tensor_matrix
from hybridgate.workers.cpu.layers import SERIAL_TOKENS
from hybridgate.workers.cpu.quant import quant_matrix

NO_ROWS = np.empty(0, np.int64)  # a step without prompt rows
MIN_WEIGHT_SUM = np.float32(6.103515625e-5)  # llama.cpp clamps the chosen weights' sum from below before it divides


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


GATES = {
    Gating.SOFTMAX: _softmax,
    Gating.SIGMOID: lambda logits: np.float32(1.0) / (np.float32(1.0) + np.exp(-logits)),
    Gating.TOPK_SOFTMAX: lambda logits: logits,
}


def route(logits: np.ndarray, moe: MixtureOfExperts, k: int, scale: float = 1.0,
          bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The chosen experts and their weights, per token: `gpu.moe.route` in numpy.

    logits float32 `[tokens, experts]`; bias float32 `[experts]` (added to choose only) or None.
    Returns weights float32 `[tokens, k]` and experts int64 `[tokens, k]` (best first; ties: the lower index).
    """
    probs = GATES[moe.gating](logits.astype(np.float32, copy=False)).astype(np.float32, copy=False)
    scores = probs if bias is None or not bias.size else probs + bias
    experts = np.argsort(-scores, axis=-1, kind="stable")[:, :k].astype(np.int64)
    weights = np.take_along_axis(probs, experts, axis=-1)
    if moe.gating == Gating.TOPK_SOFTMAX:
        weights = _softmax(weights)
    if moe.normalize:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), MIN_WEIGHT_SUM)
    return (weights * np.float32(scale) if scale != 1.0 else weights).astype(np.float32, copy=False), experts


@dataclass(frozen=True, eq=False)
class CpuExperts:
    """One block's router and experts as the kernels take them."""

    moe: MixtureOfExperts
    router: object  # matrix [experts, hidden] (`ffn_gate_inp`)
    bias: np.ndarray  # float32 [experts] selection bias; (0,): none
    gate_up: list  # per expert: matrix [2 expert_ffn, hidden], gate rows then up rows
    down: list  # per expert: matrix [hidden, expert_ffn]
    k: int  # experts per token
    scale: float  # the chosen weights' multiplier
    shared_gate_up: object = None  # matrix [2 shared_ffn, hidden] of the shared expert; None: none
    shared_down: object = None  # matrix [hidden, shared_ffn]
    # float32 [hidden]: sigmoid(x · it) scales the shared expert; (0,): no gate
    shared_gate: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))
    # gpt-oss's biases (`MixtureOfExperts.biases`), float32; (0,) or (0, 0): none
    router_bias: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # [experts] on the logits
    gate_up_bias: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.float32))  # [experts, 2 expert_ffn]
    down_bias: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.float32))  # [experts, hidden]
    # gemma4 (`MixtureOfExperts.router_input_norm`, `expert_scales`), float32; (0,): none
    router_scale: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # [hidden]: scale / sqrt(hidden)
    expert_scales: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # [experts]
    # (gate|up, down) `moe_stack.ExpertStack`s, whose views the matrices hold; (): the loops (the experts are not
    # stackable, or a caller asked for the loops); None: stacked when built (`__post_init__`)
    stacks: tuple | None = None

    def __post_init__(self):
        if self.stacks is None:
            stacks = (moe_stack.stack(self.gate_up), moe_stack.stack(self.down))
            object.__setattr__(self, "stacks", stacks if None not in stacks else ())

    def arrays(self) -> list:
        """The matrices held (each has `nbytes`)."""
        shared = [] if self.shared_gate_up is None else [self.shared_gate_up, self.shared_down]
        return [self.router, *self.gate_up, *self.down, *shared]

    @property
    def batch1_bytes(self) -> int:
        """Bytes one token's FFN reads: the router, `k` experts (a block's experts are all one size and type,
        so any k of them), the shared expert and the biases of those."""
        expert = self.gate_up[0].nbytes + self.down[0].nbytes
        shared = 0 if self.shared_gate_up is None else self.shared_gate_up.nbytes + self.shared_down.nbytes
        per_expert_bias = (self.gate_up_bias.nbytes + self.down_bias.nbytes) // max(len(self.gate_up), 1)
        return (self.router.nbytes + self.k * (expert + per_expert_bias) + shared + self.bias.nbytes
                + self.shared_gate.nbytes + self.router_bias.nbytes)

    @property
    def nbytes(self) -> int:
        biases = self.router_bias.nbytes + self.gate_up_bias.nbytes + self.down_bias.nbytes + \
            self.router_scale.nbytes + self.expert_scales.nbytes
        return sum(m.nbytes for m in self.arrays()) + self.bias.nbytes + self.shared_gate.nbytes + biases


def _slices(model: GGUFModel, name: str, experts: int) -> list[tuple[int, np.ndarray, tuple[int, int]]]:
    """(type, bytes, (rows, cols)) of each expert's slice of a 3-D tensor `[experts, rows, cols]` (no copy)."""
    t = model.tensors[name]
    rows = t.shape[1]
    return [(int(t.ggml_type), t.data[e * rows : (e + 1) * rows], t.shape[1:]) for e in range(experts)]


def load_experts(model: GGUFModel, i: int, activations: str) -> CpuExperts:
    """Block `i`'s router and experts (`MixtureOfExperts` tensor names), in the file's quantization."""
    c = model.config
    moe, e, p = c.moe, c.num_experts, f"blk.{i}."
    parts = [_slices(model, p + n + ".weight", e) for n in moe.expert_tensors]
    bias = model.tensors[p + "exp_probs_b.bias"].dequantize().reshape(-1) if moe.selection_bias else \
        np.empty(0, np.float32)
    shared = {}
    if moe.shared_expert:
        names = [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"]
        shared = {"shared_gate_up": tensor_matrix(model, names, activations),
                  "shared_down": tensor_matrix(model, [p + "ffn_down_shexp.weight"], activations)}
        if moe.shared_expert_gate:
            shared["shared_gate"] = np.ascontiguousarray(
                model.tensors[p + "ffn_gate_inp_shexp.weight"].dequantize().reshape(-1), np.float32)
    vector = lambda name: np.ascontiguousarray(model.tensors[p + name].dequantize(), np.float32)  # noqa: E731
    if moe.router_input_norm:
        shared["router_scale"] = vector("ffn_gate_inp.scale") / np.float32(np.sqrt(c.hidden_size))
    if moe.expert_scales:
        shared["expert_scales"] = vector("ffn_down_exps.scale")
    if moe.biases:
        shared |= {"router_bias": vector("ffn_gate_inp.bias").reshape(-1),
                   "gate_up_bias": np.concatenate([vector(n + ".bias") for n in moe.expert_tensors], axis=1),
                   "down_bias": vector("ffn_down_exps.bias")}
    return CpuExperts(
        moe=moe,
        router=tensor_matrix(model, [p + "ffn_gate_inp.weight"], activations),
        bias=np.ascontiguousarray(bias, np.float32),
        gate_up=[concat_rows("+".join(f"{p}{n}.weight[{x}]" for n in moe.expert_tensors), [part[x] for part in parts],
                             activations) for x in range(e)],
        down=[quant_matrix(f"{p}ffn_down_exps.weight[{x}]", *s, activations)
              for x, s in enumerate(_slices(model, p + "ffn_down_exps.weight", e))],
        k=c.experts_per_token,
        scale=c.expert_weight_scale,
        **shared,
    )


def experts_ffn(x: np.ndarray, experts: CpuExperts, activation: tuple, out: np.ndarray,
                router_input: np.ndarray | None = None, prompt: np.ndarray = NO_ROWS) -> int:
    """out = each token's chosen experts' weighted sum of down_e(act(gate_e x) · up_e x) (times each expert's
    scale where there are `expert_scales`); returns kernel calls.

    x float32 `[tokens, hidden]` (the normed FFN input), out float32 `[tokens, hidden]`; activation: the
    (parallel, serial) gated-activation kernels (`layers.GATED_ACTIVATIONS`); router_input: what the router
    reads where it is not x (gemma4's normed residual), float32 `[tokens, hidden]`; prompt int64 `[p]`
    ascending: the rows of x on the prompt kernels (`StepInputs.prompt_rows`, `QuantMatrix.matmul_prompt`), in
    every expert a row goes to. Experts are added in index order, each token's sum the same whatever its batch
    mates.
    """
    logits = experts.router.matmul(x if router_input is None else router_input)
    if experts.router_bias.size:
        logits += experts.router_bias
    weights, chosen = route(logits, experts.moe, experts.k, experts.scale, experts.bias)
    if experts.expert_scales.size:
        weights = weights * experts.expert_scales[chosen]
    if not len(prompt) and (experts.stacks or x.shape[0] == 1):
        calls = (moe_stack.decode_experts(x, experts, weights, chosen, activation, out) if experts.stacks
                 else _one_token(x, experts, weights[0], chosen[0], activation, out))
        return calls + (_shared_expert(x, experts, activation, out) if experts.shared_gate_up is not None else 0)
    flat = chosen.reshape(-1)  # [tokens · k]
    order = np.argsort(flat, kind="stable")  # the (token, slot) pairs grouped by expert
    counts = np.bincount(flat, minlength=len(experts.gate_up))
    pair_weights = weights.reshape(-1)[order]
    out[:] = 0.0
    start, calls = 0, 1
    for e in np.flatnonzero(counts):
        n = int(counts[e])
        rows = order[start : start + n] // experts.k  # distinct and ascending: a token chooses an expert once
        local = np.flatnonzero(np.isin(rows, prompt)) if len(prompt) else NO_ROWS  # its prompt rows
        gate_up = experts.gate_up[e].matmul_prompt(np.ascontiguousarray(x[rows]), local)  # [n, 2 expert_ffn]
        if experts.gate_up_bias.size:
            gate_up += experts.gate_up_bias[e]
        act = np.empty((n, gate_up.shape[1] // 2), np.float32)
        activation[n <= SERIAL_TOKENS](gate_up, act)
        y = experts.down[e].matmul_prompt(act, local)
        if experts.down_bias.size:
            y += experts.down_bias[e]
        out[rows] += y * pair_weights[start : start + n, None]
        start += n
        calls += 3
    if experts.shared_gate_up is not None:
        calls += _shared_expert(x, experts, activation, out)
    return calls


def _one_token(x: np.ndarray, experts: CpuExperts, weights: np.ndarray, chosen: np.ndarray, activation: tuple,
               out: np.ndarray) -> int:
    """`experts_ffn`'s expert loop for one token (a batch-1 decode step), without grouping pairs by expert:
    its k experts in index order, so the same sums in the same order as the grouped loop. x float32
    `[1, hidden]` (C-contiguous), weights float32 `[k]`, chosen int64 `[k]`; returns kernel calls."""
    out[:] = 0.0
    for slot in np.argsort(chosen, kind="stable"):
        e = int(chosen[slot])
        gate_up = experts.gate_up[e].matmul(x)  # [1, 2 expert_ffn]
        if experts.gate_up_bias.size:
            gate_up += experts.gate_up_bias[e]
        act = np.empty((1, gate_up.shape[1] // 2), np.float32)
        activation[1 <= SERIAL_TOKENS](gate_up, act)
        y = experts.down[e].matmul(act)
        if experts.down_bias.size:
            y += experts.down_bias[e]
        out += y * weights[slot]
    return 1 + 3 * len(chosen)


def _shared_expert(x: np.ndarray, experts: CpuExperts, activation: tuple, out: np.ndarray) -> int:
    """out += the shared expert's FFN of x, times sigmoid(x · shared_gate) where there is that gate (llama.cpp
    src/models/qwen2moe.cpp); returns kernel calls. Each row's gate is its own sum (batch invariant)."""
    gate_up = experts.shared_gate_up.matmul(x)  # [tokens, 2 shared_ffn]
    act = np.empty((x.shape[0], gate_up.shape[1] // 2), np.float32)
    activation[x.shape[0] <= SERIAL_TOKENS](gate_up, act)
    y = experts.shared_down.matmul(act)
    if experts.shared_gate.size:
        y *= np.float32(1.0) / (np.float32(1.0) + np.exp(-(x * experts.shared_gate).sum(axis=1, keepdims=True)))
    out += y
    return 3
