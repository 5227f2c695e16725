"""The row-tile layout every kernel reads, and the reduction order that makes them batch-invariant.

Layout. A weight matrix (N, K) is cut into tiles of TILE_ROWS consecutive output rows (the last
tile zero-padded). A tile is stored column-major and flat: the element at row i * TILE_ROWS + r,
column c lives at tiles[i, c * TILE_ROWS + r]. One tile column is 32 float32 lanes (four 256-bit
or two 512-bit vectors), so kernels vectorize across output rows while each row keeps its own
scalar accumulation order.
Per-block scales use the same layout with one column per block.

Reduction order, the batch-invariance contract. For output (t, n) and each block b of QK
columns starting at k0, with w the dequantized-but-unscaled weight (q, or the float value):

    s_j = w[k0 + j] * x[k0 + j]                          j = 0 .. PHASES - 1
    s_j = s_j + w[k0 + j + PHASES i] * x[k0 + j + PHASES i]   i = 1 .. QK / PHASES - 1, in order
    S_b = (s_0 + s_1) + (s_2 + s_3)
    acc = 0, then acc = acc + term_b for b = 0 .. nb - 1, in order

where term_b is d_b * S_b (Q8_0, Q4_0), d_b * S_b + m_b * X_b (Q4_1, X_b the block sum of x in
the same phase order) or S_b (floats). The sub-block formats (subblock.py: Q5_0, Q5_1, IQ4_NL,
Q2_K..Q6_K) follow the same order with QK their sub-block size, 32 or 16, and term_b =
a_b * S_b (+ c_b * X_b). Each step is one IEEE float32 operation rounded to
nearest-even: numba runs without fastmath, so LLVM neither reassociates nor contracts a * b + c
into an FMA, and the NumPy twins apply the same operations elementwise. The order depends on
(t, n) only, not on T, on which tokens share a call, or on which thread owns the tile; hence
matmul(X)[t] == matvec(X[t]) bit for bit. Kernels may share one weight load between two tokens;
that changes no operation of either token.

This module holds the constants and the NumPy helpers that build and read tiles; no kernels.
"""

from __future__ import annotations

import numpy as np

TILE_ROWS = 32  # output rows per tile. 32 rather than 16: a block's activations, broadcast once
#                and kept for the whole tile, serve four 8-row vector passes instead of two; the
#                sub-block prefill matmul ran 1.3-1.7x faster (bench_matmul, AMD EPYC, AVX2) with
#                the same operations per row, so the same bits
PHASES = 4  # independent partial sums per block: column k0 + k feeds s_(k % PHASES)
FLOAT_BLOCK = 32  # reduction block of the float formats, which have no quant block of their own


def n_tiles(rows: int) -> int:
    return -(-rows // TILE_ROWS)


def to_tiles(a: np.ndarray) -> np.ndarray:
    """a (N, C) -> (n_tiles, C * TILE_ROWS) in a's dtype, rows zero-padded to whole tiles."""
    rows, cols = a.shape
    padded = np.zeros((n_tiles(rows) * TILE_ROWS, cols), dtype=a.dtype)
    padded[:rows] = a
    tiled = padded.reshape(-1, TILE_ROWS, cols).transpose(0, 2, 1)
    return np.ascontiguousarray(tiled).reshape(-1, cols * TILE_ROWS)


def nibble_tiles(qs: np.ndarray, offset: int = 0, dtype=np.uint8) -> np.ndarray:
    """qs (N, nb, 16) uint8 GGUF nibbles (low nibble q[j], high q[j + 16] of each block) ->
    to_tiles of the unpacked (N, nb * 32) values minus `offset`, in `dtype`; each half is
    written by one strided ufunc straight into its place, no temporaries (unpack, pad and
    transpose took a third of the load time; temporaries then half of what remained)."""
    rows, nb, half = qs.shape
    tiles = n_tiles(rows)
    out = np.zeros((tiles, nb, 2, half, TILE_ROWS), dtype=dtype)
    view = out.transpose(0, 4, 1, 2, 3)  # (tiles, TILE_ROWS, nb, 2, 16), a view of out
    full, rest = divmod(rows, TILE_ROWS)
    whole = qs[:full * TILE_ROWS].reshape(full, TILE_ROWS, nb, half)
    for h, nibble in enumerate((_low_nibble, _high_nibble)):  # each straight into its place
        nibble(whole, out=view[:full, :, :, h, :])
        if rest:
            nibble(qs[full * TILE_ROWS:], out=view[full, :rest, :, h, :])
    if offset:
        np.subtract(out, dtype(offset), out=out)
        if rest:  # the padding rows back to 0
            view[full, rest:] = 0
    return out.reshape(tiles, -1)


def _low_nibble(qs: np.ndarray, out: np.ndarray) -> None:
    np.bitwise_and(qs, np.uint8(0x0F), out=out, casting="unsafe")  # 0..15 fit either dtype


def _high_nibble(qs: np.ndarray, out: np.ndarray) -> None:
    np.right_shift(qs, np.uint8(4), out=out, casting="unsafe")


def gather_rows(tiles: np.ndarray, ids: np.ndarray | slice) -> np.ndarray:
    """tiles (n_tiles, C * TILE_ROWS) -> (n, C): rows `ids` (int array or slice) of the untiled
    matrix, a new array."""
    cols = tiles.shape[1] // TILE_ROWS
    tiled = tiles.reshape(-1, cols, TILE_ROWS)
    if isinstance(ids, slice):  # a run of rows: one strided copy instead of a gather
        return tiled.transpose(0, 2, 1).reshape(-1, cols)[ids]
    return tiled[ids // TILE_ROWS, :, ids % TILE_ROWS]


def phase_view(a: np.ndarray, block: int) -> np.ndarray:
    """a (..., nb * block) -> (..., nb, block // PHASES, PHASES): column k0 + PHASES i + j at
    [..., b, i, j], the order the reduction walks a block (twins and block sums use it)."""
    return a.reshape(*a.shape[:-1], -1, block // PHASES, PHASES)


def phase_sum(terms: np.ndarray) -> np.ndarray:
    """terms (..., steps, PHASES, L) -> (..., L): s_j summed over steps in order, then
    (s_0 + s_1) + (s_2 + s_3), the block reduction of the contract, elementwise in float32."""
    s = terms[..., 0, :, :]
    for i in range(1, terms.shape[-3]):
        s = s + terms[..., i, :, :]
    return (s[..., 0, :] + s[..., 1, :]) + (s[..., 2, :] + s[..., 3, :])
