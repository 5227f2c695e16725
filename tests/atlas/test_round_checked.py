"""`storage.round_checked` (the decode step's rounding in a kernel) gives `round_rows`'s bits and
`storable`'s verdict for every storage dtype: random bit patterns, every exponent with the
mantissas that sit on and around a rounding boundary, float16's overflow and subnormal edges."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfr_atlas.atlas.storage import StorageDtype, format_of, round_checked, round_rows, storable

DTYPES = list(StorageDtype)


def _bits() -> np.ndarray:
    rng = np.random.default_rng(7)
    exponents = np.arange(256, dtype=np.uint32) << np.uint32(23)
    mantissas = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x5000,
                          0x400000, 0x7FF000, 0x7FFFFF, 0xFFFF, 0x8000, 0x18000], np.uint32)
    grid = (exponents[:, None] | mantissas[None, :]).ravel()
    edges = np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x477FE000, 0x38800000, 0x387FFFFF,
                      0x387FF000, 0x33000000, 0x33000001, 0x32FFFFFF, 0x337FFFFF, 0x7F7FFFFF],
                     np.uint32)
    rand = rng.integers(0, 1 << 32, 400_000, dtype=np.uint64).astype(np.uint32)
    both = np.concatenate([grid, edges, rand])
    return np.concatenate([both, both | np.uint32(0x80000000)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_values_round_as_round_rows(dtype):
    x = _bits().view(np.float32)
    x = x[np.isfinite(x)]
    x = np.ascontiguousarray(x[: x.size // 8 * 8]).reshape(-1, 8)
    with np.errstate(over="ignore"):
        want = round_rows(x, dtype)
    got = np.empty_like(want)
    ok = round_checked(x, format_of(dtype), got)
    assert np.array_equal(got, want)
    assert ok == storable(x, want, format_of(dtype))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1,
                max_size=12), st.sampled_from(DTYPES))
def test_the_verdict_is_storables(values, dtype):
    x = np.asarray(values, dtype=np.float32).reshape(1, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = round_rows(x, dtype)
    got = np.empty_like(want)
    ok = round_checked(x, format_of(dtype), got)
    assert ok == storable(x, want, format_of(dtype))
    if ok:
        assert np.array_equal(got, want)
