"""V as a view of K (AtlasConfig.value_dim, MLA's latent): the fold reads V from K's bytes.

Against a float64 reference (softmax(s q.K) K[:, :dv], no engine code), bitwise budgeted ==
unbounded with a regenerator, and nothing stored for V.
"""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.atlas import Atlas, AtlasConfig, PageKey
from cfr_atlas.errors import ConfigError, DimensionError

D, DV, P, N, G = 24, 16, 8, 50, 3


class _LatentKv:
    """K rows from a fixed array; V rows are (n, 0): V views K."""

    def __init__(self, k):
        self.k, self.calls = k, 0

    def regenerate_page(self, key: PageKey, tokens, k_out, v_out):
        self.calls += 1
        k_out[...] = self.k[tokens.start:tokens.stop]


def _run(k, q, budget, dtype="float32"):
    cfg = AtlasConfig(page_tokens=P, head_dim=D, value_dim=DV, hot_cache_bytes=budget,
                      storage_dtype=dtype, admit_regenerated_pages=True)
    atlas, kv = Atlas(cfg), _LatentKv(k)
    atlas.write_rows(0, 0, k[:, None], np.empty((N, 1, 0), np.float32))
    out = atlas.attend_heads(kv, 0, [0], q, N)
    return out, atlas, kv


def test_fold_reads_v_from_k_and_matches_float64():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((N, D)).astype(np.float32)
    q = rng.standard_normal((4, 1, G, D)).astype(np.float32)
    out, atlas, _ = _run(k, q, 1 << 20)
    assert out.shape == (4, 1, G, DV)
    assert atlas.cache.v.shape[2] == 0 and atlas.config.row_bytes == D * 4
    for t in range(4):
        n = N - 4 + t + 1
        s = (q[t, 0].astype(np.float64) @ k[:n].T.astype(np.float64)) / np.sqrt(D)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        ref = (w / w.sum(axis=1, keepdims=True)) @ k[:n, :DV].astype(np.float64)
        assert np.abs(out[t, 0] - ref).max() < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("budget", [0, P * D * 4, 3 * P * D * 4])
def test_any_budget_equals_unbounded_bitwise(dtype, budget):
    rng = np.random.default_rng(1)
    k = rng.standard_normal((N, D)).astype(np.float32)
    q = rng.standard_normal((2, 1, G, D)).astype(np.float32)
    full, _, _ = _run(k, q, 1 << 20, dtype)
    got, _, kv = _run(k, q, budget, dtype)
    assert kv.calls > 0
    assert np.array_equal(got, full)


def test_value_dim_is_checked():
    with pytest.raises(ConfigError, match="value_dim"):
        AtlasConfig(page_tokens=P, head_dim=D, value_dim=D + 1)
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, value_dim=DV))
    with pytest.raises(DimensionError, match="v_rows"):
        atlas.write_rows(0, 0, np.zeros((2, 1, D), np.float32), np.zeros((2, 1, DV), np.float32))
