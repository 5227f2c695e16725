"""Smoke test of the Atlas contract: budgeted == unbounded, bitwise; close to float64."""

import numpy as np

from cfr_atlas import Atlas, AtlasConfig, AttentionRequest, KeepRecent, NeverAdmit, SyntheticKv


def _ref(q, K, V, scale):
    s = (K.astype(np.float64) @ q.astype(np.float64).T).T * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p @ V.astype(np.float64)) / p.sum(axis=-1, keepdims=True)


def test_budget_zero_equals_unbounded_and_reference():
    D, P, n = 16, 8, 100
    syn = SyntheticKv(3, 2, 2, D)
    q = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
    full = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=1 << 30,
                             admit_regenerated_pages=True))
    small = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=3 * P * 2 * D * 4,
                              admit_regenerated_pages=True))
    zero = Atlas(AtlasConfig(page_tokens=P, head_dim=D))
    req = AttentionRequest(layer=1, kv_head=1, query=q, context_tokens=n)
    a = full.attend(syn, req)
    b = small.attend(syn, req, policy=KeepRecent(recent_tokens=20))
    c = zero.attend(syn, req, policy=NeverAdmit())
    assert np.array_equal(a, b) and np.array_equal(a, c)
    K, V = syn.full(1, 1, n)
    ref = _ref(q, K, V, 1 / np.sqrt(D))
    assert np.abs(a - ref).max() <= 1e-6 * np.abs(ref).max()
