"""The numba fold kernels against their NumPy twins (`fold_pages_numpy`, `merge_partitions_numpy`).

Tolerances: the twin computes scores with a BLAS matmul (a different summation order from the
kernel's eight partial sums), so the two score sets differ by up to 2 * gamma(D + 10) * (scale *
sum_e |q_e K_je| + softcap + |slope| * n), gamma(k) = k * 2**-24 / (1 - k * 2**-24); the outputs
then differ by at most twice the softmax perturbation bound of atlas_reference.error_bound.
The merges see identical float64 states and differ only in combination order (the twin uses
one global max, the kernel a running one): a few float64 ulps, so at most one float32 ulp of
the output after the final cast (asserted as 2**-23 relative, plus 2**-126 absolute).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cfr_atlas.atlas import fold
from cfr_atlas.atlas.page_sum import page_checksum_numpy
from cfr_atlas.atlas.storage import StorageDtype, format_of, round_rows, widen

U32 = 2.0**-24


def _problem(rng, dtype: StorageDtype, *, T=3, H=2, G=2, D=12, P=5, context=33, split=2,
             window=0, softcap=0.0, alibi=False, sinks=False):
    S, C = 9, 4
    q = rng.standard_normal((T, H, G, D)).astype(np.float32)
    k_hot, v_hot = (round_rows(rng.uniform(-2, 2, (S, P, D)).astype(np.float32), dtype)
                    for _ in range(2))
    k_scr, v_scr, k_map, v_map = (round_rows(rng.uniform(-2, 2, (C, P, D)).astype(np.float32),
                                             dtype) for _ in range(4))
    # K pages are stored transposed, (slots, D, P)
    k_hot, k_scr, k_map = (np.ascontiguousarray(a.transpose(0, 2, 1))
                           for a in (k_hot, k_scr, k_map))
    n_pages = -(-context // P)
    lo = max(0, (context - T - window + 1) // P) if window else 0
    n_pg = n_pages - lo
    src = rng.integers(0, 3, (H, n_pg)).astype(np.int64)  # hot, scratch or mapped pages
    slot = np.where(src == fold.SRC_HOT, rng.integers(0, S, (H, n_pg)),
                    rng.integers(0, C, (H, n_pg))).astype(np.int64)
    expect = np.array([[page_checksum_numpy(k_map[s], v_map[s]) if c == fold.SRC_MAP else 0
                        for s, c in zip(row, kinds, strict=True)]
                       for row, kinds in zip(slot, src, strict=True)],
                      dtype=np.uint32).reshape(H, n_pg)
    slopes = rng.uniform(0, 0.5, (H, G)) if alibi else np.zeros((H, G))
    sink = rng.uniform(-2, 2, (H, G)) if sinks else np.full((H, G), np.nan)
    if sinks:
        sink[0, 0] = np.nan  # a head without a sink beside heads with one
    args = (q, np.arange(context - T, context, dtype=np.int64),
            (k_hot, v_hot, k_scr, v_scr, k_map, v_map),
            (src, slot, expect, np.zeros((H, n_pg), dtype=np.uint8)),
            (lo, context, split, 0, H * n_pg),
            (np.float32(1 / math.sqrt(D)), np.float32(softcap), slopes.astype(np.float32),
             window, format_of(dtype)))
    n_part = -(-n_pages // split)
    widest = max(np.abs(widen(a, dtype)).max() for a in (k_hot, k_scr, k_map))
    vmax = max(np.abs(widen(a, dtype)).max() for a in (v_hot, v_scr, v_map))
    magnitude = (np.abs(q).sum(axis=-1).max() * widest / math.sqrt(D) + softcap
                 + slopes.max() * context)
    gamma = (D + 10) * U32 / (1 - (D + 10) * U32)
    # + the page's float32 sum of at most P weighted V rows (weights <= 1, rounded once)
    tol = 2 * (2 * math.expm1(gamma * magnitude) * math.exp(gamma * magnitude)
               + (P + 2) * U32) * vmax
    return args, (T, H, n_part, G, D), sink.astype(np.float32), tol


def _state(T, H, n_part, G, D):
    return (np.full((T, H, n_part, G), -np.inf), np.zeros((T, H, n_part, G)),
            np.zeros((T, H, n_part, G, D)))


CASES = {
    "plain": {}, "window": dict(window=7), "softcap": dict(softcap=3.0),
    "alibi+sinks": dict(alibi=True, sinks=True), "one page": dict(context=4, T=2),
    "D=8": dict(D=8, P=3), "D=3": dict(D=3, G=1), "all": dict(window=12, softcap=2.0, alibi=True,
                                                              sinks=True, split=3),
    # the register-blocked sums (fold_blocks.py): whole blocks of keys and dims, then tails
    "blocked": dict(D=64, P=40, G=3, context=100, T=2),
    "blocked tails": dict(D=80, P=37, G=7, context=90, window=50, softcap=2.0, T=2),
}


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("case", CASES)
def test_fold_and_merge_match_numpy_twins(dtype, case):
    rng = np.random.default_rng(len(case))
    args, shape, sinks, tol = _problem(rng, dtype, **CASES[case])
    m1, l1, acc1 = _state(*shape)
    m2, l2, acc2 = _state(*shape)
    fold.fold_pages(*args, (m1, l1, acc1))
    fold.fold_pages_numpy(*args, (m2, l2, acc2))
    assert not args[3][3].any()  # every mapped page passed its checksum
    assert np.array_equal(np.isinf(m1), np.isinf(m2))  # the same partitions saw tokens
    assert np.array_equal(l1 == 0, l2 == 0)

    out_kernel, out_twin = (np.empty(shape[:2] + shape[3:], dtype=np.float32) for _ in range(2))
    fold.merge_partitions(m1, l1, acc1, sinks, out_kernel)
    fold.merge_partitions_numpy(m2, l2, acc2, sinks, out_twin)
    assert np.abs(out_kernel - out_twin).max() <= tol

    # merges on identical states: at most one float32 ulp apart
    fold.merge_partitions_numpy(m1, l1, acc1, sinks, out_twin)
    assert np.all(np.abs(out_kernel - out_twin) <= 2.0**-23 * np.abs(out_twin) + 2.0**-126)


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("case", ["plain", "window", "one page", "blocked"])
@pytest.mark.parametrize("half", [4, 5], ids=["K^T byte", "V byte"])
def test_a_damaged_mapped_page_is_flagged_by_kernel_and_twin(dtype, case, half):
    rng = np.random.default_rng(11)
    args, shape, _, _ = _problem(rng, dtype, **CASES[case])
    src, slot, expect, bad = args[3]
    mapped = np.argwhere(src == fold.SRC_MAP)
    assert len(mapped), "the problem has no mapped page"
    h, i = mapped[-1]
    block = args[2][half][slot[h, i]]  # k_map or v_map's page
    block.reshape(-1).view(np.uint8)[block.nbytes // 2 + 1] ^= 0x10  # one byte of it
    damaged = (slot == slot[h, i]) & (src == fold.SRC_MAP)  # every walk page on that slot
    fold.fold_pages(*args, _state(*shape))
    assert np.array_equal(bad.astype(bool), damaged)
    twin_bad = np.zeros_like(bad)
    fold.fold_pages_numpy(*args[:3], (src, slot, expect, twin_bad), *args[4:], _state(*shape))
    assert np.array_equal(twin_bad, bad)
