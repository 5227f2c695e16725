"""Several sequences' decode walks in one compiled call per layer (a batched decode step).

A decode step of n sequences (models/decode.py) attends for each layer once per sequence, each
over its own hot cache. When a sequence's walk is all hot (the common case while a budget
keeps every page), that attention is one compiled call (`Atlas.decode_attend`, via
`HotCache.append_fold`), but the Python around each call (argument checks, the walk's tables,
counters) costs ~20 us, about as much as the call, and a step pays it n x layers times.
`HotWalks` makes every sequence's all-hot walk of a layer one call (`decode_walk.hot_walks`):
the same append, fold and merge per sequence, so every bit, table entry and recency mark is
what the per-sequence call makes. The walks are memory-bound (a token's pages come back from
memory after the layer's weights pushed them out of cache: ~25-30 us a sequence and layer on
the bundled model against ~9 us warm), so when no single fold needs both threads the rows run
side by side, one fold per thread (`hot_walks_parallel`; each sequence's walk reads and
writes only its own cache). The walks then share the memory's bandwidth two ways: at long
contexts the fold reads each sequence's K/V (23,040 bytes a token on the bundled model) and
that stream, not the arithmetic, sets its pace. A sequence whose walk does not apply there
(a new page, a miss, a budget that evicts) takes its own path for that layer, after its
bookkeeping so far is handed back to its Atlas (`flush`), so that path sees the state it
would have seen.

The bookkeeping each walk adds (the recency clock, the rows' bytes, the counters of a write
call and an all-hot attend call, the peak) is gathered in arrays and given to each Atlas at
the end of the step or before its own path runs (`Atlas.batched_walks`); the fold seconds of a
call are shared evenly among the walks it made. A group lives for one step. It holds the
sequences' hot caches' typed lists (`HotCache.walk_lists`), fetched again whenever a cache
replaced an array (`HotCache.walk_version`, checked before every call, so a call never reads
a replaced array), and lets them go at the end of the step, so no array outlives its cache's
use of it. Building the lists compiles numba's typed-list code once per process (~1 s), so a
step of one sequence keeps the per-sequence call.
"""

from __future__ import annotations

import time

import numba
import numpy as np

from cfr_atlas.atlas import decode_walk, fold
from cfr_atlas.atlas.runtime import default_score
from cfr_atlas.atlas.storage import format_of
from cfr_atlas.errors import DimensionError


class HotWalks:
    """The all-hot decode walks of a fixed list of atlases (one per sequence of a decode step,
    None where a sequence takes its own path always); see the module docstring."""

    parallel = True  # rows side by side when `_split` says so (False: always in turn)

    def __init__(self, atlases: list):
        self.atlases = atlases
        n = len(atlases)
        c = next(a.config for a in atlases if a is not None)
        self.head_dim, self.value_dim, self.out_dim = c.head_dim, c.stored_value_dim, c.out_dim
        self.dtype = c.dtype
        self._fmt = format_of(c.dtype)
        self.member = np.array([-1 if a is None else g for g, a in enumerate(atlases)],
                               dtype=np.int64)
        self.splits = np.array([1 if a is None else a.config.split_pages for a in atlases],
                               dtype=np.int64)
        self.page_tokens = np.array([1 if a is None else a.config.page_tokens for a in atlases],
                                    dtype=np.int64)
        self.ticks = np.zeros(n, dtype=np.int64)
        self.walked: np.ndarray | None = None  # (n, layers) walks since the last flush
        # pages folded and tokens consumed since the last flush, then the last walk's
        self.counts = np.zeros((n, 4), dtype=np.int64)
        self.seconds = np.zeros((n, 2), dtype=np.float64)  # since the last flush; last walk's
        self.n_head = 0
        self._scales: dict = {}
        self._versions: tuple | None = None
        self._lists: tuple | None = None
        slabs = (np.zeros((0, c.head_dim, c.page_tokens), dtype=c.dtype.array_dtype),
                 np.zeros((0, c.page_tokens, c.stored_value_dim), dtype=c.dtype.array_dtype))
        self._empty = slabs
        # one member: its arrays go to `decode_walk.hot_walk_one` (no typed lists)
        members = [g for g, a in enumerate(atlases) if a is not None]
        self._one = members[0] if len(members) == 1 else -1
        self._lanes = numba.get_num_threads()  # the fold's lanes (this thread's, this step)
        self._checked: tuple = ()  # the buffers `run` last checked, held for the step
        self._splits: dict = {}  # (window, rows' bytes) -> side by side or not
        self._score: dict = {}  # (H, G, window) -> default_score's cap, alibi, sinks

    @staticmethod
    def fits(atlas, config) -> bool:
        """Whether `atlas` may join a group whose first member has `config`: the same row
        shapes and storage dtype (the step's buffers hold one shape for all)."""
        c = atlas.config
        return (c.dtype == config.dtype and c.head_dim == config.head_dim
                and c.stored_value_dim == config.stored_value_dim
                and c.out_dim == config.out_dim)

    # --- a step ---------------------------------------------------------------------------
    def begin(self, n_layers: int) -> None:
        """Before a step: every atlas's clock read, nothing gathered."""
        for g, a in enumerate(self.atlases):
            if a is not None:
                self.ticks[g] = a.clock
        if self.walked is None or self.walked.shape[1] < n_layers:
            self.walked = np.zeros((len(self.atlases), n_layers), dtype=np.int64)
        else:
            self.walked.fill(0)
        self.counts.fill(0)
        self.seconds.fill(0.0)

    def _current_lists(self) -> tuple:
        versions = tuple(-1 if a is None else a.cache.walk_version for a in self.atlases)
        if versions != self._versions:
            from numba import typed

            per_atlas = [None if a is None else a.cache.walk_lists() for a in self.atlases]
            filler = next(x for x in per_atlas if x is not None)
            lists = []
            for i in range(5):
                outer = typed.List()
                for x in per_atlas:
                    outer.append((filler if x is None else x)[i])
                lists.append(outer)
            self._lists, self._versions = tuple(lists), versions
        return self._lists

    def run(self, layer: int, rows: np.ndarray, starts: np.ndarray, k_st: np.ndarray,
            v_st: np.ndarray, q: np.ndarray, out: np.ndarray, scale=None,
            window=None) -> np.ndarray:
        """One layer for the step's rows: rows (n,) int64, rows[r] the atlas index of row r
        (-1: none; a member at most once, and members only); starts (atlases,) int64, each
        atlas's position (indexed by atlas, not by row); rows k_st, v_st (n, H, D) of the
        storage dtype, q (n, H, G, D) float32, out (n, H, G, Dv) float32, all C-contiguous,
        and the layer's scale and window (the attention options a decode step passes).
        Returns ok (n,) bool: True where the row's walk was made here (out[r] written), False
        where the row must take its own path. The kernel trusts these shapes and indices
        (numba checks no index), so they are checked here."""
        n, H, G = q.shape[:3]
        checked = self._checked
        if not (checked and checked[0] is k_st and checked[1] is v_st and checked[2] is q
                and checked[3] is out and checked[4] is starts):
            self._check(starts, k_st, v_st, q, out)
        own = rows is self.member and n == rows.shape[0]  # valid by construction
        if not own and (rows.shape != (n,) or rows.dtype != np.int64
                        or not rows.flags.c_contiguous
                        or (n and not -1 <= int(rows.min()) <= int(rows.max())
                            < len(self.atlases))) or not 0 <= layer < self.walked.shape[1]:
            raise DimensionError(f"HotWalks.run: row indices {rows.shape} {rows.dtype} or "
                                 f"layer {layer} do not fit {n} rows of {len(self.atlases)} "
                                 f"sequences and {self.walked.shape[1]} layers")
        if not own:  # `member` itself names each member once
            g = rows[rows >= 0]
            if (self.member[g] < 0).any() or np.unique(g).size != g.size:
                raise DimensionError(f"HotWalks.run: rows {rows.tolist()} name a sequence "
                                     f"that is not a member, or one twice (members "
                                     f"{self.member.tolist()})")
        ok = np.zeros(n, dtype=np.bool_)
        win = 0 if window is None else int(window)
        scales = self._scales.get(scale)
        if scales is None:  # each atlas's scale, as Atlas.decode_attend takes it
            scales = self._scales[scale] = np.array(
                [1.0 if a is None else a.config.query_scale() if scale is None else float(scale)
                 for a in self.atlases], dtype=np.float32)
        score = self._score.get((H, G, win))
        if score is None:
            _, cap, alibi, _, sinks = default_score(H, G, 1.0, win)
            score = self._score[(H, G, win)] = (np.float32(cap), alibi, sinks)
        cap, alibi, sinks = score
        self.n_head = H
        t0 = time.perf_counter()
        if self._one >= 0:  # one member: its layer's arrays, no typed lists
            slot, tok, last_use, k, v = self.atlases[self._one].cache.walk_arrays(layer)
            decode_walk.hot_walk_one(
                layer, slot, tok, last_use, k, v, rows, starts, self.ticks, self.walked,
                self.counts, k_st, v_st, q, self.splits, scales, cap, alibi, win, self._fmt,
                sinks, fold.PARALLEL_MIN_PAIRS, self._lanes, *self._empty, out, ok)
        else:
            slots, tokens, last_uses, ks, vs = self._current_lists()
            kernel = decode_walk.hot_walks_parallel if self._split(rows, starts, win) \
                else decode_walk.hot_walks
            kernel(layer, slots, tokens, last_uses, ks, vs, rows, starts,
                   self.ticks, self.walked, self.counts, k_st, v_st, q, self.splits,
                   scales, cap, alibi, win, self._fmt, sinks,
                   fold.PARALLEL_MIN_PAIRS, self._lanes, *self._empty, out, ok)
        _share_seconds(rows, ok, self.seconds, time.perf_counter() - t0)
        return ok

    def _check(self, starts, k_st, v_st, q, out) -> None:
        """`run`'s checks of the step's buffers (the same arrays every layer: checked once,
        then held for the step)."""
        n, H, G = q.shape[:3]
        arrays = (starts, k_st, v_st, q, out)
        if (k_st.shape != (n, H, self.head_dim) or v_st.shape != (n, H, self.value_dim)
                or k_st.dtype != self.dtype.array_dtype or v_st.dtype != k_st.dtype
                or q.shape[3] != self.head_dim or out.shape != (n, H, G, self.out_dim)
                or q.dtype != np.float32 or out.dtype != np.float32
                or starts.shape != (len(self.atlases),) or starts.dtype != np.int64
                or not all(a.flags.c_contiguous for a in arrays)):
            raise DimensionError(f"HotWalks.run: rows {k_st.shape} {k_st.dtype} / {v_st.shape}, "
                                 f"query {q.shape} {q.dtype}, out {out.shape} and "
                                 f"{starts.shape} positions do not fit "
                                 f"{len(self.atlases)} sequences of head_dim {self.head_dim}")
        self._checked = arrays

    def _split(self, rows: np.ndarray, starts: np.ndarray, win: int) -> bool:
        """Whether the rows' walks run on the threads side by side (`hot_walks_parallel`,
        each fold on one thread): when at least two rows are members and no member's walk
        is more than half of all their pages (so the threads' shares can be even); else in
        turn (`hot_walks`: a long walk's fold keeps both threads to itself, by
        `fold.walk_plan`'s rule). Either way the same bits."""
        key = (win, rows.tobytes())
        split = self._splits.get(key)
        if split is None:
            g = rows[rows >= 0]
            if not self.parallel or g.size < 2:
                split = False
            else:
                context, page = starts[g] + 1, self.page_tokens[g]
                lo = np.maximum(context - win, 0) // page if win > 0 else 0
                pages = -(-context // page) - lo
                split = 2 * int(pages.max()) <= int(pages.sum())
            self._splits[key] = split  # the positions are the step's: one answer a step
        return split

    def flush(self, g: int) -> None:
        """Hand atlas g the bookkeeping of its walks so far (before its own path, and at the
        end of the step)."""
        a = self.atlases[g]
        if a is None:
            return
        walked = self.walked[g]
        if walked.any():
            pages, consumed, last_pages, last_consumed = self.counts[g].tolist()
            total, last = self.seconds[g].tolist()
            a.batched_walks(walked, self.n_head, int(self.ticks[g]), [pages, consumed], total,
                            (last_pages, last_consumed, last))
            walked.fill(0)
            self.counts[g] = 0
            self.seconds[g] = 0.0

    def resync(self, g: int) -> None:
        """After atlas g took its own path: read its clock again, and let the lists go if
        that path replaced one of its cache's arrays (they would hold the old one until the
        next layer's call)."""
        a = self.atlases[g]
        if a is not None:
            self.ticks[g] = a.clock
            if self._versions is not None and self._versions[g] != a.cache.walk_version:
                self._lists = self._versions = None

    def end(self) -> None:
        """After the step (or when it fails): every atlas's bookkeeping handed back, and the
        lists and buffers let go (they reference the caches' and the step's arrays)."""
        for g in range(len(self.atlases)):
            self.flush(g)
        self._lists = self._versions = None
        self._checked = ()


@numba.njit(cache=True, nogil=True)
def _share_seconds(rows, ok, seconds, elapsed):
    """A call's seconds shared evenly among the walks it made: seconds[g, 0] += the share,
    seconds[g, 1] = it, for each row r made (ok[r]) of member g = rows[r]."""
    made = 0
    for r in range(rows.shape[0]):
        made += ok[r]
    if made:
        share = elapsed / made
        for r in range(rows.shape[0]):
            if ok[r]:
                seconds[rows[r], 0] += share
                seconds[rows[r], 1] = share
