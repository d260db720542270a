"""Where a CPU decode step's time goes by quant type: each weight matrix's matmul timed at batch 1.

Every matrix the CPU model multiplies in a decode step (each layer's QKV, output,
gate-up and down projections, or its router and `k` of its experts, then the LM
head; a fused matrix of parts of different types counts per part) is called on one random activation row, in the
forward pass's order, so each reads its weights from memory as the step does
(a matrix timed alone and repeatedly would sit in the caches). `repeats` passes;
the median per matrix is summed per GGML type.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def step_matrices(model) -> list:
    """The matrices of one decode step in the forward pass's order, fused ones split into their parts;
    [] when the model does not expose them (a runner whose layers hold no `matmul` objects)."""
    out = []
    for i, layer in enumerate(getattr(model, "layers", []), start=1):
        for name in ("qkv", "wo", "gate_up", "down"):
            m = getattr(layer, name, None)
            out += list(getattr(m, "parts", [m])) if m is not None else []
        experts = getattr(layer, "experts", None)
        if experts is not None:  # the router and k experts, a different k in each layer as a token's choice
            chosen = [(i * 7 + j * 13) % len(experts.gate_up) for j in range(experts.k)]
            for m in [experts.router, *(m for e in chosen for m in (experts.gate_up[e], experts.down[e]))]:
                out += list(getattr(m, "parts", [m]))
    out.append(getattr(model, "lm_head", None))
    return [m for m in out if hasattr(m, "matmul") and hasattr(m, "kind")]


def type_shares(model, step_ms: float, repeats: int = 5) -> dict:
    """{type name: {"matrices", "bytes", "ms", "share", "gb_per_s"}} plus "other_ms" (the step less
    every matmul: attention, norms, activations, sampling, Python) for a step of `step_ms`.
    Each type's ms is the median per matrix, summed; share is of `step_ms`."""
    import gguf

    matrices = step_matrices(model)
    if not matrices:
        return {}
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, m.shape[1]), dtype=np.float32) for m in matrices]
    times: list[list[float]] = [[] for _ in matrices]
    for m, x in zip(matrices, inputs):  # compile and page in once
        m.matmul(x)
    for _ in range(repeats):
        for i, (m, x) in enumerate(zip(matrices, inputs)):
            start = time.perf_counter()
            m.matmul(x)
            times[i].append(time.perf_counter() - start)
    out: dict = {}
    for m, t in zip(matrices, times):
        row = out.setdefault(gguf.GGMLQuantizationType(m.kind).name, {"matrices": 0, "bytes": 0, "ms": 0.0})
        row["matrices"] += 1
        row["bytes"] += int(m.nbytes)
        row["ms"] += statistics.median(t) * 1e3
    for row in out.values():
        row["share"] = row["ms"] / step_ms
        row["gb_per_s"] = row["bytes"] / row["ms"] / 1e6
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))
    out["other_ms"] = step_ms - sum(row["ms"] for row in out.values())
    return out


def print_shares(out: dict, model, repeats: int) -> None:
    out["type_shares_c1"] = shares = type_shares(model, out["decode_step_ms_c1"], max(repeats, 3))
    for name, row in shares.items():
        if isinstance(row, dict):
            print(f"  {name:6} {row['matrices']:4} matrices {row['bytes'] / 2**20:8.1f} MiB {row['ms']:8.3f} ms "
                  f"({row['share']:.0%} of the step, {row['gb_per_s']:.1f} GB/s)", flush=True)
    if shares:
        print(f"  other  {shares['other_ms']:.3f} ms (attention, norms, activations, sampling, Python)", flush=True)
