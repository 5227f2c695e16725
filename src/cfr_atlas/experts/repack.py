"""Expert repack straight into a slot: one compiled pass per matrix, raw GGUF bytes -> tiles.

A cold expert load used to go raw -> NumPy temporaries (nibbles unpacked, padded, transposed,
f16 scales converted) -> a second copy into the slot, on the compute thread: 4-6 ms per
512 x 1408 Q4_0 expert, most of a cold load. Here a numba kernel (nogil, so a prefetch thread
overlaps it with compute) reads each matrix's contiguous bytes once and writes the slot's tile
arrays in place. Two layouts, one per matmul arithmetic (R = TILE_ROWS):

  float (subblock Tiles, tiles.py: q int8 row tiles, a float32 scale tiles, c empty)
    q[i, col * R + r] = weight q - offset of row i * R + r, column col
    a[i, b * R + r]   = f16 scale d of block b of that row, as float32 bits
  int8 (the IntTiles of q4_0.py / q8_0.py, int8.py's block tiles)
    q[i, (b * R + r) * U + j] = byte j of the quants of row i * R + r, block b, as stored
                                (U = 16 packed nibbles for Q4_0, 32 int8 for Q8_0)
    d[i, b * R + r]           = as a above
  rows past the matrix (the last tile's padding): 0 in every array

Covered: Q4_0 (18-byte block: f16 d | 16 bytes of nibbles, low = q[j], high = q[j + 16],
stored q + 8) and Q8_0 (34-byte block: f16 d | 32 int8), with either arithmetic. Every other
(arithmetic, format) loads through its codec's repack (`KERNELS` has no entry); the store
checks at build time that this pass writes the very bytes the codec's repack gives (the NumPy
twin is the codec's `repack` / `int_repack`), and refuses to use it otherwise.

Speed. The int8 layout keeps each row's block bytes together: a fill is a copy of 16 or 32
bytes per (row, block) and a scale conversion. The float layout is column-major within a
tile, so a fill transposes: each 8 x 8 byte square (8 rows' words of one block) is loaded
and transposed in registers with three rounds of masked swaps (4-, 2-, then 1-byte blocks);
a transposed word is one column's 8 rows, whose nibbles become q - 8 with word-wide masks.
The byte-at-a-time transpose this replaces read a buffer with a 32-byte stride that LLVM did
not vectorize. Bytes move through small intrinsics (unaligned word loads and stores, a
memcpy of constant length): numba's indexing tests every signed index for a negative value,
which kept those loops scalar. A tile cut short by the caller's rows range takes the
byte-at-a-time path. Both kernels split their tiles (rows) between numba's threads; a tile's
bytes do not depend on which thread wrote it (tested with 1 and 2 threads). Measured on one
1408 x 512 Q4_0 matrix, AMD EPYC: float 0.36 ms with source and tiles out of cache on 2
threads (0.50 on one; the byte-at-a-time kernel this replaced: 1.15), 0.20-0.25 ms in
cache; the int8 copy 0.08-0.09 ms in cache.

f16 -> f32 is done on the bits, as NumPy does it (npy_halfbits_to_floatbits: exact, subnormals
normalized, NaN payloads shifted, not quieted); a test runs all 65,536 halves against NumPy.
R is TILE_ROWS read at import and made a closure constant of the kernel, which numba's cache
keys by it, so a change of TILE_ROWS compiles a new kernel instead of reusing a stale one.
Not here: reading files (source.py), slot bookkeeping (store.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import literal_unroll, njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from cfr_atlas.quant import q4_0, q8_0
from cfr_atlas.quant.formats import BLOCKS, QType
from cfr_atlas.quant.subblock import Tiles
from cfr_atlas.quant.tiles import TILE_ROWS

QK = 32  # elements per block of both formats below
SCALE_BYTES = 2  # the f16 d that opens each block

# word-wide constants, typed uint64 so numba never mixes them with signed integers
_LOW4 = np.uint64(0x00000000FFFFFFFF)  # bytes 0-3 of a word
_LOW2 = np.uint64(0x0000FFFF0000FFFF)  # bytes 0-1 of each half
_LOW1 = np.uint64(0x00FF00FF00FF00FF)  # the even bytes
_NIB = np.uint64(0x0F0F0F0F0F0F0F0F)  # the low nibble of every byte
_BIT3 = np.uint64(0x0808080808080808)  # bit 3 of every byte
_HIGH = np.uint64(0x1E)  # (8 * 0x1E = 0xF0): sign bits of q - 8 when q < 8
_S32, _S16, _S8, _S4 = np.uint64(32), np.uint64(16), np.uint64(8), np.uint64(4)


@njit(nogil=True, cache=True)
def half_bits_to_float_bits(h):
    """f16 bits (uint16 as int) -> float32 bits (uint32 as int), NumPy's conversion."""
    sign = (h & 0x8000) << 16
    exp = h & 0x7C00
    sig = h & 0x03FF
    if exp == 0x7C00:  # inf, nan: payload kept
        return sign | 0x7F800000 | (sig << 13)
    if exp != 0:
        return sign | (((h & 0x7FFF) + 0x1C000) << 13)
    if sig == 0:
        return sign
    e = 0
    sig <<= 1
    while (sig & 0x0400) == 0:  # normalize the subnormal
        sig <<= 1
        e += 1
    return sign | ((127 - 15 - e) << 23) | ((sig & 0x03FF) << 13)


def _byte_ptr(context, builder, ary_t, ary, offset):
    data = context.make_array(ary_t)(context, builder, ary).data
    return builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [offset])


@intrinsic
def _copy_bytes(typingctx, dst, dst_at, src, src_at, n):
    """n bytes src[src_at:] -> dst[dst_at:] (byte offsets into contiguous arrays, no checks):
    one llvm.memcpy, which LLVM turns into a few vector moves when n is a constant. Indexing
    byte by byte compiled to a scalar loop behind a negative-index test (3.5x slower)."""
    def codegen(context, builder, sig, args):
        d = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        s = _byte_ptr(context, builder, sig.args[2], args[2], args[3])
        cgutils.raw_memcpy(builder, d, s, args[4], 1)
        return context.get_dummy_value()

    return types.void(dst, dst_at, src, src_at, n), codegen


@intrinsic
def _load_word(typingctx, src, src_at):
    """The 8 bytes src[src_at:] as a little-endian uint64, unaligned, no checks."""
    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load(builder.bitcast(p, ir.IntType(64).as_pointer()), align=1)

    return types.uint64(src, src_at), codegen


@njit(nogil=True, cache=True, inline="always")
def _swap(x, y, mask, shift):
    """One round of the 8 x 8 byte transpose on a pair of rows: the bytes `mask` selects in
    y and the bytes `shift` above them in x change places -> (x, y)."""
    t = ((x >> shift) ^ y) & mask
    return x ^ (t << shift), y ^ t


@njit(nogil=True, cache=True, inline="always")
def _transpose8(w0, w1, w2, w3, w4, w5, w6, w7):
    """8 words (word k = row k, byte c = column c) -> the 8 words of the transpose (column c
    as a word, byte k = row k), in registers."""
    w0, w4 = _swap(w0, w4, _LOW4, _S32)
    w1, w5 = _swap(w1, w5, _LOW4, _S32)
    w2, w6 = _swap(w2, w6, _LOW4, _S32)
    w3, w7 = _swap(w3, w7, _LOW4, _S32)
    w0, w2 = _swap(w0, w2, _LOW2, _S16)
    w1, w3 = _swap(w1, w3, _LOW2, _S16)
    w4, w6 = _swap(w4, w6, _LOW2, _S16)
    w5, w7 = _swap(w5, w7, _LOW2, _S16)
    w0, w1 = _swap(w0, w1, _LOW1, _S8)
    w2, w3 = _swap(w2, w3, _LOW1, _S8)
    w4, w5 = _swap(w4, w5, _LOW1, _S8)
    w6, w7 = _swap(w6, w7, _LOW1, _S8)
    return w0, w1, w2, w3, w4, w5, w6, w7


@intrinsic
def _store_word(typingctx, dst, dst_at, v):
    """The uint64 v -> dst's words at word index dst_at (words counted from dst's first byte;
    no alignment assumed), no checks."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        p = builder.gep(builder.bitcast(data, ir.IntType(64).as_pointer()), [args[1]])
        builder.store(args[2], p, align=1)
        return context.get_dummy_value()

    return types.void(dst, dst_at, types.uint64), codegen


@njit(nogil=True, cache=True, inline="always")
def _minus8(v):
    """Bytes 0..15 of a word -> the int8 bytes of v - 8 (low nibble v ^ 8, high 0xF when
    v < 8); no carry crosses a byte."""
    return (v ^ _BIT3) | (((~v) & _BIT3) * _HIGH)


def _make_fill(R: int, nibbles: bool):
    """The float-layout kernel for tiles of R rows, Q4_0 (nibbles) or Q8_0: R and the format
    are closure constants (numba's cache keys the kernel by them)."""
    unit = QK // 2 if nibbles else QK  # quant bytes of one row's block
    block = SCALE_BYTES + unit
    words = unit // 8  # 8-byte words of one row's quants
    groups = R // 8  # 8-row groups of a tile: one column's word per group
    if R % 8:
        raise ValueError(f"tiles of {R} rows are not whole 8-row groups")
    sq_index = (0, 1, 2, 3, 4, 5, 6, 7)

    @njit(nogil=True, cache=True)
    def whole(src, s0, row_bytes, q, qt8):
        """One block of a whole tile: R rows' quants from src[s0] (row r at s0 + r *
        row_bytes) -> the tile block's words from q's word qt8, 8 x 8 squares transposed."""
        for g in range(groups):
            for cw in range(words):
                s = s0 + g * 8 * row_bytes + cw * 8
                sq = _transpose8(
                    _load_word(src, s), _load_word(src, s + row_bytes),
                    _load_word(src, s + 2 * row_bytes), _load_word(src, s + 3 * row_bytes),
                    _load_word(src, s + 4 * row_bytes), _load_word(src, s + 5 * row_bytes),
                    _load_word(src, s + 6 * row_bytes), _load_word(src, s + 7 * row_bytes))
                for k in literal_unroll(sq_index):
                    col = cw * 8 + k
                    if nibbles:
                        v = sq[k]
                        _store_word(q, qt8 + col * groups + g, _minus8(v & _NIB))
                        _store_word(q, qt8 + (col + unit) * groups + g,
                                    _minus8((v >> _S4) & _NIB))
                    else:
                        _store_word(q, qt8 + col * groups + g, sq[k])

    @njit(nogil=True, cache=True)
    def part(src, s0, row_bytes, lo, hi, q, qt):
        """One block of rows lo .. hi - 1 of a tile (row lo's quants at src[s0]), byte at a
        time."""
        for r in range(lo, hi):
            s = s0 + (r - lo) * row_bytes
            for j in range(unit):
                v = src[s + j]
                if nibbles:
                    q[qt + j * R + r] = np.int8(v & 0x0F) - 8
                    q[qt + (j + unit) * R + r] = np.int8(v >> 4) - 8
                else:
                    q[qt + j * R + r] = np.int8(v)

    @njit(nogil=True, cache=True, parallel=True)
    def fill_rows(src, rows, r0, n_cols, q, a):
        """src (rows * row_bytes,) uint8 blocks -> rows r0 .. r0 + rows - 1 of the flat tiles
        q (n_tiles * n_cols * R,) int8 and a (n_tiles * nb * R,) uint32 float bits; rows of
        the touched tiles outside the range are left as they are. q's length is a multiple
        of 8 and every tile's block starts on a word (n_cols * R and QK * R are). Threads
        split the tiles (each writes only its own): the bytes do not depend on the split."""
        nb = n_cols // QK
        row_bytes = nb * block
        t0 = r0 // R
        for ti in prange((r0 + rows - 1) // R + 1 - t0):
            i = t0 + ti
            lo, hi = max(r0, i * R) - i * R, min(r0 + rows, (i + 1) * R) - i * R
            first = (i * R + lo - r0) * row_bytes  # source byte of row lo of this tile
            for b in range(nb):
                at, qt = i * nb * R + b * R, i * n_cols * R + b * QK * R
                for r in range(lo, hi):
                    s = first + (r - lo) * row_bytes + b * block
                    a[at + r] = half_bits_to_float_bits(np.uint32(src[s])
                                                        | (np.uint32(src[s + 1]) << 8))
                s0 = first + b * block + SCALE_BYTES
                if lo == 0 and hi == R:
                    whole(src, s0, row_bytes, q, qt // 8)
                else:
                    part(src, s0, row_bytes, lo, hi, q, qt)

    return fill_rows


def _make_copy(R: int, unit: int):
    """The int8-layout kernel for tiles of R rows and `unit` quant bytes a block (16: Q4_0's
    packed nibbles, 32: Q8_0's int8), both closure constants."""
    block = SCALE_BYTES + unit

    @njit(nogil=True, cache=True, parallel=True)
    def copy_rows(src, rows, r0, nb, q, d):
        """src (rows * row_bytes,) uint8 blocks -> rows r0 .. r0 + rows - 1 of the flat block
        tiles q (n_tiles * nb * R * unit,) uint8 and d (n_tiles * nb * R,) uint32 float bits.
        Threads split the rows (each writes only its own)."""
        row_bytes = nb * block
        for g in prange(rows):
            i, r = (r0 + g) // R, (r0 + g) % R
            for b in range(nb):
                s, at = g * row_bytes + b * block, i * nb * R + b * R + r
                d[at] = half_bits_to_float_bits(np.uint32(src[s]) | (np.uint32(src[s + 1]) << 8))
                _copy_bytes(q, at * unit, src, s + SCALE_BYTES, unit)

    return copy_rows


@njit(nogil=True, cache=True)
def _zero_rows(first, n_tiles, R, n_cols, q, a):
    """Float layout: rows first .. n_tiles * R - 1 (the last tile's padding) -> 0 in q and a."""
    nb = n_cols // QK
    for g in range(first, n_tiles * R):
        i, r = g // R, g % R
        for c in range(n_cols):
            q[i * n_cols * R + c * R + r] = 0
        for b in range(nb):
            a[i * nb * R + b * R + r] = 0


@njit(nogil=True, cache=True)
def _zero_block_rows(first, n_tiles, R, nb, unit, q, d):
    """Int8 layout: rows first .. n_tiles * R - 1 -> 0 in q and d."""
    for g in range(first, n_tiles * R):
        i, r = g // R, g % R
        for b in range(nb):
            at = i * nb * R + b * R + r
            d[at] = 0
            q[at * unit:(at + 1) * unit] = 0


def _rows_of(src: np.ndarray, qtype: QType, cols: int, r0: int, capacity: int) -> int:
    rows, block = src.size // (cols // QK * BLOCKS[qtype].bytes), BLOCKS[qtype].bytes
    if rows * (cols // QK) * block != src.size or r0 + rows > capacity:
        raise ValueError(f"{src.size} bytes are not whole {qtype.name} rows of {cols} "
                         f"columns fitting {capacity} rows of tiles")
    return rows


def fill(srcs: list[np.ndarray], qtype: QType, cols: int, tiles: Tiles) -> None:
    """Float layout. srcs: 1-D uint8 block bytes of matrices stacked row-wise (gate then up
    for the fused gate|up) -> tiles.q (n_tiles, cols * R) int8 and tiles.a (n_tiles,
    cols // QK * R) float32 in place, padding rows zeroed. Checks shapes; the kernels trust
    them."""
    q, a, R = tiles.q, tiles.a, TILE_ROWS
    n_tiles = q.shape[0]
    if q.shape != (n_tiles, cols * R) or a.shape != (n_tiles, cols // QK * R) \
            or q.dtype != np.int8 or a.dtype != np.float32 or cols % QK \
            or not q.flags.c_contiguous or not a.flags.c_contiguous:
        raise ValueError(f"tiles q {q.dtype}{q.shape}, a {a.dtype}{a.shape} do not fit "
                         f"{cols} columns in tiles of {R} rows")
    qf, af = q.reshape(-1), a.reshape(-1).view(np.uint32)
    r0 = 0
    for src in srcs:
        rows = _rows_of(src, qtype, cols, r0, n_tiles * R)
        _FILL[qtype](src, rows, r0, cols, qf, af)
        r0 += rows
    _zero_rows(r0, n_tiles, R, cols, qf, af)


def copy(srcs: list[np.ndarray], qtype: QType, cols: int, tiles) -> None:
    """Int8 layout: as `fill`, into an IntTiles (q block tiles, d scales)."""
    q, d, R = tiles.q, tiles.d, TILE_ROWS
    unit, nb, n_tiles = _UNIT[qtype], cols // QK, q.shape[0]
    if q.shape != (n_tiles, nb * R * unit) or d.shape != (n_tiles, nb * R) \
            or q.itemsize != 1 or d.dtype != np.float32 or cols % QK \
            or not q.flags.c_contiguous or not d.flags.c_contiguous:
        raise ValueError(f"tiles q {q.dtype}{q.shape}, d {d.dtype}{d.shape} do not fit "
                         f"{cols} columns in block tiles of {R} rows")
    qf, df = q.reshape(-1).view(np.uint8), d.reshape(-1).view(np.uint32)
    r0 = 0
    for src in srcs:
        rows = _rows_of(src, qtype, cols, r0, n_tiles * R)
        _COPY[qtype](src, rows, r0, nb, qf, df)
        r0 += rows
    _zero_block_rows(r0, n_tiles, R, nb, unit, qf, df)


_FILL = {QType.Q4_0: _make_fill(TILE_ROWS, True), QType.Q8_0: _make_fill(TILE_ROWS, False)}
_UNIT = {QType.Q4_0: QK // 2, QType.Q8_0: QK}
_COPY = {qt: _make_copy(TILE_ROWS, u) for qt, u in _UNIT.items()}


def _float_tiles(t) -> bool:
    return isinstance(t, Tiles) and t.c.size == 0


# (arithmetic, format) -> (does it write these tiles?, the pass); the store also checks that
# the weight's codec is ARITHMETIC[arithmetic][format] (slots.py)
KERNELS: dict[tuple[str, QType], tuple[Callable, Callable]] = {
    ("float", QType.Q4_0): (_float_tiles, fill),
    ("float", QType.Q8_0): (_float_tiles, fill),
    ("int8", QType.Q4_0): (lambda t: isinstance(t, q4_0.IntTiles), copy),
    ("int8", QType.Q8_0): (lambda t: isinstance(t, q8_0.IntTiles), copy),
}
