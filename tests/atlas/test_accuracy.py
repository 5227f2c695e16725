"""Accuracy of the fold against a float64 softmax written plainly (atlas_reference.py).

Tolerance (derived in `error_bound` and docs/MATH.md): each float32 score is off by at most
delta = gamma(D/8 + 10) * scale * sum_e |q_e K_je| (plus softcap / ALiBi terms); perturbing every
softmax logit by <= delta moves the weighted average by <= 2 (e^delta - 1) e^delta max|V|; the
float64 accumulation adds ~(n + 16) * 2**-53 * max|V| and the final cast 2**-24 * |out|.
That bound is worst case (all rounding errors aligned); measured errors are ~100x smaller, so
the 65,536-token test also holds the project's regression target: max |out - ref| / max |ref|
<= 1e-5 (measured ~4e-8: the final float32 rounding, since score errors average out).
"""

from __future__ import annotations

import numpy as np
import pytest
from atlas_reference import error_bound, reference_attention, stored_rows, synthetic

from cfr_atlas import Atlas, AtlasConfig, AttentionRequest, KeepRecent, SyntheticKv


@pytest.mark.parametrize("D,P,context", [(8, 4, 1), (12, 4, 30), (32, 16, 500), (24, 8, 257)])
@pytest.mark.parametrize("q_std", [0.5, 4.0])
def test_close_to_float64_reference(D, P, context, q_std):
    """D = 12 and 24 exercise the dot product's tail (D not a multiple of 8)."""
    syn = synthetic(D)
    rng = np.random.default_rng(D)
    q = (rng.standard_normal((3, D)) * q_std).astype(np.float32)
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=4 * P * 4 * D,
                              admit_regenerated_pages=True, split_pages=3))
    got = atlas.attend(syn, AttentionRequest(1, 2, q, context), KeepRecent(2 * P))
    K, V = syn.full(1, 2, context)
    ref = reference_attention(q, K, V, context - 1, 1 / np.sqrt(D))
    bound = error_bound(q, K, V, context - 1, 1 / np.sqrt(D))
    err = np.abs(got - ref).max()
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("storage_dtype", ["float16", "bfloat16"])
def test_16bit_storage_close_to_float64_of_rounded_rows(storage_dtype):
    D, P, context = 16, 8, 300
    syn = synthetic(D)
    q = np.random.default_rng(3).standard_normal((2, D)).astype(np.float32)
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, storage_dtype=storage_dtype))
    got = atlas.attend(syn, AttentionRequest(0, 0, q, context))
    K, V = (stored_rows(r, storage_dtype) for r in syn.full(0, 0, context))
    ref = reference_attention(q, K, V, context - 1, 1 / np.sqrt(D))
    assert np.abs(got - ref).max() <= error_bound(q, K, V, context - 1, 1 / np.sqrt(D))


def test_65536_tokens(all_threads):
    """head_dim 64, pages of 512, 10% of pages hot: max relative error <= 1e-5."""
    D, P, n = 64, 512, 65_536
    syn = SyntheticKv(7, 1, 1, D)
    q = np.random.default_rng(0).standard_normal((1, D)).astype(np.float32)
    budget = (n // P // 10) * P * 2 * D * 4
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget,
                              admit_regenerated_pages=True))
    got = atlas.attend(syn, AttentionRequest(0, 0, q, n), KeepRecent(budget // (2 * D * 4)))
    K, V = syn.full(0, 0, n)
    ref = reference_attention(q, K, V, n - 1, 1 / np.sqrt(D))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= 1e-5, rel
    assert np.abs(got - ref).max() <= error_bound(q, K, V, n - 1, 1 / np.sqrt(D))
