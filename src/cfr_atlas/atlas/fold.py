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
queries share a call change nothing. Scores are float32 (dot products with eight partial sums
combined in a fixed order); l and acc accumulate in float64 (see docs/MATH.md).

Each numba kernel has a NumPy twin (`fold_runs_numpy`, `merge_partitions_numpy`) with the same
signature, used by the tests. This module holds no cache or policy logic.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from cfr_atlas.atlas.storage import widen_into

SRC_HOT, SRC_SCRATCH = 0, 1


def _as_f32_rows(rows, j0, j1, code, buf):
    """rows: (n, D) stored -> a float32 (n, D) view of rows j0..j1 (a copy for 16-bit storage)."""
    if code == 0:
        return rows
    widen_into(rows[j0:j1], code, buf[j0:j1])
    return buf


@overload(_as_f32_rows, jit_options={"cache": True})
def _as_f32_rows_ov(rows, j0, j1, code, buf):
    if rows.dtype == types.float32:
        return lambda rows, j0, j1, code, buf: rows

    def impl(rows, j0, j1, code, buf):
        widen_into(rows[j0:j1], code, buf[j0:j1])
        return buf

    return impl


@njit(cache=True, inline="always")
def _dot(a, b, n):
    """float32 dot product with eight partial sums combined in a fixed order."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    n8 = n - n % 8
    for e in range(0, n8, 8):
        s0 += a[e] * b[e]
        s1 += a[e + 1] * b[e + 1]
        s2 += a[e + 2] * b[e + 2]
        s3 += a[e + 3] * b[e + 3]
        s4 += a[e + 4] * b[e + 4]
        s5 += a[e + 5] * b[e + 5]
        s6 += a[e + 6] * b[e + 6]
        s7 += a[e + 7] * b[e + 7]
    r = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for e in range(n8, n):
        r += a[e] * b[e]
    return r


@njit(cache=True, inline="always")
def _score(qrow, krow, d, scale, softcap, slope, distance):
    x = _dot(qrow, krow, d) * scale
    if softcap > 0.0:
        x = softcap * np.float32(math.tanh(x / softcap))
    if slope != 0.0:
        x = x + slope * np.float32(distance)
    return x


@njit(cache=True, inline="always")
def _fold_item(w, q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start, pg_len,
               run_begin, run_head, run_part, scale, softcap, alibi, window, m, l, acc):
    """Work item w = (run r, query t): fold run r's pages, in order, into state (t, h, part)."""
    n_tok, _, n_grp, d = q.shape
    page_tokens = k_hot.shape[1]
    r = w // n_tok
    t = w - r * n_tok
    h, part, pos = run_head[r], run_part[r], qpos[t]
    lo = pos - window + 1 if window > 0 else 0
    s = np.empty((n_grp, page_tokens), dtype=np.float32)
    kbuf = np.empty((page_tokens, d), dtype=np.float32)
    vbuf = np.empty((page_tokens, d), dtype=np.float32)
    for i in range(run_begin[r], run_begin[r + 1]):
        start = pg_start[i]
        if start > pos:
            break
        j0 = max(0, lo - start)
        j1 = min(pg_len[i], pos - start + 1)
        if j0 >= j1:
            continue
        if pg_src[i] == SRC_HOT:
            kr, vr = k_hot[pg_slot[i]], v_hot[pg_slot[i]]
        else:
            kr, vr = k_scr[pg_slot[i]], v_scr[pg_slot[i]]
        kf = _as_f32_rows(kr, j0, j1, code, kbuf)
        vf = _as_f32_rows(vr, j0, j1, code, vbuf)
        for j in range(j0, j1):
            for g in range(n_grp):
                s[g, j] = _score(q[t, h, g], kf[j], d, scale, softcap, alibi[h, g],
                                 start + j - pos)
        for g in range(n_grp):
            mx = s[g, j0]
            for j in range(j0 + 1, j1):
                mx = max(mx, s[g, j])
            m_old = m[t, h, part, g]
            m_new = max(m_old, np.float64(mx))
            corr = 0.0 if m_old == -np.inf else math.exp(m_old - m_new)
            a = acc[t, h, part, g]
            for e in range(d):
                a[e] *= corr
            lsum = l[t, h, part, g] * corr
            for j in range(j0, j1):
                p = math.exp(np.float64(s[g, j]) - m_new)
                lsum += p
                for e in range(d):
                    a[e] += p * vf[j, e]
            l[t, h, part, g] = lsum
            m[t, h, part, g] = m_new


@njit(cache=True, nogil=True)
def _fold_serial(q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start, pg_len,
                 run_begin, run_head, run_part, scale, softcap, alibi, window, m, l, acc):
    for w in range(run_head.shape[0] * q.shape[0]):
        _fold_item(w, q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start,
                   pg_len, run_begin, run_head, run_part, scale, softcap, alibi, window, m, l, acc)


@njit(cache=True, parallel=True, nogil=True)
def _fold_parallel(q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start, pg_len,
                   run_begin, run_head, run_part, scale, softcap, alibi, window, m, l, acc):
    for w in prange(run_head.shape[0] * q.shape[0]):
        _fold_item(w, q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start,
                   pg_len, run_begin, run_head, run_part, scale, softcap, alibi, window, m, l, acc)


# Below this many (query head x key) pairs a call runs on one thread: waking the pool costs
# more than it saves. Serial and parallel kernels inline the same work item, so the split only
# changes which thread computes an item, never its bits.
PARALLEL_MIN_PAIRS = 1 << 16


def fold_runs(q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start, pg_len,
              run_begin, run_head, run_part, scale, softcap, alibi, window, m, l, acc):
    """Absorb a batch of pages into the partition states.

    q: (T, H, G, D) f32 queries; qpos: (T,) absolute positions; k_hot/v_hot: (S, P, D) stored
    slab; k_scr/v_scr: (C, P, D) stored scratch; page i comes from slab or scratch (pg_src) at
    pg_slot[i] and covers tokens [pg_start[i], pg_start[i] + pg_len[i]). Runs are consecutive
    pages of one (head index, partition); run r = pages run_begin[r]:run_begin[r+1].
    alibi: (H, G) f32 slopes (0 = none); softcap 0 = none; window 0 = none.
    m, l: (T, H, NPART, G) f64; acc: (T, H, NPART, G, D) f64 — updated in place.
    """
    pairs = q.shape[0] * q.shape[2] * int(pg_len.sum())
    kernel = _fold_parallel if pairs >= PARALLEL_MIN_PAIRS else _fold_serial
    kernel(q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start, pg_len,
           run_begin, run_head, run_part, scale, softcap, alibi, window, m, l, acc)


@njit(cache=True, inline="always")
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


@njit(cache=True)
def _merge_serial(m, l, acc, sinks, out):
    for w in range(m.shape[0] * m.shape[1]):
        _merge_item(w, m, l, acc, sinks, out)


@njit(cache=True, parallel=True)
def _merge_parallel(m, l, acc, sinks, out):
    for w in prange(m.shape[0] * m.shape[1]):
        _merge_item(w, m, l, acc, sinks, out)


def merge_partitions(m, l, acc, sinks, out):
    """Combine partition states left to right, add sink logits, divide: out (T, H, G, D) f32.

    sinks: (H, G) f32 sink logits, NaN where a head has none.
    """
    big = m.shape[0] * m.shape[1] * m.shape[2] * m.shape[3] * acc.shape[4] >= PARALLEL_MIN_PAIRS
    (_merge_parallel if big else _merge_serial)(m, l, acc, sinks, out)


# --- NumPy twins (same signatures; tests compare them with the kernels) ----------------------

def fold_runs_numpy(q, qpos, k_hot, v_hot, k_scr, v_scr, code, pg_src, pg_slot, pg_start,
                    pg_len, run_begin, run_head, run_part, scale, softcap, alibi, window,
                    m, l, acc):
    from cfr_atlas.atlas.storage import StorageDtype, widen

    dtype = {0: StorageDtype.FLOAT32, 1: StorageDtype.FLOAT16, 2: StorageDtype.BFLOAT16}[code]
    for r in range(len(run_head)):
        h, part = run_head[r], run_part[r]
        for i in range(run_begin[r], run_begin[r + 1]):
            src_k, src_v = (k_hot, v_hot) if pg_src[i] == SRC_HOT else (k_scr, v_scr)
            kf = widen(src_k[pg_slot[i], :pg_len[i]], dtype)
            vf = widen(src_v[pg_slot[i], :pg_len[i]], dtype)
            keypos = pg_start[i] + np.arange(pg_len[i])
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
