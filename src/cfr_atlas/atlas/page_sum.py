"""Page checksums: cheap enough to verify every mapped page inside the fold that reads it.

A page is its K^T block (D, P) and its V block (P, D) in the storage dtype, as the page file and
the hot cache lay it out; rows and columns not yet written are zero. Number the rows of the
page r = 0..D-1 (K^T) then D..D+P-1 (V), read every row as little-endian 32-bit words (one
float32, or two 16-bit elements; an odd-length 16-bit row ends with a half word, its high half
zero), and let S_r be the sum of row r's words mod 2**32. The checksum is

    C = sum_r weight(r) * S_r   (mod 2**32),   weight(r) = (2r + 1) * 0x9E3779B1, odd.

What it catches: any change confined to one 32-bit word (an odd weight keeps a nonzero
difference nonzero mod 2**32), rows zero-filled or cut short (the written values go missing),
a page holding another page's or another sequence's bytes (unless equal, when reading them
changes nothing), rows swapped or shifted (each row has its own weight), and anything else
outside a 1-in-2**32 coincidence, like CRC32. What it misses, by design, to cost one add per
word: words permuted inside one row (two key positions of one K^T dimension exchanged, or two
words of one V row). It is no defence against a forger with write access to this process's
files (who could equally rewrite its memory).

Cost: about two vectorized 32-bit adds per word and a multiply per eight rows (`_block_sum`),
or one add per word and a multiply per row read one row after another (`k_rows_sum`, rows of
an even length or float32; others as `_block_sum`). The fold
sums a page's K^T half row by row as the page streams in from memory, before its scores, and
its V half after the values (benchmarks/bench_check.py measures what that costs the fold).
Linear in the elements, so the page file keeps each page's checksum current as rows are
appended or cleared (`row_delta`) without reading it back. This module holds no page file
or fold logic.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

_GOLDEN = 0x9E3779B1
_MASK = 0xFFFFFFFF


@njit(cache=True, inline="always")
def _u32(x):
    return np.uint32(x & _MASK)


@njit(cache=True, inline="always")
def _weight(r):
    """Odd 32-bit weight of row r."""
    return _u32(np.uint64(2 * r + 1) * np.uint64(_GOLDEN))


@njit(cache=True, inline="always")
def _rows_sum(words, row0, lo, hi):
    """sum over rows r in lo..hi-1 of `words` (uint32 rows) of weight(row0 + r) times the
    row's word sum, one row after another, mod 2**32."""
    s = np.uint32(0)
    for r in range(lo, hi):
        row_sum = np.uint32(0)
        for w in range(words.shape[1]):  # a plain add per word: vectorizes
            row_sum = _u32(row_sum + words[r, w])
        s = _u32(s + _u32(np.uint64(_weight(row0 + r)) * np.uint64(row_sum)))
    return s


@njit(cache=True, inline="always")
def _block_sum(block, row0):
    """sum over rows r of `block` (rows, n), float32 or uint16 bits, of weight(row0 + r) times
    the sum of the row's words, mod 2**32."""
    rows, n = block.shape
    s = np.uint32(0)
    if block.itemsize == 4 or n % 2 == 0:
        words = block.view(np.uint32)
        # Eight rows at a time, so the vector sums across a row's words are reduced to a
        # scalar once per eight rows instead of once per row (a page row is only 32 words):
        # with S_k the word sum of row r + k, sum_k weight(row0 + r + k) S_k =
        # weight(row0 + r) a + 2 * GOLDEN * b, a = sum_k S_k, b = sum_k k S_k, where
        # t_k = x_k + ... + x_7 per word gives a = t_0 and b = t_1 + ... + t_7. All mod 2**32.
        top = rows - rows % 8
        for r in range(0, top, 8):
            x0, x1, x2, x3 = words[r], words[r + 1], words[r + 2], words[r + 3]
            x4, x5, x6, x7 = words[r + 4], words[r + 5], words[r + 6], words[r + 7]
            a = np.uint32(0)
            b = np.uint32(0)
            for w in range(words.shape[1]):  # adds only, across the words: vectorizes
                t6 = _u32(x7[w] + x6[w])
                t5 = _u32(t6 + x5[w])
                t4 = _u32(t5 + x4[w])
                t3 = _u32(t4 + x3[w])
                t2 = _u32(t3 + x2[w])
                t1 = _u32(t2 + x1[w])
                a = _u32(a + _u32(t1 + x0[w]))
                b = _u32(b + _u32(_u32(_u32(t1 + t2) + _u32(t3 + t4))
                                  + _u32(_u32(t5 + t6) + x7[w])))
            s = _u32(s + _u32(np.uint64(_weight(row0 + r)) * np.uint64(a))
                     + _u32(np.uint64(2 * _GOLDEN) * np.uint64(b)))
        s = _u32(s + _rows_sum(words, row0, top, rows))
    else:  # odd-length 16-bit rows, element by element
        bits = block.view(np.uint16)
        for r in range(rows):
            row_sum = np.uint32(0)
            for c in range(n):
                row_sum = _u32(row_sum + (np.uint32(bits[r, c]) << np.uint32((c & 1) * 16)))
            s = _u32(s + _u32(np.uint64(_weight(row0 + r)) * np.uint64(row_sum)))
    return s


@njit(cache=True, nogil=True)
def page_checksum(k_page, v_page):
    """k_page (D, P), v_page (P, D) in storage dtype -> uint32 checksum (module docstring)."""
    return _u32(_block_sum(k_page, 0) + _block_sum(v_page, k_page.shape[0]))


@njit(cache=True, nogil=True)
def k_rows_sum(k_page):
    """The K^T half of `page_checksum` (rows 0..D-1), read one row after another: one
    sequential stream over the page, which the hardware prefetchers follow from memory (the
    fold computes it while the page streams in, fold.py). Even-length 16-bit or float32 rows
    (a session's pages); other rows go through `_block_sum`."""
    rows, n = k_page.shape
    if not (k_page.itemsize == 4 or n % 2 == 0):
        return _block_sum(k_page, 0)
    return _rows_sum(k_page.view(np.uint32), 0, 0, rows)


@njit(cache=True, nogil=True)
def v_rows_sum(v_page, d):
    """The V half of `page_checksum` (rows d..d+P-1)."""
    return _block_sum(v_page, d)


@njit(cache=True, inline="always")
def halves_sum(k_sum, v_sum):
    """page_checksum from its halves: k_rows_sum + v_rows_sum mod 2**32."""
    return _u32(k_sum + v_sum)


def _as_bits(a):
    """float32 -> its uint32 bits; uint16 bits as they are."""
    return a.view(np.uint32) if a.dtype == np.float32 else a


@overload(_as_bits, jit_options={"cache": True}, inline="always")
def _as_bits_ov(a):
    if a.dtype == types.float32:
        return lambda a: a.view(np.uint32)
    return lambda a: a


@njit(cache=True, inline="always")
def row_delta(k_row, v_row, j):
    """Checksum change when token j of a page goes from zero to k_row (D,) / v_row (D,) or (0,)
    (storage dtype, contiguous); minus it when it goes back to zero. uint32, mod 2**32."""
    d = k_row.shape[0]
    kb, vb = _as_bits(k_row), _as_bits(v_row)
    shift = np.uint64((j & 1) * 16) if k_row.itemsize == 2 else np.uint64(0)
    s = np.uint64(0)
    v_sum = np.uint64(0)
    for e in range(d):
        s += np.uint64(_weight(e)) * (np.uint64(kb[e]) << shift)  # K^T row e, column j
    for e in range(v_row.shape[0]):  # D, or 0 when V is a view of K (no V row stored)
        v_shift = np.uint64((e & 1) * 16) if v_row.itemsize == 2 else np.uint64(0)
        v_sum += np.uint64(vb[e]) << v_shift
    s += np.uint64(_weight(d + j)) * (v_sum & np.uint64(_MASK))  # V row j
    return _u32(s)


@njit(cache=True, nogil=True)
def rows_delta(k_rows, v_rows, j0):
    """`row_delta` summed over tokens j0.. of rows (T, D): uint32."""
    s = np.uint64(0)
    for t in range(k_rows.shape[0]):
        s += row_delta(np.ascontiguousarray(k_rows[t]), np.ascontiguousarray(v_rows[t]), j0 + t)
    return _u32(s)


# --- NumPy twin (the definition, row by row; tests compare it with the kernels) ---------------

def page_checksum_numpy(k_page: np.ndarray, v_page: np.ndarray) -> int:
    def row_sums(block):
        bits = block.view(np.uint32 if block.itemsize == 4 else np.uint16).astype(np.uint64)
        if block.itemsize == 2:
            bits = bits << ((np.arange(block.shape[1]) % 2) * 16).astype(np.uint64)
        return bits.sum(axis=1) & _MASK

    sums = np.concatenate([row_sums(k_page), row_sums(v_page)])
    weights = ((2 * np.arange(len(sums), dtype=np.uint64) + 1) * _GOLDEN) & _MASK
    return int(((weights * sums) & _MASK).sum() & _MASK)
