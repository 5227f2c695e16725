"""The fold's two inner products as register-blocked IR: a page's scores and its weighted V sum.

The fold (fold.py) spends its time in two sums per page and query group g:

    score  s[g, j] = sum_{e < D, in order} q[g, e] * K(e, j)      (K^T page rows e, keys j)
    values a[g, e] += sum_{j < n, in order} p[g, j] * V(j, e)      (V page rows j, dims e)

each product-and-sum one fused multiply-add (`llvm.fma`: one float32 rounding; until session
45 a multiply and an add, two roundings: on Zen 4 a 256-query prompt chunk's fold after 2,048
tokens took 14.2 ms against 16.0, runs of the two builds alternating). Written as NumPy-style
loops,
numba keeps the running sums in memory: every product is a load, a multiply, an add and a
store, and K's row is read once per group. Here the running sums stay in vector registers for
blocks of keys (scores: `score_width(groups)` blocks of 16 keys side by side for up to four
groups, over all dims) or of dims (values: 32 dims, or 64 in 512-bit vectors on AVX-512, of
up to four groups, over all keys), and each stored row is loaded and widened once for every
group. The operations on each output element are the same ones in the same order, so the
result is bitwise the loops' (tests/atlas/test_fold_blocks.py holds them to the plain loops on
every storage format); only the instruction count changes. One Zen 4 thread, a 256-key,
64-dim float16 page of three groups, one block of keys a pass: the score pass 1.4 us instead
of 2.7 with the page in L2, the values pass 1.2 instead of 3.2; from memory, the score pass
after `touch_rows` 2.6-2.8 us instead of 3.4-4.7, the values pass 2.0-2.2 instead of 2.9-3.3.
Session 48, a Xeon (AVX-512), the same page in L2: both passes 2.92 us with one block of keys
a pass and 32-dim values, 1.98 with four blocks and 64 dims (score 1.38 -> 0.99 us); a
256-query chunk's fold after 2,048 tokens 0.75x, a decode query's 0.86-0.90x.

Also here, the page's other two passes, each vectorized in a fixed order: its largest score
(`max_run`) and the float64 sum of its weights (`sum_run`); and `fma32`, the scalar fused
multiply-add of the fold's remainder loops, with its exact NumPy emulation `fma32_numpy`.

Stored elements are float32, float16 bits (uint16) or bfloat16 bits (int16 marker), widened
exactly: float16 with vcvtph2ps where the target has F16C, else from its bits (the scalar
`storage._f16_soft` rule, lane by lane).

Callers guarantee what the IR trusts: K^T and V rows contiguous (unit element stride), the
score and V scratch contiguous along their last axis, every index in range. This module holds
no fold logic.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cfr_atlas.atlas.storage import _TARGET_FEATURES, HAS_F16C
from cfr_atlas.ops import activations as _act

KEYS = 16  # keys per score block (one 512-bit or two 256-bit vectors of float32)
DIMS = 32  # dims per values block (the unit of `_value_blocks`' dims; a call takes 1 or 2)
GROUPS = 4  # at most this many query groups per call
# AVX-512 has 32 vector registers: four groups' 16 running sums of the values pass fit beside
# their weights; with AVX2's 16 a values call takes two groups (8 sums), so none spill. The
# split changes no bit (each group's sums are its own).
WIDE_REGISTERS = "+avx512f" in (_TARGET_FEATURES or "").split(",")
VALUE_GROUPS = GROUPS if WIDE_REGISTERS else 2
LANES = 16 if WIDE_REGISTERS else 8  # dims per vector of the values pass (a register's floats)
# A running sum is a chain of fused multiply-adds, each waiting on the one before (4 cycles);
# two FMA units need about 8 chains in flight. One score block of three groups (a GQA group of
# 3 query heads) had 3: the score pass ran at 0.75 FMAs a cycle. A pass now takes up to
# `score_width(groups)` blocks of keys side by side (their K^T loads shared by the groups),
# and on AVX-512 the values pass takes 64 dims a call in 512-bit vectors. Each sum is still
# the same fused multiply-adds in the same order: the same bits.
SCORE_ACCS = 12 if WIDE_REGISTERS else 4  # running score vectors of KEYS lanes a pass, at most


def score_width(groups: int) -> int:
    """Blocks of KEYS keys a score pass of `groups` groups takes side by side: as many as keep
    groups x blocks running sums (and the blocks' K^T vectors) in the registers."""
    return max(1, min(8, SCORE_ACCS // groups))

F32, F64 = ir.FloatType(), ir.DoubleType()
I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
SUM_LANES = 8  # float64 running sums of `sum_run`, two vectors of them


def _llvm(builder, name: str, args):
    """Call the LLVM intrinsic `name` (llvm.fma, llvm.maxnum, llvm.rint) on float32 scalars or
    vectors, its type suffix taken from the first argument."""
    ty = args[0].type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * len(args)),
                                        f"{name}.{suffix}")
    return builder.call(fn, args)


def _halves(builder, acc, combine):
    """acc's lanes combined in halves (lanes 0..w/2-1 with w/2..w-1, then again) down to one
    scalar: a fixed order that depends on the width alone."""
    width = acc.type.count
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(I32, width),
                                                          list(range(width))))
        hi = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(I32, width),
                                                          list(range(width, 2 * width))))
        acc = combine(lo, hi)
    return builder.extract_element(acc, _const(I32, 0))


def _mac(builder, acc, x, y):
    """acc + x * y with one rounding: llvm.fma, a vfmadd on every x86-64 target with AVX2
    (on a target without FMA, LLVM calls the C library's fmaf: the same bits, slower)."""
    return _llvm(builder, "llvm.fma", [x, y, acc])


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c, float32, rounded once (IEEE fusedMultiplyAdd): the fold's scalar remainder
    loops use it so their sums are the blocks' sums. tests/atlas/test_fold_blocks.py holds it
    to an exact NumPy emulation (`fma32_numpy`)."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        x, y, z = (context.cast(builder, v, t, types.float32)
                   for v, t in zip(args, sig.args, strict=True))
        return _mac(builder, z, x, y)

    return types.float32(a, b, c), codegen


def fma32_numpy(a, b, c) -> np.ndarray:
    """Elementwise float32 a * b + c rounded once, in NumPy, exact: the product of two float32
    values is exact in float64; the float64 sum's own error e comes from TwoSum; rounding the
    sum to odd (when e != 0 and its last bit is even, the float64 neighbour towards e) and
    then to float32 is the correctly rounded result, as float64 has more than 24 + 2 bits
    (Boldo and Melquiond's round-to-odd)."""
    a, b, c = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN operands pass through
        prod = a * b
        s = prod + c
        bp = s - c  # Knuth's TwoSum: s + e == prod + c exactly
        e = (c - (s - bp)) + (prod - bp)
        even = (s.view(np.int64) & 1) == 0
        s = np.where((e != 0) & even & np.isfinite(s), np.nextafter(s, np.copysign(np.inf, e)), s)
        return s.astype(np.float32)


@intrinsic
def max_run(typingctx, s, n):
    """The largest of s[0 .. n - 1] (n >= 1, s float32 with unit stride): KEYS running maxima
    in one vector, then combined, then the rest one by one (llvm.maxnum: a NaN is skipped).
    The maximum of numbers is the same in any order, so this is the sequential loop's value;
    the loop's chain of compares took ~6% of a prompt chunk's fold."""
    def codegen(context, builder, sig, args):
        sp, _, _ = _array(context, builder, sig.args[0], args[0])
        n_v = context.cast(builder, args[1], sig.args[1], types.intp)
        intp = n_v.type
        vf = ir.VectorType(F32, KEYS)
        first = builder.load(_at(builder, sp, [_const(intp, 0)], F32))
        best = cgutils.alloca_once_value(builder, _splat(builder, first, KEYS))
        n_vec = builder.udiv(n_v, _const(intp, KEYS))
        with cgutils.for_range(builder, n_vec, intp=intp) as c:
            off = builder.mul(c.index, _const(intp, KEYS * 4))
            v = builder.load(_at(builder, sp, [off], vf), align=4)
            builder.store(_llvm(builder, "llvm.maxnum", [builder.load(best), v]), best)
        # any order of the lanes gives the same maximum
        top = _halves(builder, builder.load(best),
                      lambda lo, hi: _llvm(builder, "llvm.maxnum", [lo, hi]))
        m = cgutils.alloca_once_value(builder, top)
        start = builder.mul(n_vec, _const(intp, KEYS))
        with cgutils.for_range(builder, builder.sub(n_v, start), intp=intp) as j:
            off = builder.mul(builder.add(start, j.index), _const(intp, 4))
            x = builder.load(_at(builder, sp, [off], F32))
            builder.store(_llvm(builder, "llvm.maxnum", [builder.load(m), x]), m)
        return builder.load(m)

    return types.float32(s, n), codegen


def _array(context, builder, ary_t, ary):
    """(data as i8*, [strides in bytes], [shape]) of a numba array value."""
    a = context.make_array(ary_t)(context, builder, ary)
    strides = cgutils.unpack_tuple(builder, a.strides, ary_t.ndim)
    shape = cgutils.unpack_tuple(builder, a.shape, ary_t.ndim)
    return builder.bitcast(a.data, I8.as_pointer()), strides, shape


def _at(builder, base, offsets, ty):
    """Pointer to ty at base + the sum of the byte offsets."""
    off = offsets[0]
    for o in offsets[1:]:
        off = builder.add(off, o)
    return builder.bitcast(builder.gep(base, [off]), ty.as_pointer())


def _const(intp, x):
    return ir.Constant(intp, x)


def _splat(builder, x, width):
    vf = ir.VectorType(F32, width)
    one = builder.insert_element(ir.Constant(vf, None), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vf, None),
                                  ir.Constant(ir.VectorType(I32, width), [0] * width))


def _f16_soft(builder, raw, width):
    """<width x i16> float16 bits -> <width x float>, exact, without F16C: the 15 bits under
    the sign moved under float32's exponent field and scaled by 2**112 (normals and
    subnormals), all-ones exponents (inf, NaN) rebuilt with their payload, then the sign."""
    vi = ir.VectorType(I32, width)

    def splat(x):
        return ir.Constant(vi, [x] * width)

    h = builder.zext(raw, vi)
    sign = builder.shl(builder.and_(h, splat(0x8000)), splat(16))
    em = builder.and_(h, splat(0x7FFF))
    finite = builder.fmul(builder.bitcast(builder.shl(em, splat(13)), ir.VectorType(F32, width)),
                          ir.Constant(ir.VectorType(F32, width), [2.0 ** 112] * width))
    special = builder.or_(splat(0x7F800000), builder.shl(builder.and_(em, splat(0x3FF)),
                                                         splat(13)))
    is_special = builder.icmp_unsigned(">=", em, splat(0x7C00))
    bits = builder.select(is_special, special, builder.bitcast(finite, vi))
    return builder.bitcast(builder.or_(bits, sign), ir.VectorType(F32, width))


def _widened(builder, ptr, width, fmt_t):
    """width stored elements at ptr (a pointer to the storage element) -> <width x float>."""
    vf = ir.VectorType(F32, width)
    if isinstance(fmt_t, types.Float):
        return builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4)
    vi = ir.VectorType(I16, width)
    raw = builder.load(builder.bitcast(ptr, vi.as_pointer()), align=2)
    if fmt_t == types.uint16:  # float16 bits
        if HAS_F16C:
            return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), width)), vf)
        return _f16_soft(builder, raw, width)
    wide = builder.shl(builder.zext(raw, ir.VectorType(I32, width)),  # bfloat16 bits
                       ir.Constant(ir.VectorType(I32, width), [16] * width))
    return builder.bitcast(wide, vf)


def _literals(*args) -> bool:
    return all(isinstance(a, types.IntegerLiteral) for a in args)


def _elem(fmt_t):
    return F32 if isinstance(fmt_t, types.Float) else I16


def _score_pass(builder, kp, k_row, k_col, d, qp, q_rows, q_col, sp, s_rows, j0, first,
                n_pass, width, fmt_t):
    """Passes c < n_pass of `width` blocks each, from block `first`: every group's running sums
    of blocks first + c * width + b (b < width) over dims in order, stored to s."""
    intp = k_row.type
    vf = ir.VectorType(F32, KEYS)
    n_groups = len(q_rows)
    accs = [[cgutils.alloca_once(builder, vf) for _ in range(width)] for _ in range(n_groups)]
    with cgutils.for_range(builder, n_pass, intp=intp) as pass_:
        block0 = builder.add(first, builder.mul(pass_.index, _const(intp, width)))
        for row in accs:
            for a in row:
                builder.store(ir.Constant(vf, [0.0] * KEYS), a)
        col_offs = [builder.mul(builder.add(j0, builder.mul(builder.add(block0, _const(intp, b)),
                                                            _const(intp, KEYS))), k_col)
                    for b in range(width)]
        with cgutils.for_range(builder, d, intp=intp) as dim:
            e = dim.index
            row_off = builder.mul(e, k_row)
            kvs = [_widened(builder, _at(builder, kp, [row_off, col_offs[b]], _elem(fmt_t)),
                            KEYS, fmt_t) for b in range(width)]
            q_off = builder.mul(e, q_col)
            for g, row in enumerate(accs):
                qe = _splat(builder, builder.load(_at(builder, qp, [q_rows[g], q_off], F32)),
                            KEYS)
                for b, a in enumerate(row):
                    builder.store(_mac(builder, builder.load(a), qe, kvs[b]), a)
        for b in range(width):
            out_col = builder.mul(builder.mul(builder.add(block0, _const(intp, b)),
                                              _const(intp, KEYS)), _const(intp, 4))
            for g, row in enumerate(accs):
                builder.store(builder.load(row[b]), _at(builder, sp, [s_rows[g], out_col], vf),
                              align=4)


@intrinsic
def score_block(typingctx, k, j0, n_blocks, q, g0, s, groups, fmt):
    """For blocks c < n_blocks, groups g < `groups` (a literal int, 1..GROUPS), lanes w < KEYS:

        s[g0 + g, c * KEYS + w] = sum_{e < D, in order} q[g0 + g, e] * K(e, j0 + c * KEYS + w)

    with K(e, j) = k[e, j] widened (k: a K^T page (D, P), rows contiguous), q (groups, D)
    float32, s float32 with contiguous rows; each step one float32 fused multiply-add. Blocks
    run `score_width(groups)` a pass, then the rest one at a time."""
    if not (_literals(groups) and 1 <= groups.literal_value <= GROUPS):
        return None
    n_groups = groups.literal_value
    width = score_width(n_groups)

    def codegen(context, builder, sig, args):
        k_v, j0_v, nb_v, q_v, g0_v, s_v = args[:6]
        fmt_t = sig.args[-1]
        kp, (k_row, k_col), (d, _) = _array(context, builder, sig.args[0], k_v)
        qp, (q_row, q_col), _ = _array(context, builder, sig.args[3], q_v)
        sp, (s_row, _), _ = _array(context, builder, sig.args[5], s_v)
        intp = k_row.type
        j0_v, nb_v, g0_v = (context.cast(builder, v, t, types.intp)
                            for v, t in ((j0_v, sig.args[1]), (nb_v, sig.args[2]),
                                         (g0_v, sig.args[4])))
        gs = [builder.add(g0_v, _const(intp, g)) for g in range(n_groups)]
        q_rows = [builder.mul(g, q_row) for g in gs]
        s_rows = [builder.mul(g, s_row) for g in gs]
        common = (builder, kp, k_row, k_col, d, qp, q_rows, q_col, sp, s_rows, j0_v)
        nb_v = builder.select(builder.icmp_signed(">", nb_v, _const(intp, 0)), nb_v,
                              _const(intp, 0))  # no blocks (or fewer): nothing runs
        n_wide = builder.udiv(nb_v, _const(intp, width))
        if width > 1:
            _score_pass(*common, _const(intp, 0), n_wide, width, fmt_t)
            done = builder.mul(n_wide, _const(intp, width))
        else:
            done = _const(intp, 0)
        _score_pass(*common, done, builder.sub(nb_v, done), 1, fmt_t)
        return context.get_dummy_value()

    return types.void(k, j0, n_blocks, q, g0, s, groups, fmt), codegen


@intrinsic
def values_block(typingctx, v, j0, n, p, g0, acc, e0, groups, fmt, dims):
    """For groups g < `groups` (a literal int, 1..GROUPS) and dims e < `dims` (a literal
    int, DIMS or 2 DIMS):

        acc[g0 + g, e0 + e] += sum_{j < n, in order} p[g0 + g, j] * V(j0 + j, e0 + e)

    with V(j, e) = v[j, e] widened (v: a V page (P, D), rows contiguous), p float32 (any
    strides), acc float32 with contiguous rows; each step one float32 fused multiply-add."""
    if not (_literals(groups, dims) and 1 <= groups.literal_value <= GROUPS
            and dims.literal_value in (DIMS, 2 * DIMS)):
        return None
    n_groups = groups.literal_value
    n_vec = dims.literal_value // LANES

    def codegen(context, builder, sig, args):
        v_v, j0_v, n_v, p_v, g0_v, a_v, e0_v = args[:7]
        fmt_t = sig.args[8]
        vp, (v_row, v_col), _ = _array(context, builder, sig.args[0], v_v)
        pp, (p_row, p_col), _ = _array(context, builder, sig.args[3], p_v)
        ap, (a_row, _), _ = _array(context, builder, sig.args[5], a_v)
        intp = v_row.type
        j0_v, n_v, g0_v, e0_v = (context.cast(builder, x, t, types.intp)
                                 for x, t in ((j0_v, sig.args[1]), (n_v, sig.args[2]),
                                              (g0_v, sig.args[4]), (e0_v, sig.args[6])))
        vf = ir.VectorType(F32, LANES)
        p_rows = [builder.mul(builder.add(g0_v, _const(intp, g)), p_row) for g in range(n_groups)]

        def acc_ptr(g, c):
            row = builder.mul(builder.add(g0_v, _const(intp, g)), a_row)
            col = builder.mul(builder.add(e0_v, _const(intp, c * LANES)), _const(intp, 4))
            return _at(builder, ap, [row, col], vf)

        accs = {}
        for g in range(n_groups):
            for c in range(n_vec):
                a = cgutils.alloca_once(builder, vf)
                builder.store(builder.load(acc_ptr(g, c), align=4), a)
                accs[g, c] = a
        cols = [builder.mul(builder.add(e0_v, _const(intp, c * LANES)), v_col)
                for c in range(n_vec)]
        with cgutils.for_range(builder, n_v, intp=intp) as key:
            j = key.index
            row_off = builder.mul(builder.add(j0_v, j), v_row)
            p_off = builder.mul(j, p_col)
            weights = [_splat(builder, builder.load(_at(builder, pp, [p_rows[g], p_off], F32)),
                              LANES) for g in range(n_groups)]
            for c in range(n_vec):
                vv = _widened(builder, _at(builder, vp, [row_off, cols[c]], _elem(fmt_t)), LANES,
                              fmt_t)
                for g in range(n_groups):
                    a = accs[g, c]
                    builder.store(_mac(builder, builder.load(a), weights[g], vv), a)
        for (g, c), a in accs.items():
            builder.store(builder.load(a), acc_ptr(g, c), align=4)
        return context.get_dummy_value()

    return types.void(v, j0, n, p, g0, acc, e0, groups, fmt, dims), codegen


@intrinsic
def widen_soft16(typingctx, src, i, out):
    """out[i:i + KEYS] = float16 bits src[i:i + KEYS] widened by the no-F16C rule (`_f16_soft`):
    for the tests, which hold it to the scalar rule on every bit pattern on any machine."""
    def codegen(context, builder, sig, args):
        sp, _, _ = _array(context, builder, sig.args[0], args[0])
        op, _, _ = _array(context, builder, sig.args[2], args[2])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        raw = builder.load(_at(builder, sp, [builder.mul(idx, _const(idx.type, 2))],
                               ir.VectorType(I16, KEYS)), align=2)
        builder.store(_f16_soft(builder, raw, KEYS),
                      _at(builder, op, [builder.mul(idx, _const(idx.type, 4))],
                          ir.VectorType(F32, KEYS)), align=4)
        return context.get_dummy_value()

    return types.void(src, i, out), codegen


LINE = 64  # bytes of a cache line


def _lines(builder, n_bytes):
    """Cache lines that n_bytes bytes from a line's start span (rounded up)."""
    intp = n_bytes.type
    return builder.udiv(builder.add(n_bytes, _const(intp, LINE - 1)), _const(intp, LINE))


def _read_into(builder, seen, base, off):
    """The byte at base + off OR-ed into the i8 at `seen` (a load the asm keeps)."""
    builder.store(builder.or_(builder.load(seen), builder.load(builder.gep(base, [off]))), seen)


@intrinsic
def touch_rows(typingctx, a, col0, n_cols):
    """Read one byte of every cache line of columns col0 .. col0 + n_cols - 1 of each row of
    the 2-D array a, rows in order (the bytes OR-ed into a value an empty asm statement
    consumes, so the loads stay). The score blocks read a K^T page down its rows, a block of
    keys at a time, which the hardware prefetchers do not follow from memory; this pass in row
    order streams the page into the caches first: a page's score pass from memory in 2.6-2.8
    us instead of 5.5 (one Zen 4 thread, 64 x 256 float16; prefetch instructions instead of
    loads: 4.5 us)."""
    def codegen(context, builder, sig, args):
        base, (row_s, col_s), (rows, _) = _array(context, builder, sig.args[0], args[0])
        intp = row_s.type
        c0 = builder.mul(context.cast(builder, args[1], sig.args[1], types.intp), col_s)
        width = builder.mul(context.cast(builder, args[2], sig.args[2], types.intp), col_s)
        n_lines = _lines(builder, width)
        seen = cgutils.alloca_once_value(builder, ir.Constant(I8, 0))
        rows = builder.select(builder.icmp_signed(">", width, _const(intp, 0)), rows,
                              _const(intp, 0))  # no columns: nothing to read
        with cgutils.for_range(builder, rows, intp=intp) as r:
            row = builder.add(builder.mul(r.index, row_s), c0)
            with cgutils.for_range(builder, n_lines, intp=intp) as line:
                _read_into(builder, seen, base,
                           builder.add(row, builder.mul(line.index, _const(intp, LINE))))
            # the row's last byte: its line, when col0 does not start a line, is one more
            _read_into(builder, seen, base, builder.add(row, builder.sub(width, _const(intp, 1))))
        builder.asm(ir.FunctionType(ir.VoidType(), [I8]), "", "r", [builder.load(seen)],
                    side_effect=True)
        return context.get_dummy_value()

    return types.void(a, col0, n_cols), codegen


@intrinsic
def sum_run(typingctx, p, n):
    """The float64 sum of float32 p[0 .. n - 1] (unit stride) in a fixed order: 2 x SUM_LANES
    running sums, sum c taking keys c, c + 16, c + 32, ... (each widened exactly), added
    pairwise (sum c + sum c + 8, then halves: lanes 0-3 + 4-7, 0-1 + 2-3, 0 + 1), then the
    keys past the last multiple of 16 one by one. The order depends on n alone, never on a
    call's neighbours; `sum_run_numpy` is its twin. A single chain of adds in key order
    waited ~3 cycles an add (~7% of a prompt chunk's fold)."""
    def codegen(context, builder, sig, args):
        pp, _, _ = _array(context, builder, sig.args[0], args[0])
        n_v = context.cast(builder, args[1], sig.args[1], types.intp)
        intp = n_v.type
        vd = ir.VectorType(F64, SUM_LANES)
        vs = ir.VectorType(F32, SUM_LANES)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vd, [0.0] * SUM_LANES))
                for _ in range(2)]
        step = 2 * SUM_LANES
        n_vec = builder.udiv(n_v, _const(intp, step))
        with cgutils.for_range(builder, n_vec, intp=intp) as c:
            base = builder.mul(c.index, _const(intp, step * 4))
            for i, a in enumerate(accs):
                off = builder.add(base, _const(intp, i * SUM_LANES * 4))
                v = builder.fpext(builder.load(_at(builder, pp, [off], vs), align=4), vd)
                builder.store(builder.fadd(builder.load(a), v), a)
        acc = builder.fadd(builder.load(accs[0]), builder.load(accs[1]))
        total = cgutils.alloca_once_value(builder, _halves(builder, acc, builder.fadd))
        start = builder.mul(n_vec, _const(intp, step))
        with cgutils.for_range(builder, builder.sub(n_v, start), intp=intp) as j:
            off = builder.mul(builder.add(start, j.index), _const(intp, 4))
            x = builder.fpext(builder.load(_at(builder, pp, [off], F32)), F64)
            builder.store(builder.fadd(builder.load(total), x), total)
        return builder.load(total)

    return types.float64(p, n), codegen


@intrinsic
def exp_run(typingctx, s, m, p, n):
    """p[j] = exp32(s[j] - m) for j < n - n % KEYS, KEYS lanes a vector (s, p float32 with
    unit stride, m float32) -> the count done; the caller computes the rest with `exp32`.
    Every lane runs `ops.activations.exp32`'s operations in its order (the same clamps,
    float32 multiplies and adds, never fused; rint; 2^n on the exponent bits; the same
    selects for x > 88, x < -87 and NaN), so each weight is exp32's bits: LLVM vectorized the
    plain loop in 256-bit vectors here, half the lanes of an AVX-512 register."""
    if not all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1
               and a.layout == "C" for a in (s, p)):
        return None  # the IR reads and writes contiguous float32 lanes: nothing else types

    def codegen(context, builder, sig, args):
        sp, _, _ = _array(context, builder, sig.args[0], args[0])
        pp, _, _ = _array(context, builder, sig.args[2], args[2])
        m_v = context.cast(builder, args[1], sig.args[1], types.float32)
        n_v = context.cast(builder, args[3], sig.args[3], types.intp)
        intp = n_v.type
        vf = ir.VectorType(F32, KEYS)
        vi = ir.VectorType(I32, KEYS)

        def c(x):
            return ir.Constant(vf, [float(x)] * KEYS)

        n_vec = builder.udiv(n_v, _const(intp, KEYS))
        m_s = _splat(builder, m_v, KEYS)
        with cgutils.for_range(builder, n_vec, intp=intp) as it:
            off = builder.mul(it.index, _const(intp, KEYS * 4))
            x = builder.fsub(builder.load(_at(builder, sp, [off], vf), align=4), m_s)
            xc = builder.select(builder.fcmp_ordered(">", x, c(_act._EXP_HI)), c(_act._EXP_HI), x)
            xc = builder.select(builder.fcmp_ordered("<", xc, c(_act._EXP_LO)), c(_act._EXP_LO),
                                xc)
            fn = _llvm(builder, "llvm.rint", [builder.fmul(xc, c(_act._LOG2E))])
            r = builder.fsub(builder.fsub(xc, builder.fmul(fn, c(_act._LN2_HI))),
                             builder.fmul(fn, c(_act._LN2_LO)))
            poly = c(_act._EXP_P[0])
            for coef in _act._EXP_P[1:]:
                poly = builder.fadd(builder.fmul(poly, r), c(coef))
            y = builder.fadd(builder.fadd(builder.fmul(poly, builder.fmul(r, r)), r), c(1.0))
            ni = builder.fptosi(builder.select(builder.fcmp_ordered("==", fn, fn), fn, c(0.0)),
                                vi)
            y = builder.fmul(y, _act.pow2_ir(builder, ni))
            y = builder.select(builder.fcmp_ordered(">", x, c(_act._EXP_HI)), c(np.inf), y)
            y = builder.select(builder.fcmp_ordered("<", x, c(_act._EXP_LO)), c(0.0), y)
            builder.store(y, _at(builder, pp, [off], vf), align=4)
        return builder.mul(n_vec, _const(intp, KEYS))

    return types.intp(s, m, p, n), codegen


def sum_run_numpy(p: np.ndarray, n: int) -> float:
    """`sum_run`'s twin: the same float64 additions in the same order."""
    x = np.asarray(p[:n], dtype=np.float32).astype(np.float64)
    step = 2 * SUM_LANES
    n_vec = n // step
    lanes = np.zeros(step)
    for c in range(n_vec):
        lanes = lanes + x[c * step:(c + 1) * step]
    acc = lanes[:SUM_LANES] + lanes[SUM_LANES:]
    while len(acc) > 1:
        acc = acc[:len(acc) // 2] + acc[len(acc) // 2:]
    total = acc[0]
    for j in range(n_vec * step, n):
        total = total + x[j]
    return float(total)


@intrinsic
def touch_pair(typingctx, a, col0, n_cols, b, row0, n_rows):
    """`touch_rows(a, col0, n_cols)` and a read of every cache line of rows row0 .. row0 +
    n_rows - 1 of the 2-D array b (contiguous rows), a line of each in turn (then b's lines
    left over). A decode query's page comes from memory twice over, K^T for the scores and V
    for the values; streamed one after the other, each waits on its own misses, and two
    streams side by side keep more of them in flight: a decode query's fold over 30 layers of
    K/V from memory took 0.89-0.94x at 2,048 tokens and 0.90-0.94x at 6,000 (paired in one
    process). Reads only: no result changes."""
    def codegen(context, builder, sig, args):
        base, (row_s, col_s), (rows, _) = _array(context, builder, sig.args[0], args[0])
        bbase, (brow_s, _), _ = _array(context, builder, sig.args[3], args[3])
        intp = row_s.type
        c0 = builder.mul(context.cast(builder, args[1], sig.args[1], types.intp), col_s)
        width = builder.mul(context.cast(builder, args[2], sig.args[2], types.intp), col_s)
        n_lines = _lines(builder, width)
        b0 = builder.mul(context.cast(builder, args[4], sig.args[4], types.intp), brow_s)
        b_lines = _lines(builder, builder.mul(
            context.cast(builder, args[5], sig.args[5], types.intp), brow_s))
        b_next = cgutils.alloca_once_value(builder, _const(intp, 0))
        seen = cgutils.alloca_once_value(builder, ir.Constant(I8, 0))
        rows = builder.select(builder.icmp_signed(">", width, _const(intp, 0)), rows,
                              _const(intp, 0))
        with cgutils.for_range(builder, rows, intp=intp) as r:
            row = builder.add(builder.mul(r.index, row_s), c0)
            with cgutils.for_range(builder, n_lines, intp=intp) as line:
                _read_into(builder, seen, base,
                           builder.add(row, builder.mul(line.index, _const(intp, LINE))))
                bl = builder.load(b_next)
                with builder.if_then(builder.icmp_signed("<", bl, b_lines)):
                    _read_into(builder, seen, bbase,
                               builder.add(b0, builder.mul(bl, _const(intp, LINE))))
                    builder.store(builder.add(bl, _const(intp, 1)), b_next)
        b_left = builder.sub(b_lines, builder.load(b_next))  # b's lines past a's count
        b_left = builder.select(builder.icmp_signed(">", b_left, _const(intp, 0)), b_left,
                                _const(intp, 0))
        b_from = builder.add(b0, builder.mul(builder.load(b_next), _const(intp, LINE)))
        with cgutils.for_range(builder, b_left, intp=intp) as line:
            _read_into(builder, seen, bbase,
                       builder.add(b_from, builder.mul(line.index, _const(intp, LINE))))
        builder.asm(ir.FunctionType(ir.VoidType(), [I8]), "", "r", [builder.load(seen)],
                    side_effect=True)
        return context.get_dummy_value()

    return types.void(a, col0, n_cols, b, row0, n_rows), codegen
