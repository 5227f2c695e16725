"""CSA/HCA block compression (DeepSeek V4 style): a block of raw K/V rows pooled into one entry.

For a block of m raw rows x (m, D) and per-row, per-channel gate logits g (m, D):

    p[i, c] = exp(g[i, c] - max_i g[i, c])                       channel-wise softmax gates
    e[c]    = (sum_i p[i, c] x[i, c]) / (sum_i p[i, c])          rows in order, float32
    entry   = rope(rms_norm(e) * w)  on the last `rope_dims` channels (adjacent pairs), at the
              position the caller gives (e.g. the block's first token)

Every step is elementwise or a sum over the block's rows in a fixed order, so an entry is a
pure function of its block's rows and gates: regenerated from the same stored rows it has the
same bits (atlas/compressed.py relies on that). This module holds no storage or attention.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.errors import DimensionError
from cfr_atlas.ops.norm import rms_norm
from cfr_atlas.ops.rope import rotate


def compress_block(rows: np.ndarray, gates: np.ndarray, norm_w: np.ndarray, eps: float,
                   cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rows, gates (m, D) f32; norm_w (D,); cos, sin (R/2,) of the entry's position -> (D,) f32,
    its last R = 2 len(cos) channels rotated."""
    x = np.asarray(rows, dtype=np.float32)
    g = np.asarray(gates, dtype=np.float32)
    if x.ndim != 2 or g.shape != x.shape or x.shape[0] < 1 or 2 * len(cos) > x.shape[1]:
        raise DimensionError(f"rows and gates must be (m >= 1, D) alike with rope dims <= D, got "
                             f"{x.shape}, {g.shape}, rope {2 * len(cos)}")
    p = np.exp(g - g.max(axis=0))
    total = p[0].copy()
    pooled = p[0] * x[0]
    for i in range(1, x.shape[0]):  # rows in order
        total += p[i]
        pooled += p[i] * x[i]
    entry = rms_norm((pooled / total)[None], np.asarray(norm_w, dtype=np.float32), eps)
    R = 2 * len(cos)
    rot = rotate(np.ascontiguousarray(entry[:, None, x.shape[1] - R:]),
                 np.asarray(cos, np.float32)[None], np.asarray(sin, np.float32)[None],
                 mode="normal")
    entry[0, x.shape[1] - R:] = rot[0, 0]
    return entry[0]
