"""Page checksums (page_sum.py): the kernel against its NumPy twin, the incremental form the
page file keeps against the whole-page form, and the corruptions it must catch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfr_atlas.atlas.page_sum import (
    halves_sum,
    k_rows_sum,
    page_checksum,
    page_checksum_numpy,
    rows_delta,
    v_rows_sum,
)
from cfr_atlas.atlas.storage import StorageDtype, round_rows

# (head_dim, page_tokens): K^T pages have head_dim rows and V pages page_tokens rows; the kernel
# sums eight rows at a time and the rest one by one, so both counts cover both
SHAPES = [(64, 256), (8, 4), (3, 5), (7, 3), (6, 4), (1, 1), (64, 64), (20, 12), (12, 21)]


def _page(rng, dtype, D, P, n):
    """A page with n of P tokens written (the rest zero), and its rows (n, D) of K and V."""
    k_rows, v_rows = (round_rows(rng.uniform(-3, 3, (n, D)).astype(np.float32), dtype)
                      for _ in range(2))
    k = np.zeros((D, P), dtype=dtype.array_dtype)
    v = np.zeros((P, D), dtype=dtype.array_dtype)
    k[:, :n], v[:n] = k_rows.T, v_rows
    return k, v, k_rows, v_rows


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_twin_and_incremental_agree(dtype, shape):
    D, P = shape
    rng = np.random.default_rng(D * 100 + P)
    n = max(1, P - 1)
    k, v, k_rows, v_rows = _page(rng, dtype, D, P, n)
    whole = page_checksum_numpy(k, v)
    assert int(page_checksum(k, v)) == whole
    # appended in two runs, as the page file does
    cut = n // 2
    grown = (int(rows_delta(k_rows[:cut], v_rows[:cut], 0))
             + int(rows_delta(k_rows[cut:], v_rows[cut:], cut))) & 0xFFFFFFFF
    assert grown == whole
    # clearing rows cut.. (a rewind) subtracts exactly their part
    cleared = (whole - int(rows_delta(k_rows[cut:], v_rows[cut:], cut))) & 0xFFFFFFFF
    k2, v2 = k.copy(), v.copy()
    k2[:, cut:], v2[cut:] = 0, 0
    assert cleared == page_checksum_numpy(k2, v2) == int(page_checksum(k2, v2))


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_bit_pattern_sums_as_the_definition(itemsize, shape):
    """Random words with every bit in play (sums wrap mod 2**32 many times over): the kernel
    equals the NumPy twin, which computes the definition row by row."""
    D, P = shape
    rng = np.random.default_rng(D * 1000 + P + itemsize)
    dt = np.uint16 if itemsize == 2 else np.uint32
    top = np.iinfo(dt).max
    k = rng.integers(0, top, (D, P), dtype=dt, endpoint=True)
    v = rng.integers(0, top, (P, D), dtype=dt, endpoint=True)
    if itemsize == 4:
        k, v = k.view(np.float32), v.view(np.float32)
    assert int(page_checksum(k, v)) == page_checksum_numpy(k, v)
    # the halves the fold computes apart (K^T row by row as the page streams in, V after)
    assert int(halves_sum(k_rows_sum(k), v_rows_sum(v, D))) == page_checksum_numpy(k, v)
    full = np.full_like(k.view(dt), top).view(k.dtype), np.full_like(v.view(dt), top).view(v.dtype)
    assert int(page_checksum(*full)) == page_checksum_numpy(*full)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(StorageDtype)), st.sampled_from(SHAPES[:5]), st.data())
def test_any_single_word_change_is_caught(dtype, shape, data):
    D, P = shape
    k, v, _, _ = _page(np.random.default_rng(7), dtype, D, P, P)
    good = int(page_checksum(k, v))
    block = data.draw(st.sampled_from(["k", "v"]))
    raw = (k if block == "k" else v).reshape(-1).view(np.uint8)
    byte = data.draw(st.integers(0, raw.size - 1))
    flip = data.draw(st.integers(1, 255))
    raw[byte] ^= flip
    assert int(page_checksum(k, v)) != good


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
def test_zeroed_swapped_and_foreign_pages_are_caught(dtype):
    rng = np.random.default_rng(3)
    k, v, _, _ = _page(rng, dtype, 64, 256, 256)
    good = int(page_checksum(k, v))
    zeroed = v.copy()
    zeroed[100:200] = 0
    assert int(page_checksum(k, zeroed)) != good
    swapped = v.copy()
    swapped[[3, 4]] = swapped[[4, 3]]  # two tokens' V rows exchanged
    assert int(page_checksum(k, swapped)) != good
    k_dims = k.copy()
    k_dims[[0, 9]] = k_dims[[9, 0]]  # two dims of every key exchanged
    assert int(page_checksum(k_dims, v)) != good
    other_k, other_v, _, _ = _page(rng, dtype, 64, 256, 256)  # another page's bytes
    assert int(page_checksum(other_k, other_v)) != good


def test_float16_widening_without_f16c_is_exact_for_every_pattern():
    """The software path (CPUs without F16C) against NumPy, all 65,536 bit patterns."""
    from numba import njit

    from cfr_atlas.atlas.storage import _f16_soft

    @njit
    def soft(bits, out):
        for i in range(bits.size):
            out[i] = _f16_soft(bits[i])

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, dtype=np.float32)
    soft(bits, out)
    assert np.array_equal(out.view(np.uint32), bits.view(np.float16).astype(np.float32)
                          .view(np.uint32))
