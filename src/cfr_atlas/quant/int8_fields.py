"""The integer path (int8.py) for the sub-block formats whose sub-blocks are the activation
block of 32: Q5_0, Q5_1 and IQ4_NL (one sub-block per block) and Q4_K, Q5_K (eight per
256-weight super-block). Built from each format's `Fields` unpacker (subblock.py), so a format
module adds nothing here.

    w[:, s * 32 + j] = a[:, s] * q[:, s * 32 + j]  (+ or - c[:, s])

A row's sub-block s is activation block s, so one integer dot per (row, s) suffices:
  * no offset (Q5_0: q - 16 in -16..15; IQ4_NL: its table, -127..113): int8 weights and the
    SCALE term, (a_s * dx) * isum, Q8_0's kernel;
  * an offset (Q5_1 adds its f16 m; Q4_K, Q5_K subtract dmin * m_s; q in 0..31): int8 weights
    and the MIN term, (a_s * dx) * isum + m_s * (dx * xsum), Q4_1's term on int8 bytes, with
    m_s = c_s or -c_s (negation is exact, so a_s q + (-c_s) has a_s q - c_s's bits).
That is llama.cpp's arithmetic for these formats against Q8_0/Q8_1/Q8_K activations (per
32-element block here; it takes one scale per 256 for the K-quants). Q6_K and Q3_K
(sub-blocks of 16, half an activation block, which these kernels do not split) are
int8_sub16.py's; Q2_K keeps its float codec under int8.

Weights are kept at the width of their values: Q4_K's (q in 0..15) packed two to a byte as
GGUF packs Q4_0 (low nibbles q[0..15] of a sub-block, high q[16..31]) through Q4_1's nibble
kernel; the 5-bit formats' (Q5_0 stored as q + 16, Q5_1 and Q5_K as q, all 0..31) as those
nibbles plus a plane of high bits (int8.pack_five), Q5_0 with the OFFSET16 term (the - 16 once per
block, in int32: the same isum); IQ4_NL's one byte each. Scales and offsets take 4 bytes per 32
weights: float16 for Q5_0, Q5_1 and IQ4_NL (GGUF's own values, widened exactly in the kernel's
term), float32 for the K-quants (a_s = d * sc_s needs more than float16's 11 bits). A token
streams 5.5 bits a weight for Q5_0 (as GGUF), 6 for Q5_1 (GGUF: 6), 7 for Q5_K, 6 for Q4_K.
Dequantization and row reads give the float path's bits (the same a, c, q).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np

from cfr_atlas.quant import int8
from cfr_atlas.quant.formats import Codec, QType
from cfr_atlas.quant.subblock import Fields, Offset, row_offsets, values
from cfr_atlas.quant.tiles import gather_rows, to_tiles

QK = int8.QK


class IntTiles(NamedTuple):
    q: np.ndarray  # (n_tiles, nb * TILE_ROWS * int8.UNIT[bits]) uint8 block tiles (int8.py)
    d: np.ndarray  # (n_tiles, nb * TILE_ROWS) sub-block scales a_s (float32, or float16 bits)
    m: np.ndarray  # the same for the offset as added (c_s or -c_s); (n_tiles, 0) without one


class Width(NamedTuple):
    """How a format's quants are kept: bits (8, 4 or 5, int8.UNIT) and the bias added to q
    for storage (Q5_0's q, its 5-bit value minus 16 in -16..15, is stored as q + 16 in 0..31;
    the OFFSET16 term takes the 16 off again, in int32)."""
    bits: int
    bias: int = 0


# keyed by (has an offset, Width)
_TERMS = {(False, Width(8)): int8.SCALE, (True, Width(8)): int8.MIN,
          (True, Width(4)): int8.MIN, (False, Width(5, 16)): int8.OFFSET16,
          (True, Width(5)): int8.MIN}
_KERNELS = {key: int8.tile_kernel(key[1].bits, term) for key, term in _TERMS.items()}
# int8 quants are stored with the sign bit flipped (int8.py: what vpdpbusd reads unsigned)
_UNPACK = {8: int8.flip_sign, 4: int8.unpack_nibbles, 5: int8.unpack_five}
_PACK = {8: int8.flip_sign, 4: int8.pack_nibbles, 5: int8.pack_five}


def _kept(a: np.ndarray, half: bool) -> np.ndarray:
    """Scales as the tiles keep them: float16 bits (uint16) for a format whose scales are
    GGUF's float16 values (exact both ways), else float32."""
    if not half:
        return a
    a16 = a.astype(np.float16)
    if not np.array_equal(a16.astype(np.float32), a, equal_nan=True):
        raise AssertionError("scales are not float16 values")  # a format table error
    return a16.view(np.uint16)


def _repack(fields: Callable[[np.ndarray], Fields], offset: Offset, width: Width, half: bool,
            raw: np.ndarray) -> IntTiles:
    a, c, q = fields(raw)
    d = to_tiles(_kept(a, half))
    if offset is Offset.NONE:
        m = np.zeros((d.shape[0], 0), dtype=d.dtype)
    else:
        m = to_tiles(_kept(-c if offset is Offset.SUBTRACT else c, half))
    stored = q.astype(np.int16) + width.bias
    if width.bits < 8 and (stored.min(initial=0) < 0 or stored.max(initial=0) >= 1 << width.bits):
        raise AssertionError(f"quants outside {width}")  # a format table error, not input
    packed = _PACK[width.bits](stored.astype(np.uint8))
    return IntTiles(int8.to_block_tiles(packed, int8.UNIT[width.bits]), d, m)


def _weights(width: Width, tiles: IntTiles, ids: np.ndarray | slice) -> np.ndarray:
    """Rows `ids` of the quants q as int8 (rows, nb * QK)."""
    stored = _UNPACK[width.bits](int8.gather_block_rows(tiles.q, ids, int8.UNIT[width.bits]))
    return (stored.view(np.int8) - np.int8(width.bias)) if width.bias else stored.view(np.int8)


def _unpack_rows(offset: Offset, width: Width, tiles: IntTiles, ids: np.ndarray | slice,
                 out: np.ndarray | None = None) -> np.ndarray:
    q = _weights(width, tiles, ids)
    a = int8.widen_scales(gather_rows(tiles.d, ids))
    c = row_offsets(offset, int8.widen_scales(tiles.m), ids)
    return values(a, c, q, np.empty(q.shape, dtype=np.float32) if out is None else out, offset)


def _matmul(has_m: bool, width: Width, x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    xq, xd, xsum = int8.quantize_transient(x)
    _KERNELS[has_m, width](xq, xd, xsum, tiles.q, tiles.d, tiles.m if has_m else tiles.d, out)


def _matmul_numpy(has_m: bool, width: Width, x: np.ndarray, tiles: IntTiles,
                  out: np.ndarray) -> None:
    """The twin: the same quantization, exact block dots of the quants q (the bias removed),
    the same float32 operations in the same block order as the kernel's SCALE / MIN term."""
    xq, xd, xsum = int8.quantize_numpy(x)
    w = _weights(width, tiles, slice(None))
    dots = int8.block_dots_numpy(w, xq).astype(np.float32)  # exact: |isum| < 2**24
    d = int8.widen_scales(gather_rows(tiles.d, slice(None)))
    m = int8.widen_scales(gather_rows(tiles.m, slice(None))) if has_m else None
    sx = xd * xsum.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # edge scales: inf, as the kernel
        acc = np.zeros(dots.shape[:2], dtype=np.float32)
        for b in range(d.shape[1]):
            term = (d[None, :, b] * xd[:, None, b]) * dots[:, :, b]
            if has_m:
                term = term + m[None, :, b] * sx[:, None, b]
            acc = acc + term
    out[:] = acc[:, :out.shape[1]]


def codec(qtype: QType, fields: Callable[[np.ndarray], Fields], offset: Offset,
          dequantize: Callable[[np.ndarray], np.ndarray], width: Width,
          half: bool = False) -> Codec:
    """The int8-path Codec of a format with sub-blocks of 32 (its float codec's dequantize);
    width: how its quants are kept (a key of _KERNELS with the offset); half: its scales (and
    offsets) are GGUF's float16 values, kept as float16 (the K-quants' d * sc are not)."""
    has_m = offset is not Offset.NONE
    if (has_m, width) not in _KERNELS:
        raise AssertionError(f"no kernel for {qtype.name} kept as {width}")
    return Codec(qtype, np.dtype(np.uint8), dequantize,
                 partial(_repack, fields, offset, width, half),
                 partial(_unpack_rows, offset, width), partial(_matmul, has_m, width),
                 partial(_matmul_numpy, has_m, width))
