"""The Triton paged-attention kernels against the reference path (gather by block table, then causal SDPA),
under Triton's interpreter on the CPU (on a CUDA machine, compiled: `make gpu-check` runs this file).

Tiny shapes: decode only, prefill only, mixed steps; a chunked prefill after a prefix-cache hit; contexts
of 1 token, exactly one block and one block + 1 (every slot outside the contexts holds NaN, which must
never reach an output); windows shorter and longer than the context; softcap on and off; GQA ratios 1, 2, 4 and 8; head_dim 64, 128 and 256; fp32, fp16 and bf16 KV; the split-KV path.

The error bound is derived, not measured (`bound`): both sides compute in float32 from the same stored
values, so they differ by float32 rounding (each score's dot product of d terms: at most d·u·scale·Σ|q||k|,
which moves a softmax weight by at most twice that, relative; the weighted sum of n values: n·u of the
largest |v|), plus the rounding of the output to the query's dtype (u of that dtype times the largest |v|).
Under the interpreter every `tl.dot` takes float32 operands (FACTS.md: its bf16 dot is wrong); a GPU's
bf16 and fp16 dots (P rounded to the KV dtype before P·V) are checked by `make gpu-check`.
"""

from __future__ import annotations

import json

import pytest
import torch
import triton

from hybridgate.workers.gpu.kernels.attention import paged_attention, write_kv
from hybridgate.workers.gpu.layers import causal_sdpa

# Interpreted on the CPU (tests/conftest.py sets TRITON_INTERPRET=1), compiled on a GPU under gpu-check.
DEVICE = torch.device("cpu" if triton.knobs.runtime.interpret else "cuda")
BLOCK = 16
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float, out_dtype) -> float:
    """The largest difference the rounding can make (module doc), from the data's magnitudes."""
    u, d = UNIT[torch.float32], q.shape[-1]
    dot = d * u * scale * (q.abs().amax() * k.abs().amax() * d).item()
    vmax = v.abs().amax().item()
    return (2 * dot + ctx * u) * vmax + UNIT[out_dtype] * vmax + 1e-30


def run_step(entries, heads, kv_heads, head_dim, dtype=torch.float32, window=0, cap=0.0, splits=1, seed=0,
             sinks=None):
    """entries: (context after the step, new tokens) per sequence. Writes the new tokens' K/V with `write_kv`
    into a cache of shuffled blocks, then checks `paged_attention` against `causal_sdpa` per sequence
    (sinks: float32 `[heads]` attention sinks on both sides, or None)."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-ctx // BLOCK) for ctx, _ in entries) + 2
    kc = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g).tolist()
    tables, starts, used = [], [0], 0
    for ctx, n in entries:
        need = -(-ctx // BLOCK)
        tables.append(order[used : used + need])
        used += need
        starts.append(starts[-1] + n)
    table = torch.zeros(len(entries), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    slots = torch.cat([(torch.tensor(t)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[ctx - n : ctx]
                       for t, (ctx, n) in zip(tables, entries)])
    unused = torch.ones(blocks * BLOCK, dtype=torch.bool)  # slots of no context: NaN, which must never be read
    for t, (ctx, _) in zip(tables, entries):
        unused[(torch.tensor(t)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:ctx]] = False
    kc[unused], vc[unused] = float("nan"), float("nan")
    q = torch.randn(starts[-1], heads, head_dim, generator=g).to(dtype)
    k_new = torch.randn(starts[-1], kv_heads, head_dim, generator=g).to(dtype)
    v_new = torch.randn(starts[-1], kv_heads, head_dim, generator=g).to(dtype)
    expect_k, expect_v = kc.clone(), vc.clone()
    expect_k[slots], expect_v[slots] = k_new, v_new
    kc, vc, table = kc.to(DEVICE), vc.to(DEVICE), table.to(DEVICE)
    write_kv(k_new.to(DEVICE), v_new.to(DEVICE), kc, vc, slots.to(DEVICE))
    for got, want in ((kc.cpu(), expect_k), (vc.cpu(), expect_v)):  # every slot, bit for bit (NaN where NaN)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    scale = head_dim**-0.5
    out = paged_attention(q.to(DEVICE), kc, vc, table, torch.tensor([c for c, _ in entries], dtype=torch.int32,
                          device=DEVICE), torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                          max(n for _, n in entries), BLOCK, scale, cap, window, splits,
                          dot_fp32=DEVICE.type == "cpu", sinks=None if sinks is None else sinks.to(DEVICE)).cpu()
    kf, vf, qf = expect_k.float(), expect_v.float(), q.float()
    for i, ((ctx, n), t) in enumerate(zip(entries, tables)):
        context = (torch.tensor(t)[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:ctx]
        ref = causal_sdpa(qf[starts[i] : starts[i + 1]], kf[context], vf[context], ctx - n, window, scale, cap,
                          sinks)
        got = out[starts[i] : starts[i + 1]].float()
        limit = bound(qf, kf[context], vf[context], ctx, scale, dtype)
        assert (got - ref).abs().max().item() <= limit, (i, ctx, n, (got - ref).abs().max().item(), limit)


DECODES = [(1, 1), (BLOCK, 1), (BLOCK + 1, 1), (3 * BLOCK + 5, 1)]  # 1 token, one block, one block + 1, more
PREFILLS = [(BLOCK + 1, BLOCK + 1), (2 * BLOCK, 2 * BLOCK)]
CHUNKS = [(3 * BLOCK + 2, 9), (2 * BLOCK, BLOCK)]  # a chunk over a cached prefix (a prefix-cache hit)


@pytest.mark.parametrize(("name", "entries"), [("decode", DECODES), ("prefill", PREFILLS),
                                               ("mixed", DECODES[:2] + CHUNKS + PREFILLS[:1])])
@pytest.mark.parametrize("splits", [1, 4])
def test_steps_match_the_reference(name, entries, splits):
    run_step(entries, heads=4, kv_heads=2, head_dim=64, splits=splits)


@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
def test_gqa_ratios(ratio):
    run_step(DECODES[2:] + CHUNKS[:1], heads=2 * ratio, kv_heads=2, head_dim=64, seed=ratio)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(head_dim):
    run_step(DECODES[1:3] + CHUNKS[:1], heads=2, kv_heads=1, head_dim=head_dim, seed=head_dim)


@pytest.mark.parametrize("window", [4, BLOCK + 3, 1000])  # shorter than a block, past a block, past every context
@pytest.mark.parametrize("splits", [1, 2])
def test_sliding_windows(window, splits):
    run_step(DECODES + CHUNKS, heads=4, kv_heads=2, head_dim=64, window=window, splits=splits, seed=window)


@pytest.mark.parametrize("cap", [0.0, 50.0, 5.0])
def test_softcap(cap):
    run_step(DECODES[1:] + CHUNKS, heads=4, kv_heads=1, head_dim=64, cap=cap, window=8 if cap == 5.0 else 0)


@pytest.mark.parametrize("splits", [1, 4])
def test_attention_sinks(splits):
    # gpt-oss: one logit per head that takes softmax weight and carries no value. Sinks from well below to
    # well above the scores (the latter leave almost nothing for the keys), with a window so that some
    # queries see few keys, GQA 2, and the split-KV path, whose combine must count each sink once.
    sinks = torch.tensor([-30.0, -1.0, 0.5, 6.0])
    run_step(DECODES + CHUNKS + PREFILLS[:1], heads=4, kv_heads=2, head_dim=64, window=BLOCK + 3, splits=splits,
             seed=11, sinks=sinks)
    with pytest.raises(ValueError, match=r"sinks must be \[heads\]"):
        run_step(DECODES[:1], heads=4, kv_heads=2, head_dim=64, sinks=sinks[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_kv(dtype):
    run_step(DECODES[1:] + CHUNKS[:1] + PREFILLS[:1], heads=4, kv_heads=2, head_dim=128, dtype=dtype)


def test_padding_slots_are_not_written():
    kc = torch.zeros(2 * BLOCK, 1, 8, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 1, 8, device=DEVICE)
    write_kv(k, 2 * k, kc, vc, torch.tensor([5, -1, 7], device=DEVICE))
    assert kc.sum().item() == 16 and vc[7].sum().item() == 16 and vc[5].sum().item() == 16


def test_bad_shapes_are_refused():
    q = torch.zeros(1, 3, 8)
    kc = torch.zeros(BLOCK, 2, 8)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(q, kc, kc, one[:, None], one + 1, torch.tensor([0, 1], dtype=torch.int32), 1, BLOCK, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(torch.zeros(1, 2, 8), kc, kc, one[:, None], one + 1, torch.tensor([0, 1], dtype=torch.int32),
                        1, BLOCK, 1.0, num_splits=3)


def test_bench_attention_runs_its_cases_and_writes_its_figures(tmp_path):
    """`hybridgate bench attention --smoke` (tiny shapes; on the CPU, interpreted): every row names its paths'
    medians and the figure it is judged by (a check of the benchmark before a lent GPU's minutes are spent)."""
    from hybridgate.cli import main

    out = tmp_path / "attention.json"
    assert main(["bench", "attention", "--smoke", "--dtype", "fp32", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "64", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    decode, prefill = result["rows"]
    assert set(decode["ms"]) == set(prefill["ms"]) == {"ours", "reference", "dense"}
    assert decode["kv_bytes"] == 2 * 2 * 33 * 2 * 64 * 4 and 0 < decode["fraction_of_copy_bandwidth"]
    assert prefill["query_tokens"] == 16 and 0 < prefill["fraction_of_matmul_rate"]
