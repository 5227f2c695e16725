"""`Atlas`: exact attention over a virtual K/V address space.

For each request the runtime walks the causal pages of one or more K/V heads in a fixed order
(head, then page). A page resident in the hot cache is folded from the slab. A page the
regenerator holds in memory-mapped form (`map_pages`: the spill page file) is folded in place
from the mapping and verified by the same kernel call: no Python per page, no copy, and it is
not admitted (it is already in memory, in the OS page cache). Any other page is written into a
reusable scratch slot by the caller's `KvRegenerator`, checked, folded, and then admitted or
dropped as the policy decides. Every page goes through the same fold kernel in the
same order, so the policy and the budget change cost and residency, never the result.

Errors are transactional: if a regenerator raises or returns non-finite rows, the hot cache and
its accounting are restored exactly (see `HotCache`), the scratch rows are wiped, and a typed
error carrying the page key is raised. This module does not compute K/V; backends do.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from cfr_atlas.atlas import fold
from cfr_atlas.atlas.config import AtlasConfig
from cfr_atlas.atlas.hot_cache import HotCache, all_heads
from cfr_atlas.atlas.pages import PageKey, first_page, page_count, page_spans
from cfr_atlas.atlas.policy import KeepAll
from cfr_atlas.atlas.storage import (
    StorageDtype,
    format_of,
    round_checked,
    round_rows,
    stage_f32,
    widen,
)
from cfr_atlas.atlas.telemetry import Counters, Telemetry
from cfr_atlas.errors import (
    AtlasError,
    CorruptPageError,
    DimensionError,
    NumericError,
    PageError,
    RegeneratorError,
)


class KvRegenerator(Protocol):
    """Anything that can write the exact K and V rows of a page.

    Optionally it may also have `map_pages(layer, heads, lo, lens, need) -> MappedPages`: the
    pages lo.. (lens[i] tokens each) of `heads` that `need` (H, NP) marks, readable in place;
    the fold reads them from the mapping and verifies each page's checksum before its result
    is used (a mismatch raises CorruptPageError).
    """

    def regenerate_page(self, key: PageKey, tokens: range, k_out: np.ndarray,
                        v_out: np.ndarray) -> None:
        """Write K and V rows for key.layer / key.kv_head, tokens[i] -> row i.

        k_out, v_out: (len(tokens), head_dim) float32 (rounded by the runtime to the storage
        dtype); both must be fully overwritten (rows left untouched are detected as NaN).
        When V is a view of K (config.value_dim), v_out is (len(tokens), 0): nothing to write.
        """


class MappedPages(NamedTuple):
    """Pages a regenerator holds readable in place: K^T (S, D, P) and V (S, P, D) slabs in the
    storage dtype (e.g. views of a memory-mapped file), and per walk page (H, NP) the slot
    and the expected checksum (page_sum.py); `missing` (H, NP) bool marks pages it lacks."""

    k: np.ndarray
    v: np.ndarray
    slot: np.ndarray
    expect: np.ndarray
    missing: np.ndarray


@dataclass(frozen=True)
class AttentionRequest:
    """One attention call for one K/V head.

    query: (head_dim,), (group, head_dim) for the query heads sharing this K/V head, or
    (tokens, group, head_dim) for a chunk at positions context_tokens - tokens ... - 1.
    alibi_slope and sink: a scalar or one value per query head of the group.
    """

    layer: int
    kv_head: int
    query: np.ndarray
    context_tokens: int
    scale: float | None = None
    softcap: float | None = None
    alibi_slope: float | np.ndarray | None = None
    window: int | None = None
    sink: float | np.ndarray | None = None


def _check_index(name: str, value, limit: int = 1 << 40) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < limit:
        raise PageError(f"{name} must be an integer in [0, {limit}), got {value!r}")
    return int(value)


@functools.lru_cache(maxsize=64)
def _filled(n_head: int, n_grp: int, fill: float) -> np.ndarray:
    """An (H, G) float32 array of `fill`, shared by every call (the kernels only read it; left
    writeable, as a read-only array would be a second numba type to compile for)."""
    return np.full((n_head, n_grp), fill, dtype=np.float32)


@functools.lru_cache(maxsize=64)
def default_score(n_head: int, n_grp: int, scale: float, window: int) -> tuple:
    """`Atlas._score(n_head, n_grp, scale=scale, window=window or None)` (a valid scale and
    window; 0: none), the other options at their defaults: shared by every call (its arrays
    are `_filled`'s)."""
    return (scale, 0.0, _filled(n_head, n_grp, 0.0), window, _filled(n_head, n_grp, np.nan))


@functools.lru_cache(maxsize=8)
def _maps_nothing(n_head: int, n_pg: int) -> tuple:
    """The mapping tables of a walk that maps nothing ((n_head, n_pg) slot, expected sums,
    missing (all set), (n_pg,) lens, bad), for `HotCache.append_fold` on an all-hot walk:
    shared by every call of that size (the kernel writes only `bad`, and only for a mapped
    page, of which this walk has none). A decode's walk grows by a page every page_tokens
    tokens, so the few sizes kept (8: 22 bytes a head and page each, outside the budget like
    every table) serve it; a longer cache would only hold old sizes."""
    shape = (n_head, n_pg)
    return (np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.uint32),
            np.ones(shape, dtype=np.bool_), np.zeros(n_pg, dtype=np.int64),
            np.zeros(shape, dtype=np.uint8))


def _per_head(name: str, value, n_head: int, n_grp: int, fill: float) -> np.ndarray:
    """Broadcast a scalar / (G,) / (H, G) option to an (H, G) float32 array."""
    if value is None:
        return _filled(n_head, n_grp, fill)
    arr = np.asarray(value, dtype=np.float32)
    try:
        arr = np.broadcast_to(arr, (n_head, n_grp)).astype(np.float32)
    except ValueError:
        raise DimensionError(f"{name} of shape {arr.shape} does not fit "
                             f"{n_head} K/V heads x {n_grp} query heads") from None
    if not np.isfinite(arr).all():
        raise NumericError(f"{name} must be finite")
    return arr


def _page_lens(lo: int, n_pg: int, context: int, page_tokens: int) -> np.ndarray:
    """Tokens of pages lo..lo+n_pg-1 of a context (int64; the last page may be partial)."""
    return np.minimum(page_tokens, context - np.arange(lo, lo + n_pg) * page_tokens)


def _overflows(stored: np.ndarray, dtype: StorageDtype) -> bool:
    """True if rounding finite float32 rows to a 16-bit storage dtype produced inf."""
    return dtype is not StorageDtype.FLOAT32 and not np.isfinite(widen(stored, dtype)).all()


class Atlas:
    """Virtual K/V for one sequence: a hot cache, scratch, and the fold (see module docstring)."""

    def __init__(self, config: AtlasConfig):
        if not isinstance(config, AtlasConfig):
            raise TypeError(f"expected AtlasConfig, got {type(config).__name__}")
        self.config = config
        self.cache = HotCache(config)
        dt = config.dtype.array_dtype
        P, D, C = config.page_tokens, config.head_dim, config.scratch_pages
        Dv = config.stored_value_dim  # D, or 0 when V is a view of K
        self._scratch_k = np.zeros((C, D, P), dtype=dt)  # K^T, like the slab
        self._scratch_v = np.zeros((C, P, Dv), dtype=dt)
        # Regenerators write float32 rows here; they are rounded (and K transposed) into scratch.
        self._stage_k = np.zeros((P, D), dtype=np.float32)
        self._stage_v = np.zeros((P, Dv), dtype=np.float32)
        self._no_map = (np.zeros((0, D, P), dtype=dt), np.zeros((0, P, Dv), dtype=dt))
        self._fmt = format_of(config.dtype)
        self._scratch_used = False
        self._tick = 0
        self._total = Counters()
        self._last = Counters()
        self._peak = 0  # logical: resident rows
        self._peak_allocated = 0  # the arrays: pool + scratch + staging

    # --- public API ------------------------------------------------------------------------
    def attend(self, backend: KvRegenerator, request: AttentionRequest, policy=None,
               out: np.ndarray | None = None) -> np.ndarray:
        """Exact attention for one K/V head; returns an array shaped like the query (float32),
        its last axis the V width (config.out_dim)."""
        q = request.query
        if not isinstance(q, np.ndarray) or q.ndim not in (1, 2, 3):
            raise DimensionError("query must be a NumPy array of shape (head_dim,), "
                                 "(group, head_dim) or (tokens, group, head_dim), got "
                                 f"{getattr(q, 'shape', type(q).__name__)}")
        D = q.shape[-1]
        q4 = q.reshape((q.shape[0] if q.ndim == 3 else 1), 1, -1 if q.ndim > 1 else 1, D)
        # (1, ...) for the one K/V head; attend_heads broadcasts to (1, G) or raises DimensionError
        alibi = None if request.alibi_slope is None else \
            np.asarray(request.alibi_slope, dtype=np.float32)[None]
        sinks = None if request.sink is None else np.asarray(request.sink, dtype=np.float32)[None]
        out_shape = q.shape[:-1] + (self.config.out_dim,)
        if out is not None:
            self._check_out(out, out_shape)
        result = self.attend_heads(backend, request.layer, [request.kv_head], q4,
                                   request.context_tokens, policy, scale=request.scale,
                                   softcap=request.softcap, alibi=alibi, window=request.window,
                                   sinks=sinks)
        result = result.reshape(out_shape)
        if out is None:
            return result
        out[...] = result
        return out

    def attend_heads(self, backend: KvRegenerator, layer: int, kv_heads, query: np.ndarray,
                     context_tokens: int, policy=None, *, scale=None, softcap=None, alibi=None,
                     window=None, sinks=None, out: np.ndarray | None = None) -> np.ndarray:
        """Exact attention for several K/V heads of one layer in one fold.

        query: (T, H, G, D) f32 for the H heads in `kv_heads`; alibi, sinks: (H, G) or None.
        Returns (T, H, G, Dv) f32 (Dv = config.out_dim). Bitwise equal to H separate `attend`
        calls.
        """
        cfg = self.config
        layer = _check_index("layer", layer, 1 << 20)
        heads = [_check_index("kv_head", h, 1 << 16) for h in kv_heads]
        if not heads or len(set(heads)) != len(heads):  # a repeated head would be admitted twice
            raise PageError(f"kv_heads must be distinct and non-empty, got {heads}")
        q = self._check_query(query, len(heads))
        n_tok, n_head, n_grp, _ = q.shape
        context = _check_index("context_tokens", context_tokens)
        if context < n_tok:
            raise PageError(f"context_tokens {context} is smaller than the {n_tok} query tokens")
        scale, cap, alibi, win, sinks = self._score(n_head, n_grp, scale, softcap, alibi, window,
                                                    sinks)
        if out is not None:
            self._check_out(out, q.shape[:3] + (cfg.out_dim,))
        policy = KeepAll() if policy is None else policy

        self._tick += 1
        self._last = Counters(calls=1)
        self._scratch_used = False
        self.cache.begin()
        try:
            result = self._fold_all(backend, layer, heads, q, context, policy, float(scale), cap,
                                    alibi, win, sinks, out)
        except BaseException:
            self.cache.rollback()
            self._wipe_scratch()
            raise
        self.cache.commit()
        if cfg.wipe_scratch_after_use and self._scratch_used:
            self._wipe_scratch()
        self._total.add(self._last)
        return result

    def write_attend(self, backend: KvRegenerator, layer: int, start_token: int,
                     k_st: np.ndarray, v_st: np.ndarray, query: np.ndarray, policy=None,
                     **score) -> np.ndarray:
        """`write_stored` of the rows (T, H, D) of tokens start.. for K/V heads 0..H-1, then
        `attend_heads` of query (T, H, G, D) over the context start + T they end: the result,
        the hot cache, the telemetry and the regenerator's view are those of the two calls.

        The decode path: when the rows grow resident pages in place and every page the query
        reads is then hot, the write, the recency marks, the fold and the merge are two
        one compiled call (`HotCache.append_fold` over a walk that maps nothing) instead of two
        walks in Python; with a regenerator that maps pages (the spill page file), when every
        page not hot (a growing page too) is read in place from its mapping,
        `HotCache.walk_misses`, `map_pages` and `HotCache.append_fold`. Any other case (a new
        page, a page to regenerate, a checked-out argument) takes the two calls themselves,
        which raise what they raise."""
        cfg = self.config
        fast = (isinstance(k_st, np.ndarray) and k_st.ndim == 3
                and isinstance(v_st, np.ndarray) and isinstance(query, np.ndarray)
                and type(start_token) is int and start_token >= 0 and type(layer) is int)
        T, H = (k_st.shape[0], k_st.shape[1]) if fast else (0, 0)
        fast = fast and (k_st.dtype == v_st.dtype == cfg.dtype.array_dtype
                         and k_st.shape[2] == cfg.head_dim
                         and v_st.shape == (T, H, cfg.stored_value_dim)
                         and query.ndim == 4 and query.shape[:2] == (T, H))
        if fast:
            try:  # an argument error is raised by attend_heads below, after the write, as ever
                q = self._check_query(query, H)
                args = self._score(H, q.shape[2], **score)
            except AtlasError:
                fast = False
        if fast:
            out = self._walk_hot(backend, layer, start_token, k_st, v_st, q, args, None)
            if out is not None:
                return out
        self.write_stored(layer, start_token, k_st, v_st, policy)
        heads = range(k_st.shape[1])
        return self.attend_heads(backend, layer, heads, query, start_token + T, policy, **score)

    def decode_attend(self, backend: KvRegenerator, layer: int, start_token: int,
                      k_st: np.ndarray, v_st: np.ndarray, query: np.ndarray,
                      out: np.ndarray | None = None, scale: float | None = None,
                      window: int | None = None) -> np.ndarray | None:
        """`write_attend`'s compiled path alone, for a caller that has made its arguments
        valid itself (the decode step, models/decode.py): rows k_st, v_st (T, H, D) of the
        storage dtype as `stored_rows` returns them, query (T, H, G, D) float32 C-contiguous
        and finite, a valid scale (None: the config's) and window, the other score options at
        their defaults, out None or (T, H, G, Dv) float32. Returns the attention (out) when
        `write_attend`'s compiled walk applies (the rows grow resident pages in place, or with
        a regenerator that maps pages continue pages it maps, and every page the query reads
        is hot or mapped), exactly what `write_attend` returns and records then; else None,
        with nothing changed (the caller takes `write_attend`)."""
        cfg = self.config
        T, H, G = query.shape[:3]
        if (k_st.shape != (T, H, cfg.head_dim) or k_st.dtype != cfg.dtype.array_dtype
                or v_st.shape != (T, H, cfg.stored_value_dim) or v_st.dtype != k_st.dtype
                or (out is not None and (out.shape != (T, H, G, cfg.out_dim)
                                         or out.dtype != np.float32
                                         or not out.flags.c_contiguous))):
            raise DimensionError(f"decode_attend: rows {k_st.dtype} {k_st.shape} / "
                                 f"{v_st.shape}, query {query.shape}, out "
                                 f"{None if out is None else out.shape} do not fit "
                                 f"(head_dim {cfg.head_dim}, {cfg.dtype.value} storage)")
        args = default_score(H, G, cfg.query_scale() if scale is None else float(scale),
                              0 if window is None else int(window))
        return self._walk_hot(backend, layer, start_token, k_st, v_st, query, args, out)

    def _walk_hot(self, backend, layer, start, k_st, v_st, q, args, out) -> np.ndarray | None:
        """The compiled walk of `write_attend` (valid arguments): append the rows, fold every
        page lo.. from the hot slab, or, with a regenerator that maps pages, from the hot slab
        and the mapping; None, nothing changed, when that walk does not apply."""
        T = k_st.shape[0]
        context, P = start + T, self.config.page_tokens
        lo = first_page(context - T - args[3] + 1, P) if args[3] else 0
        map_pages = getattr(backend, "map_pages", None)
        if map_pages is None:
            return self._fold_hot(layer, start, k_st, v_st, q, lo, args, out)
        # A regenerator that maps pages: the walk applies when the rows continue each head's
        # growing page (resident, or not resident at all) and the regenerator maps every page
        # that is not hot (it is told what the fold reads first: its read-ahead follows the
        # folds); if it refuses, the two general calls run and raise what they raise, after
        # the write.
        need = self.cache.walk_misses(layer, k_st.shape[1], start, T, lo)
        if need is None:
            return None
        lens = _page_lens(lo, need.shape[1], context, P)
        try:
            maps = map_pages(layer, all_heads(need.shape[0]), lo, lens, need)
        except AtlasError:
            return None
        return self._fold_mapped(layer, start, k_st, v_st, q, lo, lens, maps, args, out)

    def write_rows(self, layer: int, start_token: int, k_rows: np.ndarray, v_rows: np.ndarray,
                   policy=None, kv_heads=None) -> tuple[np.ndarray, np.ndarray]:
        """Store freshly computed rows (T, H, D) f32 of tokens start..start+T-1 as the policy and
        budget allow; returns the rows rounded to the storage dtype (what any later read sees).

        A page becomes resident only from its first token (a page whose earlier rows are not
        resident is left to regeneration); a resident partial page grows in place.
        """
        k_st, v_st = self.stored_rows(_check_index("start_token", start_token), k_rows, v_rows)
        return self.write_stored(layer, start_token, k_st, v_st, policy, kv_heads)

    def write_stored(self, layer: int, start_token: int, k_st: np.ndarray, v_st: np.ndarray,
                     policy=None, kv_heads=None) -> tuple[np.ndarray, np.ndarray]:
        """`write_rows` for rows `stored_rows` returned (checked and rounded once, e.g. by a
        session that hands the same rows to its page file first)."""
        layer = _check_index("layer", layer, 1 << 20)
        start = _check_index("start_token", start_token)
        if k_st.dtype != self.config.dtype.array_dtype or v_st.shape != k_st.shape[:2] + (
                self.config.stored_value_dim,):
            raise DimensionError(f"stored rows must be {self.config.dtype.array_dtype}, K and V "
                                 f"of {self.config.head_dim} and {self.config.stored_value_dim} "
                                 f"columns, got {k_st.dtype} {k_st.shape} and {v_st.shape}")
        heads = list(range(k_st.shape[1])) if kv_heads is None else [
            _check_index("kv_head", h, 1 << 16) for h in kv_heads]
        if len(heads) != k_st.shape[1] or not heads:
            raise DimensionError(f"kv_heads names {len(heads)} heads but the rows hold "
                                 f"{k_st.shape[1]} (at least one)")
        policy = KeepAll() if policy is None else policy
        context = start + k_st.shape[0]
        self._tick += 1
        self._last = Counters(calls=1)
        if self._append_in_place(layer, heads, start, k_st, v_st):
            self._total.add(self._last)
            return k_st, v_st
        self.cache.begin()
        try:
            for hi, head in enumerate(heads):
                self._write_head(layer, head, start, k_st[:, hi], v_st[:, hi], policy, context)
        except BaseException:
            self.cache.rollback()
            raise
        self.cache.commit()
        self._total.add(self._last)
        return k_st, v_st

    def stored_rows(self, start: int, k_rows: np.ndarray,
                    v_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows (T, H, D) f32 checked (shapes, finite, finite once rounded) and returned rounded
        to the storage dtype: what any later read sees. Callers writing elsewhere first, like a
        page file, take the rows from here, so they are checked and rounded once."""
        cfg = self.config
        if isinstance(k_rows, np.ndarray) and isinstance(v_rows, np.ndarray) \
                and k_rows.dtype == v_rows.dtype == np.float32 and k_rows.ndim == v_rows.ndim == 3 \
                and k_rows.shape[2] == cfg.head_dim and v_rows.shape == k_rows.shape[:2] + (
                    cfg.stored_value_dim,) and k_rows.flags.c_contiguous \
                and v_rows.flags.c_contiguous:  # the common case: two compiled passes
            # rounded as round_rows rounds, and checked, in one pass each (NumPy's float16
            # cast took ~140 us for a 256-token chunk's K of the bundled model, this ~20)
            dt = cfg.dtype.array_dtype
            k_st, v_st = np.empty(k_rows.shape, dt), np.empty(v_rows.shape, dt)
            if round_checked(k_rows, self._fmt, k_st) and round_checked(v_rows, self._fmt, v_st):
                return k_st, v_st
        out = []  # the checks one by one, which say what is wrong
        for name, rows, width in (("k_rows", k_rows, cfg.head_dim),
                                  ("v_rows", v_rows, cfg.stored_value_dim)):
            if not isinstance(rows, np.ndarray) or rows.ndim != 3 or rows.shape[2] != width \
                    or rows.shape[:2] != k_rows.shape[:2]:
                raise DimensionError(f"{name} must be (tokens, heads, {width}) like k_rows, "
                                     f"got {getattr(rows, 'shape', None)}")
            if not np.isfinite(rows).all():
                raise NumericError(f"{name} for tokens from {start} are not finite")
            out.append(round_rows(rows, cfg.dtype))
            if _overflows(out[-1], cfg.dtype):
                raise NumericError(f"rows for tokens from {start} overflow {cfg.storage_dtype}")
        return out[0], out[1]

    def _append_in_place(self, layer, heads, start, k_st, v_st) -> bool:
        """The decode fast path (see `HotCache.append`); False when it does not apply."""
        if not self.cache.append(layer, heads, start, k_st, v_st, self._tick):
            return False
        self._peak = max(self._peak, self.cache.resident_bytes)
        return True

    def forget_before(self, layer: int, token: int) -> None:
        """Drop `layer`'s hot pages wholly before `token`: outside every later query's window
        they are never read again (the fold starts at the window's first page)."""
        self._total.evictions += self.cache.forget_before(_check_index("layer", layer, 1 << 20),
                                                          _check_index("token", token))

    def truncate(self, context_tokens: int) -> None:
        """Forget every resident row at or after `context_tokens` (rewind a sequence)."""
        self.cache.truncate(context_tokens)

    def page_rows(self, backend: KvRegenerator, key: PageKey, n: int) -> tuple[np.ndarray,
                                                                             np.ndarray]:
        """Rows (n, D) in storage dtype of one page: a copy from the hot cache when resident,
        else regenerated through the staging rows (checked like any regenerated page)."""
        rows = self.cache.read(key, n)
        if rows is not None:
            return rows
        k_out, v_out = self._call_regenerator(backend, key, n)
        if not (np.isfinite(k_out).all() and np.isfinite(v_out).all()):
            raise NumericError("regenerated rows are not finite (or not fully written)", key)
        dt = self.config.dtype
        k_st, v_st = round_rows(k_out, dt), round_rows(v_out, dt)
        if self.config.wipe_scratch_after_use:
            self._stage_k.fill(0)
            self._stage_v.fill(0)
        return k_st, v_st

    def record(self, counters: Counters) -> None:
        """A call made outside `attend_heads` (a sparse fold, atlas/sparse.py): its counters
        become the last call's and join the totals."""
        self._tick += 1
        self._last = counters
        self._total.add(counters)

    def reset(self) -> None:
        """Drop every resident page (counters are kept)."""
        self.cache.clear()

    def allocations(self) -> dict[str, int]:
        """Bytes allocated now for K/V, by category, measured from the arrays (nbytes)."""
        return {"hot_cache": self.cache.allocated_bytes(),
                "scratch": self._scratch_k.nbytes + self._scratch_v.nbytes,
                "staging": self._stage_k.nbytes + self._stage_v.nbytes}

    def telemetry(self) -> Telemetry:
        cfg = self.config
        allocated = sum(self.allocations().values())
        self._peak_allocated = max(self._peak_allocated, allocated)
        return Telemetry(total=Counters(**vars(self._total)),
                         last_call=Counters(**vars(self._last)),
                         resident_bytes=self.cache.resident_bytes, peak_resident_bytes=self._peak,
                         resident_pages=self.cache.resident_pages(),
                         scratch_bytes=cfg.scratch_bytes,
                         budget_bytes=cfg.hot_cache_bytes,
                         held_bytes=self.cache.held_bytes,
                         allocated_bytes=allocated,
                         peak_allocated_bytes=self._peak_allocated,
                         table_bytes=self.cache.table_bytes())

    # --- internals -------------------------------------------------------------------------
    def _score(self, n_head: int, n_grp: int, scale=None, softcap=None, alibi=None,
               window=None, sinks=None) -> tuple:
        """The score options checked and in kernel form: (scale, softcap (0 = none), alibi
        (H, G) f32, window (0 = none), sinks (H, G) f32, NaN = none)."""
        win = self._check_window(window)
        scale = self.config.query_scale() if scale is None else scale
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise NumericError(f"scale must be a finite positive number, got {scale!r}")
        cap = 0.0 if softcap is None else float(softcap)
        if not (math.isfinite(cap) and cap >= 0):
            raise NumericError(f"softcap must be finite and positive, got {softcap!r}")
        alibi = _per_head("alibi_slope", alibi, n_head, n_grp, 0.0)
        sinks = _per_head("sink", sinks, n_head, n_grp, np.nan)
        return float(scale), cap, alibi, win, sinks

    def _walk_out(self, q, context, out) -> tuple:
        """The compiled walks' output and query positions: out (allocated if None), qpos (T,)."""
        if out is None:
            out = np.empty(q.shape[:3] + (self.config.out_dim,), dtype=np.float32)
        return out, np.arange(context - q.shape[0], context, dtype=np.int64)

    def _walk_taken(self) -> None:
        """What a compiled walk that applied records first: the ticks of the write and attend
        calls, the peak (the rows it appended included), no scratch used."""
        self._tick += 2
        self._peak = max(self._peak, self.cache.resident_bytes)
        self._scratch_used = False

    def _fold_hot(self, layer, start, k_st, v_st, q, lo, args, out=None) -> np.ndarray | None:
        """`write_attend`'s compiled path when every page is hot: the rows appended, the fold
        and merge, the recency marks, in one compiled call (`HotCache.append_fold` with a
        walk that maps nothing: a page that is not resident and whole refuses it), then the
        counters of a write call and an all-hot attend call. None, nothing changed, when the
        walk does not apply. Its fold seconds include the rows' append (a few hundred bytes)."""
        cfg = self.config
        context = start + q.shape[0]
        scale, cap, alibi, win, sinks = args
        n_head, n_pg = k_st.shape[1], -(-context // cfg.page_tokens) - lo
        slot, expect, refuse, lens, bad = _maps_nothing(n_head, n_pg)
        out, qpos = self._walk_out(q, context, out)
        fold_args = (self._scratch_k, self._scratch_v, *self._no_map, slot, expect, refuse,
                     lens, q, qpos, context, cfg.split_pages, np.float32(scale),
                     np.float32(cap), alibi, win, self._fmt, sinks, out,
                     *fold.walk_plan(q, bad, (lo, context, cfg.split_pages), self._no_map,
                                     out), bad)
        t0 = time.perf_counter()
        n_hot = self.cache.append_fold(layer, start, k_st, v_st, lo,
                                       (self._tick + 1, self._tick + 2), fold_args)[0]
        seconds = time.perf_counter() - t0
        if n_hot < 0:  # not all hot
            return None
        self._walk_taken()
        pages = n_head * n_pg
        self._last = Counters(calls=1, pages_folded=pages, hot_hits=pages,
                              tokens_consumed=(context - lo * cfg.page_tokens) * n_head,
                              fold_seconds=seconds)
        self._total.add_walk(self._last)
        return out

    @property
    def clock(self) -> int:
        """The recency clock: calls so far (each write and each attend call ticks it)."""
        return self._tick

    def batched_walks(self, walked: np.ndarray, n_head: int, tick: int, counts: list,
                      seconds: float, last: tuple) -> None:
        """The bookkeeping of all-hot decode walks a batched call made for this atlas
        (atlas/batch_walk.py): walked[layer] walks per layer, each over n_head heads, the
        clock after them, (pages folded, tokens consumed) summed, their fold seconds, and the
        last walk's (pages, tokens, seconds). What `_fold_hot` records after each walk (the
        rows' bytes, the clock, the peak, the counters of a write and an attend call), in
        one go."""
        self.cache.walked(walked, n_head * self.config.row_bytes)
        n = int(walked.sum())
        self._tick = tick
        self._peak = max(self._peak, self.cache.resident_bytes)
        self._scratch_used = False
        pages, tokens = counts
        t = self._total
        t.calls += 2 * n
        t.pages_folded += pages
        t.hot_hits += pages
        t.tokens_consumed += tokens
        t.fold_seconds += seconds
        self._last = Counters(calls=1, pages_folded=last[0], hot_hits=last[0],
                              tokens_consumed=last[1], fold_seconds=last[2])

    def _fold_mapped(self, layer, start, k_st, v_st, q, lo, lens, maps, args,
                     out=None) -> np.ndarray | None:
        """`_fold_hot` for a walk whose pages not hot are read in place from the regenerator's
        mapping (`maps`): the rows appended, the fold and merge with each mapped page's
        checksum checked (a mismatch raised before the result is used), the recency marks, in
        one compiled call (`HotCache.append_fold`); the counters of a write call and of the
        attend call the general path makes (mapped pages count as regenerated). None, nothing
        changed, when the walk does not apply (a page neither hot nor mapped). On a page that
        fails its check, `out` is left NaN."""
        cfg = self.config
        context = start + q.shape[0]
        scale, cap, alibi, win, sinks = args
        out, qpos = self._walk_out(q, context, out)
        span = (lo, context, cfg.split_pages)
        shape = (k_st.shape[1], lens.shape[0])
        if not maps.slot.shape == maps.expect.shape == maps.missing.shape == shape:
            raise DimensionError(f"map_pages returned tables of {maps.slot.shape}, "
                                 f"{maps.expect.shape}, {maps.missing.shape} for {shape} pages")
        bad = np.zeros(shape, dtype=np.uint8)
        fold_args = (self._scratch_k, self._scratch_v, maps.k, maps.v, maps.slot, maps.expect,
                     maps.missing, lens, q, qpos, context, cfg.split_pages, np.float32(scale),
                     np.float32(cap), alibi, win, self._fmt, sinks, out,
                     *fold.walk_plan(q, bad, span, (self.cache.k,), out), bad)
        t0 = time.perf_counter()
        n_hot, mapped_tokens, n_bad = self.cache.append_fold(
            layer, start, k_st, v_st, lo, (self._tick + 1, self._tick + 2), fold_args)
        seconds = time.perf_counter() - t0
        if n_hot < 0:
            return None
        self._walk_taken()
        n_head, n_pg = bad.shape
        c = self._last = Counters(calls=1, pages_folded=n_head * n_pg, hot_hits=n_hot,
                                  tokens_consumed=(context - lo * cfg.page_tokens) * n_head,
                                  fold_seconds=seconds)
        if n_bad:  # a mapped page failed its check: raise as the two calls would (the
            # attend call's counters and undo; out holds no result)
            self._total.calls += 1  # the write call
            self._last = Counters(calls=1)
            self.cache.begin()
            self.cache.rollback()
            out.fill(np.nan)
            self._check_walk(layer, range(n_head), (lo + np.arange(n_pg)) * cfg.page_tokens,
                             lens, bad, bad)
        c.regenerations = n_head * n_pg - n_hot  # mapped pages count as regenerated
        c.bytes_mapped = c.bytes_regenerated = mapped_tokens * cfg.row_bytes
        self._total.add_walk(self._last)
        return out

    def _check_query(self, query, n_head: int) -> np.ndarray:
        D = self.config.head_dim
        if not isinstance(query, np.ndarray) or query.ndim != 4 or query.shape[1] != n_head \
                or query.shape[3] != D or query.shape[0] < 1 or query.shape[2] < 1:
            raise DimensionError(f"query must be (tokens, {n_head}, group, {D}), "
                                 f"got {getattr(query, 'shape', None)}")
        if query.dtype != np.float32:
            raise DimensionError(f"query must be float32, got {query.dtype}")
        if not np.isfinite(query).all():
            raise NumericError("query is not finite")
        return np.ascontiguousarray(query)

    @staticmethod
    def _check_window(window) -> int:
        if window is None:
            return 0
        if isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1:
            raise PageError(f"window must be a positive integer or None, got {window!r}")
        return int(window)

    @staticmethod
    def _check_out(out, shape) -> None:
        if not isinstance(out, np.ndarray) or out.shape != tuple(shape) or out.dtype != np.float32:
            raise DimensionError(f"out must be a float32 array of shape {tuple(shape)}, got "
                                 f"{getattr(out, 'dtype', None)} {getattr(out, 'shape', None)}")

    def _fold_all(self, backend, layer, heads, q, context, policy, scale, cap, alibi, win, sinks,
                  out):
        cfg, c = self.config, self._last
        P, split = cfg.page_tokens, cfg.split_pages
        n_tok, n_head, n_grp, _ = q.shape
        n_pages = page_count(context, P)
        lo = first_page(context - n_tok - win + 1, P) if win else 0
        n_part = -(-n_pages // split)
        m = np.full((n_tok, n_head, n_part, n_grp), -np.inf, dtype=np.float64)
        l = np.zeros((n_tok, n_head, n_part, n_grp), dtype=np.float64)
        acc = np.zeros((n_tok, n_head, n_part, n_grp, cfg.out_dim), dtype=np.float64)
        qpos = np.arange(context - n_tok, context, dtype=np.int64)

        lay = self.cache.tables(layer, max(heads) + 1, n_pages)
        hidx = np.asarray(heads, dtype=np.int64)
        pages = np.arange(lo, n_pages, dtype=np.int64)
        starts = pages * P
        lens = np.minimum(P, context - starts)
        slots = lay.slot[hidx, lo:n_pages]  # a copy: misses get their scratch slot here
        hot = (slots >= 0) & (lay.tokens[hidx, lo:n_pages] == lens)
        for hi, pi in zip(*np.nonzero((slots >= 0) & ~hot), strict=True):  # stale partial pages
            self.cache.evict(PageKey(layer, heads[hi], int(starts[pi])))
            c.evictions += 1
        self.cache.touch(layer, hidx, lo, hot, self._tick)
        # the walk reads hot pages from their slots: none is reused before it was folded
        self.cache.protect(slots, hot)

        src = np.where(hot, fold.SRC_HOT, fold.SRC_SCRATCH).astype(np.int64)
        n_pg = len(pages)
        maps = self._map_misses(backend, layer, hidx, lo, lens, hot, src, slots)
        # The walk, head-major then page: hot pages fold from their slab slot, mapped pages in
        # place; each other miss is regenerated into the next scratch slot, and the walk so far
        # is folded whenever scratch is full.
        bad = np.zeros(src.shape, dtype=np.uint8)
        slabs = (self.cache.k, self.cache.v, self._scratch_k, self._scratch_v,
                 maps.k if maps else self._no_map[0], maps.v if maps else self._no_map[1])
        # every walk array C-contiguous: a strided one is another type to numba, and each
        # fold kernel specialization costs 7-10 s of compiling on first use
        expect = np.ascontiguousarray(maps.expect) if maps else np.zeros(src.shape, np.uint32)
        walk = (src, np.ascontiguousarray(slots), expect, bad)
        fold_args = (q, qpos, slabs, walk, lo, context, scale, cap, alibi, win, m, l, acc)
        t_fold, begin, n_scr = 0.0, 0, 0
        for f in np.flatnonzero(src == fold.SRC_SCRATCH).tolist():
            if n_scr == cfg.scratch_pages:
                t_fold += self._flush(begin, f, *fold_args)
                begin, n_scr = f, 0
                self.cache.folded_up_to(f)
            hi, pi = divmod(f, n_pg)
            self._regenerate(backend, PageKey(layer, heads[hi], int(starts[pi])), int(lens[pi]),
                             n_scr, policy, context)
            slots[hi, pi] = n_scr
            n_scr += 1
        t_fold += self._flush(begin, src.size, *fold_args)
        self._check_walk(layer, heads, starts, lens, src, bad)
        c.hot_hits += int(hot.sum())
        t0 = time.perf_counter()
        result = out if out is not None else np.empty(q.shape[:3] + (cfg.out_dim,),
                                                       dtype=np.float32)
        fold.merge_partitions(m, l, acc, sinks, result)
        c.fold_seconds += t_fold + time.perf_counter() - t0
        c.pages_folded += n_head * n_pg
        c.tokens_consumed += int(lens.sum()) * n_head
        return result

    def _check_walk(self, layer, heads, starts, lens, src, bad) -> None:
        """After the walk, before its result is used: a mapped page whose checksum did not
        match raises; mapped pages are counted as regenerated, with their bytes."""
        if bad.any():
            hi, pi = (int(x[0]) for x in np.nonzero(bad))
            raise CorruptPageError(f"{PageKey(layer, heads[hi], int(starts[pi]))}: checksum "
                                   f"mismatch in the mapped page (what the fold read is not "
                                   f"what was written)")
        mapped = src == fold.SRC_MAP
        c = self._last
        c.regenerations += int(mapped.sum())
        mapped_bytes = int((lens * mapped).sum()) * self.config.row_bytes
        c.bytes_mapped += mapped_bytes
        c.bytes_regenerated += mapped_bytes

    def _map_misses(self, backend, layer, hidx, lo, lens, hot, src, slots):
        """Point the misses the backend holds mapped at its slabs (src SRC_MAP); None if it
        maps nothing. Pages it lacks stay SRC_SCRATCH (regenerate_page then says why)."""
        map_pages = getattr(backend, "map_pages", None)
        if map_pages is None:
            return None
        maps = map_pages(layer, hidx, lo, lens, ~hot)  # also when all are hot: it learns so
        use = ~hot & ~maps.missing
        src[use] = fold.SRC_MAP
        slots[use] = maps.slot[use]
        return maps

    def _flush(self, a, b, q, qpos, slabs, walk, lo, context, scale, cap, alibi, win, m, l,
               acc) -> float:
        """Fold pages a..b of the walk (flat index = head index * pages + page - lo)."""
        if a >= b:
            return 0.0
        t0 = time.perf_counter()
        fold.fold_pages(q, qpos, slabs, walk, (lo, context, self.config.split_pages, a, b),
                        (np.float32(scale), np.float32(cap), alibi, win, self._fmt), (m, l, acc))
        return time.perf_counter() - t0

    def _call_regenerator(self, backend, key: PageKey, n: int):
        """The staging rows (n, D) float32 as the backend wrote them for `key`'s first n tokens;
        rows it forgets to write stay NaN (caught as non-finite by the callers); a backend's
        own exception becomes a RegeneratorError naming the page."""
        k_out, v_out = self._stage_k[:n], self._stage_v[:n]
        k_out.fill(np.nan)
        v_out.fill(np.nan)
        try:
            backend.regenerate_page(key, range(key.start_token, key.start_token + n), k_out, v_out)
        except AtlasError:
            raise
        except Exception as e:
            raise RegeneratorError(key, f"{type(e).__name__}: {e}") from e
        return k_out, v_out

    def _regenerate(self, backend, key: PageKey, n: int, slot: int, policy, context: int) -> None:
        cfg, c = self.config, self._last
        self._scratch_used = True
        t0 = time.perf_counter()
        try:
            k_out, v_out = self._call_regenerator(backend, key, n)
        finally:
            c.regen_seconds += time.perf_counter() - t0
        bad = NumericError("regenerated rows are not finite (or not fully written)", key)
        if cfg.dtype is StorageDtype.FLOAT32:  # rows are the stored values: check + place, once
            if not stage_f32(k_out, v_out, self._scratch_k[slot, :, :n],
                             self._scratch_v[slot, :n]):
                raise bad
            k_st, v_st = k_out, v_out
        else:
            if not (np.isfinite(k_out).all() and np.isfinite(v_out).all()):
                raise bad
            k_st, v_st = round_rows(k_out, cfg.dtype), round_rows(v_out, cfg.dtype)
            if _overflows(k_st, cfg.dtype) or _overflows(v_st, cfg.dtype):
                raise NumericError(f"regenerated rows overflow {cfg.storage_dtype}", key)
            self._scratch_k[slot, :, :n] = k_st.T
            self._scratch_v[slot, :n] = v_st
        c.regenerations += 1
        c.bytes_regenerated += n * cfg.row_bytes
        if cfg.admit_regenerated_pages and policy.admits(key, cfg.page_tokens, context):
            self._admit(key, k_st, v_st, policy, context)

    def _admit(self, key: PageKey, k_st, v_st, policy, context: int) -> bool:
        c = self._last
        evicted = self.cache.make_room(key, policy, context, self._tick)
        if evicted < 0:
            c.admission_rejections += 1
            return False
        c.evictions += evicted
        self.cache.admit(key, k_st, v_st, self._tick)
        c.admissions += 1
        self._peak = max(self._peak, self.cache.resident_bytes)
        self._peak_allocated = max(self._peak_allocated, sum(self.allocations().values()))
        return True

    def _write_head(self, layer, head, start, k_st, v_st, policy, context) -> None:
        P = self.config.page_tokens
        for page_start, pos, stop in page_spans(start, start + k_st.shape[0], P):
            key = PageKey(layer, head, page_start)
            rows_k, rows_v = k_st[pos - start:stop - start], v_st[pos - start:stop - start]
            slot, have = self.cache.page_state(key)
            if slot >= 0 and have != pos - page_start:  # not a contiguous append: drop it
                self.cache.evict(key)
                self._last.evictions += 1
                slot = -1
            if slot >= 0:  # its slot is held (and charged) already: it grows in place
                self.cache.grow(key, rows_k, rows_v, self._tick)
                self._peak = max(self._peak, self.cache.resident_bytes)
            elif pos == page_start and policy.admits(key, P, context):
                self._admit(key, rows_k, rows_v, policy, context)

    def _wipe_scratch(self) -> None:
        self._scratch_k.fill(0)
        self._scratch_v.fill(0)
        self._stage_k.fill(0)  # the float32 staging rows hold K/V too
        self._stage_v.fill(0)
