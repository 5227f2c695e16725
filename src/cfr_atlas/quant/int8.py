"""The integer matmul path: activations quantized to int8 per 32-element block, weight x
activation products summed exactly in int32 per block, one float multiply-add per block.

    activation block (llama.cpp's q8_0 / q8_1 activation format, kept in float32 here):
        amax = max |x_j|,  d_x = amax / 127,  q_j = rint(x_j * (127 / amax))  (0 if amax == 0)
        q_j in -127..127, rint rounds half to even (llama.cpp's AVX2 quantizer does the same;
        its scalar reference rounds half away from zero). xsum = sum_j q_j (an exact integer).
        A block holding inf or NaN gets d_x = NaN and q = 0, so the outputs it feeds are NaN.

    per output (t, n), blocks b = 0 .. nb - 1 in order, acc starting at 0.0:
        isum_b = sum_j w_j q_j               int32, exact, so the summation order is free
        acc    = acc + term_b                term_b per format (q8_0.py, q4_0.py, q4_1.py)

Every float operation is one IEEE float32 rounding (numba without fastmath: no FMA contraction)
and depends on (t, n) only, so matmul(X)[t] == matvec(X[t]) bit for bit. The integer dot of one
block for 8 weight rows is an LLVM intrinsic: on AVX2 it is vpmaddubsw (unsigned weights x
signed activations -> pairs summed in int16, which cannot saturate here: |pair| <= 2 * 128 * 127)
then vpmaddwd against ones (-> int32) and a vphaddd tree across the rows; elsewhere portable
IR (sext, mul, vector.reduce.add) that LLVM lowers for the target.

Weight layout ("block tiles"): a tile of TILE_ROWS output rows stores, block after block, the
bytes of each row's block contiguously: tile[(b * TILE_ROWS + r) * BYTES + j]; BYTES = 32 for
int8 weights, 16 for 4-bit weights kept packed as in GGUF (low nibbles q[0..15], high q[16..31]).

The tile kernel (`tile_kernel`) is here too, one for the three formats, which pick their
weight bytes (int8 or packed nibbles) and block term (SCALE, OFFSET8, MIN).

Not here: the repacks and NumPy twins (the format modules), shape checks (weight.py).
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, config, types
from numba.extending import intrinsic

from cfr_atlas.quant.tiles import TILE_ROWS

QK = 32  # activation block: the block of every integer-path weight format
GROUP = 8  # weight rows per integer-dot intrinsic call (one 8 x int32 result vector)
QMAX = np.float32(127.0)


def _has_avx2() -> bool:
    """AVX2 on the compile target (numba's NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else the host)."""
    if config.CPU_NAME:
        return "+avx2" in (config.CPU_FEATURES or "")
    try:
        return bool(llvm.get_host_cpu_features().get("avx2", False))
    except RuntimeError:
        return False


AVX2 = _has_avx2()

# --- activation quantization ---------------------------------------------------------------


@njit(cache=True, nogil=True)
def _quantize_block(x, k0, xq, xd, xsum, t, b):
    """One block of row x (from column k0) -> xq[t, k0:k0 + QK], xd[t, b], xsum[t, b]."""
    amax = np.float32(0.0)
    finite = True
    for j in range(QK):
        a = abs(x[k0 + j])
        finite = finite and a <= np.float32(3.4028235e38)
        amax = max(amax, a)
    if not finite:
        xd[t, b] = np.float32(np.nan)
        xq[t, k0:k0 + QK] = 0
        xsum[t, b] = 0
        return
    inv = QMAX / amax if amax > 0 else np.float32(0.0)
    s = 0
    for j in range(QK):
        q = np.int8(np.rint(x[k0 + j] * inv))
        xq[t, k0 + j] = q
        s += q
    xd[t, b] = amax / QMAX
    xsum[t, b] = s


@njit(cache=True, nogil=True)
def quantize_rows(x, xq, xd, xsum):
    """x (T, K) float32 -> xq (T, K) int8, xd (T, K // QK) float32, xsum (T, K // QK) int32."""
    T, K = x.shape
    for t in range(T):
        for b in range(K // QK):
            _quantize_block(x[t], b * QK, xq, xd, xsum, t, b)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, K) float32, K a multiple of QK -> (xq int8 (T, K), d (T, nb) float32,
    xsum (T, nb) int32) with the numba kernel."""
    T, K = x.shape
    xq = np.empty((T, K), dtype=np.int8)
    xd = np.empty((T, K // QK), dtype=np.float32)
    xsum = np.empty((T, K // QK), dtype=np.int32)
    quantize_rows(x, xq, xd, xsum)
    return xq, xd, xsum


def quantize_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The NumPy twin of `quantize`, bit for bit."""
    T, K = x.shape
    xb = x.reshape(T, K // QK, QK)
    a = np.abs(xb)
    finite = np.all(a <= np.finfo(np.float32).max, axis=-1)  # False for inf and NaN
    amax = np.where(finite, a.max(axis=-1, initial=np.float32(0.0)), np.float32(1.0))
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, QMAX / amax, np.float32(0.0)).astype(np.float32)
    q = np.where(finite[..., None], np.rint(xb * inv[..., None]), np.float32(0.0))
    q = q.astype(np.int8)
    d = np.where(finite, amax / QMAX, np.float32(np.nan)).astype(np.float32)
    return q.reshape(T, K), d, q.sum(axis=-1, dtype=np.int32)


# --- block tiles ---------------------------------------------------------------------------


def to_block_tiles(a: np.ndarray, nbytes: int) -> np.ndarray:
    """a (N, nb * nbytes) -> (n_tiles, nb * TILE_ROWS * nbytes), rows zero-padded to whole
    tiles, each row's block `nbytes` contiguous (the layout in the module docstring)."""
    rows, cols = a.shape
    tiles = -(-rows // TILE_ROWS)
    padded = np.zeros((tiles * TILE_ROWS, cols), dtype=a.dtype)
    padded[:rows] = a
    blocked = padded.reshape(tiles, TILE_ROWS, cols // nbytes, nbytes).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(blocked).reshape(tiles, -1)


def gather_block_rows(tiles: np.ndarray, ids: np.ndarray | slice, nbytes: int) -> np.ndarray:
    """Block tiles -> rows `ids` of the untiled (N, nb * nbytes) matrix, a new array."""
    nb = tiles.shape[1] // (TILE_ROWS * nbytes)
    t4 = tiles.reshape(-1, nb, TILE_ROWS, nbytes)
    if isinstance(ids, slice):
        return t4.transpose(0, 2, 1, 3).reshape(-1, nb * nbytes)[ids]
    return t4[ids // TILE_ROWS, :, ids % TILE_ROWS].reshape(len(ids), -1)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., nb * 16) uint8 GGUF nibbles -> (..., nb * 32) uint8 values 0..15 in weight order."""
    p = packed.reshape(*packed.shape[:-1], -1, QK // 2)
    q = np.concatenate([p & np.uint8(0x0F), p >> np.uint8(4)], axis=-1)
    return q.reshape(*packed.shape[:-1], -1)


def block_dots_numpy(w: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """w (N, nb * QK) integers, xq (T, nb * QK) int8 -> (T, N, nb) int64 exact block dots."""
    n, t = w.shape[0], xq.shape[0]
    wb = w.reshape(n, -1, QK).astype(np.int64)
    return np.einsum("nbj,tbj->tnb", wb, xq.reshape(t, -1, QK).astype(np.int64))


# --- the integer dot: 8 weight rows x one activation block -> 8 int32 ----------------------


def _ptr(context, builder, ary_t, ary, index, vec):
    arr = context.make_array(ary_t)(context, builder, ary)
    return builder.bitcast(builder.gep(arr.data, [index]), vec.as_pointer())


def _x86(builder, name, ret, *args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _pairs_avx2(builder, u, s):
    """u unsigned, s signed <32 x i8> -> <8 x i32> sums of 4 adjacent products."""
    i16, i32 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 8)
    p = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", i16, u, s)
    ones = ir.Constant(i16, [ir.Constant(ir.IntType(16), 1)] * 16)
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", i32, p, ones)


def _rows_avx2(builder, parts):
    """8 <8 x i32> partial vectors -> one <8 x i32>: lane r = sum of parts[r]'s lanes."""
    i32 = ir.VectorType(ir.IntType(32), 8)

    def hadd(a, b):
        return _x86(builder, "llvm.x86.avx2.phadd.d", i32, a, b)

    h = [hadd(parts[i], parts[i + 1]) for i in range(0, 8, 2)]
    lo, hi = hadd(h[0], h[1]), hadd(h[2], h[3])  # lanes: rows 0-3 | 4-7, low then high halves
    a = builder.shuffle_vector(lo, hi, ir.Constant(i32, [0, 1, 2, 3, 8, 9, 10, 11]))
    b = builder.shuffle_vector(lo, hi, ir.Constant(i32, [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.add(a, b)


def _row_generic(builder, w, x, unsigned):
    v32 = ir.VectorType(ir.IntType(32), QK)
    wide = builder.zext(w, v32) if unsigned else builder.sext(w, v32)
    prod = builder.mul(wide, builder.sext(x, v32))
    fnty = ir.FunctionType(ir.IntType(32), [v32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.vector.reduce.add.v32i32")
    return builder.call(fn, [prod])


def _dot8_one(builder, rows, xv, unsigned):
    """8 loaded weight rows (<32 x i8> each) times one activation block -> <8 x i32>."""
    if AVX2:
        v8 = xv.type
        if unsigned:
            parts = [_pairs_avx2(builder, w, xv) for w in rows]
        else:  # |w| x (x with w's sign): the unsigned x signed instruction, exactly
            parts = [_pairs_avx2(builder, _x86(builder, "llvm.x86.avx2.psign.b", v8, w, w),
                                 _x86(builder, "llvm.x86.avx2.psign.b", v8, xv, w))
                     for w in rows]
        return _rows_avx2(builder, parts)
    res = ir.Constant(ir.VectorType(ir.IntType(32), GROUP), None)
    for r, w in enumerate(rows):
        res = builder.insert_element(res, _row_generic(builder, w, xv, unsigned),
                                     ir.Constant(ir.IntType(32), r))
    return res


def _dot8(load_row, unsigned, tokens):
    """An intrinsic dot8(w, wo, x, xo, out, oo[, u, uo, out_u]): out[oo + r] = sum_j W_r[j] *
    x[xo + j] for the 8 rows r whose blocks load_row reads from w at wo (unsigned: weights
    0..255, else int8); with tokens=2 also out_u[oo + r] for u[uo:], the rows loaded once."""

    def codegen(context, builder, sig, args):
        v8, i32 = ir.VectorType(ir.IntType(8), QK), ir.VectorType(ir.IntType(32), GROUP)
        rows = [load_row(context, builder, sig.args[0], args[0], args[1], r)
                for r in range(GROUP)]
        # (activation array, offset, output array) per token; the outputs share offset oo
        for xa, xo, oa in ((2, 3, 4), (6, 7, 8))[:tokens]:
            xv = builder.load(_ptr(context, builder, sig.args[xa], args[xa], args[xo], v8),
                              align=1)
            res = _dot8_one(builder, rows, xv, unsigned)
            builder.store(res, _ptr(context, builder, sig.args[oa], args[oa], args[5], i32),
                          align=4)
        return context.get_dummy_value()

    if tokens == 1:
        @intrinsic
        def dot8(typingctx, w, wo, x, xo, out, oo):
            return types.void(w, wo, x, xo, out, oo), codegen

        return dot8

    @intrinsic
    def dot8x2(typingctx, w, wo, x, xo, out, oo, u, uo, out_u):
        return types.void(w, wo, x, xo, out, oo, u, uo, out_u), codegen

    return dot8x2


def _load_int8_row(context, builder, ary_t, ary, off, r):
    """Row r's 32 int8 weights at off + r * 32."""
    v8 = ir.VectorType(ir.IntType(8), QK)
    index = builder.add(off, ir.Constant(off.type, r * QK))
    return builder.load(_ptr(context, builder, ary_t, ary, index, v8), align=1)


def _load_nibble_row(context, builder, ary_t, ary, off, r):
    """Row r's 16 packed bytes at off + r * 16 -> <32 x i8> values 0..15 in weight order."""
    v16 = ir.VectorType(ir.IntType(8), QK // 2)
    index = builder.add(off, ir.Constant(off.type, r * QK // 2))
    p = builder.load(_ptr(context, builder, ary_t, ary, index, v16), align=1)
    lo = builder.and_(p, ir.Constant(v16, [ir.Constant(ir.IntType(8), 0x0F)] * (QK // 2)))
    hi = builder.lshr(p, ir.Constant(v16, [ir.Constant(ir.IntType(8), 4)] * (QK // 2)))
    order = ir.Constant(ir.VectorType(ir.IntType(32), QK), list(range(QK)))
    return builder.shuffle_vector(lo, hi, order)


dot8_int8 = _dot8(_load_int8_row, unsigned=False, tokens=1)
dot8_nibbles = _dot8(_load_nibble_row, unsigned=True, tokens=1)
dot8x2_int8 = _dot8(_load_int8_row, unsigned=False, tokens=2)
dot8x2_nibbles = _dot8(_load_nibble_row, unsigned=True, tokens=2)


# --- the tile kernel, one for the three integer-path formats --------------------------------

# How a block's int32 dot becomes the float32 term added to acc (per output row r, block b,
# k = b * TILE_ROWS + r, dx = the activation block's scale):
SCALE = 0  # Q8_0:  (d_k * dx) * isum_r
OFFSET8 = 1  # Q4_0: (d_k * dx) * (isum_r - 8 xsum_b)   (weights stored 0..15, value q - 8)
MIN = 2  # Q4_1:    (d_k * dx) * isum_r + m_k * (dx * xsum_b)   (llama.cpp's q8_1 s = d sum q)


def tile_kernel(nibbles: bool, term: int):
    """The parallel integer-path kernel(xq, xd, xsum, q, d, m, out) for block tiles of int8
    weights (nibbles=False) or GGUF's packed nibbles, with one of the terms above (m is unused
    unless term == MIN: pass d). Threads split the tiles; tokens go in pairs, one weight load
    serving both, every operation of either token the one a lone token performs."""
    R = TILE_ROWS
    unit = QK // 2 if nibbles else QK  # bytes of one row's block
    dot1 = dot8_nibbles if nibbles else dot8_int8
    dot2 = dot8x2_nibbles if nibbles else dot8x2_int8

    @njit(cache=True, inline="always")
    def add_terms(acc, d, m, b, dx, xs, isum):
        for r in range(R):
            k = b * R + r
            if term == SCALE:
                acc[r] += (d[k] * dx) * np.float32(isum[r])
            elif term == OFFSET8:
                acc[r] += (d[k] * dx) * np.float32(isum[r] - 8 * xs)
            else:
                acc[r] += (d[k] * dx) * np.float32(isum[r]) + m[k] * (dx * np.float32(xs))

    @njit(parallel=True, cache=True, nogil=True)
    def kernel(xq, xd, xsum, q, d, m, out):
        T, K = xq.shape
        N = out.shape[1]
        for i in prange(q.shape[0]):
            acc, acc_u = np.empty(R, dtype=np.float32), np.empty(R, dtype=np.float32)
            isum, isum_u = np.empty(R, dtype=np.int32), np.empty(R, dtype=np.int32)
            n0 = i * R
            lanes = min(R, N - n0)
            for t in range(0, T - 1, 2):
                acc[:] = 0
                acc_u[:] = 0
                for b in range(K // QK):
                    o, k0 = b * R * unit, b * QK
                    for g in range(0, R, GROUP):  # the tile's rows, GROUP at a time
                        dot2(q[i], o + g * unit, xq[t], k0, isum, g, xq[t + 1], k0, isum_u)
                    add_terms(acc, d[i], m[i], b, xd[t, b], xsum[t, b], isum)
                    add_terms(acc_u, d[i], m[i], b, xd[t + 1, b], xsum[t + 1, b], isum_u)
                out[t, n0:n0 + lanes] = acc[:lanes]
                out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
            if T % 2:
                t = T - 1
                acc[:] = 0
                for b in range(K // QK):
                    o, k0 = b * R * unit, b * QK
                    for g in range(0, R, GROUP):
                        dot1(q[i], o + g * unit, xq[t], k0, isum, g)
                    add_terms(acc, d[i], m[i], b, xd[t, b], xsum[t, b], isum)
                out[t, n0:n0 + lanes] = acc[:lanes]

    return kernel
