"""The online-softmax fold: attention over pages, one page at a time, exact by construction.

For one query row q and a page of keys/values (K_j, V_j), with scores s_j = scale * q.K_j
(then softcap, then ALiBi), the running state (m, l, acc) absorbs the page as

    m' = max(m, max_j s_j)
    l' = l * exp(m - m') + sum_j exp(s_j - m')
    acc' = acc * exp(m - m') + sum_j exp(s_j - m') V_j

and attention = acc / l once every page has been absorbed. Pages are grouped into partitions of
`split_pages` consecutive pages (a fixed split by page index, never by thread count); each
partition folds its pages in order into its own state, and `merge_partitions` combines the
states left to right with the same identity, then adds the sink logit and divides.

Why the result never depends on the policy, the budget or the chunking: for a query at position
p the arithmetic is a pure function of (q, p, the rows of each causal page). Which array a page's
rows come from (hot slab or regeneration scratch), how pages were batched into calls, and how many
queries share a call change nothing. Scores are float32 (dot products
summed over dims in order by fused multiply-adds, K pages stored transposed so keys fill the
vector lanes); each weight is a float32 exp (`exp32`) of a float32 score less the running
maximum, used for both l (its page's weights summed in float64 in a fixed order: `sum_run`)
and the page's float32 sum of V rows (fused multiply-adds, keys in order); l and acc
accumulate across pages in float64 (see docs/MATH.md).

V may be a view of K (MLA: K = [latent; rope key], V = latent): then every V slab has width 0
and the fold reads V row j as the first Dv entries of K^T's column j (Dv = acc's width), so the
stored bytes are read once per page and never copied; the sum per output entry runs over keys
in the same order as with a V slab.

Pages come from three slabs of one layout (K^T (S, D, P), V (S, P, D), storage dtype): the hot
cache (SRC_HOT), regeneration scratch (SRC_SCRATCH), and a regenerator's memory-mapped pages
(SRC_MAP, e.g. the page file in the OS page cache, read in place). A mapped page is verified in
the same kernel: the work item that reads it last computes its checksum (page_sum.py), K^T's
half row by row (even page sizes; odd 16-bit ones eight rows at a time) before the scores (that
pass streams the page in from memory, which the score blocks need anyway: see below) and V's
half after the values, and flags a mismatch in `bad`; the caller raises before the result is
used (benchmarks/bench_check.py measures the cost). 16-bit elements are read directly, never
widened into a copy of the page.

The two sums of a page (scores over dims, values over keys) run register-blocked
(fold_blocks.py): the same operations in the same order as plain loops, so the same bits, with
the running sums in vector registers. A page's last partial block of keys runs as a whole
block where the page's columns hold it, its extra lanes' scores never read: the plain loop's
key after key, whose sums wait on each other, cost ~0.2 us a key and head (a 512-token prompt's
fold took 0.75x without it, a decode walk of 41 tokens 0.62x, paired in one process, the same
bits). The score blocks read K^T down its rows a block of keys
at a time, which the hardware prefetchers do not follow from memory, so a page is first read
in row order (`touch_rows`, or the checksum's K^T half on a checked page), by the call's
first query only: items run query-fastest, so the later queries of a prompt chunk find the
page's partition in the caches, and touching it again cost them time (a 256-query chunk
after 2,048 tokens took 0.92x without those touches, paired in one process). A call of one
query (decode) touches the page's V rows beside K^T's, a line of each in turn (`touch_pair`):
two streams from memory at once instead of one after the other.

Each numba kernel has a NumPy twin (`fold_pages_numpy`, `merge_partitions_numpy`) with the same
signature, used by the tests. This module holds no cache or policy logic.

Compile time: `_fold_item` and `_merge_item` are compiled functions of their own that the
serial, parallel and all-hot kernels call, not inlined into each at numba's IR level (which
compiled the work item anew in every caller: a storage format's first use cost ~40-80 s of
compiling, then ~15-25 s; the register-blocked sums of fold_blocks.py, compiled for 1-4 groups
each, add about 2 s: the serial kernel's first float16 call 11.4 s against 9.2 s, session 39;
session 48's score passes of several blocks and 64-dim values calls another ~1.6 s, 9.8 ->
11.4 s on a Xeon).
These kernels compile fold_blocks.py's and page_sum.py's code into theirs; numba alone would
renew a cache entry only when its own file changes, so every kernel of the package is stamped
with a digest of all its sources (jit_cache.py): an edit anywhere recompiles. Each kernel
is called with one set of argument types per storage format: a strided array, prange's
unsigned index or a literal in a tuple would each be another type, hence another compile."""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import get_num_threads, njit, prange

from cfr_atlas.atlas.fold_blocks import (
    DIMS,
    GROUPS,
    KEYS,
    VALUE_GROUPS,
    WIDE_REGISTERS,
    exp_run,
    fma32,
    max_run,
    score_block,
    sum_run,
    touch_pair,
    touch_rows,
    values_block,
)
from cfr_atlas.atlas.page_sum import halves_sum, k_rows_sum, page_checksum_numpy, v_rows_sum
from cfr_atlas.atlas.storage import to_f32
from cfr_atlas.ops.activations import exp32

SRC_HOT, SRC_SCRATCH, SRC_MAP = 0, 1, 2


@njit(cache=True, inline="always")
def _page_slabs(slabs, src, s):
    """(K^T page (D, P), V page (P, D)) at slot s of source src."""
    k_hot, v_hot, k_scr, v_scr, k_map, v_map = slabs
    if src == SRC_HOT:
        return k_hot[s], v_hot[s]
    if src == SRC_SCRATCH:
        return k_scr[s], v_scr[s]
    return k_map[s], v_map[s]


@njit(cache=True, inline="always")
def _last_reader(t, qpos, window, last_key):
    """Is query t the last of the call to read a page whose last key is at `last_key`?"""
    if t == qpos.shape[0] - 1:
        return True
    return window > 0 and qpos[t + 1] - window + 1 > last_key


@njit(cache=True, inline="always")
def _score_blocks(kf, j0, n_blocks, qth, s, fmt):
    """s[g, :n_blocks * KEYS] = the raw scores of keys j0.. for every group g (fold_blocks.py),
    up to GROUPS groups a call."""
    n_grp = qth.shape[0]
    for g0 in range(0, n_grp, GROUPS):
        left = n_grp - g0
        if left >= 4:
            score_block(kf, j0, n_blocks, qth, g0, s, 4, fmt)
        elif left == 3:
            score_block(kf, j0, n_blocks, qth, g0, s, 3, fmt)
        elif left == 2:
            score_block(kf, j0, n_blocks, qth, g0, s, 2, fmt)
        else:
            score_block(kf, j0, n_blocks, qth, g0, s, 1, fmt)


@njit(cache=True, inline="always")
def _value_blocks(vf, j0, n, p, ag, e_end, fmt):
    """ag[g, e] += sum_j p[g, j] V(j0 + j, e) for dims e < e_end (a multiple of DIMS), every
    group, VALUE_GROUPS a call (fold_blocks.py): on AVX-512 64 dims a call while they fit,
    then 32 (a global constant: the other branch is never compiled)."""
    if WIDE_REGISTERS:
        e0 = 0
        while e0 + 2 * DIMS <= e_end:
            _value_dims(vf, j0, n, p, ag, e0, fmt, 64)
            e0 += 2 * DIMS
        if e0 < e_end:
            _value_dims(vf, j0, n, p, ag, e0, fmt, 32)
    else:
        for e0 in range(0, e_end, DIMS):
            _value_dims(vf, j0, n, p, ag, e0, fmt, 32)


@njit(cache=True, inline="always")
def _value_dims(vf, j0, n, p, ag, e0, fmt, dims):
    """`values_block` over dims e0 .. e0 + dims - 1 (dims a literal 32 or 64) of every group."""
    n_grp = ag.shape[0]
    for g0 in range(0, n_grp, VALUE_GROUPS):
        left = min(n_grp - g0, VALUE_GROUPS)
        if left >= 4:
            values_block(vf, j0, n, p, g0, ag, e0, 4, fmt, dims)
        elif left == 3:
            values_block(vf, j0, n, p, g0, ag, e0, 3, fmt, dims)
        elif left == 2:
            values_block(vf, j0, n, p, g0, ag, e0, 2, fmt, dims)
        else:
            values_block(vf, j0, n, p, g0, ag, e0, 1, fmt, dims)


@njit(cache=True, inline="always")
def _item_of(w, n_tok, n_pg, lo, split):
    """Work item w of a walk of n_pg pages from page lo -> (query t, head h, partition, the
    end of its page range): items run query-fastest, then partition, then head."""
    p0 = lo // split
    n_items_part = (lo + n_pg - 1) // split - p0 + 1
    part = p0 + (w // n_tok) % n_items_part
    return w % n_tok, w // (n_tok * n_items_part), part, min((part + 1) * split, lo + n_pg)


@njit(cache=True, inline="always")
def _page_keys(start, n_valid, pos, low):
    """The keys j0 .. j1 - 1 of a page from token `start` (n_valid rows) that a query at pos
    reads, its window starting at token low (empty when j0 >= j1)."""
    return max(0, low - start), min(n_valid, pos - start + 1)


@njit(cache=True, nogil=True)
def _item_scratch(n_grp, page_tokens, dv):
    """A work item's scratch (`_fold_item`), allocated once per serial call or lane: its
    arrays allocated per item cost ~2% of a prompt chunk's fold (a 256-token chunk after 256
    tokens, three K/V heads of three groups, one thread: 8.6 ms against 8.4)."""
    return (np.empty((n_grp, page_tokens), dtype=np.float32),  # scores
            np.empty((n_grp, page_tokens), dtype=np.float32),  # weights
            np.empty((n_grp, dv), dtype=np.float32),  # the page's V sums
            np.empty((4, dv), dtype=np.float32))  # four V rows widened to float32


@njit(cache=True, nogil=True)
def _fold_item(w, q, qpos, slabs, walk, span, score, state, scratch):
    """Work item w = (head h, partition, query t): fold the partition's pages of the walk
    slice a..b, in page order, into state (t, h, partition); scratch from `_item_scratch`
    (whatever it holds is overwritten before it is read).

    K pages are stored transposed, (D, P), so a score is a plain dot product summed over
    dims 0..D-1 in order (fused multiply-adds), vectorized across keys. Each weight is one
    float32 exp32; the same float32 weight enters l (summed in float64, `sum_run`) and the
    page's float32 weighted sum of V rows (keys in order), which is then added into the
    float64 acc.
    """
    src, slot, expect, bad = walk
    lo, context, split, a, b = span
    scale, softcap, alibi, window, fmt = score
    m, l, acc = state
    n_tok, n_head, n_grp, d = q.shape
    dv = acc.shape[4]  # V width: d, or the K rows V views (a V slab of width 0)
    v_in_k = slabs[1].shape[2] == 0
    page_tokens = slabs[1].shape[1]
    n_pg = src.shape[1]
    t, h, part, gp_end = _item_of(w, n_tok, n_pg, lo, split)
    pos = qpos[t]
    low = pos - window + 1 if window > 0 else 0
    s, p, ag, v4 = scratch
    for gp in range(max(part * split, lo), gp_end):
        f = h * n_pg + gp - lo
        if f < a or f >= b:
            continue
        start = gp * page_tokens
        if start > pos:
            break
        n_valid = min(page_tokens, context - start)
        j0, j1 = _page_keys(start, n_valid, pos, low)
        if j0 >= j1:
            continue
        i = gp - lo
        kf, vf = _page_slabs(slabs, src[h, i], slot[h, i])
        n = j1 - j0
        # score_j = sum_e q_e K_je, e in order: blocks of KEYS keys in registers, then the rest
        # (K^T rows, V width and q's dims are one d: models/session.py's slabs). A last
        # partial block runs as a whole one where the page's columns hold it: the lanes past
        # n read columns of the page that hold no key of this query, and their scores are
        # never read (each lane's sum is its own key's, so the keys' bits are the same)
        blocks = kf.strides[1] == kf.itemsize and kf.shape[0] == d
        n_blocked = (n // KEYS) * KEYS if blocks else 0
        if n_blocked < n and blocks and j0 + n_blocked + KEYS <= kf.shape[1] \
                and n_blocked + KEYS <= s.shape[1]:
            n_blocked = n  # (the score loop below runs blocks of ceil(n / KEYS))
        # a mapped page is verified by its last reader: K^T's half of the checksum in row
        # order before the scores (it streams the page in, as the touch would), V's after
        check = src[h, i] == SRC_MAP and _last_reader(t, qpos, window, start + n_valid - 1)
        k_sum = k_rows_sum(kf) if check else np.uint32(0)
        if n_blocked:
            if not check and t == 0 and n_tok == 1 and not v_in_k \
                    and vf.strides[1] == vf.itemsize \
                    and vf.strides[0] == vf.shape[1] * vf.itemsize:  # rows back to back
                touch_pair(kf, j0, n_blocked, vf, j0, n)
            elif not check and t == 0:  # the call's first query: the others find it cached
                touch_rows(kf, j0, n_blocked)  # row order first: the blocks read across rows
            _score_blocks(kf, j0, (n_blocked + KEYS - 1) // KEYS, q[t, h], s, fmt)
        for g in range(n_grp):
            sg = s[g]
            for j in range(n_blocked, n):
                sg[j] = 0.0
            for e in range(d):
                qe = q[t, h, g, e]
                ke = kf[e]
                for j in range(n_blocked, n):
                    sg[j] = fma32(qe, to_f32(ke[j0 + j], fmt), sg[j])
            for j in range(n):  # then scale, softcap, ALiBi: one simple loop each
                sg[j] = sg[j] * scale
            if softcap > 0.0:
                for j in range(n):
                    sg[j] = softcap * np.float32(math.tanh(sg[j] / softcap))
            slope = alibi[h, g]
            if slope != 0.0:
                for j in range(n):
                    sg[j] = sg[j] + slope * np.float32(start + j0 + j - pos)
            m_old = m[t, h, part, g]
            m_new = max(m_old, np.float64(max_run(sg, n)))
            corr = 0.0 if m_old == -np.inf else math.exp(m_old - m_new)
            m32, pg = np.float32(m_new), p[g]  # m_new is a score: a float32 value
            for j in range(exp_run(sg, m32, pg, n), n):  # the weights, float32 (exp32's
                pg[j] = exp32(sg[j] - m32)  # bits: KEYS-lane vectors, then the rest)
            l[t, h, part, g] = l[t, h, part, g] * corr + sum_run(pg, n)
            m[t, h, part, g] = m_new
            for e in range(dv):
                acc[t, h, part, g, e] *= corr
                ag[g, e] = 0.0
        if v_in_k:  # V = K's first dv rows of K^T: per (g, e) the same sum, keys in order
            for g in range(n_grp):
                for e in range(dv):
                    ke = kf[e]
                    a_ge = ag[g, e]
                    for j in range(n):
                        a_ge = fma32(p[g, j], to_f32(ke[j0 + j], fmt), a_ge)
                    ag[g, e] = a_ge
        else:  # each (g, e) sums keys in order: blocks of DIMS dims in registers, then the rest
            v_blocks = vf.strides[1] == vf.itemsize and vf.shape[1] == d
            e_blocked = (d // DIMS) * DIMS if v_blocks else 0
            if e_blocked:
                _value_blocks(vf, j0, n, p, ag, e_blocked, fmt)
            if e_blocked < d:
                n4 = n - n % 4
                for j in range(0, n4, 4):  # four keys per pass over ag
                    for r in range(4):
                        for e in range(e_blocked, d):
                            v4[r, e] = to_f32(vf[j0 + j + r, e], fmt)
                    for g in range(n_grp):
                        p0, p1, p2, p3 = p[g, j], p[g, j + 1], p[g, j + 2], p[g, j + 3]
                        for e in range(e_blocked, d):
                            ag[g, e] = fma32(p3, v4[3, e], fma32(p2, v4[2, e], fma32(
                                p1, v4[1, e], fma32(p0, v4[0, e], ag[g, e]))))
                for j in range(n4, n):  # the last n % 4 keys, one at a time
                    for e in range(e_blocked, d):
                        v4[0, e] = to_f32(vf[j0 + j, e], fmt)
                    for g in range(n_grp):
                        pj = p[g, j]
                        for e in range(e_blocked, d):
                            ag[g, e] = fma32(pj, v4[0, e], ag[g, e])
        for g in range(n_grp):
            for e in range(dv):
                acc[t, h, part, g, e] += np.float64(ag[g, e])
        if check and halves_sum(k_sum, v_rows_sum(vf, kf.shape[0])) != expect[h, i]:
            bad[h, i] = 1


def _walk_items(n_tok, n_head, n_pg, lo, split):
    """Work items of a walk of n_pg pages from lo: (head, partition, query)."""
    return n_head * ((lo + n_pg - 1) // split - lo // split + 1) * n_tok


def _n_items(q, walk, span):
    return _walk_items(q.shape[0], walk[0].shape[0], walk[0].shape[1], span[0], span[2])


@njit(cache=True, nogil=True)
def _fold_serial(q, qpos, slabs, walk, span, score, state, n_items):
    scratch = _item_scratch(q.shape[2], slabs[1].shape[1], state[2].shape[4])
    for w in range(n_items):
        _fold_item(w, q, qpos, slabs, walk, span, score, state, scratch)


@njit(cache=True, nogil=True)
def _item_keys(w, q, qpos, walk, span, window, page_tokens):
    """The keys work item w folds (`_fold_item`'s loop bounds, nothing read): its cost."""
    lo, context, split, a, b = span
    n_pg = walk[0].shape[1]
    t, h, part, gp_end = _item_of(w, q.shape[0], n_pg, lo, split)
    pos = qpos[t]
    low = pos - window + 1 if window > 0 else 0
    keys = 0
    for gp in range(max(part * split, lo), gp_end):
        f = h * n_pg + gp - lo
        if f < a or f >= b:
            continue
        start = gp * page_tokens
        if start > pos:
            break
        j0, j1 = _page_keys(start, min(page_tokens, context - start), pos, low)
        keys += max(0, j1 - j0)
    return keys


@njit(cache=True, nogil=True)
def balanced_runs(costs, n_lanes):
    """Bounds (n_lanes + 1,) cutting the items 0 .. n - 1, in order, into n_lanes runs of
    nearly equal cost: run r is items bounds[r] .. bounds[r + 1] - 1, and each cut sits at the
    item boundary nearest to r / n_lanes of the total cost (the lower one on a tie), so no
    run exceeds an even share by more than one item's cost. A prange over items gives each
    thread an equal count of them, and the counts of a decode walk's partitions differ: at
    2,049 tokens two threads took 17 and 10 pages (cut here: 13 and 14). Items stay in runs
    because dealing them out one by one (largest first) was 4-9% slower where the counts were
    already even (4,096 and 6,000 tokens)."""
    n = costs.shape[0]
    prefix = np.zeros(n + 1, dtype=np.int64)
    for w in range(n):
        prefix[w + 1] = prefix[w] + costs[w]
    total = prefix[n]
    bounds = np.zeros(n_lanes + 1, dtype=np.int64)
    bounds[n_lanes] = n
    for r in range(1, n_lanes):
        target = total * r / n_lanes
        cut = 0  # the boundary nearest the target, the lowest of equally near ones
        for i in range(1, n + 1):
            if abs(prefix[i] - target) < abs(prefix[cut] - target):
                cut = i
        bounds[r] = max(cut, bounds[r - 1])
    return bounds


@njit(cache=True, parallel=True, nogil=True)
def _fold_parallel(q, qpos, slabs, walk, span, score, state, n_items, lanes):
    """The work items cut, in order, into `lanes` runs of nearly equal keys (`_item_keys`,
    `balanced_runs`), one run per prange iteration; lanes is the caller's thread count,
    passed in (numba 0.68 declined to cache this kernel calling get_num_threads itself: "uses
    dynamic globals"). Which thread folds an item never changes its bits."""
    costs = np.empty(n_items, dtype=np.int64)
    for w in range(n_items):
        costs[w] = _item_keys(w, q, qpos, walk, span, score[3], slabs[1].shape[1])
    n_lanes = max(1, min(lanes, n_items))
    bounds = balanced_runs(costs, n_lanes)
    for r in prange(n_lanes):  # prange's index is unsigned: cast, or _fold_item compiles twice
        scratch = _item_scratch(q.shape[2], slabs[1].shape[1], state[2].shape[4])
        for w in range(bounds[np.int64(r)], bounds[np.int64(r) + 1]):
            _fold_item(w, q, qpos, slabs, walk, span, score, state, scratch)


# Below this many (query head x key) pairs a call runs on one thread: waking the pool costs
# more than it saves. Serial and parallel kernels call the same work item, so the split only
# changes which thread computes an item, never its bits.
PARALLEL_MIN_PAIRS = 1 << 13


def _fold_in_parallel(n_tok, n_grp, n_walk, page_tokens) -> bool:
    """Whether a fold of n_walk pages runs the parallel kernel (query heads x keys)."""
    return n_tok * n_grp * n_walk * page_tokens >= PARALLEL_MIN_PAIRS


def _merge_in_parallel(state_shape) -> bool:
    """Whether a merge of partition states acc (T, H, NPART, G, Dv) runs the parallel kernel."""
    return math.prod(state_shape) >= PARALLEL_MIN_PAIRS


def fold_pages(q, qpos, slabs, walk, span, score, state):
    """Absorb pages a..b of a walk into the partition states.

    slabs = (k_hot, v_hot, k_scr, v_scr, k_map, v_map): K^T (S, D, P) and V (S, P, D) slabs of
    one storage dtype. walk = (src, slot, expect, bad), each (H, NP): the walk covers pages
    lo..lo+NP-1 of H K/V heads, head-major (flat index f = h * NP + i is page lo + i of head h),
    read from slab src[h, i] at slot[h, i]; a SRC_MAP page whose checksum differs from
    expect[h, i] (uint32) sets bad[h, i] (uint8). span = (lo, context, split, a, b): page g
    covers tokens [g P, min((g+1) P, context)), partition g // split. score = (scale f32,
    softcap f32 (0 = none), alibi (H, G) f32 slopes (0 = none), window (0 = none), fmt (the
    storage format marker, storage.FORMATS)). q: (T, H, G, D) f32 queries at positions qpos (T,).
    state = (m, l: (T, H, NPART, G) f64, acc: (T, H, NPART, G, Dv) f64), updated in place;
    Dv = D, or with V slabs of width 0 the first Dv rows of each K^T page are its V.
    """
    n_items = _n_items(q, walk, span)
    if _fold_in_parallel(q.shape[0], q.shape[2], span[4] - span[3], slabs[0].shape[2]):
        _fold_parallel(q, qpos, slabs, walk, span, score, state, n_items, get_num_threads())
    else:
        _fold_serial(q, qpos, slabs, walk, span, score, state, n_items)


@njit(cache=True, nogil=True)
def _merge_item(w, m, l, acc, sinks, out):
    """Work item w = (query t, head h): combine partitions left to right, add sinks, divide."""
    n_tok, n_head, n_part, n_grp = m.shape
    d = acc.shape[4]
    t = w // n_head
    h = w - t * n_head
    a = np.empty(d, dtype=np.float64)
    for g in range(n_grp):
        mm, ll = -np.inf, 0.0
        for p in range(n_part):
            lp = l[t, h, p, g]
            if lp == 0.0:  # an empty partition holds no token
                continue
            mp = m[t, h, p, g]
            if mm == -np.inf:
                mm, ll = mp, lp
                a[:] = acc[t, h, p, g]
                continue
            mn = max(mm, mp)
            ca, cb = math.exp(mm - mn), math.exp(mp - mn)
            ll = ll * ca + lp * cb
            for e in range(d):
                a[e] = a[e] * ca + acc[t, h, p, g, e] * cb
            mm = mn
        sink = sinks[h, g]
        if not math.isnan(sink):
            mn = max(mm, np.float64(sink))
            ca = math.exp(mm - mn) if mm != -np.inf else 0.0
            ll = ll * ca + math.exp(np.float64(sink) - mn)
            for e in range(d):
                a[e] *= ca
        for e in range(d):
            out[t, h, g, e] = np.float32(a[e] / ll)


@njit(cache=True, nogil=True)
def _merge_serial(m, l, acc, sinks, out):
    for w in range(m.shape[0] * m.shape[1]):
        _merge_item(w, m, l, acc, sinks, out)


@njit(cache=True, parallel=True, nogil=True)
def _merge_parallel(m, l, acc, sinks, out):
    for w in prange(m.shape[0] * m.shape[1]):
        _merge_item(np.int64(w), m, l, acc, sinks, out)


def merge_partitions(m, l, acc, sinks, out):
    """Combine partition states left to right, add sink logits, divide: out (T, H, G, D) f32.

    sinks: (H, G) f32 sink logits, NaN where a head has none.
    """
    (_merge_parallel if _merge_in_parallel(acc.shape) else _merge_serial)(m, l, acc, sinks, out)


def fold_walk(q, qpos, slabs, walk, span, score, sinks, out):
    """A walk whose pages are hot (SRC_HOT) or read in place from a regenerator's mapping
    (SRC_MAP) in one compiled call: `fold_pages` over every page, then `merge_partitions`
    into out (T, H, G, Dv) f32; walk = (src, slot, expect, bad) as `fold_pages` takes it
    (a mapped page whose checksum differs from `expect` sets `bad`; the caller raises before
    using out). The same kernels and plan as `fold_pages` + `merge_partitions`, so bitwise
    theirs."""
    src, slot, expect, bad = walk
    scale, cap, alibi, win, fmt = score
    _fold_walk_flat(q, qpos, *slabs, src, slot, expect, bad, *span, scale, cap, alibi, win,
                    fmt, sinks, out, *walk_plan(q, slot, span, slabs, out))


def walk_plan(q, slot, span, slabs, out) -> tuple:
    """(walk items, fold lanes, merge in parallel) by `fold_pages`' and `merge_partitions`'
    rules: the fold's lanes are the calling thread's numba thread count when it runs in
    parallel, else 0 (the serial kernel)."""
    n_tok, n_head, n_grp, _ = q.shape
    items, parallel, merge = _plan_of(n_tok, n_head, n_grp, slot.shape[1], span[0], span[2],
                                      slabs[0].shape[2], out.shape[3], PARALLEL_MIN_PAIRS)
    return items, get_num_threads() if parallel else 0, merge


@njit(cache=True, nogil=True)
def plan_sizes(n_tok, n_head, n_grp, n_pg, lo, split, page_tokens, dv, min_pairs):
    """`walk_plan` of a walk's sizes: (work items, fold in parallel, merge in parallel) by
    `_walk_items`', `_fold_in_parallel`'s and `_merge_in_parallel`'s rules with threshold
    min_pairs; compiled, so the batched decode walk (decode_walk.hot_walks) plans each walk
    by the same code as `walk_plan` (tests/atlas/test_fold_parallel.py holds the rules and this
    equal)."""
    n_part = (lo + n_pg + split - 1) // split
    return (n_head * ((lo + n_pg - 1) // split - lo // split + 1) * n_tok,
            n_tok * n_grp * n_head * n_pg * page_tokens >= min_pairs,
            n_tok * n_head * n_part * n_grp * dv >= min_pairs)


# `walk_plan` of a walk's sizes, remembered (min_pairs: the threshold the rules read now, part
# of the key): the Python body of the compiled `plan_sizes`
_plan_of = functools.lru_cache(maxsize=256)(plan_sizes.py_func)


@njit(cache=True, nogil=True)
def _fold_walk_flat(q, qpos, k_hot, v_hot, k_scr, v_scr, k_map, v_map, src, slot, expect, bad,
                    lo, context, split, scale, cap, alibi, win, fmt, sinks, out, items,
                    lanes, merge_parallel):
    """`_fold_walk` with its tuples spread into plain arguments: numba types a tuple argument
    element by element in Python on every call (~10 us for these), an array or scalar in C."""
    _fold_walk(q, qpos, (k_hot, v_hot, k_scr, v_scr, k_map, v_map), (src, slot, expect, bad),
               (lo, context, split), (scale, cap, alibi, win, fmt), sinks, out,
               (items, lanes, merge_parallel))


@njit(cache=True, nogil=True)
def _fold_walk(q, qpos, slabs, walk, span, score, sinks, out, plan):
    """The kernel of `fold_walk` and of the decode walk (decode_walk.append_fold): the
    partition states allocated, then the planned
    kernels over the whole walk."""
    n_tok, n_head, n_grp, _ = q.shape
    n_pg = walk[1].shape[1]
    lo, context, split = span
    items, lanes, merge_parallel = plan  # lanes: 0 for the serial fold
    n_part = (lo + n_pg + split - 1) // split
    m = np.full((n_tok, n_head, n_part, n_grp), -np.inf, dtype=np.float64)
    l = np.zeros((n_tok, n_head, n_part, n_grp), dtype=np.float64)
    acc = np.zeros((n_tok, n_head, n_part, n_grp, out.shape[3]), dtype=np.float64)
    # np.int64(0), not 0: a literal would make the span another type (another compile)
    full = (lo, context, split, np.int64(0), n_head * n_pg)
    if lanes:
        _fold_parallel(q, qpos, slabs, walk, full, score, (m, l, acc), items, lanes)
    else:
        _fold_serial(q, qpos, slabs, walk, full, score, (m, l, acc), items)
    if merge_parallel:
        _merge_parallel(m, l, acc, sinks, out)
    else:
        _merge_serial(m, l, acc, sinks, out)


# --- NumPy twins (same signatures; tests compare them with the kernels) ----------------------

def fold_pages_numpy(q, qpos, slabs, walk, span, score, state):
    from cfr_atlas.atlas.storage import StorageDtype, widen

    src, slot, expect, bad = walk
    lo, context, split, a, b = span
    scale, softcap, alibi, window, fmt = score
    m, l, acc = state
    dtype = {np.float32: StorageDtype.FLOAT32, np.uint16: StorageDtype.FLOAT16,
             np.int16: StorageDtype.BFLOAT16}[type(fmt)]
    P = slabs[1].shape[1]
    n_pg = src.shape[1]
    for f in range(a, b):
        h, i = divmod(f, n_pg)
        gp = lo + i
        part, n = gp // split, min(P, context - gp * P)
        k_page, v_page = slabs[2 * int(src[h, i])][slot[h, i]], slabs[2 * int(src[h, i]) + 1][
            slot[h, i]]
        kf = widen(np.ascontiguousarray(k_page[:, :n].T), dtype)
        dv = acc.shape[-1]
        vf = widen(v_page[:n], dtype) if v_page.shape[1] else kf[:, :dv]  # V views K
        keypos = gp * P + np.arange(n)
        for t, pos in enumerate(qpos):
            valid = (keypos <= pos) & ((keypos > pos - window) if window > 0 else True)
            if not valid.any():
                continue
            s = (q[t, h] @ kf.T).astype(np.float32) * np.float32(scale)  # (G, n)
            if softcap > 0:
                s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
            s = s + alibi[h][:, None] * (keypos - pos).astype(np.float32)
            s = np.where(valid, s, -np.inf).astype(np.float64)
            m_new = np.maximum(m[t, h, part], s.max(axis=1))
            corr = np.where(m[t, h, part] == -np.inf, 0.0, np.exp(m[t, h, part] - m_new))
            p = np.exp(s - m_new[:, None])
            l[t, h, part] = l[t, h, part] * corr + p.sum(axis=1)
            acc[t, h, part] = acc[t, h, part] * corr[:, None] + p @ vf.astype(np.float64)
            m[t, h, part] = m_new
            # verified as the kernel does: by the page's last reader, so only pages read
            if src[h, i] == SRC_MAP and _last_reader.py_func(t, qpos, window, gp * P + n - 1) \
                    and page_checksum_numpy(k_page, v_page) != int(expect[h, i]):
                bad[h, i] = 1


def merge_partitions_numpy(m, l, acc, sinks, out):
    nonempty = l > 0
    mm = np.where(nonempty, m, -np.inf).max(axis=2)  # (T, H, G)
    with np.errstate(invalid="ignore"):
        w = np.where(nonempty, np.exp(m - mm[:, :, None]), 0.0)
    ll = (l * w).sum(axis=2)
    a = (acc * w[..., None]).sum(axis=2)
    has_sink = ~np.isnan(sinks)
    sink = np.where(has_sink, sinks, -np.inf).astype(np.float64)[None]
    mn = np.maximum(mm, sink)
    ca = np.exp(mm - mn)
    ll = ll * ca + np.where(has_sink[None], np.exp(sink - mn), 0.0)
    out[...] = (a * ca[..., None] / ll[..., None]).astype(np.float32)
