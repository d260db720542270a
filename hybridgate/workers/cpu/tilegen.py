"""What the CPU tile intrinsics (`simd`, `intdot`, `avx2`, `superblock`, `int8`) share: LLVM IR helpers
and the skeleton of a tile's code generator.

A tile is a Numba `@intrinsic` whose codegen writes LLVM IR with llvmlite: it names its arguments,
allocates vector accumulators, loops over the weight blocks (or super-blocks, with a per-block loop
inside) doing its type's sums, takes its float steps and stores each output. `TileIR` holds what
every step needs (the builder, the context, the arguments by name, the index constant `c`), so that a
tile's code is its type's sums alone.
"""

from __future__ import annotations

import contextlib
import inspect

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, LANES)
_V16I32 = ir.VectorType(_I32, LANES)


def _ptr(context, builder, ty, value, offset):
    """Address of element `offset` of a Numba array value."""
    data = context.make_array(ty)(context, builder, value).data
    return builder.gep(data, [offset])


def _load_vec(builder, ptr, vec_ty, align):
    return builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=align)


def _splat(builder, scalar, vec_ty=_V16F):
    """scalar (a float or an int32) in every lane of vec_ty."""
    vec = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, vec_ty.count), [0] * vec_ty.count))


def _ivec(value):
    return ir.Constant(_V16I32, [value] * LANES)


def reduce_halves(builder, vec, combine):
    """Lane 0 of vec's lanes combined down to one, `combine(lo, hi)` on its first half and its second,
    then on the halves of that, and so on: a fixed order, whatever the vector's width."""
    width = vec.type.count
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width))))
        vec = combine(lo, hi)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _tree_sum(builder, vec):
    """Sum of the lanes, pairwise: (0..7 + 8..15) for 16, then halves again (fixed order)."""
    return reduce_halves(builder, vec, builder.fadd)


def _fma(builder, a, b, c):
    """a * b + c on float vectors of any width, fused (llvm.fma: one vfmadd where the target has FMA)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fma.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


# Weight rows are prefetched this many rows ahead of the tile reading them: a decode step streams each
# weight matrix once from memory, and at batch 1 the hardware prefetchers alone left the kernels waiting
# on it (measured on the default model, one thread: the Q4_1 matmuls of a step took 1.4x (AVX-512) to
# 1.5x (AVX2) as long without; 8 and 16 rows ahead measured alike).
PREFETCH_ROWS = 16


def prefetch(builder, ptr):
    """A read prefetch of the cache line at ptr into every cache level (llvm.prefetch; a hint: an address
    past the array's end is not read and cannot fault)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


@intrinsic
def prefetch_span(typingctx, arr, offset, count):
    """Read prefetches of the cache lines holding arr[offset : offset + count] (a contiguous 1-D
    span of any element type; one `prefetch` per 64 bytes, a hint: addresses past the array's end
    are not read)."""
    sig = types.void(arr, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        aa, off, cnt = args
        i8p = ir.IntType(8).as_pointer()
        start = builder.bitcast(_ptr(context, builder, signature.args[0], aa, off), i8p)
        nbytes = builder.mul(cnt, ir.Constant(cnt.type, context.get_abi_sizeof(context.get_data_type(arr.dtype))))
        lines = builder.sdiv(builder.add(nbytes, ir.Constant(cnt.type, 63)), ir.Constant(cnt.type, 64))
        with cgutils.for_range(builder, lines) as loop:
            prefetch(builder, builder.gep(start, [builder.mul(loop.index, ir.Constant(cnt.type, 64))]))
        return context.get_dummy_value()

    return sig, codegen


class TileIR:
    """One tile's codegen state: the builder and context, the intrinsic's arguments by name (`names`, in
    the signature's order; every offset, stride and count an intp) and `c`, an intp constant."""

    def __init__(self, context, builder, signature, args, names):
        self.context, self.builder = context, builder
        self.types = dict(zip(names, signature.args))
        self.args = dict(zip(names, args))
        self.index = next(a.type for a, t in zip(args, signature.args) if t == types.intp)

    def __getitem__(self, name):
        return self.args[name]

    def c(self, value):
        return ir.Constant(self.index, value)

    def ptr(self, name, offset):
        """Address of element `offset` of the array argument `name`."""
        return _ptr(self.context, self.builder, self.types[name], self.args[name], offset)

    def row(self, base, stride, i):
        """base + stride · i, of the arguments named base and stride (row i's offset)."""
        return self.builder.add(self[base], self.builder.mul(self[stride], self.c(i)))

    def offset(self, base, stride, i, block, width=None):
        """row(base, stride, i) + block · width: block `block` of row i, `width` elements a block (None:
        `block` an element index)."""
        step = block if width is None else self.builder.mul(block, self.c(width))
        return self.builder.add(self.row(base, stride, i), step)

    def at(self, name, base, stride, i, block, width=None):
        """Address in the array argument `name` of `offset(base, stride, i, block, width)`."""
        return self.ptr(name, self.offset(base, stride, i, block, width))

    def prefetch_ahead(self, codes, code_bytes, scales, per, mins, wrows, block):
        """Prefetches of block `block` of the `wrows` weight rows PREFETCH_ROWS ahead (contiguous: wrows ·
        code_bytes bytes of codes in array `codes`, rows at q_off + i·q_stride; `per` scales a block in
        `scales`, rows at s_off + i·s_stride; one min a block in `mins` unless None), a block at a time, so
        the requests spread over the loop instead of queueing at the start of each tile."""
        b, c = self.builder, self.c
        span = wrows * code_bytes
        q = self.offset("q_off", "q_stride", PREFETCH_ROWS, block, span)
        for off in range(0, span, 64):
            prefetch(b, self.ptr(codes, b.add(q, c(off))))
        sp = self.offset("s_off", "s_stride", PREFETCH_ROWS, block, wrows)
        prefetch(b, self.ptr(scales, b.mul(sp, c(per))))
        if mins is not None:
            prefetch(b, self.ptr(mins, sp))

    def accumulators(self, vec_ty, wrows, xrows):
        """accs[k][i]: a zeroed stack slot of vec_ty per activation row k and weight row i."""
        zero = ir.Constant(vec_ty, [0.0] * vec_ty.count)
        return [[cgutils.alloca_once_value(self.builder, zero) for _ in range(wrows)] for _ in range(xrows)]

    @contextlib.contextmanager
    def loop(self, count):
        """`with t.loop(n) as index:` the body once per index 0 .. n - 1 (an intp count)."""
        with cgutils.for_range(self.builder, count) as loop:
            yield loop.index

    def store_outputs(self, wrows, xrows, value, name="out", base="o_off", stride="o_stride"):
        """out[base + k·stride + i] = value(k, i) (a float scalar) for activation row k, weight row i."""
        b = self.builder
        for k in range(xrows):
            for i in range(wrows):
                v = value(k, i)
                b.store(v, self.ptr(name, b.add(self.row(base, stride, k), self.c(i))))
        return self.context.get_dummy_value()


def tile_intrinsic(name: str, names: tuple[str, ...], state_of, emit):
    """A Numba intrinsic named `name` returning nothing, over the arguments `names` (after typingctx; integer
    ones taken as intp): `state_of(arg types by name)` gives what `emit` needs or raises TypeError, and
    `emit(t, state)` writes the body, `t` a `TileIR`, and returns `t.store_outputs`'s value."""

    def generic(typingctx, *arg_types):
        state = state_of(dict(zip(names, arg_types)))
        sig = types.void(*(types.intp if isinstance(a, types.Integer) else a for a in arg_types))

        def codegen(context, builder, signature, args):
            return emit(TileIR(context, builder, signature, args, names), state)

        return sig, codegen

    generic.__name__ = name
    # Numba folds a call's arguments by the definition's signature: name them (a *args would come as a tuple)
    generic.__signature__ = inspect.Signature([inspect.Parameter(arg, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                               for arg in ("typingctx", *names)])
    return intrinsic(generic)
