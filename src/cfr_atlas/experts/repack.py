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
    q[i, b * R * U + block_byte(r, j, U)] = byte j of the quants of row i * R + r, block b,
                                as stored (U = 16 packed nibbles for Q4_0), or with its sign
                                bit flipped (U = 32 int8 for Q8_0; int8.flip_sign); rows
                                interleaved in 4-byte chunks, int8.py
    d[i, b * R + r]           = f16 scale d of block b of that row, its bits as stored
  rows past the matrix (the last tile's padding): 0 in every array (a stored int8 quant of 0
  is a weight of -128 there; padding rows' outputs are never written out)

Covered: Q4_0 (18-byte block: f16 d | 16 bytes of nibbles, low = q[j], high = q[j + 16],
stored q + 8) and Q8_0 (34-byte block: f16 d | 32 int8), with either arithmetic. Every other
(arithmetic, format) loads through its codec's repack (`KERNELS` has no entry); the store
checks at build time that this pass writes the very bytes the codec's repack gives (the NumPy
twin is the codec's `repack` / `int_repack`), and refuses to use it otherwise.

Speed. The int8 layout keeps each row's block bytes in 4-byte chunks interleaved across 8-row
groups: a whole group's block is 8 row loads, one dword transpose in registers and one store
(`_group_block`; Q8_0's bytes xor'ed on the way); rows outside whole groups go 4 bytes at a
time. The float layout is column-major within a tile, so a fill transposes: each 16 x 16 byte
square (16 rows' quants of one block) is loaded into vector registers and transposed by byte
unpacks (`_tile_block`), and Q4_0's nibbles become q - 8 with vector masks. Bytes move through
small intrinsics (vector loads and stores, a memcpy of constant length): numba's indexing tests
every signed index for a negative value, which kept byte loops scalar. A tile cut short by the
caller's rows range takes a byte-at-a-time path. Both kernels split their tiles (rows, or
groups) between numba's threads; a tile's bytes do not depend on which thread wrote it (tested
with 1 and 2 threads). Measured on one 1408 x 512 matrix in cache, 2 threads, AMD EPYC: float
Q4_0 0.13 ms (the 8 x 8 word transpose before it: 0.20 ms; the byte-at-a-time kernel before
that: ~0.6 ms on one thread); int8 Q4_0 30-33 us and Q8_0 33-38 us with the group transpose,
against 62-81 and 48-52 us copying 4 bytes at a time (session 40, alternating processes). A
load from memory moves its bytes at the memory's pace either way (~0.2-0.3 ms an expert of
the bench_moe file).

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
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from cfr_atlas.quant import q4_0, q8_0
from cfr_atlas.quant.formats import BLOCKS, QType
from cfr_atlas.quant.int8 import block_byte
from cfr_atlas.quant.subblock import Tiles
from cfr_atlas.quant.tiles import TILE_ROWS

QK = 32  # elements per block of both formats below
SCALE_BYTES = 2  # the f16 d that opens each block


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
def _copy_flipped(typingctx, dst, dst_at, src, src_at, n):
    """n bytes src[src_at:] -> dst[dst_at:], each with its sign bit flipped (int8 quants as the
    int8 block tiles keep them: int8.flip_sign); n a literal int. One vector load, xor and
    store."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    width = n.literal_value

    def codegen(context, builder, sig, args):
        vec = ir.VectorType(ir.IntType(8), width)
        d = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        s = _byte_ptr(context, builder, sig.args[2], args[2], args[3])
        v = builder.load(builder.bitcast(s, vec.as_pointer()), align=1)
        v = builder.xor(v, ir.Constant(vec, [0x80] * width))
        builder.store(v, builder.bitcast(d, vec.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(dst, dst_at, src, src_at, n), codegen


@intrinsic
def _group_block(typingctx, dst, dst_at, src, src_at, row_bytes, unit, flip):
    """One block of a whole group of GROUP = 8 rows, int8 layout, in vector registers: `unit`
    quant bytes of each row (row r at src[src_at + r * row_bytes]) -> dst[dst_at:] in the
    block tiles' chunk order, chunk c of row r at (c * 8 + r) * 4 (int8.block_byte within a
    group); flip: every byte's sign bit flipped (int8 quants). unit and flip literals. The 8
    rows' chunks are gathered into one vector and transposed by one shuffle (LLVM emits
    dword permutes), then stored as 8 * unit contiguous bytes."""
    if not all(isinstance(t, types.Literal) for t in (unit, flip)):
        return None
    n_unit, do_flip = unit.literal_value, bool(flip.literal_value)
    if n_unit % 4:
        return None
    n = n_unit // 4  # chunks of a row's block

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        row_t = ir.VectorType(i32, n)
        src_ary, s0, rb = args[2], args[3], args[4]
        parts = []
        for r in range(8):
            p = _byte_ptr(context, builder, sig.args[2], src_ary,
                          builder.add(s0, builder.mul(rb, ir.Constant(i64, r))))
            parts.append(builder.load(builder.bitcast(p, row_t.as_pointer()), align=1))
        while len(parts) > 1:  # concatenate pairs: 8 rows -> one vector of 8 * n dwords
            width = parts[0].type.count
            mask = ir.Constant(ir.VectorType(i32, 2 * width), list(range(2 * width)))
            parts = [builder.shuffle_vector(parts[k], parts[k + 1], mask)
                     for k in range(0, len(parts), 2)]
        whole = parts[0]  # dword r * n + c: chunk c of row r
        order = [r * n + c for c in range(n) for r in range(8)]  # -> chunk-major
        out_t = ir.VectorType(i32, 8 * n)
        out = builder.shuffle_vector(whole, ir.Constant(out_t, None),
                                     ir.Constant(out_t, order))
        if do_flip:
            out = builder.xor(out, ir.Constant(out_t, [0x80808080] * (8 * n)))
        d = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(out, builder.bitcast(d, out_t.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(dst, dst_at, src, src_at, row_bytes, unit, flip), codegen


def _interleave(builder, a, b, high: bool):
    """The low (or high) halves of two <16 x i8> interleaved: a0 b0 a1 b1 ... (punpck*bw)."""
    half = 8 if high else 0
    mask = [i for k in range(8) for i in (half + k, 16 + half + k)]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 16), mask))


@intrinsic
def _tile_block(typingctx, src, s0, row_bytes, q, qt, rows, unit, nibbles):
    """One block of a whole tile, float layout, in vector registers: `rows` rows of `unit`
    quant bytes (row r at src[s0 + r * row_bytes]) -> q[qt + col * rows + r] for every
    column col of the block (nibbles: the low nibble of byte j is column j, the high one
    column j + unit, each stored as nibble - 8). rows, unit and nibbles are compile-time
    constants. Each 16 x 16 byte square is transposed by four rounds of interleaving row i
    with row i + 8 (a round moves one bit of the column index into the row index), which
    LLVM emits as byte unpacks: 4 shuffles per 16 bytes. (An 8 x 8 transpose in 64-bit words
    took ~20 scalar operations per 8 bytes: 0.20 against 0.13 ms a 1408 x 512 Q4_0 matrix.)"""
    if not all(isinstance(t, types.Literal) for t in (rows, unit, nibbles)):
        return None
    n_rows, n_unit, nib = rows.literal_value, unit.literal_value, nibbles.literal_value
    if n_rows % 16 or n_unit % 16:
        return None

    def codegen(context, builder, sig, args):
        i8, i64 = ir.IntType(8), ir.IntType(64)
        vec = ir.VectorType(i8, 16)
        src_ary, s0_, rb, q_ary, qt_ = args[:5]
        low4 = ir.Constant(vec, [0x0F] * 16)
        eight = ir.Constant(vec, [8] * 16)
        four = ir.Constant(vec, [4] * 16)

        def load(offset):
            p = _byte_ptr(context, builder, sig.args[0], src_ary, offset)
            return builder.load(builder.bitcast(p, vec.as_pointer()), align=1)

        def store(v, offset):
            p = _byte_ptr(context, builder, sig.args[3], q_ary, offset)
            builder.store(v, builder.bitcast(p, vec.as_pointer()), align=1)

        for h in range(n_rows // 16):
            for k in range(n_unit // 16):
                base = builder.add(s0_, ir.Constant(i64, k * 16))
                sq = [load(builder.add(base, builder.mul(rb, ir.Constant(i64, h * 16 + r))))
                      for r in range(16)]
                for _ in range(4):
                    sq = [v for i in range(8) for v in (_interleave(builder, sq[i], sq[i + 8],
                                                                     False),
                                                        _interleave(builder, sq[i], sq[i + 8],
                                                                    True))]
                for c in range(16):  # sq[c]: column k * 16 + c of rows h * 16 ..
                    at = builder.add(qt_, ir.Constant(i64, (k * 16 + c) * n_rows + h * 16))
                    if nib:
                        store(builder.sub(builder.and_(sq[c], low4), eight), at)
                        hi_at = builder.add(at, ir.Constant(i64, n_unit * n_rows))
                        store(builder.sub(builder.lshr(sq[c], four), eight), hi_at)
                    else:
                        store(sq[c], at)
        return context.get_dummy_value()

    return types.void(src, s0, row_bytes, q, qt, rows, unit, nibbles), codegen


@njit(nogil=True, cache=True)
def _part_block(src, s0, row_bytes, lo, hi, q, qt, R, unit, nibbles):
    """Float layout, one block of rows lo .. hi - 1 of a tile (row lo's quants at src[s0]),
    byte at a time (a tile cut short by the caller's rows range)."""
    for r in range(lo, hi):
        s = s0 + (r - lo) * row_bytes
        for j in range(unit):
            v = src[s + j]
            if nibbles:
                q[qt + j * R + r] = np.int8(v & 0x0F) - 8
                q[qt + (j + unit) * R + r] = np.int8(v >> 4) - 8
            else:
                q[qt + j * R + r] = np.int8(v)


def _make_fill(R: int, nibbles: bool):
    """The float-layout kernel for tiles of R rows, Q4_0 (nibbles) or Q8_0: R and the format
    are closure constants (numba's cache keys the kernel by them). The closure holds plain
    values only: a compiled function in it pickles differently in every process, which gave
    the kernel a new cache key, and a compile, in each."""
    unit = QK // 2 if nibbles else QK  # quant bytes of one row's block
    block = SCALE_BYTES + unit
    if R % 16:
        raise ValueError(f"tiles of {R} rows are not whole 16-row squares")

    @njit(nogil=True, cache=True, parallel=True)
    def fill_rows(src, rows, r0, n_cols, q, a):
        """src (rows * row_bytes,) uint8 blocks -> rows r0 .. r0 + rows - 1 of the flat tiles
        q (n_tiles * n_cols * R,) int8 and a (n_tiles * nb * R,) uint32 float bits; rows of
        the touched tiles outside the range are left as they are. Threads split the tiles
        (each writes only its own): the bytes do not depend on the split."""
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
                    _tile_block(src, s0, row_bytes, q, qt, R, unit, nibbles)
                else:
                    _part_block(src, s0, row_bytes, lo, hi, q, qt, R, unit, nibbles)

    return fill_rows


@njit(nogil=True, cache=True)
def _copy_row(src, g, r0, nb, q, d, R, unit, flip):
    """Int8 layout, source row g (tile row r0 + g) alone, chunk by chunk (`_make_copy`)."""
    row_bytes = nb * (SCALE_BYTES + unit)
    i, r = (r0 + g) // R, (r0 + g) % R
    for b in range(nb):
        s, at = g * row_bytes + b * (SCALE_BYTES + unit), i * nb * R + b * R + r
        d[at] = np.uint16(src[s]) | (np.uint16(src[s + 1]) << np.uint16(8))
        base = (i * nb + b) * R * unit
        for j in range(0, unit, 4):  # the row's 4-byte chunks (int8.block_byte)
            if flip:
                _copy_flipped(q, base + block_byte(r, j, unit), src, s + SCALE_BYTES + j, 4)
            else:
                _copy_bytes(q, base + block_byte(r, j, unit), src, s + SCALE_BYTES + j, 4)


def _make_copy(R: int, unit: int):
    """The int8-layout kernel for tiles of R rows and `unit` quant bytes a block (16: Q4_0's
    packed nibbles, copied as stored; 32: Q8_0's int8, each byte's sign bit flipped as the
    block tiles keep int8 quants), both closure constants."""
    block = SCALE_BYTES + unit
    flip = unit == QK
    if R % 8:
        raise ValueError(f"tiles of {R} rows are not whole 8-row groups")

    @njit(nogil=True, cache=True, parallel=True)
    def copy_rows(src, rows, r0, nb, q, d):
        """src (rows * row_bytes,) uint8 blocks -> rows r0 .. r0 + rows - 1 of the flat block
        tiles q (n_tiles * nb * R * unit,) uint8 and d (n_tiles * nb * R,) uint16: the
        block's float16 scale bits as stored. Rows of whole 8-row groups of the tiles go a
        group and block at a time (`_group_block`), threads splitting the groups; the rows
        before the first whole group and after the last go one at a time. Each byte is
        written by one thread, the same whatever the split."""
        row_bytes = nb * block
        lo = min(max(-(-r0 // 8) * 8 - r0, 0), rows)  # source row of the first whole group
        hi = max(min((r0 + rows) // 8 * 8 - r0, rows), lo)  # and past the last one
        for gi in prange((hi - lo) // 8):
            g = lo + gi * 8
            i, r = (r0 + g) // R, (r0 + g) % R  # r: a multiple of 8
            for b in range(nb):
                s, at = g * row_bytes + b * block, i * nb * R + b * R + r
                for k in range(8):
                    sk = s + k * row_bytes
                    d[at + k] = np.uint16(src[sk]) | (np.uint16(src[sk + 1]) << np.uint16(8))
                _group_block(q, (i * nb + b) * R * unit + r * unit, src, s + SCALE_BYTES,
                             row_bytes, unit, flip)
        for g in range(lo):
            _copy_row(src, g, r0, nb, q, d, R, unit, flip)
        for g in range(hi, rows):
            _copy_row(src, g, r0, nb, q, d, R, unit, flip)

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
            d[i * nb * R + b * R + r] = 0
            base = (i * nb + b) * R * unit
            for j in range(unit):
                q[base + block_byte(r, j, unit)] = 0


def _stacked(kernel, srcs: list[np.ndarray], qtype: QType, cols: int, capacity: int,
             *args) -> int:
    """kernel(src, rows, r0, *args) for each matrix of srcs stacked row-wise from row 0 (each
    checked to be whole rows of `cols` columns within `capacity` rows) -> the rows written."""
    block, r0 = BLOCKS[qtype].bytes, 0
    for src in srcs:
        rows = src.size // (cols // QK * block)
        if rows * (cols // QK) * block != src.size or r0 + rows > capacity:
            raise ValueError(f"{src.size} bytes are not whole {qtype.name} rows of {cols} "
                             f"columns fitting {capacity} rows of tiles")
        kernel(src, rows, r0, *args)
        r0 += rows
    return r0


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
    r0 = _stacked(_FILL[qtype], srcs, qtype, cols, n_tiles * R, cols, qf, af)
    _zero_rows(r0, n_tiles, R, cols, qf, af)


def copy(srcs: list[np.ndarray], qtype: QType, cols: int, tiles) -> None:
    """Int8 layout: as `fill`, into an IntTiles (q block tiles, d scales)."""
    q, d, R = tiles.q, tiles.d, TILE_ROWS
    unit, nb, n_tiles = _UNIT[qtype], cols // QK, q.shape[0]
    if q.shape != (n_tiles, nb * R * unit) or d.shape != (n_tiles, nb * R) \
            or q.itemsize != 1 or d.dtype != np.uint16 or cols % QK \
            or not q.flags.c_contiguous or not d.flags.c_contiguous:
        raise ValueError(f"tiles q {q.dtype}{q.shape}, d {d.dtype}{d.shape} do not fit "
                         f"{cols} columns in block tiles of {R} rows")
    qf, df = q.reshape(-1).view(np.uint8), d.reshape(-1)
    r0 = _stacked(_COPY[qtype], srcs, qtype, cols, n_tiles * R, nb, qf, df)
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
