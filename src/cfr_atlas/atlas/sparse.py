"""Sparse attention through the page walk: each query folds only the tokens selected for it.

`attend_selected` takes per query row a set of token indices (a lightning indexer's top-k,
ops/indexer.py, or any other selection), ascending and -1 padded. Only the pages holding a
selected token are read: resident pages in place from the hot slab, the others in place from the
regenerator's mapping (the spill page file; checksum verified before use) or regenerated
(`Atlas.page_rows`, checked); a page no query selects is neither regenerated nor folded (counted
as `pages_skipped`). Regenerated pages are not admitted to the hot cache. Each query row's
selected rows are then gathered, in token order, into a contiguous copy and folded by the same
fold kernel as a dense context of that many tokens (`fold_gathered`). So the result is, bitwise,
dense attention over the gathered copy (what the tests check), and it never depends on the
budget, the policy, the regenerator or the other rows of the chunk.

The index keys a selector scores are a second, small paged stream: an Atlas of its own with
K rows only (`AtlasConfig(head_dim=index dim, value_dim=1)`: no V bytes), resident or
regenerated like the main stream; `read_stream` returns its rows for a context, in page order.

Selection is causal by construction (the indexer only picks tokens at or before the query);
windows and ALiBi are position rules the gathered copy does not keep, so they are refused.
This module holds no selection rule and no page tables: it asks the Atlas for rows.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas import fold
from cfr_atlas.atlas.page_sum import page_checksum
from cfr_atlas.atlas.pages import PageKey, page_count
from cfr_atlas.atlas.storage import format_of, widen
from cfr_atlas.atlas.telemetry import Counters
from cfr_atlas.errors import CorruptPageError, DimensionError, PageError


def _check_select(select, n_tok: int, context: int) -> np.ndarray:
    sel = np.asarray(select)
    if sel.ndim != 2 or sel.shape[0] != n_tok or sel.dtype.kind not in "iu":
        raise DimensionError(f"select must be ({n_tok}, top_k) integers, got "
                             f"{sel.dtype} {sel.shape}")
    sel = sel.astype(np.int64)
    pos = np.arange(context - n_tok, context, dtype=np.int64)[:, None]
    ok = (sel == -1) | ((sel >= 0) & (sel <= pos))
    if not ok.all():
        t = int(np.nonzero(~ok.all(axis=1))[0][0])
        raise PageError(f"select row {t} (position {context - n_tok + t}) names tokens outside "
                        f"0..{context - n_tok + t}: {sel[t].tolist()[:16]}")
    bad = (sel[:, 1:] >= 0) & ((sel[:, :-1] < 0) | (sel[:, 1:] <= sel[:, :-1]))
    if bad.any():
        raise PageError("select rows must be ascending and distinct, -1 padded at the end")
    return sel


def fold_gathered(atlas, q: np.ndarray, kt: np.ndarray, v: np.ndarray, scale: float,
                  softcap: float, sinks: np.ndarray) -> np.ndarray:
    """One query row q (1, H, G, D) over n gathered tokens, kt (H, D, n) (K transposed) and
    v (H, n, Dvs) in storage dtype, as a dense context of n tokens: -> (1, H, G, Dv) f32,
    the fold's bits (pages of page_tokens, partitions of split_pages, as `attend_heads`)."""
    cfg = atlas.config
    P, (H, _, n) = cfg.page_tokens, kt.shape
    n_pg = page_count(n, P)
    k_slab = np.zeros((H, n_pg * P, cfg.head_dim), dtype=kt.dtype)
    k_slab[:, :n] = kt.transpose(0, 2, 1)
    k_slab = np.ascontiguousarray(k_slab.reshape(H * n_pg, P, -1).transpose(0, 2, 1))
    v_slab = np.zeros((H, n_pg * P, v.shape[2]), dtype=v.dtype)
    v_slab[:, :n] = v
    v_slab = v_slab.reshape(H * n_pg, P, -1)
    src = np.full((H, n_pg), fold.SRC_HOT, dtype=np.int64)
    slot = np.arange(H * n_pg, dtype=np.int64).reshape(H, n_pg)
    walk = (src, slot, np.zeros((H, n_pg), np.uint32), np.zeros((H, n_pg), np.uint8))
    slabs = (k_slab, v_slab, k_slab[:0], v_slab[:0], k_slab[:0], v_slab[:0])
    n_part, G = -(-n_pg // cfg.split_pages), q.shape[2]
    m = np.full((1, H, n_part, G), -np.inf, dtype=np.float64)
    l = np.zeros((1, H, n_part, G), dtype=np.float64)
    acc = np.zeros((1, H, n_part, G, cfg.out_dim), dtype=np.float64)
    fold.fold_pages(q, np.array([n - 1], dtype=np.int64), slabs, walk,
                    (0, n, cfg.split_pages, 0, H * n_pg),
                    (np.float32(scale), np.float32(softcap), np.zeros((H, G), np.float32), 0,
                     format_of(cfg.dtype)), (m, l, acc))
    out = np.empty((1, H, G, cfg.out_dim), dtype=np.float32)
    fold.merge_partitions(m, l, acc, sinks, out)
    return out


def _read_pages(atlas, backend, layer: int, heads: list[int], pages: np.ndarray, context: int):
    """The selected pages, per (head index, page): (K^T (D, n), V (n, Dvs)) in storage dtype,
    read in place from the hot slab or the regenerator's mapping (checksum verified), else
    regenerated (`Atlas.page_rows`); and the counters of that read."""
    cfg, P = atlas.config, atlas.config.page_tokens
    n_pages = page_count(context, P)
    lens = np.minimum(P, context - np.arange(n_pages) * P)
    lay = atlas.cache.tables(layer, max(heads) + 1, n_pages)
    hidx = np.asarray(heads, dtype=np.int64)
    slots = lay.slot[hidx][:, :n_pages]
    hot = (slots >= 0) & (lay.tokens[hidx][:, :n_pages] == lens)
    need = np.zeros(hot.shape, dtype=bool)
    need[:, pages] = ~hot[:, pages]
    maps = None
    if need.any() and hasattr(backend, "map_pages"):
        maps = backend.map_pages(layer, hidx, 0, lens, need)
    out, c = {}, Counters(calls=1, pages_folded=len(heads) * len(pages),
                          pages_skipped=len(heads) * (n_pages - len(pages)))
    for hi, head in enumerate(heads):
        for g in pages.tolist():
            n = int(lens[g])
            if hot[hi, g]:
                s = int(slots[hi, g])
                out[hi, g] = atlas.cache.k[s, :, :n], atlas.cache.v[s, :n]
                c.hot_hits += 1
                continue
            c.regenerations += 1
            c.bytes_regenerated += n * cfg.row_bytes
            if maps is not None and not maps.missing[hi, g]:
                s = int(maps.slot[hi, g])
                if page_checksum(maps.k[s], maps.v[s]) != maps.expect[hi, g]:
                    raise CorruptPageError(f"{PageKey(layer, head, g * P)}: checksum mismatch "
                                           "in the mapped page")
                out[hi, g] = maps.k[s, :, :n], maps.v[s, :n]
                c.bytes_mapped += n * cfg.row_bytes
                continue
            k_st, v_st = atlas.page_rows(backend, PageKey(layer, head, g * P), n)
            out[hi, g] = k_st.T, v_st
    return out, c


def attend_selected(atlas, backend, layer: int, kv_heads, query: np.ndarray, context: int,
                    select, *, scale: float | None = None, softcap: float | None = None,
                    sinks=None) -> np.ndarray:
    """query (T, H, G, D) f32 at positions context - T.. over, per row t, only the tokens
    select[t] (ascending, -1 padded) -> (T, H, G, Dv) f32 (module docstring)."""
    cfg, P = atlas.config, atlas.config.page_tokens
    heads = [int(h) for h in kv_heads]
    q = np.ascontiguousarray(query, dtype=np.float32)
    if q.ndim != 4 or q.shape[1] != len(heads) or q.shape[3] != cfg.head_dim:
        raise DimensionError(f"query must be (T, {len(heads)}, G, {cfg.head_dim}), got {q.shape}")
    n_tok, H, G, _ = q.shape
    sel = _check_select(select, n_tok, context)
    scale = cfg.query_scale() if scale is None else float(scale)
    sinks = np.full((H, G), np.nan, dtype=np.float32) if sinks is None else \
        np.broadcast_to(np.asarray(sinks, dtype=np.float32), (H, G)).copy()
    rows, counters = _read_pages(atlas, backend, layer, heads, np.unique(sel[sel >= 0] // P),
                                 context)
    out = np.empty((n_tok, H, G, cfg.out_dim), dtype=np.float32)
    for t in range(n_tok):
        idx = sel[t][sel[t] >= 0]
        parts = [(g, idx[idx // P == g] - g * P) for g in np.unique(idx // P).tolist()]
        kt = np.stack([np.concatenate([rows[h, g][0][:, j] for g, j in parts], axis=1)
                       for h in range(H)])
        v = np.stack([np.concatenate([rows[h, g][1][j] for g, j in parts]) for h in range(H)])
        out[t] = fold_gathered(atlas, q[t:t + 1], kt, v, scale,
                               0.0 if softcap is None else float(softcap), sinks)[0]
    atlas.record(counters)
    return out


def read_stream(atlas, backend, layer: int, head: int, context: int) -> np.ndarray:
    """Every K row (context, D) f32 of one stream (e.g. the index keys), page by page: resident
    pages copied from the hot cache, the others regenerated (`Atlas.page_rows`)."""
    P = atlas.config.page_tokens
    parts = [atlas.page_rows(backend, PageKey(layer, head, g * P), min(P, context - g * P))[0]
             for g in range(page_count(context, P))]
    return widen(np.concatenate(parts), atlas.config.dtype)
