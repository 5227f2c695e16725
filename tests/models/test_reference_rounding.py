"""The float64 reference's own K/V rounding (`reference.round_kv`) on hand-picked values, and
against the engine's `round_rows`: two implementations written apart must agree bit for bit."""

import numpy as np
import pytest
from reference import ReferenceError, round_bfloat16, round_kv

from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen


@pytest.mark.parametrize("x, want", [
    (1 + 2**-8, 1.0),                   # a tie between 1 and 1 + 2^-7: to even (1)
    (1 + 3 * 2**-8, 1 + 2**-6),         # a tie between 1 + 2^-7 and 1 + 2^-6: to even
    (-(1 + 2**-8), -1.0),               # symmetric
    (1 + 2**-8 + 2**-30, 1 + 2**-7),    # just past the tie: up
    (3.0, 3.0), (0.0, 0.0),
    (1.5 * 2**-133, 2**-132),           # subnormal tie: to even
    (2**-134, 0.0),                     # half the smallest subnormal: to even (0)
])  # fmt: skip
def test_round_bfloat16_hand_values(x, want):
    assert round_bfloat16(np.array([x]))[0] == want


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_kv_equals_the_engine_storage_on_float32_values(dtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-16, 8, 200_000))).astype(np.float32)
    stored = widen(round_rows(x, StorageDtype(dtype)), StorageDtype(dtype))
    assert np.array_equal(round_kv(x.astype(np.float64), dtype), stored.astype(np.float64))


def test_round_kv_refuses_overflow_and_unknown_formats():
    assert np.array_equal(round_kv(np.array([7e4]), None), [7e4])
    with pytest.raises(ReferenceError, match="overflow float16"):
        round_kv(np.array([7e4]), "float16")
    with pytest.raises(ReferenceError, match="kv_round 'fp8'"):
        round_kv(np.zeros(2), "fp8")
