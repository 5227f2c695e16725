"""Activations: float64 references, NumPy twins, batch invariance, errors."""

import numba
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


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


SPECIAL = np.float32([0.0, -0.0, 1e-30, -1e-30, 0.625, -0.625, 0.62499994, 44.0, -44.0, 87.9,
                      88.0, 88.1, -86.9, -87.0, -87.1, 1e4, -1e4, np.inf, -np.inf, np.nan])


@pytest.mark.parametrize("name", ["silu", "gelu"])
def test_unary_kernels_match_numpy_twins(name):
    """The kernels and their twins run the same float32 operations: the same bits, also at
    the polynomials' seams, the clamps, infinities and NaN."""
    x = np.concatenate([_rand((5000,)), SPECIAL])
    a, b = np.empty_like(x), np.empty_like(x)
    getattr(act, f"_{name}_kernel")(x, a)
    with np.errstate(all="ignore"):
        getattr(act, f"{name}_numpy")(x, b)
    assert np.array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gated_kernels_match_numpy_twins(name):
    g, u = _rand((5000,), seed=1), _rand((5000,), seed=2)
    a, b = np.empty_like(g), np.empty_like(g)
    getattr(act, f"_{name}_kernel")(g, u, a)
    getattr(act, f"{name}_numpy")(g, u, b)
    assert np.array_equal(_bits(a), _bits(b))


def test_exp32_and_tanh32_against_float64():
    """Cephes' polynomials: exp within 2 ulp (relative 2.4e-7) on [-87, 88], tanh within 3 ulp
    of its value; the documented clamps (inf above 88, 0 below -87), +-1 at +-inf, NaN kept;
    the compiled scalars equal the twins."""
    x = np.linspace(-87.0, 88.0, 400_001, dtype=np.float32)
    e = act.exp32_numpy(x)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(e - ref) / ref) < 2.4e-7
    t = np.linspace(-12.0, 12.0, 400_001, dtype=np.float32)
    th, ref = act.tanh32_numpy(t), np.tanh(t.astype(np.float64))
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(th - ref) / ulp) <= 3.0
    with np.errstate(all="ignore"):
        edge = act.exp32_numpy(np.float32([88.5, -87.5, np.inf, -np.inf, np.nan]))
        assert edge[0] == np.inf and edge[1] == 0 and edge[2] == np.inf and edge[3] == 0
        assert np.isnan(edge[4])
        np.testing.assert_array_equal(act.tanh32_numpy(np.float32([np.inf, -np.inf])), [1, -1])
        assert np.isnan(act.tanh32_numpy(np.float32([np.nan]))[0])
        twin_e, twin_t = act.exp32_numpy(SPECIAL), act.tanh32_numpy(SPECIAL)
    scalar = numba.njit(lambda v: (act.exp32(v), act.tanh32(v)))
    for i, v in enumerate(SPECIAL):
        ev, tv = scalar(v)
        assert _bits(ev) == _bits(twin_e[i]) and _bits(tv) == _bits(twin_t[i]), v


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


@pytest.mark.parametrize("gelu_act", [False, True])
def test_gated_halves_equals_the_gated_op_on_the_halves(gelu_act):
    """gated_halves reads [gate | up] in place; every bit is swiglu's / geglu's of the two
    halves (edge values included), and a strided input is copied, not misread."""
    rng = np.random.default_rng(5)
    gu = (rng.standard_normal((7, 2 * 96)) * 6).astype(np.float32)
    gu[0, :4] = [np.inf, -np.inf, np.nan, 0.0]
    gu[1, :3] = [88.8, -104.0, -0.0]
    gu[2, 96:99] = [np.inf, np.nan, -0.0]
    want = (geglu if gelu_act else swiglu)(gu[:, :96].copy(), gu[:, 96:].copy())
    got = act.gated_halves(gu, gelu=gelu_act)
    assert np.array_equal(got, want, equal_nan=True)
    wide = np.zeros((7, 2 * 2 * 96), dtype=np.float32)
    wide[:, ::2] = gu  # every other column: a strided view of the same values
    assert np.array_equal(act.gated_halves(wide[:, ::2], gelu=gelu_act), want, equal_nan=True)
    out = np.empty((7, 96), dtype=np.float32)
    assert act.gated_halves(gu, gelu=gelu_act, out=out) is out


@pytest.mark.parametrize("gelu_act", [False, True])
def test_gated_halves_on_the_threads_is_the_same_bits(gelu_act):
    """From PARALLEL_ELEMENTS outputs the rows are split between threads: the same bits as the
    serial kernel and as the gated op on the halves."""
    rng = np.random.default_rng(6)
    gu = (rng.standard_normal((80, 2 * 1024)) * 6).astype(np.float32)
    gu[3, :3] = [np.inf, np.nan, -0.0]
    assert gu.shape[0] * 1024 >= act.PARALLEL_ELEMENTS
    want = (geglu if gelu_act else swiglu)(gu[:, :1024].copy(), gu[:, 1024:].copy())
    serial = np.empty((80, 1024), dtype=np.float32)
    act._gated_halves_kernel(gu, gelu_act, serial)
    got = act.gated_halves(gu, gelu=gelu_act)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(got.view(np.uint32), serial.view(np.uint32))


def test_gated_halves_errors():
    with pytest.raises(DimensionError, match="even"):
        act.gated_halves(np.zeros((2, 5), dtype=np.float32))
    with pytest.raises(DimensionError):
        act.gated_halves(np.zeros(6, dtype=np.float32))
    with pytest.raises(DimensionError):
        act.gated_halves(np.zeros((2, 6)))
