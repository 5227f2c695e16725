"""Block-sparse selection (MiniMax-style): each query reads its top-k key blocks and its own.

Keys are cut into blocks of `block` tokens (128 in MiniMax); a block is summarized by the mean
of its keys (`block_means`, float32, rows summed in order then divided). Query row t, at
position p = S - T + t, scores every block that ends before its own block starts,

    s[t, b] = sum_h q[t, h] . mean_b        (heads in order)

and keeps the top_k blocks (ties to the lower block, a stable sort), plus its own block, the
one holding p (its tokens up to p: causal). `block_select` returns the selected tokens per row,
ascending and -1 padded, for `atlas.sparse.attend_selected`, which reads only their pages. Each
row is computed on its own, so a row's selection never depends on its chunk.
The block means are a small stream of their own in a model (one row per block); here they are
an argument. This module holds no attention and no storage.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.errors import DimensionError


def block_means(k: np.ndarray, block: int) -> np.ndarray:
    """k (S, D) f32 -> (ceil(S / block), D) f32 means (the last block's own count)."""
    k = np.asarray(k, dtype=np.float32)
    if k.ndim != 2 or block < 1:
        raise DimensionError(f"k must be (S, D) and block >= 1, got {k.shape}, {block}")
    n_blocks = -(-k.shape[0] // block)
    out = np.zeros((n_blocks, k.shape[1]), dtype=np.float32)
    for j in range(block):  # rows summed in order within each block
        rows = k[j::block]
        out[:len(rows)] += rows
    counts = np.minimum(block, k.shape[0] - block * np.arange(n_blocks)).astype(np.float32)
    return out / counts[:, None]


def block_select(q: np.ndarray, means: np.ndarray, context: int, top_k: int,
                 block: int) -> np.ndarray:
    """q (T, H, D) f32 at positions context - T.., means (B, D) of the blocks of `context`
    tokens -> (T, (top_k + 1) * block) int64 selected tokens, ascending, -1 padded."""
    q = np.asarray(q, dtype=np.float32)
    means = np.asarray(means, dtype=np.float32)
    if q.ndim != 3 or means.ndim != 2 or q.shape[2] != means.shape[1] \
            or means.shape[0] != -(-context // block) or context < q.shape[0]:
        raise DimensionError(f"q (T, H, D) {q.shape} and means (B, D) {means.shape} do not fit "
                             f"{context} tokens in blocks of {block}")
    if top_k < 0:
        raise DimensionError(f"top_k must be >= 0, got {top_k}")
    T = q.shape[0]
    out = np.full((T, (top_k + 1) * block), -1, dtype=np.int64)
    for t in range(T):
        pos = context - T + t
        own = pos // block
        s = np.zeros(own, dtype=np.float32)
        for h in range(q.shape[1]):
            s += means[:own] @ q[t, h]
        chosen = np.sort(np.argsort(-s, kind="stable")[:top_k])
        tokens = [np.arange(b * block, (b + 1) * block) for b in chosen.tolist()]
        tokens.append(np.arange(own * block, pos + 1))
        sel = np.concatenate(tokens)
        out[t, :len(sel)] = sel
    return out
