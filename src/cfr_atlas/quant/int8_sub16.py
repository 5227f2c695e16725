"""The integer path (int8.py) for the K-quants with sub-blocks of 16 and no offset: Q6_K and
Q3_K, w = (d * sc_s) * q with d f16 per 256 weights, sc_s an integer per 16. An activation block
of 32 spans two sub-blocks, its halves lo (weights 0..15) and hi (16..31), so per block b and
output row r:

    isum_r = sc_lo,r * sum_{j < 16} w_j x_j + sc_hi,r * sum_{j >= 16} w_j x_j   int32, exact
    acc_r  = acc_r + (d_r * dx) * float32(isum_r)        int8.py's SCALE term, d of b's super-block

llama.cpp's arithmetic against Q8_K activations (there one activation scale per 256 and the
integer sums of a whole super-block; here one per 32, as all of cfr-atlas's int8 path).

Bounds (|x| <= 127). Q6_K: q - 32 in -32..31, sc in -128..127: a half's sum is at most
16 * 32 * 127 = 65,024 in magnitude, isum at most 2 * 128 * 65,024 = 16,646,144 < 2**24, so
float32(isum) is exact too. Q3_K: q in -4..3, sc in -32..31, far below.

Weights: int8 block tiles (int8.py), one byte each. Scales: int8, in block tiles of their own,
8 bytes (a group's 8 rows) per (tile, block, group, half):

    scale of row r, half h, block b:  s[b * 2 * TILE_ROWS + scale_byte(r, h)]
    scale_byte(r, h) = (r // 8) * 16 + h * 8 + r % 8

d: float32 per row and 32-block (tiles.py layout), the super-block's d repeated 8 times, so
the term is Q8_0's. 1 + 1/16 + 1/8 bytes per weight (Q6_K's GGUF: 0.82).

AVX2 dot of one block for a group of 8 rows: per 4-weight chunk c (chunks 0..3 are half lo,
4..7 hi) p_c = vpmaddubsw(|w_c|, x_c with w_c's sign) (vpsignb twice, as int8 weights in
int8.py), int16 lanes 2r, 2r + 1 holding row r; the 4 chunks of a half added in int16: at most
4 * 2 * 32 * 127 = 32,512 < 32,767 in magnitude, which holds only because |w| <= 32 (Q6_K's
q - 32 = -32 included; an int8 weight of -128 would overflow). Then vpmaddwd of that sum
against the half's scales, each row's sc in both of its lanes (8 bytes sign-extended, then
duplicated), gives sc_h,r * half sum in int32 lane r; the two halves' vectors added. Portable
IR elsewhere (isa=PORTABLE): int32 products per chunk, summed, times the scales. With VNNI
(int8.VNNI_DOT) a half is 4 vpdpbusd of |w| and x with w's sign in int32, then times the
scales (vpmulld). All exact, so the same bits.

Dequantization and row reads give the float codec's bits: a = d * sc in float32 (exact), then
subblock.values. Not here: Q2_K (an offset per 16 weights needs activation sums per half
block: it keeps its float codec under int8), shape checks (weight.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

from cfr_atlas.quant import int8
from cfr_atlas.quant.formats import Codec, QType
from cfr_atlas.quant.int8 import CHUNK, GROUP, I8, I16, I32, QK, SCALE, V8, V32
from cfr_atlas.quant.kquants import QK_K, SuperScaled
from cfr_atlas.quant.subblock import Offset, values
from cfr_atlas.quant.tiles import TILE_ROWS, gather_rows, n_tiles, to_tiles

HALF = QK // 2  # weights per sub-block
WMAX = 32  # largest |w| (Q6_K's q - 32 = -32): the int16 sum of a half's chunks stays exact
CHUNKS = HALF // CHUNK  # chunk vectors per half
assert CHUNKS * 2 * WMAX * 127 <= 2**15 - 1  # 32,512: the int16 lanes never overflow
assert 2 * 128 * HALF * WMAX * 127 < 2**24  # 16,646,144: float32(isum) is exact
V8S, V16S = ir.VectorType(I8, GROUP), ir.VectorType(I16, GROUP)  # one half's 8 scales
TWICE = ir.Constant(ir.VectorType(I32, 2 * GROUP), [r // 2 for r in range(2 * GROUP)])


@njit(cache=True, nogil=True)
def scale_byte(r, h):
    """Offset of the scale of row r (of the tile), half h, within one block's scales."""
    return (r // GROUP) * 2 * GROUP + h * GROUP + r % GROUP


def to_scale_tiles(sc: np.ndarray) -> np.ndarray:
    """sc (N, nb * 2) int8 -> (n_tiles, nb * 2 * TILE_ROWS), rows zero-padded, scale_byte's
    layout."""
    rows, cols = sc.shape
    padded = np.zeros((n_tiles(rows) * TILE_ROWS, cols), dtype=sc.dtype)
    padded[:rows] = sc
    # (tile, group, row, block, half) -> (tile, block, group, half, row)
    split = padded.reshape(-1, TILE_ROWS // GROUP, GROUP, cols // 2, 2)
    return np.ascontiguousarray(split.transpose(0, 3, 1, 4, 2)).reshape(split.shape[0], -1)


def gather_scale_rows(tiles: np.ndarray, ids: np.ndarray | slice) -> np.ndarray:
    """Scale tiles -> rows `ids` of the untiled (N, nb * 2) scales, a new array."""
    nb = tiles.shape[1] // (2 * TILE_ROWS)
    t5 = tiles.reshape(-1, nb, TILE_ROWS // GROUP, 2, GROUP)
    if isinstance(ids, slice):
        return t5.transpose(0, 2, 4, 1, 3).reshape(-1, nb * 2)[ids]
    ids = np.asarray(ids)
    r = ids % TILE_ROWS  # advanced indices apart: their dimension comes first
    return t5[ids // TILE_ROWS, :, r // GROUP, :, r % GROUP].reshape(len(ids), nb * 2)


# --- the integer dot: 8 rows x one activation block, two scaled halves -> 8 int32 ----------


def _half_avx2(builder, mags, chunks, xbs, scales):
    """One half: sum of its chunks' vpmaddubsw pairs in int16 (|sum| <= 32,512), then
    vpmaddwd against the rows' scales, each twice -> <8 x i32> sc_r * half sum."""
    pairs = int8._sum(builder, [int8._madd_avx2(builder, m, int8.psign(builder, xb, w))
                                for m, w, xb in zip(mags, chunks, xbs, strict=True)])
    wide = builder.sext(scales, V16S)
    twice = builder.shuffle_vector(wide, ir.Constant(V16S, None), TWICE)
    return int8._x86(builder, "llvm.x86.avx2.pmadd.wd", V32, pairs, twice)


def _half_vnni(builder, mags, chunks, xbs, scales):
    """One half with vpdpbusd: its chunks' dots of |w| and x with w's sign summed in int32,
    then times the rows' sign-extended scales -> <8 x i32> sc_r * half sum."""
    acc = int8._splat(V32, 0)
    for m, w, xb in zip(mags, chunks, xbs, strict=True):
        acc = int8._x86(builder, "llvm.x86.avx512.vpdpbusd.256", V32, acc,
                        builder.bitcast(m, V32), builder.bitcast(int8.psign(builder, xb, w), V32))
    return builder.mul(acc, builder.sext(scales, V32))


def _half_generic(builder, chunks, xbs, scales):
    """Portable: the half's chunk dots in int32, summed, times the sign-extended scales."""
    dots = int8._sum(builder, [int8._chunk_generic(builder, w, xb, False)
                               for w, xb in zip(chunks, xbs, strict=True)])
    return builder.mul(dots, builder.sext(scales, V32))


def _load(context, builder, ary_t, ary, offset, step, vec, count):
    """count vectors vec from ary[offset + i * step], i = 0 .. count - 1."""
    return [builder.load(int8._ptr(context, builder, ary_t, ary,
                                   builder.add(offset, ir.Constant(offset.type, i * step)), vec),
                         align=1) for i in range(count)]


def _group_weights(context, builder, w_t, w, wo, s_t, s, so, isa):
    """The 8-row group's block at w[wo:] (int8 block tiles) and its halves' scales at s[so:]:
    (chunk vectors, their |w| (None for PORTABLE), the two halves' scale vectors)."""
    chunks = _load(context, builder, w_t, w, wo, QK, V8, QK // CHUNK)
    scales = _load(context, builder, s_t, s, so, GROUP, V8S, 2)
    mags = [int8.psign(builder, c, c) for c in chunks] if isa != int8.PORTABLE else None
    return chunks, mags, scales


def _dot16_codegen(tokens: int):
    """Codegen of dot16 / dot16x2 for their literal isa argument (int8.ISAS)."""

    def codegen(context, builder, sig, args):
        isa = sig.args[-1].literal_value
        chunks, mags, scales = _group_weights(context, builder, sig.args[0], args[0], args[1],
                                              sig.args[2], args[2], args[3], isa)
        for xa, xo, oa in ((4, 5, 6), (8, 9, 10))[:tokens]:
            xbs = [int8._broadcast(context, builder, sig.args[xa], args[xa], args[xo], CHUNK * c)
                   for c in range(QK // CHUNK)]
            halves = _halves(builder, chunks, mags, scales, xbs, isa)
            out = int8._ptr(context, builder, sig.args[oa], args[oa], args[7], V32)
            builder.store(int8._sum(builder, halves), out, align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def dot16(typingctx, w, wo, s, so, x, xo, out, oo, isa):
    """out[oo + r] = sum_h s[so + scale_byte(r, h)] * sum_{j in half h} W_r[j] x[xo + j] for
    the 8 rows r of the group at w[wo:] (int8 block tiles, |w| <= WMAX); isa a literal int
    of int8.ISAS (PORTABLE: the portable IR)."""
    if not int8.literal_isa(isa):
        return None
    return types.void(w, wo, s, so, x, xo, out, oo, isa), _dot16_codegen(1)


@intrinsic
def dot16x2(typingctx, w, wo, s, so, x, xo, out, oo, u, uo, out_u, isa):
    """dot16 for two tokens, x[xo:] -> out and u[uo:] -> out_u, weights and scales loaded
    once."""
    if not int8.literal_isa(isa):
        return None
    return types.void(w, wo, s, so, x, xo, out, oo, u, uo, out_u, isa), _dot16_codegen(2)


def _group_load(context, builder, sig, args, b, g, isa, rows):
    """int8.PassWeights.load for SUB16: group g's block b, its weights (int8 block tiles at
    tile_dots' q) and its two halves' scales (scale tiles at tile_dots' m), |w| once (rows:
    GROUP, the one its entry takes)."""
    intp = context.get_value_type(types.intp)
    R = TILE_ROWS
    wo = builder.add(builder.mul(b, ir.Constant(intp, R * QK)), ir.Constant(intp, g * GROUP * QK))
    so = builder.add(builder.mul(b, ir.Constant(intp, 2 * R)),
                     ir.Constant(intp, g * 2 * GROUP))
    state = _group_weights(context, builder, sig.args[0], args[0], wo, sig.args[6], args[6], so,
                           isa)
    return state, [CHUNK * c for c in range(QK // CHUNK)]


def _group_dot(builder, state, xbs, isa):
    """int8.PassWeights.dot for SUB16: the two scaled halves summed, as dot16."""
    chunks, mags, scales = state
    return int8._sum(builder, _halves(builder, chunks, mags, scales, xbs, isa))


def _halves(builder, chunks, mags, scales, xbs, isa):
    """<8 x i32> sc_h,r * (half h's dot) of the 8 rows, h = 0, 1."""
    half = {int8.AVX2_DOT: _half_avx2, int8.VNNI_DOT: _half_vnni}.get(isa)
    out = []
    for h in range(2):
        part = slice(h * CHUNKS, (h + 1) * CHUNKS)
        if half is not None:
            out.append(half(builder, mags[part], chunks[part], xbs[part], scales[h]))
        else:
            out.append(_half_generic(builder, chunks[part], xbs[part], scales[h]))
    return out


int8.PASS_WEIGHTS[int8.SUB16] = int8.PassWeights(_group_load, _group_dot, (types.int8,))


# --- the tile kernel ---------------------------------------------------------------------------


def tile_kernel(isa: int = int8.ISA, in_registers: bool | None = None):
    """The parallel kernel(xq, xd, xsum, q, d, s, out) for int8 block tiles q with scale tiles
    s and per-block d, with int8.py's SCALE term (xsum unread). in_registers (None:
    int8.registers_for(isa)): int8.py's register kernel, whose passes read the weights through
    this module's PASS_WEIGHTS entry (tokens in fours, then a pair, then one); else the memory
    kernel below (tokens in pairs sharing one weight load, int32 dots and float32 sums in
    memory). Either way the same bits. The register kernel is an entry of int8.py's numba
    cache with this module's codegen compiled in; the package's stamp (jit_cache.py: a digest
    of all its sources) renews that entry when this module changes."""
    isa = int(isa)
    if int8.registers_for(isa) if in_registers is None else in_registers:
        return int8._register_kernel(int8.SUB16, isa, SCALE)
    return _memory_kernel(isa)


def _memory_kernel(isa: int):
    """`tile_kernel` with its dots and sums in memory: int8.py's memory kernel's loops with
    dot16 / dot16x2 (and their scale offsets) in place of dot8 / dot8x2. The closure holds
    plain values only (numba's disk cache, see int8.tile_kernel), so the loops cannot take the
    dot as an argument."""
    R = TILE_ROWS

    @njit(parallel=True, cache=True, nogil=True)
    def kernel(xq, xd, xsum, q, d, s, out):
        T, K = xq.shape
        N = out.shape[1]
        accs = np.empty((q.shape[0], 2, R), dtype=np.float32)
        isums = np.empty((q.shape[0], 2, R), dtype=np.int32)
        for i in prange(q.shape[0]):  # scratch allocated once per call (int8.tile_kernel)
            acc, acc_u, isum, isum_u = accs[i, 0], accs[i, 1], isums[i, 0], isums[i, 1]
            n0 = i * R
            lanes = min(R, N - n0)
            for t in range(0, T - 1, 2):
                acc[:] = 0
                acc_u[:] = 0
                for b in range(K // QK):
                    o, so, k0 = b * R * QK, b * 2 * R, b * QK
                    for g in range(0, R, GROUP):  # the tile's rows, GROUP at a time
                        dot16x2(q[i], o + g * QK, s[i], so + 2 * g, xq[t], k0, isum, g,
                                xq[t + 1], k0, isum_u, isa)
                    int8._add_terms(acc, d[i], d[i], b, xd[t, b], 0, isum, R, SCALE)
                    int8._add_terms(acc_u, d[i], d[i], b, xd[t + 1, b], 0, isum_u, R, SCALE)
                out[t, n0:n0 + lanes] = acc[:lanes]
                out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
            if T % 2:
                t = T - 1
                acc[:] = 0
                for b in range(K // QK):
                    o, so, k0 = b * R * QK, b * 2 * R, b * QK
                    for g in range(0, R, GROUP):
                        dot16(q[i], o + g * QK, s[i], so + 2 * g, xq[t], k0, isum, g, isa)
                    int8._add_terms(acc, d[i], d[i], b, xd[t, b], 0, isum, R, SCALE)
                out[t, n0:n0 + lanes] = acc[:lanes]

    return kernel


KERNEL = tile_kernel()

# --- the codec ---------------------------------------------------------------------------------


class IntTiles(NamedTuple):
    q: np.ndarray  # (n_tiles, nb * TILE_ROWS * QK) int8 block tiles (int8.py layout)
    s: np.ndarray  # (n_tiles, nb * TILE_ROWS * 2) int8 sub-block scales sc (scale_byte)
    d: np.ndarray  # (n_tiles, nb * TILE_ROWS) float32 super-block d per block (tiles.py)


def _repack(split: Callable[[np.ndarray], SuperScaled], raw: np.ndarray) -> IntTiles:
    d, sc, q = split(raw)
    per_block = np.repeat(d.astype(np.float32), QK_K // QK, axis=1)  # f16 -> f32 is exact
    return IntTiles(int8.to_block_tiles(q, QK), to_scale_tiles(sc.reshape(sc.shape[0], -1)),
                    to_tiles(per_block))


def _scales(tiles: IntTiles, ids: np.ndarray | slice) -> np.ndarray:
    """Rows `ids` of a = d * sc, (n, nb * 2) float32: kquants._scaled's product of the same
    float32 operands (exact), so the float codec's bits."""
    d = np.repeat(gather_rows(tiles.d, ids), 2, axis=1)
    return d * gather_scale_rows(tiles.s, ids).astype(np.float32)


def _unpack_rows(tiles: IntTiles, ids: np.ndarray | slice,
                 out: np.ndarray | None = None) -> np.ndarray:
    q = int8.gather_block_rows(tiles.q, ids, QK).view(np.int8)
    out = np.empty(q.shape, dtype=np.float32) if out is None else out
    return values(_scales(tiles, ids), None, q, out, Offset.NONE)


def _matmul(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    xq, xd, xsum = int8.quantize_transient(x)
    KERNEL(xq, xd, xsum, tiles.q, tiles.d, tiles.s, out)


def _matmul_numpy(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """The twin: the same quantization, exact half-block dots times the scales, the same
    float32 operations in the same block order as the kernel's SCALE term."""
    xq, xd, _ = int8.quantize_numpy(x)
    w = int8.gather_block_rows(tiles.q, slice(None), QK).view(np.int8)
    n, t = w.shape[0], xq.shape[0]
    halves = np.einsum("nhj,thj->tnh", w.reshape(n, -1, HALF).astype(np.int64),
                       xq.reshape(t, -1, HALF).astype(np.int64))  # (T, N, nb * 2)
    sc = gather_scale_rows(tiles.s, slice(None)).astype(np.int64)
    dots = (halves * sc).reshape(t, n, -1, 2).sum(axis=-1).astype(np.float32)  # exact < 2**24
    d = gather_rows(tiles.d, slice(None))
    with np.errstate(over="ignore", invalid="ignore"):  # edge scales: inf, as the kernel
        acc = np.zeros((t, n), dtype=np.float32)
        for b in range(d.shape[1]):
            acc = acc + (d[None, :, b] * xd[:, None, b]) * dots[:, :, b]
    out[:] = acc[:, :out.shape[1]]


def codec(qtype: QType, split: Callable[[np.ndarray], SuperScaled],
          dequantize: Callable[[np.ndarray], np.ndarray]) -> Codec:
    """The int8-path Codec of Q6_K or Q3_K from its unpacker (its float codec's dequantize)."""
    return Codec(qtype, np.dtype(np.uint8), dequantize, partial(_repack, split), _unpack_rows,
                 _matmul, _matmul_numpy)
