"""Activations: float64 references, NumPy twins, batch invariance, errors."""

import numpy as np
import pytest

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.ops import activations as act
from cfr_atlas.ops import geglu, gelu, silu, softcap, swiglu


def _rand(shape, seed=0, scale=4.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def silu_ref(x):
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-x))


def gelu_ref(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


# Tolerances: float32 evaluation is good to a few ulp (rtol 1e-6) except GELU for x << 0, where
# 1 + tanh(.) cancels; there the absolute error is |x| * 2^-24 <= 1e-6 for |x| < 16.
CASES = [
    (silu, silu_ref, dict(rtol=1e-6, atol=1e-30)),
    (gelu, gelu_ref, dict(rtol=1e-5, atol=1e-6)),
]


@pytest.mark.parametrize(("fn", "ref", "tol"), CASES)
def test_unary_matches_float64_reference(fn, ref, tol):
    x = np.concatenate([_rand((4000,)), np.float32([0.0, -0.0, 1e-30, -20.0, 20.0, -90.0, 90.0])])
    np.testing.assert_allclose(fn(x), ref(x), **tol)


def test_gated_match_references():
    g, u = _rand((7, 300), seed=1), _rand((7, 300), seed=2)
    np.testing.assert_allclose(swiglu(g, u), silu_ref(g) * u, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(geglu(g, u), gelu_ref(g) * u, rtol=2e-5, atol=1e-5)
    assert np.array_equal(swiglu(g, u), silu(g) * u)  # same float32 steps
    assert np.array_equal(geglu(g, u), gelu(g) * u)


def test_softcap_matches_reference_and_bounds():
    x = _rand((1000,), scale=100.0)
    y = softcap(x, 30.0)
    np.testing.assert_allclose(y, 30.0 * np.tanh(x.astype(np.float64) / 30.0), rtol=1e-6, atol=1e-5)
    assert np.all(np.abs(y) <= 30.0)


# Kernels call libm expf/tanhf, NumPy its own SIMD versions: the two differ by a few ulp.
TWIN_TOL = dict(rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["silu", "gelu"])
def test_unary_kernels_match_numpy_twins(name):
    x = _rand((5000,))
    a, b = np.empty_like(x), np.empty_like(x)
    getattr(act, f"_{name}_kernel")(x, a)
    getattr(act, f"{name}_numpy")(x, b)
    np.testing.assert_allclose(a, b, **TWIN_TOL)


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gated_kernels_match_numpy_twins(name):
    g, u = _rand((5000,), seed=1), _rand((5000,), seed=2)
    a, b = np.empty_like(g), np.empty_like(g)
    getattr(act, f"_{name}_kernel")(g, u, a)
    getattr(act, f"{name}_numpy")(g, u, b)
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-5)


def test_softcap_kernel_matches_numpy_twin():
    x = _rand((5000,), scale=50.0)
    a, b = np.empty_like(x), np.empty_like(x)
    inv, cap = np.float32(1.0) / np.float32(30.0), np.float32(30.0)
    act._softcap_kernel(x, inv, cap, a)
    act.softcap_numpy(x, inv, cap, b)
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("n_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("offset", [0, 2, 31])
def test_batch_invariance(n_tokens, offset):
    fused = _rand((100, 2 * 96), seed=3)  # a gate|up matmul output; halves are strided views
    gate, up = fused[:, :96], fused[:, 96:]
    rows = slice(offset, offset + n_tokens)
    for fn in (silu, gelu, lambda a: softcap(a, 5.0)):
        assert np.array_equal(fn(gate[rows]), fn(gate)[rows])
    for fn in (swiglu, geglu):
        assert np.array_equal(fn(gate[rows], up[rows]), fn(gate, up)[rows])
        assert np.array_equal(
            fn(gate[offset : offset + 1], up[offset : offset + 1])[0], fn(gate, up)[offset]
        )


def test_out_and_in_place():
    x = _rand((3, 5))
    expected = silu(x)
    y = x.copy()
    assert silu(y, out=y) is y
    assert np.array_equal(y, expected)
    g, u = _rand((3, 5), seed=1), _rand((3, 5), seed=2)
    out = np.empty((3, 5), dtype=np.float32)
    assert swiglu(g, u, out=out) is out


def test_errors():
    with pytest.raises(DimensionError, match=r"\(3, 4\).*\(3, 5\)"):
        swiglu(_rand((3, 4)), _rand((3, 5)))
    with pytest.raises(DimensionError, match="float32"):
        silu(np.zeros(3))
    with pytest.raises(DimensionError, match="shape"):
        gelu(_rand((3,)), out=np.empty(4, dtype=np.float32))
    with pytest.raises(ConfigError, match="cap"):
        softcap(_rand((3,)), 0.0)
