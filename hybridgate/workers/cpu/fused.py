"""Weights that multiply the same activations as one matrix (fused Q/K/V, gate/up), of one type or several.

Parts of one type and one column count are stacked into one matrix of `quant` (one kernel call); parts of
different types (llama.cpp's Q4_K_M mixes them) keep one matrix and kernel each (`FusedMatrix`), their
outputs side by side.
"""

from __future__ import annotations

import numpy as np

from hybridgate.workers.cpu.quant import QuantMatrix, quant_matrix


class FusedMatrix:
    """Weights of different types (or layouts) multiplied as one: `matmul(x)` → `[batch, Σ rows]`,
    each part by its own kernel into its own output columns, in order. A row's result is its
    part's, so batch invariance holds as it does for each part."""

    def __init__(self, name: str, parts: list[QuantMatrix]):
        self.name, self.parts = name, parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.activations = "+".join(p.activations for p in parts)
        self._starts = np.cumsum([0] + [p.shape[0] for p in parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = QuantMatrix._out(self, x, out)
        for part, start in zip(self.parts, self._starts):
            out[:, start : start + part.shape[0]] = part.matmul(x)
        return out

    def matmul_prompt(self, x: np.ndarray, prompt: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """`QuantMatrix.matmul_prompt` part by part."""
        out = QuantMatrix._out(self, x, out)
        for part, start in zip(self.parts, self._starts):
            out[:, start : start + part.shape[0]] = part.matmul_prompt(x, prompt)
        return out

    def row(self, index: int) -> np.ndarray:
        at = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.parts[at].row(index - int(self._starts[at]))


def concat_rows(name: str, parts: list[tuple[int, np.ndarray, tuple[int, int]]],
                activations: str = "auto") -> QuantMatrix | FusedMatrix:
    """One matrix of several weights `(kind, data, (rows, cols))` multiplying the same activations
    (fused Q/K/V, gate/up): rows stacked into one matrix when they share a type, a `FusedMatrix`
    of one matrix per part otherwise. name: the parts' names joined by "+". Raises ValueError
    naming the parts when their column counts differ (they cannot take the same activations)."""
    names = name.split("+") if name.count("+") == len(parts) - 1 else [f"{name}[{i}]" for i in range(len(parts))]
    cols = {s[1] for _, _, s in parts}
    if len(cols) != 1:
        shapes = ", ".join(f"{n} {s[0]}x{s[1]}" for n, (_, _, s) in zip(names, parts))
        raise ValueError(f"fused matrix {name!r}: parts differ in columns ({shapes}); they must share the input")
    kinds = {k for k, _, _ in parts}
    if len(kinds) == 1:
        data = np.concatenate([np.ascontiguousarray(d) for _, d, _ in parts], axis=0)
        return quant_matrix(name, kinds.pop(), data, (sum(s[0] for _, _, s in parts), cols.pop()), activations)
    return FusedMatrix(name, [quant_matrix(n, k, d, s, activations) for n, (k, d, s) in zip(names, parts)])


def tensor_matrix(model, names: list[str], activations: str):
    """One matrix of the named tensors of a `GGUFModel`, their rows in order (`concat_rows` when several)."""
    parts = [(int(model.tensors[n].ggml_type), model.tensors[n].data, model.tensors[n].shape) for n in names]
    if len(parts) > 1:
        return concat_rows("+".join(names), parts, activations)
    return quant_matrix(names[0], *parts[0], activations)
