"""`hybridgate bench kernels`: its table covers every type of the path's kernel table and its weights are valid blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hybridgate.bench import kernels
from hybridgate.workers.cpu import quant
from hybridgate.workers.cpu.blocks import LAYOUTS
from tests.unit.test_kernel_table import EXPECTED


@pytest.mark.parametrize("kind", kernels.table_types())
def test_random_weights_are_blocks_gguf_dequantizes_to_finite_values(kind):
    data = kernels.random_weight(kind, 3, 256, np.random.default_rng(kind))
    assert data.shape == (3, 256 // LAYOUTS[kind].weights * LAYOUTS[kind].nbytes)
    dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind))
    assert np.isfinite(dense).all() and np.abs(dense).max() > 0


def test_one_row_per_table_type_and_batch_with_the_classes_it_compares():
    # Expected rows from the reviewed literal table (test_kernel_table.EXPECTED: "class activations kernel"),
    # not from the kernel table the bench reads.
    expected = {name: row.split()[:2] for name, row in EXPECTED[quant.PATH].items()}
    rows = kernels.measure((8, 256), [1, 3], repeats=1)
    assert [(r["type"], r["batch"]) for r in rows] == [(name, b) for name in expected for b in (1, 3)]
    for r in rows:
        matrix, activations = expected[r["type"]]
        assert (r["fast"]["class"], r["fast"]["activations"]) == (matrix, activations.split("/")[0])
        assert r["row-dequantize"]["class"] == "QuantMatrix"
        if "other" in r:  # the other activation format, on its own class or kernel
            assert r["other"]["activations"] != r["fast"]["activations"]
        assert r["speedup_vs_row-dequantize"] == pytest.approx(r["row-dequantize"]["ms"] / r["fast"]["ms"])
    assert any("other" in r for r in rows)
    table = kernels._format(rows)
    assert len(table.splitlines()) == len(rows) + 1 and "FloatMatrix" in table
