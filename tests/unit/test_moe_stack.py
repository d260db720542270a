"""The decode step's experts over stacked arrays (`moe_stack`) against gguf's dequantizer, and bit for bit
against each expert's own matmul as `moe.experts_ffn`'s loops call it.

Experts in Q4_K (gate|up) and Q6_K (down), as llama.cpp's Q4_K_M writes a MoE block, random valid blocks.
The reference: gguf's dequantized weights in float64, each token's chosen experts added with their weights;
the stacked path's error is the int16 activations' rounding (`superblock`: at most max|x_sb| / 65534 per
activation, twice: the input and the gated activation), within 1e-3 of each token's largest output. Bit for
bit: a token alone, the same token among 48 (experts read by about 12 tokens: the GEMM tiles), and the
per-expert loop (`stacks` emptied) agree.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from hybridgate.models import MixtureOfExperts
from hybridgate.workers.cpu import isa, moe, quant
from hybridgate.workers.cpu.layers import GATED_ACTIVATIONS
from tests.unit.test_cpu_kernels import random_blocks

T = gguf.GGMLQuantizationType
EXPERTS, K, HIDDEN, FFN = 12, 3, 256, 256
SILU = GATED_ACTIVATIONS["silu"]


def _experts(rng):
    gate_up_blocks = [random_blocks("Q4_K", 2 * FFN, HIDDEN, rng) for _ in range(EXPERTS)]
    down_blocks = [random_blocks("Q6_K", HIDDEN, FFN, rng) for _ in range(EXPERTS)]
    router = rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32)
    experts = moe.CpuExperts(
        moe=MixtureOfExperts(normalize=True),
        router=quant.quant_matrix("router", int(T.F32), router.view(np.uint8), router.shape, "f32"),
        bias=np.empty(0, np.float32),
        gate_up=[quant.quant_matrix(f"gate_up[{e}]", int(T.Q4_K), b, (2 * FFN, HIDDEN))
                 for e, b in enumerate(gate_up_blocks)],
        down=[quant.quant_matrix(f"down[{e}]", int(T.Q6_K), b, (HIDDEN, FFN)) for e, b in enumerate(down_blocks)],
        k=K, scale=1.0)
    dense = lambda blocks, kind, shape: np.asarray(  # noqa: E731
        gguf.quants.dequantize(blocks, kind), np.float64).reshape(shape)
    weights = ([dense(b, T.Q4_K, (2 * FFN, HIDDEN)) for b in gate_up_blocks],
               [dense(b, T.Q6_K, (HIDDEN, FFN)) for b in down_blocks])
    return experts, router, weights


def _reference(x, router, weights, experts):
    """float64: each token's chosen experts (the runner's own routing of the same logits) weighted and added."""
    w, chosen = moe.route(x @ router.T, experts.moe, experts.k)
    gate_up, down = weights
    out = np.zeros((len(x), HIDDEN))
    for t in range(len(x)):
        for slot in range(K):
            e = chosen[t, slot]
            h = gate_up[e] @ x[t].astype(np.float64)
            gate, up = h[:FFN], h[FFN:]
            out[t] += w[t, slot] * (down[e] @ (gate / (1.0 + np.exp(-gate)) * up))
    return out


@pytest.fixture(scope="module")
def stacked():
    rng = np.random.default_rng(5)
    experts, router, weights = _experts(rng)
    x = rng.standard_normal((48, HIDDEN)).astype(np.float32)
    return experts, router, weights, x


def test_stacked_experts_hold_views_of_one_array_per_part(stacked):
    experts = stacked[0]
    if isa.selected().isa == "generic":
        pytest.skip("the generic path has no super-block matrices: its experts keep the loops")
    assert experts.stacks, "Q4_K and Q6_K experts on this path stack"
    gate_up, down = experts.stacks
    assert gate_up.qs.shape[0] == down.qs.shape[0] == EXPERTS and gate_up.rows == 2 * FFN and down.rows == HIDDEN
    assert all(np.shares_memory(m.qs, gate_up.qs) for m in experts.gate_up)
    assert all(np.shares_memory(m.qs, down.qs) for m in experts.down)


@pytest.mark.parametrize("tokens", [1, 3, 16, 48])  # 48: about 12 rows an expert, the GEMM tiles
def test_stacked_decode_matches_the_dequantized_reference_and_the_loops_bit_for_bit(stacked, tokens):
    experts, router, weights, x = stacked
    x = np.ascontiguousarray(x[:tokens])
    got = np.full((tokens, HIDDEN), np.nan, np.float32)
    calls = moe.experts_ffn(x, experts, SILU, got)
    want = _reference(x, router, weights, experts)
    scale = np.abs(want).max(axis=1, keepdims=True)  # random K-quant blocks: outputs of order 1e6
    assert (np.abs(got - want) <= 1e-3 * scale).all()
    loops = np.full((tokens, HIDDEN), np.nan, np.float32)
    moe.experts_ffn(x, dataclasses.replace(experts, stacks=()), SILU, loops)
    assert np.array_equal(got, loops)
    if experts.stacks:
        assert calls == 1 + 4  # the router, then two matmul regions, the activation and the weighted sum


def test_a_token_alone_gets_its_row_of_the_stacked_batch(stacked):
    experts, _, _, x = stacked
    batch = np.empty((48, HIDDEN), np.float32)
    moe.experts_ffn(x, experts, SILU, batch)
    for t in (0, 7, 47):
        alone = np.empty((1, HIDDEN), np.float32)
        moe.experts_ffn(np.ascontiguousarray(x[t : t + 1]), experts, SILU, alone)
        assert np.array_equal(alone[0], batch[t])
