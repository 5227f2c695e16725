"""The integer matmul path: activations quantized to int8 per 32-element block, weight x
activation products summed exactly in int32 per block, one float multiply-add per block.

    activation block (llama.cpp's q8_0 / q8_1 activation format, kept in float32 here):
        amax = max |x_j|,  d_x = amax / 127,  q_j = rint(x_j * (127 / amax))  (0 if amax == 0)
        q_j in -127..127, rint rounds half to even (llama.cpp's AVX2 quantizer does the same;
        its scalar reference rounds half away from zero). xsum = sum_j q_j (an exact integer).
        A block holding inf or NaN gets d_x = NaN and q = 0, so the outputs it feeds are NaN.
        A block with 0 < amax < TINY = 127 / FLT_MAX (127 / amax would overflow to inf) is a
        zero block: q = 0, xsum = 0, d_x = amax / 127; it feeds less than 1e-36 to any dot.

    per output (t, n), blocks b = 0 .. nb - 1 in order, acc starting at 0.0:
        isum_b = sum_j w_j q_j               int32, exact, so the summation order is free
        acc    = acc + term_b                term_b per format (q8_0.py, q4_0.py, q4_1.py)

Every float operation is one IEEE float32 rounding (numba without fastmath: no FMA contraction)
and depends on (t, n) only, so matmul(X)[t] == matvec(X[t]) bit for bit.

Weight layout ("block tiles"). A tile of TILE_ROWS output rows stores its blocks one after
another; a block holds the tile's rows in groups of GROUP = 8, and a group interleaves its
rows' bytes in 4-byte chunks, chunk after chunk:

    byte j of row r, block b:  tile[b * TILE_ROWS * BYTES + block_byte(r, j, BYTES)]
    block_byte(r, j, BYTES) = (r // 8) * 8 * BYTES + ((j // 4) * 8 + r % 8) * 4 + j % 4

BYTES (`UNIT[bits]`) = 32 for int8 weights (bits = 8, each stored with its sign bit flipped:
the byte u = w ^ 0x80, which read unsigned is w + 128; `flip_sign`), 16 for 4-bit weights
kept packed as in GGUF (bits = 4: low nibbles q[0..15], high q[16..31]), 20 for 5-bit weights
(bits = 5: the nibbles of q & 15 as for 4 bits, then 4 bytes of high bits, `pack_five`). So
one 32-byte vector is the same 4 weights of 8 rows, and a 4-byte group of activations broadcast
across it lines up with each row's 4 weights (llama.cpp's repacked Q4_0x8 layout is built on
the same idea). A 5-bit group's fifth vector holds, in row r's byte i, the high bits of the
weights its chunk c's byte i carries: bit 2c that of q[4c + i] (low nibble), bit 2c + 1 that
of q[16 + 4c + i]; in the kernel a shift and a mask put it beside the nibble. 5 bits a weight
instead of 8.

Block scales (and Q4_1's minimums) sit in tiles of their own (tiles.py), one per (row, block):
the float16 bits GGUF stores (uint16) where the format's scales are float16 values (Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), float32 where they are products (the K-quants' d * sc). The
block term widens float16 exactly (vcvtph2ps), so either gives the same float32 operands; with
float16 scales a Q4_0 / Q4_1 / Q8_0 / Q5_0 matrix streams exactly as many bytes as GGUF stores
(Q8_0's quants with their sign bits flipped).

The integer dot of one block for 8 weight rows is an LLVM intrinsic. With AVX-512 VNNI (and
VL) or AVX-VNNI, per 4-weight chunk one vpdpbusd: each int32 lane (one row) adds its 4 unsigned
weight bytes times the 4 broadcast activations, in two accumulators. int8 weights go in as
stored, as the unsigned u = w + 128: the dot is then isum + 128 xsum, and the block term takes
128 xsum off again in int32 (the FLIP flag of the terms below), exactly. (Before session 40 the
weights were stored as w and went in as |w| against x with w's sign, one vpsignb more per
chunk and token: Q8_0 matmuls of 1 to 64 tokens ran 1.1-1.7x slower, docs/PERFORMANCE.md.)
On AVX2, per 4-weight chunk: vpmaddubsw (unsigned weights x signed activations -> pairs
summed in int16) of the chunk vector and the broadcast activations, so every int16 lane
already belongs to one row.
Nibbles: the 8 chunks' int16 vectors are added in int16 (|sum| <= 8 * 2 * 15 * 127 = 30,480,
no overflow), then one vpmaddwd against ones gives the 8 rows' int32 dots. 5-bit weights: the
same in two halves of 4 chunks (|sum| <= 4 * 2 * 31 * 127 = 31,496), each widened. int8 weights:
the sign bit flipped back (one vpxor a chunk, shared by the tokens), then |w| x (x with w's
sign) through vpsignb (u x x in pairs could overflow int16), each chunk's pairs (|pair| <=
2 * 128 * 127) widened by vpmaddwd and added in int32. No horizontal adds. Elsewhere portable
IR (sext, mul, shuffles, add) that LLVM lowers for the target. The integer dots are exact, so
the layout and the instruction choice cannot change a bit of the result.

The tile kernel (`tile_kernel`) is here too, one for the formats, which pick their weight
bytes (int8, packed nibbles or 5 bits) and block term (SCALE, OFFSET8, OFFSET16, MIN). Two
builds give the same bits: with AVX-512's 32 vector registers, a pass over a tile is one
compiled loop over the blocks (`tile_dots`) whose float32 sums stay in registers; with 16, the
block dots are stored as int32 and their terms added into sums in memory. With AVX-512 BW as
well (`WIDE`), a register pass of four or eight tokens joins two 8-row groups' chunk vectors
into one 512-bit vector, 16 rows a vpdpbusd and a term (`_group_chunks`, `WIDE_ROWS`): the
same operations per row, so the same bits, with half the broadcasts and term instructions.
int8_fields.py builds the sub-block formats of 32 on it. int8_sub16.py (Q6_K, Q3_K: two
scaled sub-blocks of 16 per block) has a dot of its own, made of this module's IR pieces, and
the SCALE term: its memory kernel is its own, its register kernel this module's
(`PASS_WEIGHTS`, 8 rows a vector).

Not here: the repacks and NumPy twins (the format modules), shape checks (weight.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import NamedTuple

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, config, types
from numba.extending import intrinsic

from cfr_atlas.quant.tiles import TILE_ROWS

QK = 32  # activation block: the block of every integer-path weight format
UNIT = {8: QK, 4: QK // 2, 5: QK // 2 + QK // 8}  # weight bytes of one row's block, by bits
GROUP = 8  # weight rows per integer-dot intrinsic call (one 8 x int32 result vector)
WIDE_ROWS = 2 * GROUP  # weight rows a vector of a wide register pass (512-bit vectors, `WIDE`)
CHUNK = 4  # bytes of one row in a chunk vector (vpmaddubsw + vpmaddwd sum 4 products)
QMAX = np.float32(127.0)
TINY = np.float32(QMAX / np.finfo(np.float32).max)  # below it, 127 / amax overflows


def _target_has(*features: str) -> bool:
    """All features on the compile target (numba's NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else
    the host), by LLVM's names."""
    if config.CPU_NAME:
        return all(f"+{f}" in (config.CPU_FEATURES or "").split(",") for f in features)
    try:
        host = llvm.get_host_cpu_features()
    except RuntimeError:
        return False
    return all(host.get(f, False) for f in features)


AVX2 = _target_has("avx2")
# vpdpbusd on 256-bit vectors: AVX-512 VNNI with VL (EVEX), or AVX-VNNI (VEX)
VNNI = AVX2 and (_target_has("avx512vnni", "avx512vl") or _target_has("avxvnni"))
# the instruction set a dot is built for: a literal of the kernels (the tests build all three)
PORTABLE, AVX2_DOT, VNNI_DOT = 0, 1, 2
ISA = VNNI_DOT if VNNI else AVX2_DOT if AVX2 else PORTABLE
ISAS = tuple(i for i, ok in ((PORTABLE, True), (AVX2_DOT, AVX2), (VNNI_DOT, VNNI)) if ok)

# --- activation quantization ---------------------------------------------------------------


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the integer `bits`."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        low = builder.trunc(args[0], I32) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_bits(typingctx, v):
    """The bit pattern of the float32 v as an int32."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], I32)

    return types.int32(v), codegen


_ROUNDER = np.float32(1.5 * 2**23)  # float32 v + it - it: v rounded to an integer (|v| < 2**22)
_ABS_BITS = np.int32(0x7FFFFFFF)  # |x| on the bits
_MAX_BITS = np.int32(0x7F7FFFFF)  # the largest finite float32; above it inf and NaN


def _row_element(context, builder, ary_t, ary, index):
    """A pointer to element `index` (intp) of the 1-D array value `ary` (any stride)."""
    a = context.make_array(ary_t)(context, builder, ary)
    stride = cgutils.unpack_tuple(builder, a.strides, 1)[0]
    base = builder.bitcast(a.data, ir.IntType(8).as_pointer())
    at = builder.gep(base, [builder.mul(index, stride)])
    return builder.bitcast(at, context.get_data_type(ary_t.dtype).as_pointer())


def _block_values(context, builder, sig, args):
    """The QK float32 values x[k0:k0 + QK] of the block as one vector (a vector load where x
    is contiguous, else element by element)."""
    x_t, k0_t = sig.args[0], sig.args[1]
    k0 = context.cast(builder, args[1], k0_t, types.intp)
    vf = ir.VectorType(ir.FloatType(), QK)
    if x_t.layout == "C":
        return builder.load(_ptr(context, builder, x_t, args[0], k0, vf), align=4)
    v = ir.Constant(vf, ir.Undefined)
    for j in range(QK):
        at = builder.add(k0, ir.Constant(k0.type, j))
        v = builder.insert_element(v, builder.load(_row_element(context, builder, x_t,
                                                                args[0], at)),
                                   ir.Constant(I32, j))
    return v


@intrinsic
def _block_max_bits(typingctx, x, k0):
    """max over j < QK of (bit pattern of x[k0 + j]) & 0x7FFFFFFF, as int32: `_quantize_row`'s
    amax on the bits, one vector and one reduction (the same value as the scalar loop)."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and isinstance(k0, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vi = ir.VectorType(I32, QK)
        bits = builder.and_(builder.bitcast(_block_values(context, builder, sig, args), vi),
                            _splat(vi, 0x7FFFFFFF))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [vi]),
                                            f"llvm.vector.reduce.smax.v{QK}i32")
        return builder.call(fn, [bits])

    return types.int32(x, k0), codegen


@intrinsic
def _block_quantize(typingctx, x, k0, inv, xq, t):
    """xq[t, k0 + j] = int8(rint(x[k0 + j] * inv)) for j < QK (x * inv within +-127 and
    a little: rint by adding and taking back 1.5 * 2**23 in float32, ties to even, as
    np.rint), returning their sum as int32: `_quantize_row`'s quantization of one block as
    vector operations (an element-wise np.rint is a library call per element, which kept
    the loop scalar)."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and isinstance(k0, types.Integer) and inv == types.float32
            and isinstance(xq, types.Array) and xq.ndim == 2 and xq.layout == "C"
            and xq.dtype == types.int8 and isinstance(t, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vf = ir.VectorType(ir.FloatType(), QK)
        splat = builder.shuffle_vector(
            builder.insert_element(ir.Constant(vf, ir.Undefined), args[2], ir.Constant(I32, 0)),
            ir.Constant(vf, ir.Undefined), ir.Constant(ir.VectorType(I32, QK), [0] * QK))
        v = builder.fmul(_block_values(context, builder, sig, args), splat)
        rounder = _splat(vf, float(_ROUNDER))
        r = builder.fsub(builder.fadd(v, rounder), rounder)
        q = builder.fptosi(r, ir.VectorType(ir.IntType(8), QK))
        row_len = cgutils.unpack_tuple(
            builder, context.make_array(sig.args[3])(context, builder, args[3]).shape, 2)[1]
        t_v = context.cast(builder, args[4], sig.args[4], types.intp)
        k0 = context.cast(builder, args[1], sig.args[1], types.intp)
        at = builder.add(builder.mul(t_v, row_len), k0)
        builder.store(q, _ptr(context, builder, sig.args[3], args[3], at, q.type), align=1)
        wide = builder.sext(q, ir.VectorType(I32, QK))
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(I32, [wide.type]), f"llvm.vector.reduce.add.v{QK}i32")
        return builder.call(fn, [wide])

    return types.int32(x, k0, inv, xq, t), codegen


@njit(cache=True, nogil=True, inline="always")
def _quantize_row(x, xq, xd, xsum, t):
    """Row t: x (K,) float32 (any stride) -> xq[t], xd[t], xsum[t]. amax is taken on the
    bits (|x| orders as its bit pattern; an integer max vectorizes without fast-math, a float
    one does not), which also tells inf and NaN (bits above _MAX_BITS) apart. Each block is
    a few vector operations (`_block_max_bits`, `_block_quantize`; the tests hold them to
    the plain loops)."""
    for b in range(x.size // QK):
        k0 = b * QK
        m = _block_max_bits(x, k0)
        if m > _MAX_BITS:
            xd[t, b] = np.float32(np.nan)
            xq[t, k0:k0 + QK] = 0
            xsum[t, b] = 0
            continue
        amax = _f32_from_bits(m)
        inv = QMAX / amax if amax >= TINY else np.float32(0.0)
        xsum[t, b] = _block_quantize(x, k0, inv, xq, t)
        xd[t, b] = amax / QMAX


@njit(cache=True, nogil=True)
def quantize_rows(x, xq, xd, xsum):
    """x (T, K) float32 -> xq (T, K) int8, xd (T, K // QK) float32, xsum (T, K // QK) int32."""
    for t in range(x.shape[0]):
        _quantize_row(x[t], xq, xd, xsum, t)


@njit(parallel=True, cache=True, nogil=True)
def _quantize_rows_parallel(x, xq, xd, xsum):
    """quantize_rows with the rows split between threads (a row's bits are its own)."""
    for t in prange(x.shape[0]):
        _quantize_row(x[t], xq, xd, xsum, t)


# From this many elements the threads share the quantization. Below it, starting the threads
# costs more than it saves (one thread against two, OMP_WAIT_POLICY=ACTIVE, which the default
# resembles between a token's kernels): 8 rows of 576, 7 us against 10; 32 of 1,536 (49,152
# elements), 31 against 32; two threads win from 128 rows of 576 (73,728: 45 against 37) and
# 64 of 1,536 (98,304: 60 against 40). With PASSIVE one thread won at every size measured.
PARALLEL_ELEMENTS = 1 << 16


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, K) float32, K a multiple of QK -> (xq int8 (T, K), d (T, nb) float32,
    xsum (T, nb) int32) with the numba kernel (threads from PARALLEL_ELEMENTS elements: the
    same bits)."""
    T, K = x.shape
    xq = np.empty((T, K), dtype=np.int8)
    xd = np.empty((T, K // QK), dtype=np.float32)
    xsum = np.empty((T, K // QK), dtype=np.int32)
    _quantize_into(x, xq, xd, xsum)
    return xq, xd, xsum


def _quantize_into(x, xq, xd, xsum) -> None:
    """`quantize`'s kernel, on both threads from PARALLEL_ELEMENTS elements."""
    (_quantize_rows_parallel if x.size >= PARALLEL_ELEMENTS else quantize_rows)(x, xq, xd, xsum)


_scratch = threading.local()  # per thread: (T, K) -> the buffers `quantize_transient` reuses
# shapes a thread keeps buffers for, the oldest dropped first (a step's rows, twice that for
# the refined head, prompt chunks, the model's few K; an MoE step's expert row counts)
SCRATCH_SHAPES = 16


def quantize_transient(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quantize` into buffers the calling thread reuses: the arrays returned are overwritten by
    its next call with the same shape, so they are for a product's own use before it returns
    (the integer matmuls). Saves a decode token's ~120 products three allocations each."""
    shape = x.shape
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    out = bufs.get(shape)
    if out is None:
        if len(bufs) >= SCRATCH_SHAPES:
            del bufs[next(iter(bufs))]  # the oldest shape (a holder keeps its arrays)
        T, K = shape
        out = bufs[shape] = (np.empty((T, K), dtype=np.int8),
                             np.empty((T, K // QK), dtype=np.float32),
                             np.empty((T, K // QK), dtype=np.int32))
    _quantize_into(x, *out)
    return out


def quantize_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The NumPy twin of `quantize`, bit for bit."""
    T, K = x.shape
    xb = x.reshape(T, K // QK, QK)
    a = np.abs(xb)
    finite = np.all(a <= np.finfo(np.float32).max, axis=-1)  # False for inf and NaN
    amax = np.where(finite, a.max(axis=-1, initial=np.float32(0.0)), np.float32(1.0))
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(amax >= TINY, QMAX / amax, np.float32(0.0)).astype(np.float32)
    q = np.where(finite[..., None], np.rint(xb * inv[..., None]), np.float32(0.0))
    q = q.astype(np.int8)
    d = np.where(finite, amax / QMAX, np.float32(np.nan)).astype(np.float32)
    return q.reshape(T, K), d, q.sum(axis=-1, dtype=np.int32)


def with_residual(x: np.ndarray) -> np.ndarray:
    """x (T, K) float32 -> (2T, K): row 2t is x[t], row 2t + 1 its quantization residual
    r = x[t] - d_x q (float32, one rounding each for d_x q and the difference). Quantized in
    turn, r's blocks carry amax(r) <= d_x / 2 (up to float32 rounding of d_x q), so the two
    integer passes summed see each activation to within amax / (2 * 127 * 254): about 15 bits
    instead of 8 (`matmul_refined` in weight.py). The pair of a row depends on that row only;
    a non-finite block's residual is NaN (d_x = NaN), so its outputs stay NaN."""
    xq, xd, _ = quantize(x)
    T, K = x.shape
    out = np.empty((2 * T, K), dtype=np.float32)
    out[0::2] = x
    deq = (xq.reshape(T, -1, QK).astype(np.float32) * xd[..., None]).reshape(T, K)
    np.subtract(x, deq, out=out[1::2])
    return out


# --- block tiles ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def block_byte(r, j, nbytes):
    """Offset of byte j of row r (of the tile) within one block of a tile (the layout above)."""
    return (r // GROUP) * GROUP * nbytes + ((j // CHUNK) * GROUP + r % GROUP) * CHUNK + j % CHUNK


def to_block_tiles(a: np.ndarray, nbytes: int) -> np.ndarray:
    """a (N, nb * nbytes) -> (n_tiles, nb * TILE_ROWS * nbytes), rows zero-padded to whole
    tiles, in the layout of the module docstring (padding bytes 0: for sign-flipped int8
    quants a weight of -128, in rows whose outputs are never written out)."""
    rows, cols = a.shape
    tiles = -(-rows // TILE_ROWS)
    padded = np.zeros((tiles * TILE_ROWS, cols), dtype=a.dtype)
    padded[:rows] = a
    # (tile, group, row, block, chunk, byte) -> (tile, block, group, chunk, row, byte)
    split = padded.reshape(tiles, TILE_ROWS // GROUP, GROUP, cols // nbytes, nbytes // CHUNK,
                           CHUNK)
    return np.ascontiguousarray(split.transpose(0, 3, 1, 4, 2, 5)).reshape(tiles, -1)


def gather_block_rows(tiles: np.ndarray, ids: np.ndarray | slice, nbytes: int) -> np.ndarray:
    """Block tiles -> rows `ids` of the untiled (N, nb * nbytes) matrix, a new array."""
    nb = tiles.shape[1] // (TILE_ROWS * nbytes)
    t6 = tiles.reshape(-1, nb, TILE_ROWS // GROUP, nbytes // CHUNK, GROUP, CHUNK)
    if isinstance(ids, slice):
        return t6.transpose(0, 2, 4, 1, 3, 5).reshape(-1, nb * nbytes)[ids]
    ids = np.asarray(ids)
    r = ids % TILE_ROWS  # advanced indices apart: their dimension comes first
    return t6[ids // TILE_ROWS, :, r // GROUP, :, r % GROUP].reshape(len(ids), nb * nbytes)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., nb * 16) uint8 GGUF nibbles -> (..., nb * 32) uint8 values 0..15 in weight order."""
    p = packed.reshape(*packed.shape[:-1], -1, QK // 2)
    q = np.concatenate([p & np.uint8(0x0F), p >> np.uint8(4)], axis=-1)
    return q.reshape(*packed.shape[:-1], -1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """The inverse of unpack_nibbles: (rows, nb * 32) values 0..15 (any 1-byte dtype) ->
    (rows, nb * 16) uint8, byte j of a block holding q[j] low and q[j + 16] high (GGUF's Q4_0)."""
    b = q.view(np.uint8).reshape(q.shape[0], -1, QK)
    return (b[..., :QK // 2] | (b[..., QK // 2:] << np.uint8(4))).reshape(q.shape[0], -1)


def gather_nibble_rows(tiles: np.ndarray, ids: np.ndarray | slice) -> np.ndarray:
    """Block tiles of packed nibbles -> rows `ids` as (n, nb * 32) uint8 values 0..15."""
    return unpack_nibbles(gather_block_rows(tiles, ids, QK // 2))


_HALF, _FOUR = QK // 2, QK // 8
_HIGH_SHIFTS = np.array([[2 * c, 2 * c + 1] for c in range(_FOUR)], dtype=np.uint8)  # [c, half]


def pack_five(q: np.ndarray) -> np.ndarray:
    """(rows, nb * 32) values 0..31 (any 1-byte dtype) -> (rows, nb * 20) uint8 per block: the
    16 bytes of pack_nibbles(q & 15), then 4 bytes whose byte i holds q[4c + i] >> 4 at bit 2c
    and q[16 + 4c + i] >> 4 at bit 2c + 1, c = 0..3 (the module docstring)."""
    b = q.view(np.uint8).reshape(q.shape[0], -1, QK)
    rows, nb = b.shape[:2]
    nib = pack_nibbles((b & np.uint8(0x0F)).reshape(rows, -1)).reshape(rows, nb, _HALF)
    # high bits as [row, block, half, c, i]
    high = (b >> np.uint8(4)).reshape(rows, nb, 2, _FOUR, 4)
    shifted = high << _HIGH_SHIFTS.T[None, None, :, :, None]
    return np.concatenate([nib, np.bitwise_or.reduce(shifted, axis=(2, 3))],
                          axis=-1).reshape(rows, -1)


def unpack_five(packed: np.ndarray) -> np.ndarray:
    """The inverse of pack_five: (rows, nb * 20) uint8 -> (rows, nb * 32) uint8 values 0..31."""
    rows = packed.shape[0]
    p = packed.reshape(rows, -1, UNIT[5])
    nb = p.shape[1]
    low = unpack_nibbles(p[..., :_HALF].reshape(rows, -1)).reshape(rows, nb, QK)
    bits = (p[..., None, None, _HALF:] >> _HIGH_SHIFTS.T[None, None, :, :, None]) & np.uint8(1)
    return (low | (bits.reshape(rows, nb, QK) << np.uint8(4))).reshape(rows, -1)


def block_dots_numpy(w: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """w (N, nb * QK) integers, xq (T, nb * QK) int8 -> (T, N, nb) int64 exact block dots."""
    n, t = w.shape[0], xq.shape[0]
    wb = w.reshape(n, -1, QK).astype(np.int64)
    return np.einsum("nbj,tbj->tnb", wb, xq.reshape(t, -1, QK).astype(np.int64))


# --- the integer dot: 8 weight rows x one activation block -> 8 int32 ----------------------

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
V8 = ir.VectorType(I8, CHUNK * GROUP)  # one chunk vector: 4 bytes of each of 8 rows
V16, V32 = ir.VectorType(I16, QK // 2), ir.VectorType(I32, GROUP)


def _ptr(context, builder, ary_t, ary, index, vec):
    arr = context.make_array(ary_t)(context, builder, ary)
    return builder.bitcast(builder.gep(arr.data, [index]), vec.as_pointer())


def _x86(builder, name, ret, *args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _splat(v, x):
    return ir.Constant(v, [ir.Constant(v.element, x)] * v.count)


def _splat_value(builder, vec, x):
    """A scalar repeated across the lanes of a vector type."""
    one = builder.insert_element(ir.Constant(vec, None), x, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, vec.count), [0] * vec.count)
    return builder.shuffle_vector(one, ir.Constant(vec, None), mask)


def _broadcast(context, builder, x_t, x, xo, j, rows=GROUP):
    """Activations x[xo + j .. xo + j + 3] repeated `rows` times: a <4 rows x i8> (a chunk
    vector's 4 bytes of each of its rows)."""
    p = _ptr(context, builder, x_t, x, builder.add(xo, ir.Constant(xo.type, j)), I32)
    vec = _splat_value(builder, ir.VectorType(I32, rows), builder.load(p, align=1))
    return builder.bitcast(vec, ir.VectorType(I8, CHUNK * rows))


def _madd_avx2(builder, u, s):
    """vpmaddubsw: unsigned u x signed s, adjacent pairs summed -> <16 x i16>."""
    return _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", V16, u, s)


def _widen_avx2(builder, p):
    """vpmaddwd against ones: <16 x i16> -> <8 x i32>, lane r = the pair of lanes 2r, 2r + 1."""
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", V32, p, _splat(V16, 1))


def _chunk_generic(builder, w, xb, unsigned):
    """Portable: <32 x i8> chunk vector times broadcast activations -> <8 x i32> row sums."""
    v32 = ir.VectorType(I32, QK)
    wide = builder.zext(w, v32) if unsigned else builder.sext(w, v32)
    prod = builder.mul(wide, builder.sext(xb, v32))
    parts = [builder.shuffle_vector(prod, ir.Constant(v32, None),
                                    ir.Constant(V32, list(range(k, QK, CHUNK))))
             for k in range(CHUNK)]
    return _sum(builder, parts)


def _sum(builder, vectors):
    """Lane-wise integer sum of a list of vectors (exact: the order is free)."""
    return functools.reduce(builder.add, vectors)


SIGN = np.uint8(0x80)


def flip_sign(a: np.ndarray) -> np.ndarray:
    """int8 weights <-> the bytes the block tiles store for them (either way: u = w ^ 0x80, as
    uint8; read unsigned, u = w + 128). A new uint8 array."""
    return a.view(np.uint8) ^ SIGN


def psign(builder, a, b):
    """vpsignb: a with b's sign per byte (0 where b is 0)."""
    return _x86(builder, "llvm.x86.avx2.psign.b", V8, a, b)


def _dot_vnni(builder, pairs):
    """vpdpbusd: each int32 lane (one row) += its 4 unsigned weight bytes x the 4 signed
    activations, one instruction a chunk (int8 weights as stored, u = w + 128: the caller's
    term takes the 128 xsum off). Two accumulators, added at the end (exact in int32: the
    order is free). 8 rows a chunk vector (256 bits) or 16 (512 bits, `WIDE`)."""
    rows = pairs[0][0].type.count // CHUNK
    vec = ir.VectorType(I32, rows)
    name = "llvm.x86.avx512.vpdpbusd.512" if rows == WIDE_ROWS else \
        "llvm.x86.avx512.vpdpbusd.256"
    accs = [_splat(vec, 0), _splat(vec, 0)]
    for k, (u, s) in enumerate(pairs):
        accs[k % 2] = _x86(builder, name, vec, accs[k % 2], builder.bitcast(u, vec),
                           builder.bitcast(s, vec))
    return builder.add(*accs)


def _dot_chunks(builder, chunks, xbs, bits, isa):
    """Chunk vectors (each with its broadcast activations) -> <8 x i32> dots of the 8 rows;
    bits 4 and 5: unsigned weights, lows then highs; 8: int8 weights stored sign-flipped, whose
    dot is isum on PORTABLE and AVX2_DOT and isum + 128 xsum on VNNI_DOT (`dot_offset`). isa:
    PORTABLE, AVX2_DOT or VNNI_DOT."""
    pairs = list(zip(chunks, xbs, strict=True))
    if bits == 8 and isa != VNNI_DOT:  # the stored bytes back to the int8 weights
        pairs = [(builder.xor(w, _splat(V8, 0x80)), xb) for w, xb in pairs]
    if isa == PORTABLE:
        return _sum(builder, [_chunk_generic(builder, w, xb, bits != 8) for w, xb in pairs])
    if isa == VNNI_DOT:
        return _dot_vnni(builder, pairs)
    if bits == 4:  # 8 chunks of 0..15 weights, summed in int16 without overflow
        return _widen_avx2(builder, _sum(builder, [_madd_avx2(builder, w, xb)
                                                   for w, xb in pairs]))
    if bits == 5:  # 0..31: each half's 4 chunks in int16, then widened
        half = len(pairs) // 2
        return _sum(builder, [_widen_avx2(builder, _sum(builder, [
            _madd_avx2(builder, w, xb) for w, xb in part]))
            for part in (pairs[:half], pairs[half:])])
    # int8: |w| x (x with w's sign), the unsigned x signed instruction, exactly
    return _sum(builder, [_widen_avx2(builder, _madd_avx2(builder, psign(builder, w, w),
                                                          psign(builder, xb, w)))
                          for w, xb in pairs])


def _shift_to_bit4(builder, v, bit):
    """(v >> bit) << 4 & 0x10 per byte: bit `bit` of each byte of v moved to bit 4."""
    if bit < 4:
        v = builder.shl(v, _splat(v.type, 4 - bit))
    elif bit > 4:
        v = builder.lshr(v, _splat(v.type, bit - 4))
    return builder.and_(v, _splat(v.type, 0x10))


def _weight_chunks(builder, raw, bits):
    """The loaded vectors of a group's block -> (chunk vectors, each chunk's first weight)."""
    if bits == 8:
        return raw, [CHUNK * c for c in range(len(raw))]
    nib = raw[:QK // 2 // CHUNK]  # chunk c: weights 4c .. 4c + 3 (low nibbles), 16 + 4c .. (high)
    lows = [builder.and_(v, _splat(v.type, 0x0F)) for v in nib]
    highs = [builder.lshr(v, _splat(v.type, 4)) for v in nib]
    if bits == 5:  # the fifth vector's bits 2c, 2c + 1 are chunk c's high bits
        hb = raw[-1]
        lows = [builder.or_(v, _shift_to_bit4(builder, hb, 2 * c)) for c, v in enumerate(lows)]
        highs = [builder.or_(v, _shift_to_bit4(builder, hb, 2 * c + 1))
                 for c, v in enumerate(highs)]
    starts = [CHUNK * c for c in range(len(nib))]
    return lows + highs, starts + [QK // 2 + j for j in starts]


def _group_chunks(context, builder, w_t, w, wo, bits, rows=GROUP):
    """The chunk vectors of the 8-row group's block at w[wo:] (block tiles), loaded and
    unpacked, with each chunk's first weight (`_weight_chunks`); rows WIDE_ROWS: the group's
    and the next group's vectors joined (<64 x i8>, the next group's rows in the upper half),
    16 rows a vector."""

    def load(offset):
        p = _ptr(context, builder, w_t, w, builder.add(wo, ir.Constant(wo.type, offset)), V8)
        return builder.load(p, align=1)

    raw = [load(c * QK) for c in range(UNIT[bits] // CHUNK)]
    if rows == WIDE_ROWS:  # the next group's block starts GROUP rows' bytes on
        join = ir.Constant(ir.VectorType(I32, 2 * V8.count), list(range(2 * V8.count)))
        raw = [builder.shuffle_vector(v, load(GROUP * UNIT[bits] + c * QK), join)
               for c, v in enumerate(raw)]
    return _weight_chunks(builder, raw, bits)


def _dot8_codegen(tokens: int):
    """Codegen of dot8 / dot8x2 / dot8x4 for their literal (bits, isa) arguments: the weights
    loaded and unpacked once, then each token's dots."""

    def codegen(context, builder, sig, args):
        bits, isa = sig.args[-2].literal_value, sig.args[-1].literal_value
        chunks, starts = _group_chunks(context, builder, sig.args[0], args[0], args[1], bits)
        # (activation array, offset, output array) per token; the outputs share offset oo
        for xa, xo, oa in ((2, 3, 4), (6, 7, 8), (9, 10, 11), (12, 13, 14))[:tokens]:
            xbs = [_broadcast(context, builder, sig.args[xa], args[xa], args[xo], j)
                   for j in starts]
            res = _dot_chunks(builder, chunks, xbs, bits, isa)
            builder.store(res, _ptr(context, builder, sig.args[oa], args[oa], args[5], V32),
                          align=4)
        return context.get_dummy_value()

    return codegen


def literal_isa(isa) -> bool:
    """Is isa a literal int of ISAS (the dots' instruction-set argument)?"""
    return isinstance(isa, types.IntegerLiteral) and isa.literal_value in ISAS


def _literal_bits(bits, isa) -> bool:
    return (isinstance(bits, types.IntegerLiteral) and bits.literal_value in UNIT
            and literal_isa(isa))


@intrinsic
def dot8(typingctx, w, wo, x, xo, out, oo, bits, isa):
    """out[oo + r] = sum_j W_r[j] x[xo + j] for the 8 rows r of the group at w[wo:] (block
    tiles; bits 8: int8 weights, 4: packed nibbles 0..15, 5: 0..31); bits and isa (one of
    ISAS: PORTABLE, AVX2_DOT, VNNI_DOT) literal ints."""
    if not _literal_bits(bits, isa):
        return None
    return types.void(w, wo, x, xo, out, oo, bits, isa), _dot8_codegen(1)


@intrinsic
def dot8x2(typingctx, w, wo, x, xo, out, oo, u, uo, out_u, bits, isa):
    """dot8 for two tokens, x[xo:] -> out and u[uo:] -> out_u, the weights loaded once."""
    if not _literal_bits(bits, isa):
        return None
    return types.void(w, wo, x, xo, out, oo, u, uo, out_u, bits, isa), _dot8_codegen(2)


@intrinsic
def dot8x4(typingctx, w, wo, x, xo, out, oo, u, uo, out_u, y, yo, out_y, z, zo, out_z, bits,
           isa):
    """dot8 for four tokens (x, u, y, z at their offsets -> out, out_u, out_y, out_z), the
    weights loaded and unpacked once for all four."""
    if not _literal_bits(bits, isa):
        return None
    sig = types.void(w, wo, x, xo, out, oo, u, uo, out_u, y, yo, out_y, z, zo, out_z, bits, isa)
    return sig, _dot8_codegen(4)


# --- the tile kernel, one for the three integer-path formats --------------------------------

# How a block's int32 dot becomes the float32 term added to acc (per output row r, block b,
# k = b * TILE_ROWS + r, dx = the activation block's scale):
SCALE = 0  # Q8_0:  (d_k * dx) * isum_r
OFFSET8 = 1  # Q4_0: (d_k * dx) * (isum_r - 8 xsum_b)   (weights stored 0..15, value q - 8)
MIN = 2  # Q4_1:    (d_k * dx) * isum_r + m_k * (dx * xsum_b)   (llama.cpp's q8_1 s = d sum q)
OFFSET16 = 3  # Q5_0: (d_k * dx) * (isum_r - 16 xsum_b)  (weights stored 0..31, value q - 16)
_OFFSETS = {OFFSET8: 8, OFFSET16: 16}
# A flag on any term: the dots came from vpdpbusd on int8 weights as stored (u = w + 128), so
# isum_r - 128 xsum_b (exact in int32: |isum| <= 32 * 255 * 127) is the dot the term reads
FLIP = 8


def dot_offset(bits: int, isa: int) -> int:
    """What the dots of `bits`-bit weights carry beyond sum_j w_j x_j, in units of the block's
    xsum: 128 for int8 weights on VNNI_DOT (read unsigned as stored), else 0."""
    return 128 if bits == 8 and isa == VNNI_DOT else 0


F32 = ir.FloatType()
VF = ir.VectorType(F32, GROUP)


def widen_scales(a: np.ndarray) -> np.ndarray:
    """Tile scales as float32: float16 bits (uint16, how the block formats keep GGUF's scales)
    widened exactly, float32 as is."""
    return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a


def _scales(context, builder, a_t, a, k, rows=GROUP):
    """<rows x float> of a[k .. k + rows - 1]: float32 loaded as is, uint16 float16 bits widened
    (exact: vcvtph2ps with F16C)."""
    vf = ir.VectorType(F32, rows)
    if a_t.dtype == types.uint16:
        bits = builder.load(_ptr(context, builder, a_t, a, k, ir.VectorType(I16, rows)),
                            align=2)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), rows)), vf)
    return builder.load(_ptr(context, builder, a_t, a, k, vf), align=4)


def _block_term(context, builder, dot, xs, xs_t, dx, d_t, d, m_t, m, k, term):
    """The float32 block term of 8 rows (<8 x float>) from their int32 dots (<8 x i32>), or of
    16 (<16 x ...>, a wide pass): the scalar rule of _add_terms, lane by lane (the same IEEE
    float32 operations in the same order, no fast-math flags, so no contraction into FMA and
    the same bits as one row at a time). xs: the activation block's integer sum (of type
    xs_t), dx its float32 scale; the rows' scales at d[k], m[k] (MIN only)."""
    rows = dot.type.count
    vi, vf = dot.type, ir.VectorType(F32, rows)
    xs = context.cast(builder, xs, xs_t, types.int32)  # |xs| <= 32 * 127: exact
    if term & FLIP:  # the dots of int8 weights read as stored: isum + 128 xs
        dot = builder.sub(dot, _splat_value(builder, vi, builder.mul(xs, ir.Constant(I32, 128))))
        term &= ~FLIP
    if term in _OFFSETS:  # isum - 8 xs or - 16 xs, exact in int32 (|isum| <= 32 * 31 * 127)
        shift_xs = builder.mul(xs, ir.Constant(I32, _OFFSETS[term]))
        dot = builder.sub(dot, _splat_value(builder, vi, shift_xs))
    scaled = builder.fmul(_scales(context, builder, d_t, d, k, rows),
                          _splat_value(builder, vf, dx))
    t = builder.fmul(scaled, builder.sitofp(dot, vf))
    if term == MIN:  # + m_k * (dx * xs)
        dxs = builder.fmul(dx, builder.sitofp(xs, F32))
        t = builder.fadd(t, builder.fmul(_scales(context, builder, m_t, m, k, rows),
                                         _splat_value(builder, vf, dxs)))
    return t


def _term8_codegen(context, builder, sig, args):
    """acc[ao + r] += the block term of rows r = 0..7 (`_block_term`)."""
    acc_t, d_t, m_t, isum_t = sig.args[0], sig.args[2], sig.args[3], sig.args[7]
    acc, ao, d, m, k, dx, xs, isum, io = args[:9]
    dot = builder.load(_ptr(context, builder, isum_t, isum, io, V32), align=4)
    t = _block_term(context, builder, dot, xs, sig.args[6], dx, d_t, d, m_t, m, k,
                    sig.args[9].literal_value)
    p = _ptr(context, builder, acc_t, acc, ao, VF)
    builder.store(builder.fadd(builder.load(p, align=4), t), p, align=4)
    return context.get_dummy_value()


@intrinsic
def term8(typingctx, acc, ao, d, m, k, dx, xs, isum, io, term):
    """acc[ao + r] += block term for 8 rows r: d[k + r], m[k + r] (MIN only; float32, or
    float16 bits as uint16, widened exactly), the activation block's dx (float32) and xs (its
    integer sum), isum[io + r] the rows' int32 dots; term a literal SCALE / OFFSET8 / OFFSET16
    / MIN, with FLIP or'ed in where the dots carry 128 xs (`dot_offset`)."""
    f32_acc = isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.layout == "C"
    scales = all(isinstance(a, types.Array) and a.dtype in (types.float32, types.uint16)
                 and a.layout == "C" for a in (d, m))
    if (not isinstance(term, types.IntegerLiteral) or dx != types.float32 or not f32_acc
            or not scales or not isinstance(xs, types.Integer)
            or not isinstance(isum, types.Array) or isum.dtype != types.int32
            or isum.layout != "C"):
        return None  # the vector loads below assume these element types, contiguous
    return types.void(acc, ao, d, m, k, dx, xs, isum, io, term), _term8_codegen


@njit(cache=True, inline="always")
def _add_terms(acc, d, m, b, dx, xs, isum, R, term):
    """acc[r] += block b's term for the tile's rows r (term a constant of the caller, R rows):
        SCALE   (d[k] * dx) * float32(isum[r])
        OFFSET8 (d[k] * dx) * float32(isum[r] - 8 xs)     (OFFSET16: - 16 xs)
        MIN     (d[k] * dx) * float32(isum[r]) + m[k] * (dx * float32(xs))
    with k = b * R + r, GROUP rows per term8 call."""
    for g in range(0, R, GROUP):
        term8(acc, g, d, m, b * R + g, dx, xs, isum, g, term)


def _opaque_zero(builder, intp):
    """A zero LLVM cannot see through (an empty inline asm passing 0 on): added to an address,
    it keeps loads of the same bytes apart, so each one folds into the instruction that uses
    it instead of being merged into one value held in a register."""
    asm = ir.InlineAsm(ir.FunctionType(intp, [intp]), "", "=r,0", side_effect=True)
    return builder.call(asm, [ir.Constant(intp, 0)])


class PassWeights(NamedTuple):
    """How a register pass reads one 8-row group's block of a kind of weights (the `bits`
    literal of `tile_dots`): UNIT's 4, 5 and 8 here, SUB16 registered by int8_sub16.py."""

    # (context, builder, sig, args, b, g, isa, rows) -> (state, activation offsets to
    # broadcast): loads (and unpacks) group g's block b (rows WIDE_ROWS: groups g and g + 1
    # joined); sig and args are tile_dots' (m: the scales it reads, if any)
    load: Callable
    dot: Callable  # (builder, state, broadcasts, isa) -> <rows x i32> the rows' dots
    m_types: tuple  # numba dtypes tile_dots' m may have for these weights
    rows: tuple = (GROUP,)  # the rows a vector it can take: GROUP, and WIDE_ROWS if it can


SUB16 = 16  # `tile_dots`' bits for int8_sub16's weights (Q6_K, Q3_K: scaled halves)
_SCALE_TYPES = (types.float32, types.uint16)  # float32 scales, or float16 bits (`_scales`)


def _block_tile_weights(bits: int) -> PassWeights:
    """PassWeights of this module's block tiles of `bits`-bit weights."""

    def load(context, builder, sig, args, b, g, isa, rows):
        intp = context.get_value_type(types.intp)
        unit = UNIT[bits]
        wo = builder.add(builder.mul(b, ir.Constant(intp, TILE_ROWS * unit)),
                         ir.Constant(intp, g * GROUP * unit))
        return _group_chunks(context, builder, sig.args[0], args[0], wo, bits, rows)

    def dot(builder, chunks, xbs, isa):
        return _dot_chunks(builder, chunks, xbs, bits, isa)

    return PassWeights(load, dot, _SCALE_TYPES, (GROUP, WIDE_ROWS))


PASS_WEIGHTS: dict[int, PassWeights] = {bits: _block_tile_weights(bits) for bits in UNIT}


def _tile_dots_codegen(context, builder, sig, args):
    """Codegen of tile_dots: a loop over the blocks whose float32 sums stay in registers."""
    q_t, xq_t, t_t, xd_t, xs_t, d_t, m_t, acc_t = sig.args[:8]
    q, xq, t, xd, xsum, d, m, acc = args[:8]
    bits, isa, term, tokens, rows = (a.literal_value for a in sig.args[8:])
    weights, R = PASS_WEIGHTS[bits], TILE_ROWS
    intp = context.get_value_type(types.intp)

    def const(v):
        return ir.Constant(intp, v)

    K = cgutils.unpack_tuple(builder, context.make_array(xq_t)(context, builder, xq).shape)[1]
    nb = builder.sdiv(K, const(QK))
    t = context.cast(builder, t, t_t, types.intp)
    xd_data = context.make_array(xd_t)(context, builder, xd).data
    xs_data = context.make_array(xs_t)(context, builder, xsum).data
    vf = ir.VectorType(F32, rows)
    zero = ir.Constant(vf, [ir.Constant(F32, 0.0)] * rows)
    groups = range(0, R // GROUP, rows // GROUP)  # a vector's first 8-row group
    # one sum per (token, vector of rows): allocas, which LLVM promotes to registers
    sums = [[cgutils.alloca_once_value(builder, zero) for _ in groups] for _ in range(tokens)]
    tok = [builder.add(t, const(j)) for j in range(tokens)]
    with cgutils.for_range(builder, nb) as loop:
        b = loop.index
        xos = [builder.add(builder.mul(r, K), builder.mul(b, const(QK))) for r in tok]
        blk = [builder.add(builder.mul(r, nb), b) for r in tok]  # (row, b) in xd, xsum
        dxs = [builder.load(builder.gep(xd_data, [i])) for i in blk]
        xss = [builder.load(builder.gep(xs_data, [i])) for i in blk]
        for v, g in enumerate(groups):
            state, starts = weights.load(context, builder, sig, args, b, g, isa, rows)
            k = builder.add(builder.mul(b, const(R)), const(g * GROUP))
            # each vector loads its broadcasts anew (merged, four groups' tokens' broadcasts
            # would be live at once: they spilled)
            apart = _opaque_zero(builder, intp)
            for j in range(tokens):
                xo = builder.add(xos[j], apart)
                xbs = [_broadcast(context, builder, xq_t, xq, xo, s, rows) for s in starts]
                dot = weights.dot(builder, state, xbs, isa)
                term_v = _block_term(context, builder, dot, xss[j], xs_t.dtype, dxs[j], d_t, d,
                                     m_t, m, k, term)
                builder.store(builder.fadd(builder.load(sums[j][v]), term_v), sums[j][v])
    for j in range(tokens):
        for v, g in enumerate(groups):
            at = const(j * R + g * GROUP)
            builder.store(builder.load(sums[j][v]), _ptr(context, builder, acc_t, acc, at, vf),
                          align=4)
    return context.get_dummy_value()


@intrinsic
def tile_dots(typingctx, q, xq, t, xd, xsum, d, m, acc, bits, isa, term, tokens, rows):
    """acc[j, :] = the tile's outputs for token t + j (j < tokens): every block's dots and term
    (`_block_term`) added in block order into float32 sums held in registers for the whole
    row, one load and unpack of a vector's weights serving all the tokens. q: the tile's bytes
    (block tiles); xq (T, K) int8, xd (T, K // QK) float32, xsum (T, K // QK) int32, all
    C-contiguous; d, m: the tile's scales (m read for MIN only; for SUB16 the tile's int8
    sub-block scales); acc (tokens or more, TILE_ROWS) float32. bits (a key of PASS_WEIGHTS),
    isa, term (with FLIP where `dot_offset`), tokens and rows (weight rows a vector: GROUP,
    or WIDE_ROWS where the weights take it and isa is VNNI_DOT): literal ints."""
    literal = all(isinstance(a, types.IntegerLiteral) for a in (bits, isa, term, tokens, rows))
    arrays = (isinstance(a, types.Array) and a.layout == "C" for a in (q, xq, xd, xsum, d, m, acc))
    if not literal or not all(arrays) or bits.literal_value not in PASS_WEIGHTS:
        return None
    weights = PASS_WEIGHTS[bits.literal_value]
    m_ok = m.dtype in weights.m_types
    rows_ok = rows.literal_value in weights.rows and (  # 512-bit dots: only on a WIDE target
        rows.literal_value == GROUP or (WIDE and isa.literal_value == VNNI_DOT))
    if not literal_isa(isa) or xq.ndim != 2 or xq.dtype != types.int8 or not m_ok \
            or not rows_ok or xd.dtype != types.float32 or xsum.dtype != types.int32 \
            or acc.dtype != types.float32 or d.dtype not in _SCALE_TYPES:
        return None  # the loads below assume these element types, contiguous
    sig = types.void(q, xq, t, xd, xsum, d, m, acc, bits, isa, term, tokens, rows)
    return sig, _tile_dots_codegen


# Whether the tile kernel's vpdpbusd dots keep their sums in registers (`tile_kernel`): with
# AVX-512's 32 vector registers. With 16 (AVX-VNNI, or AVX2's dots: haswell as numba's target
# on this AMD EPYC Zen 4) four tokens' sums of a whole tile spill, and the block dots through
# memory ran faster (1.05-1.17x the memory kernel's time from four tokens up). AVX2's dots on
# 32 registers (the same machine's target with the AVX2 dots) gained for nibbles (0.84-0.98x)
# but lost for int8 weights (1.06-1.24x: their sign handling), so they keep the memory kernel
# too (docs/PERFORMANCE.md, session 44).
REGISTER_SUMS = VNNI and _target_has("avx512f", "avx512vnni", "avx512vl")
# Whether the register passes of block tiles (4, 5 and 8 bits) take 16 rows a vector: two
# 8-row groups' chunk vectors joined into one 512-bit vector (`_group_chunks`), one 512-bit
# vpdpbusd a chunk, and eight tokens a pass (16 sums of 16 rows in 32 registers). Per row
# and token the same int32 dots and float32 operations in the same order, so the same bits;
# half the broadcasts and term instructions a row. Paired in one process on this AMD EPYC
# Zen 4 (its 512-bit operations take two 256-bit halves), 1,536 x 576 tiles in cache,
# 16-row / 8-row time: Q4_0 0.81-0.89, Q4_1 0.90-0.96, Q8_0 0.86-0.90 from 8 tokens up
# (docs/PERFORMANCE.md, session 47).
WIDE = REGISTER_SUMS and _target_has("avx512bw")


def registers_for(isa: int) -> bool:
    """Whether `tile_kernel`'s default for isa keeps the sums in registers (REGISTER_SUMS)."""
    return REGISTER_SUMS and isa == VNNI_DOT


def pass_rows(bits: int, isa: int) -> int:
    """Weight rows a vector in the register kernel's passes for `bits` (a key of PASS_WEIGHTS)
    on isa by default: WIDE_ROWS where `WIDE`, isa is VNNI_DOT and the weights take it."""
    wide = WIDE and isa == VNNI_DOT and WIDE_ROWS in PASS_WEIGHTS[bits].rows
    return WIDE_ROWS if wide else GROUP


def tile_kernel(bits: int, term: int, isa: int = ISA, in_registers: bool | None = None,
                rows: int | None = None):
    """The parallel integer-path kernel(xq, xd, xsum, q, d, m, out) for block tiles of int8
    weights (bits=8), GGUF's packed nibbles (4) or 5-bit weights (5), with one of the terms
    above (m is unused unless term == MIN: pass d). Threads split the tiles; tokens go in
    fours (then a pair, then one), one pass over the tile's blocks in order, one weight load
    and unpack serving all the tokens, every operation of any token the one a lone token
    performs (four per load: Q5_0 prefill matmuls 1.24x, Q8_0 1.09x, Q4_1 the same, against
    pairs). in_registers (None: REGISTER_SUMS and isa VNNI_DOT) picks how a pass keeps its
    sums:
    - True: `tile_dots`, the pass one compiled loop whose float32 sums stay in registers;
    - False: the dots of a block's 8-row groups (dot8x4, dot8x2, dot8) stored as int32 and
      their terms added into float32 sums in memory (`_add_terms`).
    The two give the same bits (the same operations in the same order). isa picks the dots'
    instructions (ISA: the best the target has; PORTABLE builds on any machine; the tests
    compare every one the machine runs, both ways). rows (None: `pass_rows`) is the register
    kernel's weight rows a vector: GROUP, or WIDE_ROWS (VNNI_DOT on a target with AVX-512 BW:
    tokens in eights, then four; a last pair or token 8 rows a vector).
    The kernel's closure holds plain values only (numba's disk cache keys a closure by its
    pickled cells, and an intrinsic or dispatcher object pickles differently in every process,
    so a closure over one was compiled anew by every process: ~3 s of each int8 start)."""
    bits, isa = int(bits), int(isa)
    term = int(term) | (FLIP if dot_offset(bits, isa) else 0)
    if rows is not None and int(rows) != GROUP and not (
            int(rows) == WIDE_ROWS and WIDE and isa == VNNI_DOT):
        raise ValueError(f"rows {rows}: {GROUP}, or {WIDE_ROWS} with VNNI_DOT on a target "
                         f"with AVX-512 BW and VNNI (int8.WIDE is {WIDE})")
    if registers_for(isa) if in_registers is None else in_registers:
        return _register_kernel(bits, isa, term, rows)
    return _memory_kernel(bits, isa, term)


@njit(cache=True, inline="always")
def _pass(q, xq, t, xd, xsum, d, m, acc, out, n0, lanes, bits, isa, term, tokens, rows):
    """One register pass (`tile_dots`) of tokens t .. t + tokens - 1 over a tile, its outputs
    copied to out's columns n0 .. n0 + lanes - 1 (inlined: bits .. rows stay literals)."""
    tile_dots(q, xq, t, xd, xsum, d, m, acc, bits, isa, term, tokens, rows)
    for j in range(tokens):
        out[t + j, n0:n0 + lanes] = acc[j, :lanes]


@njit(cache=True, inline="always")
def _last_pair_and_one(q, xq, xd, xsum, d, m, acc, out, n0, lanes, bits, isa, term):
    """A tile's last pair of tokens (T % 4 >= 2), then its last token (T odd), 8 rows a
    vector, after the passes of four or eight."""
    T = xq.shape[0]
    if T % 4 >= 2:
        _pass(q, xq, T - T % 4, xd, xsum, d, m, acc, out, n0, lanes, bits, isa, term, 2, GROUP)
    if T % 2:
        _pass(q, xq, T - 1, xd, xsum, d, m, acc, out, n0, lanes, bits, isa, term, 1, GROUP)


def _register_kernel(bits: int, isa: int, term: int, rows: int | None = None):
    """`tile_kernel` with its sums in registers, `rows` weight rows a vector (None:
    `pass_rows`)."""
    rows = pass_rows(bits, isa) if rows is None else int(rows)
    if rows == WIDE_ROWS:
        return _wide_kernel(bits, isa, term)
    G = GROUP
    R = TILE_ROWS

    @njit(parallel=True, cache=True, nogil=True)
    def kernel(xq, xd, xsum, q, d, m, out):
        T = xq.shape[0]
        N = out.shape[1]
        # every tile's sums in one allocation per call (one per tile cost ~10% of a matvec)
        accs = np.empty((q.shape[0], 4, R), dtype=np.float32)
        for i in prange(q.shape[0]):
            acc = accs[i]
            n0 = i * R
            lanes = min(R, N - n0)
            for t in range(0, T - 3, 4):  # four tokens per weight load
                _pass(q[i], xq, t, xd, xsum, d[i], m[i], acc, out, n0, lanes, bits, isa, term,
                      4, G)
            _last_pair_and_one(q[i], xq, xd, xsum, d[i], m[i], acc, out, n0, lanes, bits, isa,
                               term)

    return kernel


def _wide_kernel(bits: int, isa: int, term: int):
    """`_register_kernel` with WIDE_ROWS rows a vector: tokens in eights per weight load, then
    four; a last pair or token takes GROUP rows a vector (joining two groups' vectors cost
    more than it saved for so few tokens: Q8_0's 49,152 x 576 head from memory, two tokens,
    1.09-1.13x the time of 8-row vectors)."""
    R, W = TILE_ROWS, WIDE_ROWS

    @njit(parallel=True, cache=True, nogil=True)
    def kernel(xq, xd, xsum, q, d, m, out):
        T = xq.shape[0]
        N = out.shape[1]
        # one allocation per call, as many token rows a tile as a pass takes
        accs = np.empty((q.shape[0], 8 if T >= 8 else 4, R), dtype=np.float32)
        for i in prange(q.shape[0]):
            acc = accs[i]
            n0 = i * R
            lanes = min(R, N - n0)
            for t in range(0, T - 7, 8):  # eight tokens per weight load
                _pass(q[i], xq, t, xd, xsum, d[i], m[i], acc, out, n0, lanes, bits, isa, term,
                      8, W)
            if T % 8 >= 4:  # then four
                _pass(q[i], xq, T - T % 8, xd, xsum, d[i], m[i], acc, out, n0, lanes, bits, isa,
                      term, 4, W)
            _last_pair_and_one(q[i], xq, xd, xsum, d[i], m[i], acc, out, n0, lanes, bits, isa,
                               term)

    return kernel


def _memory_kernel(bits: int, isa: int, term: int):
    """`tile_kernel` with its block dots and sums in memory."""
    R = TILE_ROWS
    unit = UNIT[bits]  # bytes of one row's block

    @njit(parallel=True, cache=True, nogil=True)
    def kernel(xq, xd, xsum, q, d, m, out):
        T, K = xq.shape
        N = out.shape[1]
        # every tile's scratch in one allocation per call (one per tile cost ~10% of a matvec)
        accs = np.empty((q.shape[0], 4, R), dtype=np.float32)
        isums = np.empty((q.shape[0], 4, R), dtype=np.int32)
        for i in prange(q.shape[0]):
            acc, acc_u, acc_y, acc_z = accs[i, 0], accs[i, 1], accs[i, 2], accs[i, 3]
            isum, isum_u, isum_y, isum_z = isums[i, 0], isums[i, 1], isums[i, 2], isums[i, 3]
            n0 = i * R
            lanes = min(R, N - n0)
            for t in range(0, T - 3, 4):  # four tokens per weight load
                acc[:] = 0
                acc_u[:] = 0
                acc_y[:] = 0
                acc_z[:] = 0
                for b in range(K // QK):
                    o, k0 = b * R * unit, b * QK
                    for g in range(0, R, GROUP):  # the tile's rows, GROUP at a time
                        dot8x4(q[i], o + g * unit, xq[t], k0, isum, g, xq[t + 1], k0, isum_u,
                               xq[t + 2], k0, isum_y, xq[t + 3], k0, isum_z, bits, isa)
                    _add_terms(acc, d[i], m[i], b, xd[t, b], xsum[t, b], isum, R, term)
                    _add_terms(acc_u, d[i], m[i], b, xd[t + 1, b], xsum[t + 1, b], isum_u, R,
                               term)
                    _add_terms(acc_y, d[i], m[i], b, xd[t + 2, b], xsum[t + 2, b], isum_y, R,
                               term)
                    _add_terms(acc_z, d[i], m[i], b, xd[t + 3, b], xsum[t + 3, b], isum_z, R,
                               term)
                out[t, n0:n0 + lanes] = acc[:lanes]
                out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
                out[t + 2, n0:n0 + lanes] = acc_y[:lanes]
                out[t + 3, n0:n0 + lanes] = acc_z[:lanes]
            if T % 4 >= 2:  # then a pair
                t = T - T % 4
                acc[:] = 0
                acc_u[:] = 0
                for b in range(K // QK):
                    o, k0 = b * R * unit, b * QK
                    for g in range(0, R, GROUP):
                        dot8x2(q[i], o + g * unit, xq[t], k0, isum, g, xq[t + 1], k0, isum_u,
                               bits, isa)
                    _add_terms(acc, d[i], m[i], b, xd[t, b], xsum[t, b], isum, R, term)
                    _add_terms(acc_u, d[i], m[i], b, xd[t + 1, b], xsum[t + 1, b], isum_u, R,
                               term)
                out[t, n0:n0 + lanes] = acc[:lanes]
                out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
            if T % 2:  # then one
                t = T - 1
                acc[:] = 0
                for b in range(K // QK):
                    o, k0 = b * R * unit, b * QK
                    for g in range(0, R, GROUP):
                        dot8(q[i], o + g * unit, xq[t], k0, isum, g, bits, isa)
                    _add_terms(acc, d[i], m[i], b, xd[t, b], xsum[t, b], isum, R, term)
                out[t, n0:n0 + lanes] = acc[:lanes]

    return kernel
