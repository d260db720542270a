"""The router's choice and the experts' sum on both runners, against hand-worked values.

Routing (llama.cpp `build_moe_ffn`): logits [1, 3, 2, 0] under softmax choose experts 1 and 2 with
probabilities e^3/Σ and e^2/Σ (Σ = e + e^3 + e^2 + 1), renormalised to sigmoid(1) and 1 - sigmoid(1);
top-k-then-softmax gives the same pair; sigmoid gating with a selection bias of 2 on expert 3 chooses
3 (sigmoid(0) + 2 = 2.5) and then 1, weighted by the unbiased sigmoid(0) and sigmoid(3). Ties choose
the lower index. The experts' sum is checked against a float64 loop over each token's chosen experts,
on a router that sends every token to expert 3 first and, its other scores tied, to expert 0 second:
six experts receive no token; and with a shared expert behind a sigmoid gate added for every token
(llama.cpp's qwen2moe), against the same loop.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridgate.models import Activation, Gating, MixtureOfExperts
from hybridgate.workers.cpu import moe as cpu_moe
from hybridgate.workers.cpu.layers import GATED_ACTIVATIONS
from hybridgate.workers.cpu.quant import F32, quant_matrix
from hybridgate.workers.gpu import moe as gpu_moe
from hybridgate.workers.gpu.layers import ACTIVATIONS

SIG1 = 1.0 / (1.0 + math.exp(-1.0))
SIG3 = 1.0 / (1.0 + math.exp(-3.0))
TOTAL = math.e + math.e**3 + math.e**2 + 1.0
LOGITS = [[1.0, 3.0, 2.0, 0.0]]

CASES = [  # (moe, k, scale, bias, experts, weights)
    (MixtureOfExperts(Gating.SOFTMAX, normalize=True), 2, 1.0, None, [1, 2], [SIG1, 1 - SIG1]),
    (MixtureOfExperts(Gating.SOFTMAX), 2, 1.0, None, [1, 2], [math.e**3 / TOTAL, math.e**2 / TOTAL]),
    (MixtureOfExperts(Gating.TOPK_SOFTMAX), 2, 1.0, None, [1, 2], [SIG1, 1 - SIG1]),
    (MixtureOfExperts(Gating.SOFTMAX), 1, 2.5, None, [1], [2.5 * math.e**3 / TOTAL]),
    (MixtureOfExperts(Gating.SIGMOID, selection_bias=True, normalize=True), 2, 2.5, [0, 0, 0, 2.0], [3, 1],
     [2.5 * 0.5 / (0.5 + SIG3), 2.5 * SIG3 / (0.5 + SIG3)]),
    (MixtureOfExperts(Gating.SOFTMAX, normalize=True), 3, 1.0, None, [1, 2, 0], None),  # three of four, best first
]


def routes(logits, moe, k, scale, bias):
    """Each runner's (weights, experts) as float64 and int64 numpy arrays."""
    t = gpu_moe.route(torch.tensor(logits), moe, k, scale, None if bias is None else torch.tensor(bias))
    c = cpu_moe.route(np.asarray(logits, np.float32), moe, k, scale,
                      None if bias is None else np.asarray(bias, np.float32))
    return [(np.asarray(w, np.float64), np.asarray(e)) for w, e in (
        (t[0].numpy(), t[1].numpy()), c)]


@pytest.mark.parametrize("moe, k, scale, bias, experts, weights", CASES)
def test_route_matches_hand_worked_values(moe, k, scale, bias, experts, weights):
    for got_w, got_e in routes(LOGITS, moe, k, scale, bias):
        assert got_e.tolist() == [experts]
        if weights is not None:
            np.testing.assert_allclose(got_w[0], weights, rtol=1e-6)


def test_ties_choose_the_lower_expert_index():
    logits = [[2.0, 0.5, 2.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]]
    for got_w, got_e in routes(logits, MixtureOfExperts(Gating.SOFTMAX, normalize=True), 2, 1.0, None):
        assert got_e.tolist() == [[0, 2], [0, 1]]
        np.testing.assert_allclose(got_w, 0.5, rtol=1e-6)


# ---- the experts' weighted sum: every token to expert 3 first, expert 0 second (a tie among the rest) ----

EXPERTS, HIDDEN, FFN, TOKENS, K = 8, 32, 32, 5, 2
FIRST = 1.0 / (1.0 + math.exp(-5.0))  # renormalised weight of expert 3 against expert 0: sigmoid(5)


def _weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    x[:, 0] = 1.0  # the router reads only this column
    router = np.zeros((EXPERTS, HIDDEN), np.float32)
    router[3, 0] = 5.0  # logits [0, 0, 0, 5, 0, 0, 0, 0] for every token
    gate_up = (rng.standard_normal((EXPERTS, 2 * FFN, HIDDEN)) / math.sqrt(HIDDEN)).astype(np.float32)
    down = (rng.standard_normal((EXPERTS, HIDDEN, FFN)) / math.sqrt(FFN)).astype(np.float32)
    return x, router, gate_up, down


def _reference(x, gate_up, down) -> np.ndarray:
    """float64: each token's sigmoid(5) · expert 3 + (1 - sigmoid(5)) · expert 0, each SwiGLU."""
    out = np.zeros(x.shape, np.float64)
    for t in range(TOKENS):
        for e, w in ((3, FIRST), (0, 1.0 - FIRST)):
            h = gate_up[e].astype(np.float64) @ x[t]
            g, u = h[:FFN], h[FFN:]
            out[t] += w * (down[e].astype(np.float64) @ (g / (1.0 + np.exp(-g)) * u))
    return out


def _shared(seed: int = 1):
    """A shared expert's gate|up `[2 FFN, HIDDEN]`, down `[HIDDEN, FFN]` and gate `[HIDDEN]` (float32)."""
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((2 * FFN, HIDDEN)) / math.sqrt(HIDDEN)).astype(np.float32),
            (rng.standard_normal((HIDDEN, FFN)) / math.sqrt(FFN)).astype(np.float32),
            rng.standard_normal(HIDDEN).astype(np.float32))


def _shared_reference(x, gate_up, down, gate) -> np.ndarray:
    """float64: sigmoid(x · gate) · down(silu(g) · u) for each token."""
    h = x.astype(np.float64) @ gate_up.T.astype(np.float64)
    g, u = h[:, :FFN], h[:, FFN:]
    y = (g / (1.0 + np.exp(-g)) * u) @ down.T.astype(np.float64)
    return y / (1.0 + np.exp(-(x.astype(np.float64) @ gate.astype(np.float64))))[:, None]


def test_torch_experts_every_token_to_one_expert_and_idle_experts():
    x, router, gate_up, down = _weights()
    weights, experts = gpu_moe.route(torch.from_numpy(x @ router.T), MixtureOfExperts(normalize=True), K)
    assert experts.tolist() == [[3, 0]] * TOKENS
    got = gpu_moe.experts_ffn(torch.from_numpy(x), weights, experts, torch.from_numpy(gate_up).transpose(1, 2),
                              torch.from_numpy(down).transpose(1, 2), ACTIVATIONS[Activation.SILU])
    np.testing.assert_allclose(got.numpy(), _reference(x, gate_up, down), atol=1e-5)
    sgu, sd, sg = _shared()
    shared = gpu_moe.shared_expert(torch.from_numpy(x), torch.from_numpy(sgu).t(), torch.from_numpy(sd).t(),
                                   torch.from_numpy(sg), ACTIVATIONS[Activation.SILU])
    np.testing.assert_allclose(shared.numpy(), _shared_reference(x, sgu, sd, sg), atol=1e-5)


def _numba_experts(with_shared: bool):
    """(x, the CPU runner's experts of `_weights` (and `_shared`) as F32 matrices, the reference output)."""
    x, router, gate_up, down = _weights()
    sgu, sd, sg = _shared()
    matrix = lambda name, w: quant_matrix(name, F32, w.view(np.uint8), w.shape, "f32")  # noqa: E731
    shared = dict(shared_gate_up=matrix("shared_gate_up", sgu), shared_down=matrix("shared_down", sd),
                  shared_gate=sg) if with_shared else {}
    experts = cpu_moe.CpuExperts(
        moe=MixtureOfExperts(normalize=True, shared_expert=with_shared, shared_expert_gate=with_shared),
        router=matrix("router", router), bias=np.empty(0, np.float32),
        gate_up=[matrix(f"gate_up[{e}]", gate_up[e]) for e in range(EXPERTS)],
        down=[matrix(f"down[{e}]", down[e]) for e in range(EXPERTS)], k=K, scale=1.0, **shared)
    want = _reference(x, gate_up, down) + (_shared_reference(x, sgu, sd, sg) if with_shared else 0.0)
    return x, experts, want


@pytest.mark.parametrize("with_shared", [False, True])
def test_numba_experts_every_token_to_one_expert_and_idle_experts(with_shared):
    x, experts, want = _numba_experts(with_shared)
    out = np.full((TOKENS, HIDDEN), np.nan, np.float32)
    calls = cpu_moe.experts_ffn(x, experts, GATED_ACTIVATIONS["silu"], out)
    np.testing.assert_allclose(out, want, atol=1e-5)
    # the router, three kernels for each of the two experts read, three for the shared expert
    assert calls == 1 + 3 * 2 + 3 * with_shared


@pytest.mark.parametrize("experts, used", [(8, 9), (8, 0), (0, 8)])
def test_config_refuses_more_experts_per_token_than_experts(experts, used):
    from hybridgate.models import ARCHITECTURES, ModelConfig, ModelLoadError

    with pytest.raises(ModelLoadError, match=f"expert_used_count {used} must be in 1..expert_count {experts}"):
        ModelConfig("qwen3moe", "", 1, 64, 192, 4, 2, 16, 4096, 1e6, 1e-6, 260, 1, 2, False,
                    arch=ARCHITECTURES["qwen3moe"], num_experts=experts, experts_per_token=used,
                    expert_intermediate_size=32)


@pytest.mark.parametrize("with_shared", [False, True])
def test_numba_experts_one_token_alone_gives_its_row_of_the_batch(with_shared):
    """A batch-1 step takes the ungrouped loop: each token alone gives the reference and, bit for bit, its
    row of the grouped batch (the experts added in the same order)."""
    x, experts, want = _numba_experts(with_shared)
    batch = np.full((TOKENS, HIDDEN), np.nan, np.float32)
    cpu_moe.experts_ffn(x, experts, GATED_ACTIVATIONS["silu"], batch)
    for t in range(TOKENS):
        alone = np.full((1, HIDDEN), np.nan, np.float32)
        calls = cpu_moe.experts_ffn(np.ascontiguousarray(x[t : t + 1]), experts, GATED_ACTIVATIONS["silu"], alone)
        np.testing.assert_allclose(alone[0], want[t], atol=1e-5)
        assert np.array_equal(alone[0], batch[t])
        assert calls == 1 + 3 * K + 3 * with_shared
