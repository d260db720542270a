"""The CPU kernels on each instruction-set path this machine runs, each in its own process.

Numba compiles for one target per process, so every path runs in a child
(`python tests/unit/test_cpu_isa.py ISA MODEL`): each quant type on random
blocks (codes at their extremes, subnormal and large fp16 scales too, and fused
matrices of parts of different types) and every tensor of the default model
against gguf's dequantizer times the activations in float64, in each activation format (float32, and int16 per
32-block with integer multiply-adds, whose error is the activations'
quantization), batch invariance, and the target LLVM was given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hybridgate.workers.cpu import isa  # noqa: E402  (no Numba: safe to import here)
from tests.conftest import TIME_FACTOR  # noqa: E402

RUNNABLE = isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):]
TOLERANCE = 1e-5  # relative L2 error of a matmul against float64: fp32 activations, exact weights
# int16 activations: each rounded by at most 2^-16 of its block's largest value; on Gaussian
# activations that is about 2e-5 of the product (relative L2), stated in intdot's docstring.
I16_TOLERANCE = 5e-5


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**(env or os.environ), "PYTHONPATH": str(ROOT)})


def _result(proc: subprocess.Popen, timeout: float = 240) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout * TIME_FACTOR)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checks(model_path):
    """Each runnable path's `check` child, all started at once: each compiles its kernels from cold on a
    fresh machine, mostly on one core, so they overlap on the others."""
    procs = {p: _start([p, "check", str(model_path)]) for p in RUNNABLE}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("path", RUNNABLE)
def test_each_path_matches_the_dequantizer_on_random_blocks_and_every_model_tensor(path, checks):
    out = _result(checks[path], timeout=480)  # the children share the cores
    assert out["isa"] == path
    assert out["numba_cpu_name"] == {"avx512": "skylake-avx512", "avx2": "haswell", "generic": "generic"}[path]
    assert out["random_worst"] <= TOLERANCE, out["random"]
    assert out["model_tensors"] >= 211 and out["model_worst"] <= TOLERANCE, out["model_worst_tensor"]
    assert out["batch_invariant"]
    assert out["i16_random_worst"] <= I16_TOLERANCE, out["i16_random"]
    assert out["i16_model_tensors"] >= 211 and out["i16_model_worst"] <= I16_TOLERANCE, out["i16_model_worst_tensor"]
    assert out["i16_random_worst"] > 1e-7  # the int16 kernels ran (float32 activations are 1e5 times closer)
    assert out["i16_batch_invariant"]
    assert out["edge_rows_exact"] and out["edge_worst"] <= 1e-6, out["edge_worst"]
    assert out["i16_edge_worst"] <= 4e-5, out["i16_edge_worst"]  # test_cpu_kernels' bound for the format


def test_one_cache_entry_per_path_compiled_once_and_avx2_has_no_zmm(tmp_path):
    env = {"HOME": str(tmp_path)}
    base = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    paths = [p for p in ("avx2", "generic") if p in RUNNABLE]
    started = {p: _start([p, "asm"], env={**base, **env}) for p in paths}  # one cache folder each: no clash
    first = {p: _result(proc) for p, proc in started.items()}
    for p in paths:
        assert first[p]["misses"] > 0 and first[p]["asm_bytes"] > 0
        assert "zmm" not in first[p]["registers"], p
    if "avx2" in paths:
        assert "ymm" in first["avx2"]["registers"]
    again = _result(_start(["avx2" if "avx2" in paths else "generic", "asm"], env={**base, **env}))
    assert again["misses"] == 0 and again["hits"] > 0  # loaded from the cache, not compiled again
    folders = sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / ".cache" / "hybridgate" / "numba").iterdir())
    assert folders == sorted(paths)


def test_a_path_the_cpu_cannot_run_or_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="cpu_isa: expected one of"):
        isa.select("sse9")
    if RUNNABLE[0] != "avx512":
        with pytest.raises(ValueError, match="cannot run avx512"):
            isa.select("avx512")


def test_amx_joins_the_avx512_target_only_where_the_cpu_has_it_and_the_setting_allows(tmp_path):
    with pytest.raises(ValueError, match="cpu_amx: expected auto or off, got 'on'"):
        isa.select(amx="on")
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vnni"}
    plain = isa._target("avx512", avx512, tmp_path, amx=True)  # no AMX on this CPU: none asked of LLVM
    assert not plain.amx and "amx" not in plain.features and not plain.cache_dir.endswith("-amx")
    off = isa._target("avx512", avx512 | {"amx-tile", "amx-bf16", "avx512bf16"}, tmp_path, amx=False)
    assert not off.amx and "amx" not in off.features
    if not isa.request_tiles():  # the tile state needs a Linux that grants it (5.16 or later, an AMX CPU)
        pytest.skip("this Linux or CPU grants no AMX tile state")
    on = isa._target("avx512", avx512 | {"amx-tile", "amx-bf16", "avx512bf16"}, tmp_path, amx=True)
    assert on.amx and on.features.endswith("+amx-tile,+amx-bf16,+avx512bf16") and on.cache_dir.endswith("-avx512-amx")


def test_a_worker_setting_for_a_path_the_cpu_cannot_run_is_refused_before_any_worker_starts(monkeypatch):
    from hybridgate.workers.config import EngineConfig

    assert EngineConfig(cpu_isa=RUNNABLE[0]).cpu_isa == RUNNABLE[0]
    monkeypatch.setattr(isa, "host_features", lambda: set())  # a CPU with no vector extensions: generic only
    with pytest.raises(ValueError, match=r"cpu_isa: this CPU cannot run avx2 \(it runs at most generic\)"):
        EngineConfig(cpu_isa="avx2")
    assert EngineConfig(cpu_isa="generic").cpu_isa == "generic"


# ---- the child ----

def _worst(pairs):
    worst, name = 0.0, ""
    for key, got, ref in pairs:
        err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
        if err > worst:
            worst, name = err, key
    return worst, name


def _check(model_file: str) -> dict:
    import gguf

    from hybridgate.workers.cpu import quant
    from hybridgate.workers.cpu.fused import concat_rows
    from hybridgate.workers.cpu.runner import NumbaRunner  # noqa: F401  (the runner's imports, as a worker has)
    from tests.unit.test_cpu_kernels import ALL_TYPES, FAST_TYPES, MIXES, T, edge_blocks, random_blocks

    rng = np.random.default_rng(13)
    pairs = {"f32": ([], []), "i16": ([], [])}  # (random, model) per format
    invariant = {"f32": True, "i16": True}
    edge_worst, edge_rows_exact = 0.0, True
    for kind in ALL_TYPES:
        rows, cols = 37, 512
        data = random_blocks(kind, rows, cols, rng)
        dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(rows, cols)
        x = rng.standard_normal((9, cols)).astype(np.float32)
        for fmt in ("f32", "i16") if kind in FAST_TYPES else ("f32",):
            for m in (quant.quant_matrix("w", int(T[kind]), data, (rows, cols), fmt),
                      quant.QuantMatrix("w", int(T[kind]), data, (rows, cols))):  # the row path of every type
                y = m.matmul(x)
                pairs[m.activations][0].append((f"{kind} {type(m).__name__}", y, x.astype(np.float64) @ dense.T))
                invariant[m.activations] &= all(np.array_equal(m.matmul(x[b : b + 1])[0], y[b]) for b in (0, 4, 8))
        # codes at their extremes, subnormal and large fp16 scales: rows bit-exact, products within
        # float32 rounding of the terms' size
        data = edge_blocks(kind, 16, 256, rng)
        dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(16, 256)
        m = quant.QuantMatrix("w", int(T[kind]), data, (16, 256))
        edge_rows_exact &= all(np.array_equal(m.row(r), dense[r].astype(np.float32)) for r in range(16))
        x = rng.standard_normal((3, 256)).astype(np.float32)
        size = np.abs(x).max(axis=1, keepdims=True) * np.abs(dense).sum(axis=1)[None, :] + 1e-30
        edge_worst = max(edge_worst, float((np.abs(m.matmul(x) - x.astype(np.float64) @ dense.T) / size).max()))
    for kinds in MIXES:  # fused matrices of parts of different types
        parts = [(int(T[k]), random_blocks(k, 11, 256, rng), (11, 256)) for k in kinds]
        fused = concat_rows("+".join(kinds), parts)
        dense = np.concatenate([gguf.quants.dequantize(d, T[k]).reshape(11, 256) for k, (_, d, _) in zip(kinds, parts)])
        x = rng.standard_normal((5, 256)).astype(np.float32)
        y = fused.matmul(x)
        pairs["i16"][0].append(("+".join(kinds), y, x.astype(np.float64) @ dense.astype(np.float64).T))
        invariant["i16"] &= all(np.array_equal(fused.matmul(x[b : b + 1])[0], y[b]) for b in range(5))
    for kind in ("Q4_1", "Q8_0"):  # the integer sums at their limits: every code at its extreme, every
        # activation at ±its block's largest value (int16 ±32767), so a pair sum or a lane that lost a
        # bit (the avx2 path's Q4_1 lanes hold 16 times their codes) shows far past the format's error
        rows, cols = 8, 128
        data = random_blocks(kind, rows, cols, rng).reshape(rows, cols // 32, -1)
        if kind == "Q4_1":
            data[:, :, 4:] = 0xFF  # codes 15 (the min stays random)
        else:
            data[:, :, 2:] = np.where(rng.random(data[:, :, 2:].shape) < 0.5, 0x80, 0x7F)  # codes -128 and 127
        data = data.reshape(rows, -1)
        dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(rows, cols)
        x = np.where(rng.random((5, cols)) < 0.5, -3.0, 3.0).astype(np.float32)
        m = quant.quant_matrix("w", int(T[kind]), data, (rows, cols), "i16")
        pairs["i16"][0].append((kind + " extremes", m.matmul(x), x.astype(np.float64) @ dense.T))
    i16_edge_worst = 0.0
    for kind in FAST_TYPES:  # at the formats' limits, int16 activations: the error is relative to the size
        data = edge_blocks(kind, 8, 256, rng)  # of the terms (the activations' quantization), not of the sum
        dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(8, 256)
        x = rng.standard_normal((3, 256)).astype(np.float32)
        m = quant.quant_matrix("w", int(T[kind]), data, (8, 256), "i16")
        size = np.abs(x).max(axis=1, keepdims=True) * np.abs(dense).sum(axis=1)[None, :] + 1e-30
        i16_edge_worst = max(i16_edge_worst, float((np.abs(m.matmul(x) - x.astype(np.float64) @ dense.T) / size).max()))
    for kind in FAST_TYPES:  # every tile shape: 4-row tiles and a 1-row tail, 4x4 and 4x1, two X_TILE passes
        cols = 256 if kind == "Q4_K" else 96
        m = quant.quant_matrix("w", int(T[kind]), random_blocks(kind, 37, cols, rng), (37, cols), "i16")
        x = rng.standard_normal((70, cols)).astype(np.float32)
        batched = m.matmul(x)
        invariant["i16"] &= all(np.array_equal(m.matmul(x[b : b + 1])[0], batched[b]) for b in range(70))
    reader = gguf.GGUFReader(model_file)
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])
        data = np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1)
        pick = np.sort(rng.choice(rows, size=min(rows, 256), replace=False))  # the LM head: 256 of its rows
        dense = np.asarray(gguf.quants.dequantize(data[pick], t.tensor_type), np.float64).reshape(len(pick), cols)
        x = rng.standard_normal((5, cols)).astype(np.float32)
        for fmt in ("f32", "i16"):
            m = quant.quant_matrix(t.name, int(t.tensor_type), data[pick], (len(pick), cols), fmt)
            y = m.matmul(x)
            pairs[fmt][1].append((t.name, y, x.astype(np.float64) @ dense.T))
            invariant[fmt] &= np.array_equal(m.matmul(x[2:3])[0], y[2])
    from numba.core import config

    out = {"isa": isa.selected().isa, "numba_cpu_name": config.CPU_NAME, "edge_worst": edge_worst,
           "edge_rows_exact": bool(edge_rows_exact), "i16_edge_worst": i16_edge_worst}
    for fmt, (random_pairs, model_pairs) in pairs.items():
        prefix = "" if fmt == "f32" else "i16_"
        rw, rn = _worst(random_pairs)
        mw, mn = _worst(model_pairs)
        out.update({f"{prefix}random_worst": rw, f"{prefix}random": rn, f"{prefix}model_worst": mw,
                    f"{prefix}model_worst_tensor": mn, f"{prefix}model_tensors": len(model_pairs),
                    f"{prefix}batch_invariant": bool(invariant[fmt])})
    return out


def _asm() -> dict:
    import re

    from hybridgate.workers.cpu import intdot, quant, simd
    from tests.unit.test_cpu_kernels import T, random_blocks

    rng = np.random.default_rng(1)
    for fmt in ("f32", "i16"):  # both matmul kernels: float32 and int16 activations
        m = quant.quant_matrix("w", int(T.Q4_1), random_blocks("Q4_1", 8, 64, rng), (8, 64), fmt)
        m.matmul(rng.standard_normal((4, 64)).astype(np.float32))
        # Q6_K's scale pairs, and F16/BF16 widened in the float tiles
        m = quant.quant_matrix("w", int(T.Q6_K), random_blocks("Q6_K", 8, 256, rng), (8, 256), fmt)
        m.matmul(rng.standard_normal((4, 256)).astype(np.float32))
    for kind in ("F16", "BF16"):
        quant.quant_matrix("w", int(T[kind]), random_blocks(kind, 8, 64, rng), (8, 64)).matmul(
            rng.standard_normal((4, 64)).astype(np.float32))
    kernels = (simd.matmul_blocks, intdot.matmul_i16)
    hits = sum(sum(k.stats.cache_hits.values()) for k in kernels)
    misses = sum(sum(k.stats.cache_misses.values()) for k in kernels)
    asm = "" if hits else "\n".join(a for k in kernels for a in k.inspect_asm().values())
    return {"hits": hits, "misses": misses, "asm_bytes": len(asm),
            "registers": sorted(set(re.findall(r"%([xyz]mm)\d+", asm)))}


if __name__ == "__main__":
    isa.select(sys.argv[1])
    result = _check(sys.argv[3]) if sys.argv[2] == "check" else _asm()
    print(json.dumps(result))
