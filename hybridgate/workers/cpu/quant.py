"""GGUF weights for the Numba runner: `[B, K] x W^T` matmuls per quant type, fused matrices of parts.

`QuantMatrix` keeps a weight `[rows, cols]` in its GGUF bytes (layouts and per-type
row dequantizers in `blocks`) with its sub-block scales widened to float32 once at
load; `matmul(x)` computes x @ W.T for activations x float32 `[batch, cols]`, reading
each weight row once for the whole batch (one pass over the weights per step): the
row is dequantized into a per-thread scratch of `cols` floats and dotted with every
activation row. Every type of `blocks.LAYOUTS` runs there, on every path (the code is
plain Numba, compiled for the process's instruction set). The other classes are the fast
paths: Q4_1 and Q8_0 split (fp16 scales widened to float32 at load) for `simd` (float32
activations) and `intdot`/`avx2` (int16), Q4_0, Q4_K and Q5_0 repacked onto those, Q6_K onto
Q8_0's with a scale per 16 columns, the low-bit types for `kquant`, the K-quants for
`superblock` (sub-block scales in integers), and F32/F16/BF16 as stored for `simd`'s float
tiles. Which class and kernel multiply a type on this path is `kernel_table`'s row, and only
there (`quant_matrix`). Fused matrices (Q, K, V; gate and up) are `fused`'s.
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import importlib  # noqa: E402

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from numba import prange  # noqa: E402

from hybridgate.workers.cpu.blocks import (  # noqa: E402, F401  (the type ids, re-exported)
    BF16, BLOCK, F16, F32, LAYOUTS, MXFP4_VALUES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, dequant_row,
    e8m0_half, unpack_scales,
)
from hybridgate.workers.cpu import kernel_table, kquant  # noqa: E402
from hybridgate.workers.cpu.kquant import CODES, matmul_packed, pack  # noqa: E402
from hybridgate.workers.cpu.simd import matmul_blocks  # noqa: E402

if isa.selected().isa in ("avx2", "avx512"):  # its kernels are x86's (vpmaddwd, vpdpwssd, vpsrlvd)
    from hybridgate.workers.cpu import superblock  # noqa: E402
if isa.selected().amx:  # compiled with AMX's features: its tiles multiply long prompts
    from hybridgate.workers.cpu import amx  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)
_CHUNKS = 16  # row chunks per call: each thread allocates its scratch once per chunk, not per row


@nb.njit(parallel=True, **_JIT)
def matmul_rows(kind, x, w, scale, minimum, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ dequant(w uint8 `[rows, row_bytes]`).T.

    kind: a `blocks.LAYOUTS` key; scale, minimum: `blocks.unpack_scales` of w. Each weight row is
    dequantized once into a per-thread scratch of `cols` floats (L1/L2-resident) and dotted with
    every activation row, each dot the same loop whatever the batch (batch invariance)."""
    rows, batch, cols = w.shape[0], x.shape[0], x.shape[1]
    per = (rows + _CHUNKS - 1) // _CHUNKS
    for c in prange(_CHUNKS):
        scratch = np.empty(cols, dtype=np.float32)
        for r in range(c * per, min(rows, (c + 1) * per)):
            dequant_row(kind, w[r], scale[r], minimum[r], scratch)
            for b in range(batch):
                s = np.float32(0.0)
                for i in range(cols):
                    s += scratch[i] * x[b, i]
                out[b, r] = s


PATH = kernel_table.path_of(isa.selected().isa, isa.selected().amx)  # this process's rows of the table


def kernel(name: str):
    """The compiled kernel a `kernel_table.KernelRow` names ("module.function" in this package)."""
    module, function = name.split(".")
    return getattr(importlib.import_module(f"hybridgate.workers.cpu.{module}"), function)


def _format_row(kind: int, activations: str) -> tuple:
    """(activation format, kernel name, kernel) of the row of a class taking either activation format
    (`kernel_table.formatted`): "f32" or "i16", or for "auto" the format the table gives the type on this path."""
    name = LAYOUTS[kind].name
    if activations == "auto":
        activations = kernel_table.choose(name, "auto", PATH).decode.split("/")[0]
    row = kernel_table.formatted(name, activations, PATH)
    return row.decode.split("/")[0], row.kernel, kernel(row.kernel)


class QuantMatrix:
    """A weight `[rows, cols]` in its GGUF blocks; `matmul(x)` → x @ W.T (float32).

    Raises ValueError naming the tensor for a type without a kernel (`blocks.LAYOUTS`) or columns
    that are not a whole number of blocks."""

    activations = "f32"  # the row-dequantizing kernel multiplies float32 activations
    kernel_name = "quant.matmul_rows"  # the decode kernel (`kernel_table.KernelRow.kernel`)
    prompt_kernel = ""  # "amx.multiply" where the table gives this matrix AMX prompt rows (set by quant_matrix)
    column_multiple = 1  # columns must be a whole number of blocks (checked by `unpack_scales`)

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        if kind not in LAYOUTS:
            supported = ", ".join(v.name for v in LAYOUTS.values())
            raise ValueError(f"tensor {name!r}: GGUF type {kind} has no CPU kernel (supported: {supported})")
        # The row-dequantizing class multiplies the input's bytes as they are: its own copy, since a view would keep
        # the whole GGUF mapping (and every page the load touched) resident; the repacking subclasses read them once.
        self.name, self.kind, self.shape = name, kind, shape
        self.data = np.array(data, order="C") if type(self) is QuantMatrix else np.ascontiguousarray(data)
        try:
            self.scale, self.minimum = unpack_scales(kind, self.data, shape)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes + self.minimum.nbytes

    def _out(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The result array of `matmul(x, out)`: out (float32 `[batch, rows]`, C-contiguous), or a new one."""
        return np.empty((x.shape[0], self.shape[0]), dtype=np.float32) if out is None else out

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = self._out(x, out)
        matmul_rows(self.kind, x, self.data, self.scale, self.minimum, out)
        return out

    def row(self, index: int) -> np.ndarray:
        out = np.empty(self.shape[1], dtype=np.float32)
        dequant_row(self.kind, self.data[index], self.scale[index], self.minimum[index], out)
        return out

    def _prompt_arrays(self) -> tuple | None:
        """(qs, sc, d, ndmin, mins) as the prompt kernel (`amx`, `int8`, `int8_blocks`) reads them, or None."""
        return None

    def matmul_prompt(self, x: np.ndarray, prompt: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x @ W.T like `matmul`, the rows `prompt` (int64 `[p]`, ascending: `StepInputs.prompt_rows`) on the
        prompt kernel (`amx`'s bf16 tiles, `int8`'s GEMM) where this matrix has a format there. Which kernel
        computes a row is fixed by its request, so a row's bits do not depend on its batch."""
        amx_panels = self.prompt_kernel != "amx.multiply" or self.shape[0] % amx.PANEL == 0
        arrays = self._prompt_arrays() if len(prompt) and self.prompt_kernel and amx_panels else None
        if arrays is None:
            return self.matmul(x, out)
        out = self._out(x, out)
        if len(prompt) < x.shape[0]:
            rest = np.ones(x.shape[0], dtype=bool)
            rest[prompt] = False
            out[rest] = self.matmul(x[rest])  # a boolean index copies: contiguous
        kernel(self.prompt_kernel)(x, prompt, *arrays, out)
        return out

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Dequantized rows float32 `[len(index), cols]` (the embedding lookup)."""
        return np.stack([self.row(int(i)) for i in index]) if len(index) else np.empty((0, self.shape[1]), np.float32)


class Q41Matrix(QuantMatrix):
    """Q4_1 split: ggml's nibbles `[rows, cols / 2]` (16 bytes per block, byte j: columns j and
    j + 16) plus float32 scales and mins `[rows, cols / 32]`: 6 bits per weight; the GGUF bytes
    are not kept. Multiplied by `simd.matmul_blocks` (float32 activations) or
    `intdot.matmul_i16` (int16 activations), as `activations` resolves for this path."""

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)  # scale and minimum: unpacked by QuantMatrix
        self.activations, self.kernel_name, self._kernel = _format_row(kind, activations)
        self.qs = self._nibbles()
        self.data = None

    def _nibbles(self) -> np.ndarray:
        """Codes 0..15 in Q4_1's byte order, uint8 `[rows, cols / 2]`, from the GGUF bytes."""
        rows, cols = self.shape
        return np.ascontiguousarray(self.data.reshape(rows, cols // 32, 20)[:, :, 4:]).reshape(rows, cols // 2)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scale.nbytes + self.minimum.nbytes

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = self._out(x, out)
        self._kernel(x, self.qs, self.scale, self.minimum, out)
        return out

    def row(self, index: int) -> np.ndarray:
        q = self.qs[index].reshape(-1, 16)
        codes = np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32)
        return (codes * self.scale[index][:, None] + self.minimum[index][:, None]).ravel()

    def _prompt_arrays(self) -> tuple | None:  # int8_blocks.multiply_q4: Q4_0 and Q4_1 (the table gives Q4_K none)
        return self.qs, self.scale, self.minimum


class Q80Matrix(QuantMatrix):
    """Q8_0 split: int8 codes `[rows, cols]` and float32 scales `[rows, cols / 32]` (9 bits per weight).
    Multiplied by `simd.matmul_blocks` or `intdot.matmul_i16`, as for `Q41Matrix`."""

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)  # scale: unpacked by QuantMatrix
        self.activations, self.kernel_name, self._kernel = _format_row(kind, activations)
        self.minimum = self.scale  # no min: the kernels ignore it for int8 codes (one array, not two)
        self.qs = self._codes()
        self.data = None

    def _codes(self) -> np.ndarray:
        """Signed codes int8 `[rows, cols]` (weight = scale · code), from the GGUF bytes."""
        blocks = self.data.reshape(self.shape[0], self.shape[1] // 32, 34)
        return np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scale.nbytes

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = self._out(x, out)
        self._kernel(x, self.qs, self.scale, self.scale, out)
        return out

    def _prompt_arrays(self) -> tuple | None:  # amx and int8_blocks; none for Q6_K here (a scale per 16 columns)
        return None if self.scale.ndim == 3 else (self.qs, self.scale, self.minimum, self.scale, self.qs.view(np.uint8))

    def row(self, index: int) -> np.ndarray:
        return self.rows(np.array([index]))[0]

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Dequantized rows float32 `[len(index), cols]` (the embedding lookup)."""
        q = self.qs[index].astype(np.float32).reshape(len(index), -1, 32)
        return (q * self.scale[index][:, :, None]).reshape(len(index), -1)


class Q40Matrix(Q41Matrix):
    """Q4_0 on the Q4_1 kernels: the same nibbles, minimum = -8 · scale (w = d·c - 8d, which the
    kernels' fused multiply-add rounds once, as d·(c - 8)); 6 bits per weight."""

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape, activations)
        self.minimum = np.float32(-8.0) * self.scale

    def _nibbles(self) -> np.ndarray:
        rows, cols = self.shape
        return np.ascontiguousarray(self.data.reshape(rows, cols // 32, 18)[:, :, 2:]).reshape(rows, cols // 2)


class Q4KMatrix(Q41Matrix):
    """Q4_K on the Q4_1 kernels: each 32-column sub-block becomes a Q4_1 block with scale d·sc and
    minimum -dmin·m (widened at load), its nibbles reordered from Q4_K's (a 64-column pair shares 32
    bytes, low nibbles the first sub-block) to Q4_1's; 6 bits per weight instead of 4.5."""

    def _nibbles(self) -> np.ndarray:
        return q4k_nibbles(self.data, self.shape)


def q4k_nibbles(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A Q4_K weight's codes uint8 `[rows, cols / 2]` in Q4_1's byte order (16 bytes per 32 columns, byte j:
    column j low, j + 16 high), from its GGUF bytes `[rows, row_bytes]` (a 64-column pair of sub-blocks
    shares 32 bytes there, the first sub-block in the low nibbles)."""
    rows, cols = shape
    qs = data.reshape(rows, cols // 256, 144)[:, :, 16:].reshape(rows, cols // 256, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=3)  # [rows, blocks, pair, sub-block, column]
    return np.ascontiguousarray(codes[..., :16] | (codes[..., 16:] << 4)).reshape(rows, cols // 2)


class Q45KSuperMatrix(QuantMatrix):
    """Q4_K and Q5_K on the avx2 and avx512 paths' `superblock.matmul_superblock`: Q4_K's nibbles in Q4_1's
    order (`q4k_nibbles`) or Q5_K's codes 0..31 as int8 in column order (`superblock.q5k_codes`), the 6-bit
    sub-block scales and mins as uint8 per 32 columns, d and -dmin as float32 per 256 (4.75 bits per weight
    for Q4_K, GGUF's 4.5; 8.75 for Q5_K); activations int16 per 256 columns, the sub-block scales and mins
    applied in integers and one float step per super-block (see `superblock`). Error: at most max|x_sb| /
    65534 per activation."""

    activations, kernel_name = "i16", "superblock.matmul_superblock"
    column_multiple = 256
    superblock_fields = ("qs", "sc", "d", "ndmin", "mins")  # matmul_superblock's arrays (`moe_stack` stacks them)

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)  # the type and shape checks
        self.qs = q4k_nibbles(self.data, shape) if kind == Q4_K else superblock.q5k_codes(self.data, shape)
        self.sc, self.d, self.ndmin, self.mins = superblock.split_scales(kind, self.data, shape)
        self.data = self.scale = self.minimum = None

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.sc.nbytes + self.d.nbytes + self.ndmin.nbytes + self.mins.nbytes

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = self._out(x, out)
        superblock.matmul_superblock(x, self.qs, self.sc, self.d, self.ndmin, self.mins, out)
        return out

    def _prompt_arrays(self) -> tuple | None:  # amx and int8: Q4_K and Q5_K
        return self.qs, self.sc, self.d, self.ndmin, self.mins

    def row(self, index: int) -> np.ndarray:
        if self.qs.dtype == np.int8:  # Q5_K: whole codes in column order
            codes = self.qs[index].reshape(-1, 32).astype(np.float32)
        else:
            q = self.qs[index].reshape(-1, 16)
            codes = np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32)  # [blocks, 32]
        scale = np.repeat(self.d[index], 8) * self.sc[index].astype(np.float32)  # d·sc, as gguf rounds it
        minimum = np.repeat(self.ndmin[index], 8) * self.mins[index].astype(np.float32)  # -(dmin·m), as gguf
        return (codes * scale[:, None] + minimum[:, None]).ravel()


class Q6KSuperMatrix(QuantMatrix):
    """Q6_K on the avx2 and avx512 paths' `superblock.matmul_superblock`: codes c - 32 int8 in column order
    (avx2: 8.6 bits per weight) or kept 6 bits (avx512, `superblock.pack_q6k`: 6.6, GGUF's 6.56), the signed
    sub-block scales as int8 per 16 columns, d per 256; activations int16 per 256 columns, the sub-block
    scales applied in integers and a float step per 128 (avx2) or 256 (avx512) columns (see `superblock`).
    Error: at most max|x_sb| / 65534 per activation."""

    activations, kernel_name = "i16", "superblock.matmul_superblock"
    column_multiple = 256
    superblock_fields = ("qs", "sc", "d", "_no_ndmin", "_no_mins")  # as Q45KSuperMatrix's

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)  # the type and shape checks
        codes, self.sc, self.d = superblock.split_q6k(self.data, shape)
        self.qs = superblock.pack_q6k(codes) if superblock.Q6K_PACKED else codes
        self._no_ndmin, self._no_mins = np.zeros((1, 1), np.float32), np.zeros((1, 1), np.uint8)  # no min: unread
        self.data = self.scale = self.minimum = None

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.sc.nbytes + self.d.nbytes

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = self._out(x, out)
        superblock.matmul_superblock(x, self.qs, self.sc, self.d, self._no_ndmin, self._no_mins, out)
        return out

    def _prompt_arrays(self) -> tuple | None:  # amx: the 6-bit codes (avx512); int8: the codes as this path keeps them
        if self.prompt_kernel == "int8.multiply":
            return self.qs, self.sc, self.d, self._no_ndmin, self._no_mins
        return (self.qs, self.sc, self.d, self.d, self.sc) if superblock.Q6K_PACKED else None

    def row(self, index: int) -> np.ndarray:
        return self.rows(np.array([index]))[0]

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Dequantized rows float32 `[len(index), cols]` (the embedding lookup): (d·sc)·(c - 32), as gguf."""
        scale = np.repeat(self.d[index], 16, axis=1) * self.sc[index].astype(np.float32)  # [n, cols / 16]
        codes = superblock.unpack_q6k(self.qs[index]) if superblock.Q6K_PACKED else self.qs[index]
        q = codes.astype(np.float32).reshape(len(index), -1, 16)
        return (q * scale[:, :, None]).reshape(len(index), -1)


class Q50Matrix(Q80Matrix):
    """Q5_0 on the Q8_0 kernels: codes c - 16 (-16..15) as int8, the fp16 scale widened; 9 bits per
    weight instead of 5.5, for the fast kernels' integer and float paths (Q5_0 is most of a Q4_K_M
    file whose rows are not a multiple of 256). Exact: w = d·(c - 16) as gguf computes it."""

    def _codes(self) -> np.ndarray:
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // 32, 22)
        qh = blocks[:, :, 2:6].copy().view("<u4")  # [rows, blocks, 1]: bit j is column j's fifth bit
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        low = np.concatenate([blocks[:, :, 6:] & 15, blocks[:, :, 6:] >> 4], axis=2)
        return ((low | high).astype(np.int16) - 16).astype(np.int8).reshape(self.shape)


class LowBitMatrix(QuantMatrix):
    """Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and MXFP4 repacked for `kquant.matmul_packed` (int16 activations
    per 32-block, integer dot products): 4-bit codes two a byte, the 5th bits of the 5-bit types as bit
    masks (or whole codes a byte on `kquant.MERGE_FIVE` paths), float32 d (and m) per 32 columns: 6 bits
    per weight for Q4_1 and Q4_K, 5 for Q4_0, 4.25 for MXFP4 (its bytes regrouped, the E8M0 byte kept), 7 and 6
    for Q5_1/Q5_K and Q5_0 (10, 9 with whole codes). The GGUF bytes are not kept.
    Error: the activations' rounding, at most max|x_block| / 65534 per activation (about 2e-5 of a product)."""

    activations, kernel_name = "i16", "kquant.matmul_packed"

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)  # the type and shape checks
        self.qs, self.qh, self.d, self.m, self.mscale = pack(kind, self.data, shape)
        self.data = self.scale = self.minimum = None

    @property
    def nbytes(self) -> int:
        ms = 0 if self.m is self.d else self.m.nbytes
        return self.qs.nbytes + (self.qh.nbytes if self.qh.dtype == np.uint32 else 0) + self.d.nbytes + ms

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = self._out(x, out)
        matmul_packed(x, self.qs, self.qh, self.d, self.m, self.mscale, out)
        return out

    def _prompt_arrays(self) -> tuple | None:
        if self.qh.dtype == np.int8:  # MXFP4 (`kquant.E2M1`): int8_blocks.multiply_mxfp4
            from hybridgate.workers.cpu.int8_blocks import E8M0_HALF
            return self.qs, self.d, E8M0_HALF
        if self.qs.dtype != np.uint8 or self.qh.dtype != np.uint32:  # amx: only the 5-bit types' bit-mask layout
            return None
        return self.qs, self.d, self.m, np.full((1, 1), self.mscale, np.float32), self.qh

    def row(self, index: int) -> np.ndarray:
        cols = self.shape[1]
        if self.qs.dtype == np.int8:  # whole codes: per quad, 16-bit lanes of (s 0, s 2), then of (s 1, s 3)
            merged = self.qs[index].view(np.uint8).reshape(-1, 2, 32, 2)
            codes = self._scatter(merged.transpose(0, 3, 1, 2).reshape(-1, 4, 32))
        else:
            q = self.qs[index].reshape(-1, 16)  # [blocks (padded), 16]: column j low, j + 16 high
            codes = np.concatenate([q & 15, q >> 4], axis=1)
        if self.qh.dtype == np.uint32:  # bit t of word s: the 5th bit of lane t of vector s
            bits = np.unpackbits(self.qh[index].view(np.uint8), bitorder="little").reshape(-1, 4, 32)
            codes = codes | (self._scatter(bits) << 4)
        n = cols // 32
        if self.qh.dtype == np.int8:  # `kquant.E2M1`: d·value, d half the E8M0 scale
            return (MXFP4_VALUES[codes[:n]] * e8m0_half(self.d[index, :n, None])).ravel()
        d, m = self.d[index, :n, None], self.m[index, :n, None] * self.mscale
        return (codes[:n].astype(np.float32) * d + m).ravel()

    @staticmethod
    def _scatter(lanes: np.ndarray) -> np.ndarray:
        """`[quads, 4, 32]` values in the kernels' lane order → `[quads · 4, 32]` by block and column."""
        out = np.empty((lanes.shape[0], 128), lanes.dtype)
        out[:, kquant.QUAD_COLUMNS] = lanes
        return out.reshape(-1, 32)


class Q6KMatrix(Q80Matrix):
    """Q6_K on the Q8_0 kernels: codes c - 32 (-32..31) as int8 in column order, and the 16-column
    sub-blocks' scales d·sc widened to float32 `[rows, cols / 32, 2]` (a 32-column block's two, which
    the kernels apply to its columns 0..15 and 16..31); 10 bits per weight instead of 6.5625. Exact:
    w = (d·sc)·(c - 32) as gguf computes it."""

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape, activations)
        self.scale = self.minimum = np.ascontiguousarray(self.scale.reshape(shape[0], shape[1] // 32, 2))

    def _codes(self) -> np.ndarray:
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // 256, 210)
        ql = blocks[:, :, :128].reshape(rows, -1, 2, 64)  # per 128 columns: ql[64], then qh[32]
        qh = blocks[:, :, 128:192].reshape(rows, -1, 2, 32)
        lo, hi = ql[..., :32], ql[..., 32:]  # low nibbles: columns l, l + 32; high: l + 64, l + 96
        codes = np.concatenate([(lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4),
                                (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], axis=-1)
        return (codes.astype(np.int8) - np.int8(32)).reshape(self.shape)

    def rows(self, index: np.ndarray) -> np.ndarray:
        q = self.qs[index].astype(np.float32).reshape(len(index), -1, 16)
        return (q * self.scale[index].reshape(len(index), -1, 1)).reshape(len(index), -1)


class FloatMatrix(QuantMatrix):
    """F32, F16 and BF16 weights as stored: float32, binary16 bits (int16) or bfloat16 bits (uint16)
    `[rows, cols]`, widened in the kernel (`simd.matmul_blocks`: F16C's vcvtph2ps on the avx2 and
    avx512 paths, a shift for BF16) and multiplied by float32 activations with float32 sums. cols
    must be a multiple of 32 (`quant_matrix` gives other widths to the row kernel)."""

    column_multiple = 32
    kernel_name = "simd.matmul_blocks"
    _STORED = {F32: np.float32, F16: np.int16, BF16: np.uint16}

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)
        # a copy: a view would keep the whole GGUF mapping alive (and its touched pages resident) after load
        self.qs = np.array(self.data, copy=True).view(self._STORED[kind]).reshape(shape)
        self.scale = self.minimum = np.zeros((1, 1), np.float32)  # no scales: the kernel reads none
        self.data = None

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32) if out is None else out
        matmul_blocks(x, self.qs, self.scale, self.minimum, out)
        return out

    def _prompt_arrays(self) -> tuple | None:
        """BF16 only (exact in bf16). F16 rounded to bf16 failed the top-1 floor (99.4% on the default model in
        F16, docs/results/accuracy/2026-12-06-avx512-amx-xeon-207-smollm2-requantized-f16.json); an F32 file asks
        for float32."""
        return (self.qs, self.scale, self.scale, self.scale, self.qs) if self.kind == BF16 else None

    def row(self, index: int) -> np.ndarray:
        return self.rows(np.array([index]))[0]

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows float32 `[len(index), cols]`, widened exactly (numpy's binary16 conversion; bfloat16's
        bits are a float32's top half)."""
        q = self.qs[index]
        if self.kind == F16:
            return q.view(np.float16).astype(np.float32)
        if self.kind == BF16:
            return (q.astype(np.uint32) << 16).view(np.float32)
        return q.copy()


def quant_matrix(name: str, kind: int, data: np.ndarray, shape: tuple[int, int],
                 activations: str = "auto") -> QuantMatrix:
    """The matrix multiplying a `kind` weight on this path under the cpu_activations setting `activations`
    (`kernel_table.choose`: the one place the choice is made); the row-dequantizing `QuantMatrix` for
    columns the chosen class does not take. Raises ValueError naming cpu_activations for an unknown
    setting, and naming the tensor for a type without a kernel."""
    if kind not in LAYOUTS:
        return QuantMatrix(name, kind, data, shape)  # raises, naming the tensor and the supported types
    row = kernel_table.choose(LAYOUTS[kind].name, activations, PATH)
    cls = globals()[row.matrix]
    if shape[1] % cls.column_multiple:
        return QuantMatrix(name, kind, data, shape)
    matrix = cls(name, kind, data, shape, row.decode.split("/")[0])  # the classes of one format ignore it
    matrix.prompt_kernel = row.prompt_kernel
    return matrix
