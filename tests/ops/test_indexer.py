"""The lightning indexer's top-k: kernel vs NumPy twin vs a float64 brute force, ties, causality,
row independence."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.errors import DimensionError
from cfr_atlas.ops import lightning_indexer_topk
from cfr_atlas.ops.indexer import lightning_indexer_topk_numpy


def _brute(q, w, k, top_k):
    T = q.shape[0]
    out = np.full((T, top_k), -1, dtype=np.int64)
    for t in range(T):
        n = k.shape[0] - T + t + 1
        s = sum(w[t, h] * np.maximum(k[:n].astype(np.float64) @ q[t, h].astype(np.float64), 0)
                for h in range(q.shape[1]))
        top = sorted(range(n), key=lambda j: (-s[j], j))[:top_k]
        out[t, :len(top)] = sorted(top)
    return out


@pytest.mark.parametrize("top_k", [1, 7, 64, 200])
def test_kernel_twin_and_float64_agree(top_k):
    rng = np.random.default_rng(top_k)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    w = rng.random((5, 4)).astype(np.float32)
    k = rng.standard_normal((120, 16)).astype(np.float32)
    got = lightning_indexer_topk(q, w, k, top_k)
    assert np.array_equal(got, lightning_indexer_topk_numpy(q, w, k, top_k))
    assert np.array_equal(got, _brute(q, w, k, top_k))
    assert got.shape == (5, top_k)


def test_causal_and_padded():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    k = rng.standard_normal((10, 8)).astype(np.float32)
    got = lightning_indexer_topk(q, np.ones(2, np.float32), k, 9)
    for t in range(3):
        live = got[t][got[t] >= 0]
        assert live.max() <= 7 + t and len(live) == min(9, 8 + t)
    assert got[0, -1] == -1  # 8 causal tokens for 9 places


def test_ties_go_to_the_lower_index():
    k = np.zeros((6, 4), np.float32)  # every score 0: the lowest indices win
    q = np.ones((1, 1, 4), np.float32)
    assert lightning_indexer_topk(q, np.ones(1, np.float32), k, 3).tolist() == [[0, 1, 2]]
    k[4] = 1.0
    k[2] = 1.0  # two equal winners, then ties among zeros
    assert lightning_indexer_topk(q, np.ones(1, np.float32), k, 3).tolist() == [[0, 2, 4]]


def test_a_row_never_depends_on_its_chunk():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((6, 3, 8)).astype(np.float32)
    w = rng.random((6, 3)).astype(np.float32)
    k = rng.standard_normal((40, 8)).astype(np.float32)
    whole = lightning_indexer_topk(q, w, k, 10)
    for t in range(6):
        alone = lightning_indexer_topk(q[t:t + 1], w[t:t + 1], k[:40 - 6 + t + 1], 10)
        assert np.array_equal(alone[0], whole[t])


def test_bad_shapes_are_typed_errors():
    with pytest.raises(DimensionError):
        lightning_indexer_topk(np.zeros((2, 2, 4)), np.ones(3), np.zeros((5, 4)), 2)
    with pytest.raises(DimensionError):
        lightning_indexer_topk(np.zeros((2, 2, 4)), np.ones(2), np.zeros((5, 4)), 0)
