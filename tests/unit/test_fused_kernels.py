"""The fused Triton kernels (`kernels.fused`) against the eager torch ops they replace (`gpu.layers`), under
Triton's interpreter on the CPU (compiled on a GPU by `make gpu-check`).

The reference is computed in float64 from the same stored inputs, with the eager path's roundings to the
tensors' dtype where it rounds (bf16: the residual sum, the normalized row, its product with the weight,
the activation); a hand-worked literal pins each kernel's convention (which elements rotate together,
which columns are gate and up). Bounds are fixed: in fp32 a few float32 units (float32 order of
operations), in bf16 one bf16 unit of the output's magnitude (2^-8 relative: both sides round the same
float32 values, which differ by float32 noise, so at most one rounding step apart).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from hybridgate.workers.gpu.kernels.fused import (GELU_TANH, ROTATE_HALVES, ROTATE_PAIRS, SILU, SWIGLU_OAI, act_mul,
                                                  add_rms_norm, rope)

DEVICE = torch.device("cpu" if triton.knobs.runtime.interpret else "cuda")
BOUND = {torch.float32: 8 * 2.0**-24, torch.bfloat16: 2.0**-8}  # relative to the output's largest magnitude
EPS = 1e-6


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


def ref_norm(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm in float64, rounded where the eager bf16 path rounds: w * round(x / rms(x))."""
    return rounded(w.double() * rounded(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS), dtype), dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.abs().amax().item()
    err = (got.cpu().double() - want).abs().amax().item()
    assert err <= BOUND[dtype] * scale, (err, BOUND[dtype] * scale)


def randn(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("residual", "post"), [(False, False), (True, False), (True, True)])
def test_add_rms_norm(dtype, residual, post):
    hidden = 40  # not a power of two: the padded lanes must not count in the mean
    x, res = randn(5, hidden, dtype=dtype) * 3, randn(5, hidden, dtype=dtype, seed=1)
    w, pw = randn(hidden, dtype=dtype, seed=2), randn(hidden, dtype=dtype, seed=3)
    r = x.double()
    if post:
        r = ref_norm(r, pw, dtype)
    if residual:
        r = rounded(r + res.double(), dtype)
    res_dev = res.to(DEVICE)
    normed, new_res = add_rms_norm(x.to(DEVICE), res_dev if residual else None, w.to(DEVICE), EPS,
                                   pw.to(DEVICE) if post else None)
    close(normed, ref_norm(r, w, dtype), dtype)
    close(new_res, r, dtype)
    assert normed.dtype == dtype and (new_res is res_dev) == residual  # the residual is updated in place


def test_add_rms_norm_hand_worked():
    # x = [3, 4] with residual [1, 0] and no post norm: r = [4, 4], rms 4, normed = w = [0.5, 2].
    normed, res = add_rms_norm(torch.tensor([[3.0, 4.0]], device=DEVICE), torch.tensor([[1.0, 0.0]], device=DEVICE),
                               torch.tensor([0.5, 2.0], device=DEVICE), 0.0)
    assert normed.cpu().tolist() == [[0.5, 2.0]] and res.cpu().tolist() == [[4.0, 4.0]]


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: int) -> torch.Tensor:
    """float64 rotation: pairs (2i, 2i+1) or halves (i, i + d/2)."""
    d = x.shape[-1]
    i0 = torch.arange(0, d, 2) if layout == ROTATE_PAIRS else torch.arange(d // 2)
    i1 = i0 + (1 if layout == ROTATE_PAIRS else d // 2)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    out = x.clone()
    out[..., i0] = x[..., i0] * c - x[..., i1] * s
    out[..., i1] = x[..., i0] * s + x[..., i1] * c
    return out


def angles(tokens: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.arange(tokens, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    return a.cos().to(dtype), a.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [ROTATE_PAIRS, ROTATE_HALVES])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope(dtype, layout, qk_norm):
    tokens, heads, kv_heads, d = 3, 5, 1, 24  # 6 heads in all, head_dim 24: both padded to powers of two
    qkv = randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype) * 2  # rotated in place inside the QKV product
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
    cos, sin = angles(tokens, d, dtype)
    w = randn(heads + kv_heads, d, dtype=dtype, seed=4) if qk_norm else None
    x = ref_norm(qk.double(), w, dtype) if qk_norm else qk.double()
    want = ref_rope(x, cos, sin, layout)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    qkv_dev = qkv.to(DEVICE)
    out = rope(qkv_dev[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos.to(DEVICE), sin.to(DEVICE),
               layout, None if w is None else w.to(DEVICE), EPS)
    close(out, want, dtype)
    assert torch.equal(qkv_dev[:, (heads + kv_heads) * d :].cpu(), v_before)  # V untouched


@pytest.mark.parametrize(("layout", "want"), [(ROTATE_PAIRS, [-2.0, 1.0, 3.0, 4.0]),
                                              (ROTATE_HALVES, [-3.0, 2.0, 1.0, 4.0])])
def test_rope_hand_worked(layout, want):
    # x = [1, 2, 3, 4], a quarter turn for the first frequency, none for the second:
    # pairs rotate (x0, x1) -> (-x1, x0); halves rotate (x0, x2) -> (-x2, x0).
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], device=DEVICE)
    rope(x, torch.tensor([[0.0, 1.0]], device=DEVICE), torch.tensor([[1.0, 0.0]], device=DEVICE), layout)
    assert x.cpu().flatten().tolist() == want


def ref_act(gate_up: torch.Tensor, act: int, dtype) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    if act == SILU:
        a = g / (1 + torch.exp(-g))
    elif act == SWIGLU_OAI:  # transformers' GptOssExperts: gate clamped above at 7, up to [-7, 7], plus 1
        g = g.clamp(max=7.0)
        a, u = g * torch.sigmoid(1.702 * g), u.clamp(-7.0, 7.0) + 1
    else:
        a = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    return rounded(rounded(a, dtype) * u, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100) is inf: the interpreter's numpy says so
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [SILU, GELU_TANH, SWIGLU_OAI])
def test_act_mul(dtype, act):
    gate_up = randn(4, 2 * 1100, dtype=dtype) * 4  # 1100 columns: two column blocks, the second ragged
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-4])  # saturated, zero, tiny: tanh's edges
    close(act_mul(gate_up.to(DEVICE), act), ref_act(gate_up, act, dtype), dtype)


def test_act_mul_matches_torch_functions():
    """The eager path's own functions (F.silu, F.gelu tanh) on a few hand-picked values."""
    g = torch.tensor([[-3.0, -0.5, 0.0, 0.5, 3.0]])
    gate_up = torch.cat([g, torch.full_like(g, 2.0)], 1)
    for act, fn in ((SILU, torch.nn.functional.silu),
                    (GELU_TANH, lambda t: torch.nn.functional.gelu(t, approximate="tanh"))):
        got = act_mul(gate_up.to(DEVICE), act).cpu()
        assert (got - 2 * fn(g)).abs().max().item() <= 1e-6


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm weights must be \[8\]"):
        add_rms_norm(x, None, torch.zeros(4, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm(x, torch.zeros(3, 8, device=DEVICE), torch.zeros(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope(torch.zeros(1, 2, 5, device=DEVICE), torch.zeros(1, 2, device=DEVICE), torch.zeros(1, 2, device=DEVICE),
             ROTATE_PAIRS)
    with pytest.raises(ValueError, match="even width"):
        act_mul(torch.zeros(1, 7, device=DEVICE), SILU)
