"""ops.wht: orthonormal Walsh-Hadamard transform against Sylvester's matrix in float64,
self-inverse, norm-preserving, kernel == NumPy twin bitwise, bad lengths refused."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.errors import DimensionError
from cfr_atlas.ops import wht
from cfr_atlas.ops.wht import wht_numpy


def _hadamard(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("n", [1, 2, 8, 64, 512])
def test_matches_the_matrix_and_its_twin(n):
    x = np.random.default_rng(n).standard_normal((5, n)).astype(np.float32)
    got = wht(x)
    ref = x.astype(np.float64) @ _hadamard(n) / np.sqrt(n)
    assert np.abs(got - ref).max() < 1e-5 * max(1.0, np.log2(n))
    assert np.array_equal(got, wht_numpy(x))
    assert np.allclose(np.linalg.norm(got, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)


def test_self_inverse_and_row_independent():
    x = np.random.default_rng(0).standard_normal((3, 4, 256)).astype(np.float32)
    assert np.abs(wht(wht(x)) - x).max() < 1e-5
    assert np.array_equal(wht(x)[1, 2], wht(x[1, 2]))
    ints = np.arange(16, dtype=np.float32)  # power of 4: the scale is exact, small ints too
    assert np.array_equal(wht(wht(ints)), ints)


@pytest.mark.parametrize("shape", [(6,), (2, 12), ()])
def test_bad_lengths_are_refused(shape):
    with pytest.raises(DimensionError):
        wht(np.zeros(shape, np.float32))
