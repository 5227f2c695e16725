"""rms_norm / rms_norm_per_head: float64 reference, NumPy twin, batch invariance, errors."""

import numpy as np
import pytest

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.ops import rms_norm, rms_norm_per_head
from cfr_atlas.ops.norm import _rms_norm_kernel, rms_norm_numpy

EPS = 1e-5


def _rand(shape, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def reference(x, w, eps):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w64


@pytest.mark.parametrize("dim", [1, 7, 64, 576])
def test_matches_float64_reference(dim):
    x, w = _rand((33, dim)), _rand((dim,), seed=1, scale=1.0)
    # Three float32 roundings after an exact-enough float64 mean: relative error <= ~4 ulp.
    np.testing.assert_allclose(rms_norm(x, w, EPS), reference(x, w, EPS), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("shape", [(1, 1), (5, 13), (64, 576), (3, 1000)])
def test_kernel_and_numpy_twin_agree_bitwise(shape):
    x, w = _rand(shape), _rand(shape[1:], seed=2)
    a, b = np.empty_like(x), np.empty_like(x)
    _rms_norm_kernel(x, w, np.float32(EPS), a)
    rms_norm_numpy(x, w, np.float32(EPS), b)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("n_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("offset", [0, 1, 29])
def test_batch_invariance(n_tokens, offset):
    x, w = _rand((100, 576)), _rand((576,), seed=1)
    full = rms_norm(x, w, EPS)
    assert np.array_equal(
        rms_norm(x[offset : offset + n_tokens], w, EPS), full[offset : offset + n_tokens]
    )
    assert np.array_equal(rms_norm(x[offset : offset + 1], w, EPS)[0], full[offset])


def test_in_place_and_non_contiguous_input():
    x, w = _rand((8, 64)), _rand((64,), seed=1)
    expected = rms_norm(x, w, EPS)
    wide = np.zeros((8, 128), dtype=np.float32)
    wide[:, ::2] = x
    assert np.array_equal(rms_norm(wide[:, ::2], w, EPS), expected)
    y = x.copy()
    assert rms_norm(y, w, EPS, out=y) is y
    assert np.array_equal(y, expected)


def test_zero_row_is_zero():
    w = np.ones(16, dtype=np.float32)
    assert np.array_equal(rms_norm(np.zeros((2, 16), dtype=np.float32), w, EPS), np.zeros((2, 16)))


def test_per_head_is_rms_norm_on_each_head():
    x, w = _rand((17, 9, 64)), _rand((64,), seed=3)
    y = rms_norm_per_head(x, w, EPS)
    assert y.shape == x.shape
    assert np.array_equal(y, rms_norm(x.reshape(-1, 64), w, EPS).reshape(x.shape))
    assert np.array_equal(rms_norm_per_head(x[5:6], w, EPS), y[5:6])


def test_errors_carry_numbers():
    x = _rand((4, 8))
    with pytest.raises(DimensionError, match="7 elements.*8"):
        rms_norm(x, np.ones(7, dtype=np.float32), EPS)
    with pytest.raises(DimensionError, match="float32"):
        rms_norm(x.astype(np.float64), np.ones(8, dtype=np.float32), EPS)
    with pytest.raises(DimensionError, match="2 dims"):
        rms_norm(x[0], np.ones(8, dtype=np.float32), EPS)
    with pytest.raises(DimensionError, match=r"\(4, 8\)"):
        rms_norm(x, np.ones(8, dtype=np.float32), EPS, out=np.empty((4, 9), dtype=np.float32))
    with pytest.raises(DimensionError, match="head_dim is 8"):
        rms_norm_per_head(x[:, None, :], np.ones(4, dtype=np.float32), EPS)
    with pytest.raises(ConfigError, match="eps"):
        rms_norm(x, np.ones(8, dtype=np.float32), -1.0)


def test_parallel_rows_equal_the_serial_kernel_and_the_twin():
    """Above PARALLEL_ELEMENTS the rows are split between threads: every row is still the
    same sequential loop, so the result is bitwise the serial kernel's and the twin's, and
    a row alone gives the same bits as inside the batch."""
    from cfr_atlas.ops.norm import PARALLEL_ELEMENTS, _rms_norm_parallel

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((PARALLEL_ELEMENTS // 640 + 7, 640)) * 3).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    eps = np.float32(1e-6)
    serial, twin, par = (np.empty_like(x) for _ in range(3))
    _rms_norm_kernel(x, w, eps, serial)
    rms_norm_numpy(x, w, eps, twin)
    _rms_norm_parallel(x, w, eps, par)
    np.testing.assert_array_equal(par, serial)
    np.testing.assert_array_equal(par, twin)
    np.testing.assert_array_equal(rms_norm(x, w, 1e-6), par)  # the dispatching entry point
    np.testing.assert_array_equal(rms_norm(x[5:6], w, 1e-6)[0], par[5])
