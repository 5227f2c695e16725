"""The decode walk's kernels: rows appended to resident pages, and the mapped walk in one call.

A decode token's attention for one layer writes T new rows (T = 1 when decoding) into the
page each K/V head is growing, then folds every page lo.. of every head. When that page is
not a new one (the rows are not its first), is resident with exactly the rows before the new
ones or not resident at all (its rows are then the regenerator's alone, as the general path
leaves them), and every other page of the walk is either resident and whole or held in place
by the regenerator's mapping (the spill page file), the layer's attention is two compiled
calls: `look` (which pages are not resident: what the regenerator is asked to map) and
`append_fold` (the rows appended, the walk arrays, the fold and merge with each mapped page's
checksum checked, the recency marks). Without a regenerator that maps pages, every page must
be resident: `append_fold` alone, over a mapping that maps nothing (every page marked
missing), is the whole layer. Anything else (a new page, a stale partial page, a page the
mapping lacks) is reported, with nothing written, and the caller takes the general path.

The tables (slot, tokens, last_use: (heads, pages) int64) and slabs are `HotCache`'s: its
methods call these kernels, and `hot_walks` takes them through `HotCache.walk_lists` (the
batched walk, atlas/batch_walk.py). The fold is `fold._fold_walk` (`fold.fold_walk`'s kernel), whose
work items are the general path's (`_fold_item`, `_merge_item`), so the result is bitwise that
of the general path. No policy, accounting or telemetry here. numba's cache: `append_fold`
compiles the fold's kernels into this module's cache entry, which numba alone would renew only
when this file changes; the package's stamp (jit_cache.py: a digest of all its sources) makes
an edit of fold.py, fold_blocks.py, page_sum.py or storage.py renew it too.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cfr_atlas.atlas.fold import SRC_HOT, SRC_MAP, _fold_walk, plan_sizes


@njit(cache=True, nogil=True)
def append_walk(slot, tokens, last_use, k, v, heads, start, k_st, v_st, lo, tick_w, tick_a,
                out, write, misses):
    """`HotCache._append`'s check and writes for table rows `heads` (row i of k_st, v_st is
    head heads[i]): True and out (H, NP) filled when the rows grow each head's resident page
    in place and pages lo.. of those heads are all then resident and whole, or with `misses`
    absent (slot -1; the page the rows grow too, which then stays absent: the general path
    writes nothing into a page it did not admit at its first row) (and, if `write`, done:
    rows written at tick_w, the resident pages lo.. marked at tick_a unless it is -1); False,
    nothing written, otherwise."""
    n_t = k_st.shape[0]
    page_tokens = v.shape[1]
    page, off = divmod(start, page_tokens)
    if off == 0 or off + n_t > page_tokens or page - lo + 1 != out.shape[1]:
        return False
    for h in heads:
        grows = slot[h, page] >= 0  # else absent: allowed with misses (the rows skip it)
        if (grows and tokens[h, page] != off) or not (grows or misses):
            return False
        for p in range(lo, page):
            if slot[h, p] < 0:
                if misses:
                    continue
                return False
            if tokens[h, p] != page_tokens:
                return False
    for i, h in enumerate(heads):
        for p in range(lo, page + 1):
            out[i, p - lo] = slot[h, p]
        if not write:
            continue
        s = slot[h, page]  # what `grow` writes: K^T columns, V rows, rows held, recency
        if s >= 0:
            for t in range(n_t):
                for e in range(k.shape[1]):
                    k[s, e, off + t] = k_st[t, i, e]
                for e in range(v.shape[2]):
                    v[s, off + t, e] = v_st[t, i, e]
            tokens[h, page] = off + n_t
            last_use[h, page] = tick_w
        for p in range(lo, page + 1):  # what the fold's `touch` then marks (resident pages)
            if slot[h, p] >= 0 and tick_a >= 0:
                last_use[h, p] = tick_a
    return True


@njit(cache=True, nogil=True)
def look(slot, tokens, k, v, n_heads, start, n_rows, lo, need):
    """`append_walk`'s check with misses allowed, for heads 0..n_heads-1 and n_rows rows: True
    and need (H, NP) set where a page lo.. is not resident, or False."""
    heads = np.arange(n_heads)
    k_st = np.empty((n_rows, 0, 0), dtype=k.dtype)  # shapes only: nothing is written
    hot = np.empty(need.shape, dtype=np.int64)
    if not append_walk(slot, tokens, slot, k, v, heads, start, k_st, k_st, lo, 0, -1, hot,
                       False, True):
        return False
    for h in range(need.shape[0]):
        for i in range(need.shape[1]):
            need[h, i] = hot[h, i] < 0
    return True


@njit(cache=True, nogil=True)
def append_fold(slot, tokens, last_use, k_hot, v_hot, heads, start, k_st, v_st, lo, tick_w,
                tick_a, k_scr, v_scr, k_map, v_map, map_slot, map_expect, map_missing, lens, q,
                qpos, context, split, scale, cap, alibi, win, fmt, sinks, out, items,
                lanes, merge_parallel, bad):
    """The mapped decode walk of one layer in one call (module docstring): pages lo.. of table
    rows `heads` are read from the hot slab where resident, else from the regenerator's slabs
    (k_map, v_map) at map_slot with checksum map_expect (`map_missing` set: it lacks the page);
    map_slot, map_expect, map_missing, bad are (H, NP) for the H = len(heads) heads (the
    caller checks). If the rows (T, H, D) do not continue each head's growing page (resident
    with the rows before them, or not resident), or a page is neither resident and whole nor
    mapped, returns (-1, 0, 0, 0) with nothing written. Else appends the
    rows at tick_w (to the heads whose growing page is resident: the rows of the others are
    the regenerator's alone, as the general path leaves them), folds and merges into out (as
    `fold.fold_walk` over the same walk), marks the resident pages at tick_a unless a mapped
    page failed its check (bad (H, NP) set), and returns (resident pages, tokens of the
    mapped pages, pages that failed, heads whose resident page took the rows)."""
    n_head, n_pg = map_slot.shape
    hot = np.empty((n_head, n_pg), dtype=np.int64)
    if not append_walk(slot, tokens, last_use, k_hot, v_hot, heads, start, k_st, v_st, lo, 0,
                       -1, hot, False, True):
        return -1, 0, 0, 0
    src = np.empty((n_head, n_pg), dtype=np.int64)
    walk_slot = np.empty((n_head, n_pg), dtype=np.int64)
    expect = np.zeros((n_head, n_pg), dtype=np.uint32)
    n_hot, mapped_tokens = 0, 0
    for h in range(n_head):
        for i in range(n_pg):
            if hot[h, i] >= 0:
                src[h, i], walk_slot[h, i] = SRC_HOT, hot[h, i]
                n_hot += 1
            elif map_missing[h, i]:
                return -1, 0, 0, 0
            else:
                src[h, i], walk_slot[h, i] = SRC_MAP, map_slot[h, i]
                expect[h, i] = map_expect[h, i]
                mapped_tokens += lens[i]
    append_walk(slot, tokens, last_use, k_hot, v_hot, heads, start, k_st, v_st, lo, tick_w, -1,
                hot, True, True)
    grown = 0  # heads whose resident page took the rows
    for h in range(n_head):
        grown += hot[h, n_pg - 1] >= 0
    _fold_walk(q, qpos, (k_hot, v_hot, k_scr, v_scr, k_map, v_map), (src, walk_slot, expect, bad),
               (lo, context, split), (scale, cap, alibi, win, fmt), sinks, out,
               (items, lanes, merge_parallel))
    n_bad = 0
    for h in range(n_head):
        for i in range(n_pg):
            n_bad += bad[h, i] != 0
    if n_bad == 0:  # the fold's `touch`: after a fold whose result is used
        for h in range(n_head):
            for i in range(n_pg):
                if hot[h, i] >= 0:
                    last_use[heads[h], lo + i] = tick_a
    return n_hot, mapped_tokens, n_bad, grown


@njit(cache=True, nogil=True)
def _hot_walk(r, layer, slots, tokens, last_uses, ks, vs, heads, members, starts, ticks, walked,
              counts, k_st, v_st, q, splits, scales, cap, alibi, win, fmt, sinks, min_pairs,
              lanes, empty_k, empty_v, out, ok, serial):
    """Row r of `hot_walks`: `append_fold`'s work for a walk that maps nothing, without its
    mapping tables (serial: the fold's serial kernels, whatever the plan says)."""
    ok[r] = False
    g = members[r]
    if g < 0 or layer >= len(slots[g]):  # not a member, or no tables for the layer yet
        return
    _walk_member(r, g, layer, slots[g][layer], tokens[g][layer], last_uses[g][layer],
                 ks[g][0], vs[g][0], heads, starts, ticks, walked, counts, k_st, v_st, q,
                 splits, scales, cap, alibi, win, fmt, sinks, min_pairs, lanes, empty_k,
                 empty_v, out, ok, serial)


@njit(cache=True, nogil=True)
def _walk_member(r, g, layer, slot, tok, last_use, k, v, heads, starts, ticks, walked, counts,
                 k_st, v_st, q, splits, scales, cap, alibi, win, fmt, sinks, min_pairs, lanes,
                 empty_k, empty_v, out, ok, serial):
    """Row r's walk for member g over its cache's layer tables (slot, tok, last_use) and slabs
    (k, v): `_hot_walk`'s work once the arrays are found (ok[r] is False on entry)."""
    n_head, n_grp = q.shape[1], q.shape[2]
    page_tokens, split = v.shape[1], splits[g]
    start = starts[g]
    context = start + 1
    lo = max(0, context - win) // page_tokens if win > 0 else 0
    n_pages = (context + page_tokens - 1) // page_tokens
    if not (lo < n_pages <= slot.shape[1] and n_head <= slot.shape[0]):  # `_walk_tables`
        return
    n_pg = n_pages - lo
    hot = np.empty((n_head, n_pg), dtype=np.int64)
    tick = ticks[g]
    if not append_walk(slot, tok, last_use, k, v, heads, start, k_st[r:r + 1], v_st[r:r + 1],
                       lo, tick + 1, tick + 2, hot, True, False):
        return
    items, fold_parallel, merge_parallel = plan_sizes(1, n_head, n_grp, n_pg, lo, split,
                                                      page_tokens, out.shape[3], min_pairs)
    plan = (items, lanes if fold_parallel and not serial else 0, merge_parallel and not serial)
    walk = (np.zeros((n_head, n_pg), dtype=np.int64), hot,
            np.zeros((n_head, n_pg), dtype=np.uint32), np.zeros((n_head, n_pg), dtype=np.uint8))
    slabs = (k, v, empty_k, empty_v, empty_k, empty_v)  # hot pages only: no scratch, no map
    _fold_walk(q[r:r + 1], np.full(1, start, np.int64), slabs, walk, (lo, context, split),
               (scales[g], cap, alibi, win, fmt), sinks, out[r:r + 1], plan)
    pages, consumed = n_head * n_pg, (context - lo * page_tokens) * n_head
    ticks[g] = tick + 2
    walked[g, layer] += 1
    counts[g, 0] += pages
    counts[g, 1] += consumed
    counts[g, 2], counts[g, 3] = pages, consumed  # the last walk's
    ok[r] = True


@njit(cache=True, nogil=True)
def hot_walks(layer, slots, tokens, last_uses, ks, vs, members, starts, ticks, walked, counts,
              k_st, v_st, q, splits, scales, cap, alibi, win, fmt, sinks, min_pairs, lanes,
              empty_k, empty_v, out, ok):
    """One layer's all-hot decode walk for several sequences in one call (batch_walk.py).

    Row r of k_st, v_st (n, H, D), q (n, H, G, D) and out (n, H, G, Dv) is one token of
    sequence members[r] (-1: not in the group, skipped), at position starts[g]; sequence g's
    hot cache is slots[g][layer], tokens[g][layer], last_uses[g][layer] and the slabs ks[g][0],
    vs[g][0] (`HotCache.walk_lists`), its recency clock ticks[g], its fold split splits[g] and
    score scale scales[g]. For each row in order, what `Atlas.decode_attend` does when the
    walk is all hot (`Atlas._fold_hot`: `append_fold` over a mapping that maps nothing): if
    the tables cover the walk and the row grows each head's resident page in place with
    pages lo.. (the window's first page) then resident and whole, the row is appended at
    ticks[g] + 1, those pages marked at ticks[g] + 2, the walk folded and merged into out[r]
    with the plan `fold.walk_plan` gives (its thresholds: min_pairs; a parallel fold's lanes:
    lanes, the caller's thread count), ticks[g] += 2,
    walked[g, layer] += 1, counts[g, :2] += (pages folded, tokens consumed), counts[g, 2:]
    = those of this walk, and ok[r] = True; else nothing is written and ok[r] = False (the
    caller takes the sequence's own path). The fold is `fold._fold_walk`, with the plan of
    `fold.plan_sizes`, so every bit is the per-sequence walk's."""
    heads = np.arange(q.shape[1])
    for r in range(members.shape[0]):
        _hot_walk(r, layer, slots, tokens, last_uses, ks, vs, heads, members, starts, ticks,
                  walked, counts, k_st, v_st, q, splits, scales, cap, alibi, win, fmt, sinks,
                  min_pairs, lanes, empty_k, empty_v, out, ok, False)


@njit(cache=True, nogil=True, parallel=True)
def hot_walks_parallel(layer, slots, tokens, last_uses, ks, vs, members, starts, ticks, walked,
                       counts, k_st, v_st, q, splits, scales, cap, alibi, win, fmt, sinks,
                       min_pairs, lanes, empty_k, empty_v, out, ok):
    """`hot_walks` with the rows split between threads, each row's fold on its own thread
    (the fold's serial kernels: the same work items, so the same bits)."""
    heads = np.arange(q.shape[1])
    for r in prange(members.shape[0]):
        _hot_walk(np.int64(r), layer, slots, tokens, last_uses, ks, vs, heads, members, starts,
                  ticks, walked, counts, k_st, v_st, q, splits, scales, cap, alibi, win, fmt,
                  sinks, min_pairs, lanes, empty_k, empty_v, out, ok, True)


@njit(cache=True, nogil=True)
def hot_walk_one(layer, slot, tok, last_use, k, v, members, starts, ticks, walked, counts,
                 k_st, v_st, q, splits, scales, cap, alibi, win, fmt, sinks, min_pairs, lanes,
                 empty_k, empty_v, out, ok):
    """`hot_walks` for a step whose rows hold one member (the others -1): that member's layer
    tables (slot, tok, last_use; a (0, 0) table where the layer has none) and slabs (k, v)
    passed as arrays, not typed lists (batch_walk.py: a process that decodes one sequence
    builds none). The same row walk (`_walk_member`), so the same bits and bookkeeping."""
    heads = np.arange(q.shape[1])
    for r in range(members.shape[0]):
        ok[r] = False
        g = members[r]
        if g >= 0:
            _walk_member(r, g, layer, slot, tok, last_use, k, v, heads, starts, ticks, walked,
                         counts, k_st, v_st, q, splits, scales, cap, alibi, win, fmt, sinks,
                         min_pairs, lanes, empty_k, empty_v, out, ok, False)
