"""The lightning indexer (DeepSeek V3.2's DSA): which tokens each query attends to.

For query row t (position context - T + t) and every causal token j <= that position:

    I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])          float32, h and dims in order

and the selection is the top_k tokens by I, ties to the lower token index (a stable sort of -I),
returned ascending (page order) and padded with -1 when fewer than top_k tokens are causal.
Each row is computed on its own in a fixed order, so a query's selection never depends on the
other rows of its chunk. `lightning_indexer_topk` is the numba kernel's checked wrapper;
`lightning_indexer_topk_numpy` its twin (same float32 order, NumPy dot products).
This module holds no attention and no K/V storage (atlas/sparse.py folds the selection).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cfr_atlas.errors import DimensionError, NumericError


@njit(cache=True, inline="always")
def _row_scores(q, w, kt, n, out):
    """out[j] = sum_h w[h] relu(q[h] . k[j]) for j < n, kt = k transposed (D, S): each dot
    summed over dims in order (lanes across keys), heads added in order (float32)."""
    n_head, d = q.shape
    dot = np.empty(n, dtype=np.float32)
    for j in range(n):
        out[j] = 0.0
    for h in range(n_head):
        for j in range(n):
            dot[j] = 0.0
        for e in range(d):
            qe = q[h, e]
            ke = kt[e]
            for j in range(n):
                dot[j] += qe * ke[j]
        for j in range(n):
            if dot[j] > 0:
                out[j] += w[h] * dot[j]


@njit(cache=True, inline="always")
def _topk_row(t, q, w, kt, top_k, out):
    n_tok, context = q.shape[0], kt.shape[1]
    n = context - n_tok + t + 1  # causal: tokens 0..position
    scores = np.empty(n, dtype=np.float32)
    _row_scores(q[t], w[t], kt, n, scores)
    order = np.argsort(-scores, kind="mergesort")  # stable: ties to the lower index
    m = min(top_k, n)
    chosen = np.sort(order[:m])
    for i in range(m):
        out[t, i] = chosen[i]
    for i in range(m, top_k):
        out[t, i] = -1


@njit(cache=True, nogil=True)
def _topk_serial(q, w, kt, top_k, out):
    for t in range(q.shape[0]):
        _topk_row(t, q, w, kt, top_k, out)


@njit(cache=True, parallel=True, nogil=True)
def _topk_parallel(q, w, kt, top_k, out):
    for t in prange(q.shape[0]):
        _topk_row(t, q, w, kt, top_k, out)


# Below this many multiply-adds a call runs on one thread (waking the pool costs more); both
# kernels inline the same row, so the choice never changes a bit.
PARALLEL_MIN_MACS = 1 << 24


def _check(q_index, head_weights, k_index, top_k):
    q = np.ascontiguousarray(q_index, dtype=np.float32)
    k = np.ascontiguousarray(k_index, dtype=np.float32)
    if q.ndim != 3 or k.ndim != 2 or q.shape[2] != k.shape[1] or k.shape[0] < q.shape[0]:
        raise DimensionError(f"q_index must be (T, H, D) and k_index (S, D) with S >= T, got "
                             f"{q.shape} and {k.shape}")
    w = np.asarray(head_weights, dtype=np.float32)
    w = np.ascontiguousarray(np.broadcast_to(w, (q.shape[0], q.shape[1]))) \
        if w.shape in ((q.shape[1],), (q.shape[0], q.shape[1])) else None
    if w is None:
        raise DimensionError(f"head_weights must be ({q.shape[1]},) or {q.shape[:2]}, got "
                             f"{np.shape(head_weights)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1:
        raise DimensionError(f"top_k must be a positive integer, got {top_k!r}")
    if not (np.isfinite(q).all() and np.isfinite(k).all() and np.isfinite(w).all()):
        raise NumericError("indexer inputs are not finite")
    return q, w, k, int(top_k)


def lightning_indexer_topk(q_index, head_weights, k_index, top_k: int) -> np.ndarray:
    """q_index (T, H, D), head_weights (H,) or (T, H), k_index (S, D) f32 -> (T, top_k) int64
    token indices, ascending, -1 padded; query t sits at position S - T + t (module docstring)."""
    q, w, k, top_k = _check(q_index, head_weights, k_index, top_k)
    out = np.empty((q.shape[0], top_k), dtype=np.int64)
    big = q.size * k.shape[0] >= PARALLEL_MIN_MACS
    (_topk_parallel if big else _topk_serial)(q, w, np.ascontiguousarray(k.T), top_k, out)
    return out


def lightning_indexer_topk_numpy(q_index, head_weights, k_index, top_k: int) -> np.ndarray:
    """The NumPy twin: same contract; dot products by NumPy, the sum over heads in order."""
    q, w, k, top_k = _check(q_index, head_weights, k_index, top_k)
    T, H, _ = q.shape
    out = np.full((T, top_k), -1, dtype=np.int64)
    for t in range(T):
        n = k.shape[0] - T + t + 1
        s = np.zeros(n, dtype=np.float32)
        for h in range(H):
            s += w[t, h] * np.maximum(k[:n] @ q[t, h], np.float32(0))
        chosen = np.sort(np.argsort(-s, kind="stable")[:top_k])
        out[t, :len(chosen)] = chosen
    return out
