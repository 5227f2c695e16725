"""The fast Walsh-Hadamard transform, orthonormal: x (..., n) -> x H_n / sqrt(n), n = 2^k.

H_n is Sylvester's Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]), symmetric,
so the orthonormal transform is its own inverse: wht(wht(x)) == x up to float32 rounding. It
runs as log2(n) butterfly passes (a, b) -> (a + b, a - b) over pairs h = 1, 2, 4, ... apart,
O(n log n), then one multiply by 1/sqrt(n) (exact when n is a power of 4). Each output is
computed by the same float32 operations in the same order in the numba kernel and the NumPy
twin, so the two agree bitwise, and a row's result never depends on the other rows.
Used to spread a vector's energy over all its coordinates before quantizing it.
This module holds nothing else.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from cfr_atlas.errors import DimensionError


@njit(cache=True, nogil=True)
def _wht_rows(x, scale):
    """In place on x (rows, n) float32."""
    rows, n = x.shape
    for r in range(rows):
        v = x[r]
        h = 1
        while h < n:
            for i in range(0, n, 2 * h):
                for j in range(i, i + h):
                    a, b = v[j], v[j + h]
                    v[j] = a + b
                    v[j + h] = a - b
            h *= 2
        for j in range(n):
            v[j] *= scale


def _check(x) -> np.ndarray:
    x = np.array(x, dtype=np.float32, copy=True)
    n = x.shape[-1] if x.ndim else 0
    if x.ndim < 1 or n < 1 or n & (n - 1):
        raise DimensionError(f"wht needs a last axis of power-of-two length, got shape "
                             f"{x.shape}")
    return x


def wht(x: np.ndarray) -> np.ndarray:
    """x (..., n) float32, n a power of two -> (..., n) float32 = x H_n / sqrt(n), a new array."""
    y = _check(x)
    n = y.shape[-1]
    flat = y.reshape(-1, n)
    _wht_rows(flat, np.float32(1.0 / math.sqrt(n)))
    return flat.reshape(y.shape)


def wht_numpy(x: np.ndarray) -> np.ndarray:
    """The NumPy twin: the same butterflies, vectorized per pass."""
    y = _check(x)
    n = y.shape[-1]
    h = 1
    while h < n:
        v = y.reshape(-1, n // (2 * h), 2, h)
        a, b = v[:, :, 0, :].copy(), v[:, :, 1, :].copy()
        v[:, :, 0, :], v[:, :, 1, :] = a + b, a - b
        h *= 2
    return y * np.float32(1.0 / math.sqrt(n))
