"""RoPE: float64 loop reference, convention relations, inverse, invariance, errors."""

import numba
import numpy as np
import pytest

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.ops import apply_rope, rope_cos_sin, rope_freqs, rotate


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def reference(x, positions, theta, n_rot, mode, freq_factors=None, freq_scale=1.0):
    """Plain loops in float64; pairs (2i, 2i+1) for normal, (i, i + n_rot/2) for neox."""
    y = x.astype(np.float64)
    half = n_rot // 2
    for t, pos in enumerate(positions):
        for i in range(half):
            freq = freq_scale * theta ** (-2.0 * i / n_rot)
            if freq_factors is not None:
                freq /= float(freq_factors[i])
            c, s = np.cos(pos * freq), np.sin(pos * freq)
            j, k = (2 * i, 2 * i + 1) if mode == "normal" else (i, i + half)
            a, b = y[t, :, j].copy(), y[t, :, k].copy()
            y[t, :, j], y[t, :, k] = a * c - b * s, a * s + b * c
    return y


# cos/sin rounded to float32 (2^-24 relative) plus two float32 products and a sum, on |x| < 5:
# the absolute error stays below 4 * 5 * 2^-24 ~ 1.2e-6.
ATOL = 2e-6


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize(("head_dim", "n_rot"), [(64, 64), (64, 32), (8, 6)])
def test_matches_float64_reference(mode, head_dim, n_rot):
    x = _rand((9, 3, head_dim))
    positions = np.array([0, 1, 2, 7, 100, 1000, 4095, 8191, 123456])
    got = apply_rope(x, positions, theta=100000.0, n_rot=n_rot, mode=mode)
    expected = reference(x, positions, 100000.0, n_rot, mode)
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])  # partial rotary: tail untouched


def test_freq_factors_and_scale_match_reference():
    x = _rand((5, 2, 16))
    ff = np.array([1.0, 1.0, 2.0, 4.0, 8.0, 8.0, 32.0, 40.0], dtype=np.float32)
    positions = np.array([0, 3, 50, 700, 9000])
    got = apply_rope(x, positions, freq_factors=ff, freq_scale=0.25)
    expected = reference(x, positions, 10000.0, 16, "normal", ff, 0.25)
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


def test_scaling_identities_are_exact():
    x = _rand((4, 2, 16))
    even = np.array([0, 2, 64, 5000])
    base = apply_rope(x, even // 2)
    assert np.array_equal(apply_rope(x, even, freq_scale=0.5), base)
    twos = np.full(8, 2.0, dtype=np.float32)
    assert np.array_equal(apply_rope(x, even, freq_factors=twos), base)
    ones = np.ones(8, dtype=np.float32)
    assert np.array_equal(apply_rope(x, even, freq_factors=ones), apply_rope(x, even))


def test_neox_is_normal_on_permuted_dims():
    x = _rand((6, 4, 32))
    positions = np.arange(10, 16)
    half = 16
    perm = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)  # 0,16,1,17..
    normal = apply_rope(np.ascontiguousarray(x[..., perm]), positions, mode="normal")
    unperm = np.empty_like(normal)
    unperm[..., perm] = normal
    assert np.array_equal(apply_rope(x, positions, mode="neox"), unperm)


def test_position_zero_is_identity_and_known_angle():
    x = _rand((1, 2, 8))
    assert np.array_equal(apply_rope(x, np.array([0])), x)
    unit = np.zeros((1, 1, 2), dtype=np.float32)
    unit[..., 0] = 1.0
    y = apply_rope(unit, np.array([1]))  # pair 0 has frequency 1 rad/position
    assert np.array_equal(y[0, 0], np.float32([np.cos(1.0), np.sin(1.0)]))


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_inverse_undoes_rotation(mode):
    x = _rand((7, 3, 64))
    positions = np.array([0, 1, 5, 99, 1000, 4000, 8000])
    y = apply_rope(x, positions, mode=mode, n_rot=48)
    back = apply_rope(y, positions, mode=mode, n_rot=48, inverse=True)
    np.testing.assert_allclose(back, x, rtol=0, atol=2e-6)  # two rotations' float32 rounding


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("offset", [0, 1, 30])
def test_batch_invariance(mode, n_tokens, offset):
    x = _rand((100, 3, 64))
    positions = np.arange(100) + 4093  # one sequence continuing a long context
    full = apply_rope(x, positions, theta=100000.0, mode=mode)
    rows = slice(offset, offset + n_tokens)
    part = apply_rope(x[rows], positions[rows], theta=100000.0, mode=mode)
    assert np.array_equal(part, full[rows])
    shuffled = np.random.default_rng(n_tokens).permutation(100)[:n_tokens]
    part = apply_rope(x[shuffled], positions[shuffled], theta=100000.0, mode=mode)
    assert np.array_equal(part, full[shuffled])


def test_cos_sin_table_is_per_position():
    freqs = rope_freqs(64, theta=100000.0)
    cos, sin = rope_cos_sin(np.arange(4096), freqs)
    cos1, sin1 = rope_cos_sin(np.array([4000]), freqs)
    assert cos.dtype == np.float32 and cos.shape == (4096, 32)
    assert np.array_equal(cos1[0], cos[4000]) and np.array_equal(sin1[0], sin[4000])


def test_rotate_in_place():
    x = _rand((3, 2, 16))
    cos, sin = rope_cos_sin(np.array([1, 2, 3]), rope_freqs(16))
    expected = rotate(x, cos, sin)
    y = x.copy()
    assert rotate(y, cos, sin, out=y) is y
    assert np.array_equal(y, expected)


def test_errors():
    x = _rand((2, 1, 8))
    with pytest.raises(ConfigError, match="n_rot"):
        apply_rope(x, np.array([0, 1]), n_rot=5)
    with pytest.raises(DimensionError, match="n_rot 10 exceeds head_dim 8"):
        apply_rope(x, np.array([0, 1]), n_rot=10)
    with pytest.raises(DimensionError, match="3 positions for 2 tokens"):
        apply_rope(x, np.array([0, 1, 2]))
    with pytest.raises(DimensionError, match="integer"):
        apply_rope(x, np.array([0.0, 1.0]))
    with pytest.raises(ConfigError, match="mode"):
        apply_rope(x, np.array([0, 1]), mode="glm")
    with pytest.raises(DimensionError, match="freq_factors has 3 entries, n_rot / 2 is 4"):
        apply_rope(x, np.array([0, 1]), freq_factors=np.ones(3, dtype=np.float32))
    with pytest.raises(ConfigError, match="theta"):
        apply_rope(x, np.array([0, 1]), theta=-1.0)
    cos, sin = rope_cos_sin(np.array([0, 1, 2]), rope_freqs(8))
    with pytest.raises(DimensionError, match="do not fit"):
        rotate(x, cos, sin)


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(("n_tokens", "n_heads", "head_dim", "n_rot"),
                         [(1, 9, 64, 64), (5, 3, 64, 32), (7, 2, 8, 6), (3, 14, 256, 256)])
def test_kernel_is_its_numpy_twin(mode, inverse, n_tokens, n_heads, head_dim, n_rot):
    """The compiled rotation gives NumPy's float32 bits (each product and sum rounded on its
    own), in place or not."""
    from cfr_atlas.ops.rope import rotate_numpy

    x = _rand((n_tokens, n_heads, head_dim), seed=n_tokens) * np.float32(3)
    cos, sin = rope_cos_sin(np.arange(40, 40 + n_tokens), rope_freqs(n_rot, theta=1e4))
    want = rotate_numpy(x, cos, sin, mode=mode, inverse=inverse)
    assert np.array_equal(rotate(x, cos, sin, mode=mode, inverse=inverse), want)
    y = x.copy()
    assert rotate(y, cos, sin, mode=mode, inverse=inverse, out=y) is y
    assert np.array_equal(y, want)


def test_kernel_has_no_fused_multiply_add():
    """Exactness: a*c - b*s is two rounded products and a rounded difference, as NumPy's; an FMA
    would round once and change bits."""
    from cfr_atlas.ops.rope import _rotate_kernel

    x = _rand((2, 3, 8))
    cos, sin = rope_cos_sin(np.arange(2), rope_freqs(8, theta=1e4))
    rotate(x, cos, sin, mode="neox")
    # numba cannot inspect code loaded from its cache: compile the same function afresh
    fresh = numba.njit(_rotate_kernel.py_func)
    sig = _rotate_kernel.signatures[0]
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    assert "vcvt" in asm or "mulss" in asm or "vmulps" in asm  # the kernel's own code
    assert not any(op in asm for op in ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub"))
