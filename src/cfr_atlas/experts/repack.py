"""Expert repack straight into a slot: one compiled pass per matrix, raw GGUF bytes -> tiles.

A cold expert load used to go raw -> NumPy temporaries (nibbles unpacked, padded, transposed,
f16 scales converted) -> a second copy into the slot, on the compute thread: 4-6 ms per
512 x 1408 Q4_0 expert, most of a cold load. Here a numba kernel (nogil, so a prefetch thread
overlaps it with compute) reads each matrix's contiguous bytes once and writes the slot's tile
arrays in place, the layout tiles.py defines for subblock Tiles (q int8 row tiles, a float32
scale tiles, c empty):

    q[i, col * R + r] = weight q - offset of row i * R + r, column col     (R = TILE_ROWS)
    a[i, b * R + r]   = f16 scale d of block b of that row, as float32 bits
    rows past the matrix (the last tile's padding): 0 in q and a

Covered: Q4_0 (18-byte block: f16 d | 16 bytes of nibbles, low = q[j], high = q[j + 16],
stored q + 8) and Q8_0 (34-byte block: f16 d | 32 int8) with the float arithmetic. Every other
(format, arithmetic) loads through its codec's repack (`KERNELS` has no entry); the store checks
at build time that this pass writes the very bytes the codec's repack gives (the NumPy twin is
the codec's `repack`), and refuses to use it otherwise.

f16 -> f32 is done on the bits, as NumPy does it (npy_halfbits_to_floatbits: exact, subnormals
normalized, NaN payloads shifted, not quieted); a test runs all 65,536 halves against NumPy.
R is TILE_ROWS read at import and made a closure constant of the kernel, which numba's cache
keys by it, so a change of TILE_ROWS compiles a new kernel instead of reusing a stale one.
Not here: reading files (source.py), slot bookkeeping (store.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cfr_atlas.quant.formats import BLOCKS, QType
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


def _make_fill(R: int, nibbles: bool):
    """The kernel for tiles of R rows, Q4_0 (nibbles) or Q8_0: R and the format are closure
    constants (numba's cache keys the kernel by them), so LLVM unrolls and vectorizes the tile
    column writes; a tile's block is unpacked into an (R, QK) buffer, then written column by
    column."""
    block = SCALE_BYTES + (QK // 2 if nibbles else QK)

    @njit(nogil=True, cache=True)
    def fill_rows(src, rows, r0, n_cols, q, a):
        """src (rows * row_bytes,) uint8 blocks -> rows r0 .. r0 + rows - 1 of the flat tiles
        q (n_tiles * n_cols * R,) int8 and a (n_tiles * nb * R,) uint32 float bits; rows of
        the touched tiles outside the range are left as they are."""
        nb = n_cols // QK
        row_bytes = nb * block
        buf = np.empty((R, QK), dtype=np.int8)
        for i in range(r0 // R, (r0 + rows - 1) // R + 1):
            lo, hi = max(r0, i * R) - i * R, min(r0 + rows, (i + 1) * R) - i * R
            first = (i * R + lo - r0) * row_bytes  # source byte of row lo of this tile
            for b in range(nb):
                at, qt = i * nb * R + b * R, i * n_cols * R + b * QK * R
                for r in range(lo, hi):
                    s = first + (r - lo) * row_bytes + b * block
                    a[at + r] = half_bits_to_float_bits(np.uint32(src[s])
                                                        | (np.uint32(src[s + 1]) << 8))
                    s += SCALE_BYTES
                    if nibbles:
                        for j in range(QK // 2):
                            v = src[s + j]
                            buf[r, j] = np.int8(v & 0x0F) - 8
                            buf[r, j + QK // 2] = np.int8(v >> 4) - 8
                    else:
                        for j in range(QK):
                            buf[r, j] = np.int8(src[s + j])
                if lo == 0 and hi == R:
                    for j in range(QK):
                        for r in range(R):
                            q[qt + j * R + r] = buf[r, j]
                else:
                    for j in range(QK):
                        for r in range(lo, hi):
                            q[qt + j * R + r] = buf[r, j]

    return fill_rows


@njit(nogil=True, cache=True)
def _zero_rows(first, n_tiles, R, n_cols, q, a):
    """Rows first .. n_tiles * R - 1 (the last tile's padding) -> 0 in q and a."""
    nb = n_cols // QK
    for g in range(first, n_tiles * R):
        i, r = g // R, g % R
        for c in range(n_cols):
            q[i * n_cols * R + c * R + r] = 0
        for b in range(nb):
            a[i * nb * R + b * R + r] = 0


def fill(srcs: list[np.ndarray], qtype: QType, cols: int, q: np.ndarray, a: np.ndarray) -> None:
    """srcs: 1-D uint8 block bytes of matrices stacked row-wise (gate then up for the fused
    gate|up) -> q (n_tiles, cols * R) int8 and a (n_tiles, cols // QK * R) float32 in place,
    padding rows zeroed. Checks shapes; the kernels trust them."""
    R, block = TILE_ROWS, BLOCKS[qtype].bytes
    n_tiles = q.shape[0]
    if q.shape != (n_tiles, cols * R) or a.shape != (n_tiles, cols // QK * R) \
            or q.dtype != np.int8 or a.dtype != np.float32 or cols % QK:
        raise ValueError(f"tiles q {q.dtype}{q.shape}, a {a.dtype}{a.shape} do not fit "
                         f"{cols} columns in tiles of {R} rows")
    qf, af = q.reshape(-1), a.reshape(-1).view(np.uint32)
    r0 = 0
    for src in srcs:
        rows = src.size // (cols // QK * block)
        if rows * (cols // QK) * block != src.size or r0 + rows > n_tiles * R:
            raise ValueError(f"{src.size} bytes are not whole {qtype.name} rows of {cols} "
                             f"columns fitting {n_tiles} tiles")
        _FILL[qtype](src, rows, r0, cols, qf, af)
        r0 += rows
    _zero_rows(r0, n_tiles, R, cols, qf, af)


_FILL = {QType.Q4_0: _make_fill(TILE_ROWS, True), QType.Q8_0: _make_fill(TILE_ROWS, False)}
KERNELS = {QType.Q4_0: fill, QType.Q8_0: fill}  # formats (float arithmetic) filled in one pass
