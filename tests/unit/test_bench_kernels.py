"""`hybridgate bench kernels`: its table covers every fast type of the path and its weights are valid blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hybridgate.bench import kernels
from hybridgate.workers.cpu import quant
from hybridgate.workers.cpu.blocks import LAYOUTS


@pytest.mark.parametrize("kind", sorted(quant._FAST))
def test_random_weights_are_blocks_gguf_dequantizes_to_finite_values(kind):
    data = kernels.random_weight(kind, 3, 256, np.random.default_rng(kind))
    assert data.shape == (3, 256 // LAYOUTS[kind].weights * LAYOUTS[kind].nbytes)
    dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind))
    assert np.isfinite(dense).all() and np.abs(dense).max() > 0


def test_one_row_per_fast_type_and_batch_with_the_classes_it_compares():
    rows = kernels.measure((8, 256), [1, 3], repeats=1)
    assert [(r["type"], r["batch"]) for r in rows] == [(LAYOUTS[k].name, b) for k in quant._FAST for b in (1, 3)]
    for r in rows:
        kind = next(k for k in quant._FAST if LAYOUTS[k].name == r["type"])
        assert r["fast"]["class"] == quant._FAST[kind].__name__
        assert r["row-dequantize"]["class"] == "QuantMatrix"
        other = quant._PREVIOUS.get(kind) or quant._ALTERNATIVE.get(kind)
        assert r.get("other", {}).get("class") == (other.__name__ if other else None)
        assert r["speedup_vs_row-dequantize"] == pytest.approx(r["row-dequantize"]["ms"] / r["fast"]["ms"])
    table = kernels._format(rows)
    assert len(table.splitlines()) == len(rows) + 1 and "LowBitMatrix" in table
