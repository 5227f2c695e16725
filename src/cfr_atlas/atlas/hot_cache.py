"""The hot cache: resident K/V pages in one slot pool bounded by a byte budget, with undo.

Storage is one pool of page slots shared by every layer: `k` (slots, head_dim, page_tokens) holds K
pages transposed (the fold's score loop runs across keys), `v` (slots, page_tokens, head_dim) holds
V rows, both in the storage dtype; when V is a view of K (`config.value_dim`, MLA) `v` has width 0
and every V argument is a (n, 0) array. A resident page occupies one whole slot, however many rows
it holds, so the budget is charged per slot: `held_bytes` = slots held x page_bytes. The pool never
has more than `capacity` = hot_cache_bytes // page_bytes slots, so the bytes really allocated
(`allocated_bytes`, the arrays' nbytes) never exceed the budget. With `config.preallocate_hot_cache`
the whole pool is allocated on first use (once, no copy ever); otherwise it grows geometrically up
to the capacity (an unbounded cache).

Per layer, three tables indexed [kv_head, page_index] say where a page lives (`slot`, -1 when
not resident), how many tokens it holds (`tokens`) and when it was last used (`last_use`, a
call counter). The fold reads the tables with NumPy, so an all-hot call costs no per-page
Python. Only this class writes them: the runtime asks it to `admit`, `grow`, `append`,
`evict`, `truncate`, and for the decode walk over resident and mapped pages (`append_fold`: its
tables and slabs handed to one compiled call, atlas/decode_walk.py, which also folds). The one
other writer is the batched decode walk (atlas/batch_walk.py), to which this class hands its
tables and slabs as typed lists (`walk_lists`): its kernel appends rows and marks recency
exactly as `append_fold` does, and the rows' bytes are accounted (`walked`) when the step
hands each Atlas its bookkeeping, so within a step `resident_bytes` may lag the rows written.

Invariants (checked by the stateful test):
- held_bytes == slots held x page_bytes <= budget, and per layer <= the layer budget;
- resident_bytes == sum over resident pages of tokens * row_bytes <= held_bytes (logical rows);
- allocated_bytes == k.nbytes + v.nbytes <= capacity x page_bytes <= budget;
- a slot is in exactly one of: a table entry, the free list, the pending list.

Transactions: `begin()` opens a journal. Evicted slots go to a pending list instead of the
free list, so their rows survive; `rollback()` replays the journal backwards, restoring the
tables (recency included) and the accounting. A full pool may hand a pending slot to a new page
of the same call (the pool is never enlarged past the budget to keep it), but never a slot the
running fold still reads (`protect`); such a victim cannot come back on rollback and simply
stays evicted (it is regenerated on demand, bits unchanged).
No timing or telemetry code lives here: mutators return counts, the runtime records them.
"""

from __future__ import annotations

import functools

import numpy as np

from cfr_atlas.atlas import decode_walk
from cfr_atlas.atlas.config import AtlasConfig
from cfr_atlas.atlas.pages import PageKey


class _Layer:
    """Page tables of one layer (the slots live in the shared pool)."""

    def __init__(self):
        self.slot = np.full((0, 0), -1, dtype=np.int64)
        self.tokens = np.zeros((0, 0), dtype=np.int64)
        self.last_use = np.zeros((0, 0), dtype=np.int64)
        self.bytes = 0   # logical: resident rows x row_bytes
        self.slots = 0   # slots held by this layer's pages

    def ensure_table(self, heads: int, pages: int) -> bool:
        """Grow the tables to cover `heads` x `pages`; True when they were reallocated."""
        h0, p0 = self.slot.shape
        if heads <= h0 and pages <= p0:
            return False
        h1, p1 = max(heads, h0), max(pages, 2 * p0, 8)
        for name, fill in (("slot", -1), ("tokens", 0), ("last_use", 0)):
            old = getattr(self, name)
            new = np.full((h1, p1), fill, dtype=np.int64)
            new[:h0, :p0] = old
            setattr(self, name, new)
        return True

    @property
    def table_bytes(self) -> int:
        return self.slot.nbytes + self.tokens.nbytes + self.last_use.nbytes


class HotCache:
    """Resident pages of one sequence under `config.hot_cache_bytes` (see module docstring)."""

    def __init__(self, config: AtlasConfig):
        self.config = config
        self.row_bytes, self.page_tokens = config.row_bytes, config.page_tokens
        self.page_bytes = config.page_bytes
        self.capacity = config.hot_cache_bytes // config.page_bytes  # slots, at most
        self.layers: dict[int, _Layer] = {}
        self.resident_bytes = 0
        self.held_slots = 0
        # counts every replacement of the arrays the batched decode walk reads (tables, slabs):
        # `walk_lists` rebuilds its lists when it moved, and their holders compare it
        self.walk_version = 0
        self._walk_lists: tuple | None = None
        self._empty_pool()
        self._journal: list[tuple] | None = None
        self._pending: list[int] = []  # slots evicted inside a transaction
        self._stolen: set[int] = set()  # pending slots handed to a new page in this transaction
        # slot -> position in the running fold's walk; a slot at or after `_folded` is still
        # to be read, so it is never handed out (built only when a slot must be reused)
        self._walk: tuple | None = None
        self._protected: dict[int, int] | None = None
        self._folded = 0
        # The ranking of resident pages by policy priority, valid while the set of resident
        # pages (the epoch counts admissions and evictions), the policy, the context and, for
        # policies that rank by recency, the call stay the same.
        self._epoch = 0
        self._ranked: tuple | None = None

    def _empty_pool(self) -> None:
        self._arrays_replaced()
        dt, D, P = self.config.dtype.array_dtype, self.config.head_dim, self.page_tokens
        self.k = np.zeros((0, D, P), dtype=dt)  # K^T pages
        # V rows; width 0 when V is a view of K (config.value_dim): nothing stored twice
        self.v = np.zeros((0, P, self.config.stored_value_dim), dtype=dt)
        self.free: list[int] = []

    # --- lookups ---------------------------------------------------------------------------
    def layer(self, layer: int) -> _Layer:
        lay = self.layers.get(layer)
        if lay is None:
            lay = self.layers[layer] = _Layer()
            self._arrays_replaced()
        return lay

    def tables(self, layer: int, heads: int, pages: int) -> _Layer:
        """The tables of `layer`, grown to cover `heads` x `pages` (read them, do not write)."""
        lay = self.layer(layer)
        if lay.ensure_table(heads, pages):
            self._arrays_replaced()
        return lay

    def _arrays_replaced(self) -> None:
        """A table or slab array was replaced: the walk lists no longer hold it."""
        self.walk_version += 1
        self._walk_lists = None

    def walk_lists(self) -> tuple:
        """(slot, tokens, last_use, k, v) as numba typed lists, for the batched decode walk
        (atlas/batch_walk.py): per layer 0..L-1 (L: one past the highest layer with tables)
        that layer's table, an empty (0, 0) table where a layer has none; k and v hold the
        pool's slabs as one item each. Built on first use after any replacement of those
        arrays (`walk_version` then moves: a holder of older lists must fetch these) and
        read only by the kernels, which write rows, rows held and recency into the arrays
        they reference, as `append_fold` does."""
        if self._walk_lists is None:
            from numba import from_dtype, typed, types  # only processes that batch build them

            table_t = types.Array(types.int64, 2, "C")
            none = np.zeros((0, 0), dtype=np.int64)
            n = max(self.layers, default=-1) + 1
            lists = []
            for name in ("slot", "tokens", "last_use"):
                tables = typed.List.empty_list(table_t)
                for i in range(n):
                    lay = self.layers.get(i)
                    tables.append(none if lay is None else getattr(lay, name))
                lists.append(tables)
            for slab in (self.k, self.v):
                one = typed.List.empty_list(types.Array(from_dtype(slab.dtype), 3, "C"))
                one.append(slab)
                lists.append(one)
            self._walk_lists = tuple(lists)
        return self._walk_lists

    def walk_arrays(self, layer: int) -> tuple:
        """`walk_lists`' arrays for one layer as plain arrays: (slot, tokens, last_use, k, v),
        an empty (0, 0) table for each of the first three where the layer has none; for the
        batched decode walk of a single sequence (`decode_walk.hot_walk_one`), fetched for
        each call (so a call never holds an array the cache replaced)."""
        lay = self.layers.get(layer)
        if lay is None:
            return _NO_TABLE, _NO_TABLE, _NO_TABLE, self.k, self.v
        return lay.slot, lay.tokens, lay.last_use, self.k, self.v

    def budget(self) -> int:
        return self.config.hot_cache_bytes

    def layer_budget(self, layer: int) -> int:
        budgets = self.config.layer_budgets or {}
        return budgets.get(layer, self.config.hot_cache_bytes)

    @property
    def held_bytes(self) -> int:
        """Bytes of the slots held by resident pages (what the budget is charged)."""
        return self.held_slots * self.page_bytes

    def resident_pages(self) -> int:
        return self.held_slots

    def allocated_bytes(self) -> int:
        """Bytes of the slot pool as allocated (not as used)."""
        return self.k.nbytes + self.v.nbytes

    def table_bytes(self) -> int:
        """Bookkeeping: the int64 page tables (grow with the context, not with the budget)."""
        return sum(lay.table_bytes for lay in self.layers.values())

    def page_state(self, key: PageKey) -> tuple[int, int]:
        """(slot, tokens) of a page; slot -1 when not resident."""
        lay = self.layers.get(key.layer)
        page = key.start_token // self.page_tokens
        if lay is None or key.kv_head >= lay.slot.shape[0] or page >= lay.slot.shape[1]:
            return -1, 0
        return int(lay.slot[key.kv_head, page]), int(lay.tokens[key.kv_head, page])

    def read(self, key: PageKey, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Copies of a resident page's rows (n, D) in storage dtype if it holds exactly n, else
        None."""
        slot, have = self.page_state(key)
        if slot < 0 or have != n:
            return None
        return self.k[slot, :, :n].T.copy(), self.v[slot, :n].copy()

    # --- transactions ------------------------------------------------------------------------
    def begin(self) -> None:
        self._journal = []

    def protect(self, slots: np.ndarray, hot: np.ndarray) -> None:
        """The running fold reads slots[hot] (walk position = flat index): their rows must
        survive until `folded_up_to` passes them. Kept by reference, read only if needed."""
        self._walk, self._protected, self._folded = (slots, hot), None, 0

    def folded_up_to(self, position: int) -> None:
        """The running fold has read every page before walk position `position`."""
        self._folded = position

    def _reusable(self, slot: int) -> bool:
        if self._protected is None:
            self._protected = {}
            if self._walk is not None:
                slots, hot = self._walk
                self._protected = dict(zip(slots[hot].tolist(), np.flatnonzero(hot).tolist(),
                                           strict=True))
        return self._protected.get(slot, -1) < self._folded

    def commit(self) -> None:
        self.free.extend(self._pending)
        self._end()

    def _end(self) -> None:
        self._pending.clear()
        self._stolen.clear()
        self._walk, self._protected = None, None
        self._journal = None

    def touch(self, layer: int, heads: np.ndarray, lo: int, hot: np.ndarray, tick: int) -> None:
        """Mark the hot pages lo.. of `heads` used at `tick` (journaled, so undone on rollback)."""
        used = self.layers[layer].last_use[:, lo:lo + hot.shape[1]]
        before = used[heads]
        if self._journal is not None:
            self._journal.append(("touch", layer, heads, lo, before, 0, 0))
        used[heads] = np.where(hot, tick, before)

    def rollback(self) -> None:
        self._epoch += 1
        for entry in reversed(self._journal or []):
            if entry[0] == "touch":
                _, layer, heads, lo, before, _, _ = entry
                self.layers[layer].last_use[:, lo:lo + before.shape[1]][heads] = before
                continue
            op, layer, head, page, slot, tokens, last_use = entry
            lay = self.layers[layer]
            if op == "admit":
                self._set(lay, head, page, -1, 0, lay.last_use[head, page])
            elif op == "evict" and slot not in self._stolen:
                self._set(lay, head, page, slot, tokens, last_use)
            elif op == "grow":  # tokens is the growth
                lay.tokens[head, page] -= tokens
                self._account(lay, -tokens * self.row_bytes, 0)
        held = {int(s) for lay in self.layers.values() for s in lay.slot[lay.slot >= 0]}
        self.free = [s for s in range(self.k.shape[0] - 1, -1, -1) if s not in held]
        self._end()

    def _log(self, *entry) -> None:
        if self._journal is not None:
            self._journal.append(entry)

    def _account(self, lay: _Layer, nbytes: int, slots: int) -> None:
        lay.bytes += nbytes
        self.resident_bytes += nbytes
        lay.slots += slots
        self.held_slots += slots

    def _set(self, lay: _Layer, head: int, page: int, slot: int, tokens: int, last_use) -> None:
        """Point a table entry at `slot` with `tokens` rows (slot -1: not resident), accounted."""
        old = int(lay.tokens[head, page])
        was = int(lay.slot[head, page]) >= 0
        lay.slot[head, page] = slot
        lay.tokens[head, page] = tokens
        lay.last_use[head, page] = last_use
        self._account(lay, (tokens - old) * self.row_bytes, int(slot >= 0) - int(was))

    # --- slots -------------------------------------------------------------------------------
    def _take_slot(self) -> int:
        """A slot for a new page; `make_room` checked that one can be had."""
        if not self.free and self.k.shape[0] < self.capacity:
            self._grow_pool()
        if self.free:
            return self.free.pop()
        # a victim of this call that the fold does not read: it will not come back on rollback
        i = next(i for i in range(len(self._pending) - 1, -1, -1)
                 if self._reusable(self._pending[i]))
        slot = self._pending.pop(i)
        self._stolen.add(slot)
        return slot

    def _slot_obtainable(self, victims: list) -> bool:
        """After evicting `victims` (keys), can `_take_slot` hand out a slot?"""
        if self.free or self.k.shape[0] < self.capacity:
            return True
        slots = self._pending + [self.page_state(v)[0] for _, v in victims]
        return any(self._reusable(s) for s in slots)

    def _grow_pool(self) -> None:
        cap = self.k.shape[0]
        if self.config.preallocate_hot_cache:
            new_cap = self.capacity
        else:
            new_cap = min(max(2 * cap, 8), self.capacity)
        k = np.zeros((new_cap,) + self.k.shape[1:], dtype=self.k.dtype)
        v = np.zeros((new_cap,) + self.v.shape[1:], dtype=self.v.dtype)
        k[:cap], v[:cap] = self.k, self.v
        self.k, self.v = k, v
        self._arrays_replaced()
        self.free.extend(range(new_cap - 1, cap - 1, -1))  # pop() hands out low slots first

    # --- mutators --------------------------------------------------------------------------
    def evict(self, key: PageKey) -> None:
        self._epoch += 1  # the cached ranking no longer lists the resident pages
        self._evict(key)

    def _evict(self, key: PageKey) -> None:
        lay = self.layers[key.layer]
        page = key.start_token // self.page_tokens
        slot, tokens = int(lay.slot[key.kv_head, page]), int(lay.tokens[key.kv_head, page])
        last_use = int(lay.last_use[key.kv_head, page])
        self._set(lay, key.kv_head, page, -1, 0, last_use)
        if self._journal is not None:
            self._pending.append(slot)
        else:
            self.free.append(slot)
        self._log("evict", key.layer, key.kv_head, page, slot, tokens, last_use)

    def make_room(self, key: PageKey, policy, context_tokens: int, tick: int) -> int:
        """Evict lower-priority pages so one more slot fits; -1 if impossible (nothing evicted).

        Only pages of strictly lower priority than the incoming one may leave, lowest first.
        A layer over its own budget gives up its own pages; the global budget takes any layer's.
        """
        lay, PB = self.layer(key.layer), self.page_bytes
        need_layer = lay.slots + 1 - self.layer_budget(key.layer) // PB
        need_global = self.held_slots + 1 - self.capacity
        if need_layer <= 0 and need_global <= 0:
            return 0 if self._slot_obtainable([]) else -1
        if PB > min(self.budget(), self.layer_budget(key.layer)):
            return -1
        incoming = policy.keep_priority(key, self.page_tokens, context_tokens, tick)
        ranked = self._ranking(policy, context_tokens, tick)
        chosen, freed = [], 0  # (position in ranked, key)
        if need_layer > 0:
            freed = self._pick(ranked, incoming, key, need_layer, chosen, key.layer)
            if freed < need_layer:
                return -1
        if freed < need_global:
            freed = self._pick(ranked, incoming, key, need_global, chosen, None, freed)
            if freed < need_global:
                return -1
        if not self._slot_obtainable(chosen):
            return -1
        for i, victim in sorted(chosen, reverse=True):
            del ranked[i]  # the ranking stays valid: only these members left
            self._evict(victim)
        return len(chosen)

    def _pick(self, ranked, incoming, protect, need, chosen, layer, freed=0) -> int:
        """Add ranked pages (lowest first, of `layer` if given) to `chosen` until `need` slots
        are freed or the priorities reach `incoming`; returns the slots freed so far."""
        taken = {i for i, _ in chosen}
        for i, (prio, victim) in enumerate(ranked):
            if freed >= need or not prio < incoming:
                break
            if i in taken or victim == protect or (layer is not None and victim.layer != layer):
                continue
            chosen.append((i, victim))
            freed += 1
        return freed

    def _ranking(self, policy, context_tokens: int, tick: int) -> list:
        """Every resident page as (priority, key), lowest priority first; rebuilt only
        when residency, the policy, the context or the call changed (a fold that keeps
        rejecting admissions pays for one ranking, not one per page)."""
        recency = getattr(policy, "ranks_by_recency", True)
        state = (self._epoch, id(policy), context_tokens, tick if recency else None)
        if self._ranked is None or self._ranked[0] != state:
            out = []
            for layer, lay in self.layers.items():
                if not lay.slots:
                    continue
                heads, pages = np.nonzero(lay.slot >= 0)
                for h, p in zip(heads.tolist(), pages.tolist(), strict=True):
                    key = PageKey(layer, h, p * self.page_tokens)
                    prio = policy.keep_priority(key, self.page_tokens, context_tokens,
                                                int(lay.last_use[h, p]))
                    out.append((prio, key))
            out.sort()
            self._ranked = (state, out)
        return self._ranked[1]

    def admit(self, key: PageKey, k_rows: np.ndarray, v_rows: np.ndarray, tick: int) -> None:
        """Copy rows (n, D) in storage dtype into a fresh slot; room must have been made."""
        self._epoch += 1
        lay = self.layer(key.layer)
        page = key.start_token // self.page_tokens
        if lay.ensure_table(key.kv_head + 1, page + 1):
            self._arrays_replaced()
        slot = self._take_slot()
        n = k_rows.shape[0]
        self.k[slot, :, :n] = k_rows.T
        self.v[slot, :n] = v_rows
        self._set(lay, key.kv_head, page, slot, n, tick)
        self._log("admit", key.layer, key.kv_head, page, slot, n, tick)

    def grow(self, key: PageKey, k_rows: np.ndarray, v_rows: np.ndarray, tick: int) -> None:
        """Append rows to a resident partial page (its slot is already held and charged)."""
        lay = self.layers[key.layer]
        page = key.start_token // self.page_tokens
        slot, n0 = int(lay.slot[key.kv_head, page]), int(lay.tokens[key.kv_head, page])
        n = k_rows.shape[0]
        self.k[slot, :, n0:n0 + n] = k_rows.T
        self.v[slot, n0:n0 + n] = v_rows
        lay.tokens[key.kv_head, page] = n0 + n
        lay.last_use[key.kv_head, page] = tick
        self._account(lay, n * self.row_bytes, 0)
        self._log("grow", key.layer, key.kv_head, page, slot, n, tick)

    def append(self, layer: int, heads: list[int], start: int, k_st: np.ndarray,
               v_st: np.ndarray, tick: int) -> bool:
        """The decode fast path: rows (T, H, D) of tokens start.. for `heads` when every head's
        page is resident, holds exactly the rows before `start` and has room for T more; then
        all heads grow in one compiled write (what `grow` does head by head). Else False."""
        rows = np.asarray(heads, dtype=np.int64)
        n_rows = int(rows.max()) + 1 if rows.size else 0
        return self._append(layer, rows, n_rows, start, k_st, v_st, start // self.page_tokens,
                            (tick, tick)) is not None

    def _append(self, layer, heads, n_rows, start, k_st, v_st, lo, ticks) -> np.ndarray | None:
        """`append` for table rows `heads` (all below n_rows): the walk's slots, or None."""
        T = k_st.shape[0]
        lay = self._walk_tables(layer, n_rows, start + T, lo)
        if lay is None:
            return None
        slots = np.empty((len(heads), -(-(start + T) // self.page_tokens) - lo), dtype=np.int64)
        if not decode_walk.append_walk(lay.slot, lay.tokens, lay.last_use, self.k, self.v,
                                       heads, start, k_st, v_st, lo, ticks[0], ticks[1], slots,
                                       True, False):
            return None
        self._account(lay, T * len(heads) * self.row_bytes, 0)
        return slots

    def _walk_tables(self, layer: int, n_heads: int, end: int, lo: int) -> _Layer | None:
        """`layer`'s tables if they cover heads 0..n_heads-1 and pages lo.. of a context of
        `end` tokens (a walk from page lo), else None."""
        lay = self.layers.get(layer)
        n_pages = -(-end // self.page_tokens)
        if lay is None or not (0 <= lo < n_pages <= lay.slot.shape[1]
                               and n_heads <= lay.slot.shape[0]):
            return None
        return lay

    def walk_misses(self, layer: int, n_heads: int, start: int, n_rows: int,
                    lo: int) -> np.ndarray | None:
        """Whether `append_fold` can take n_rows rows of heads 0..n_heads-1 from `start`
        (`decode_walk.look`), nothing written: None when it cannot, else (H, NP) bool, True
        where page lo + i of head h is not resident (what a mapping regenerator is asked)."""
        lay = self._walk_tables(layer, n_heads, start + n_rows, lo)
        if lay is None:
            return None
        need = np.empty((n_heads, -(-(start + n_rows) // self.page_tokens) - lo), dtype=np.bool_)
        if not decode_walk.look(lay.slot, lay.tokens, self.k, self.v, n_heads, start, n_rows,
                                lo, need):
            return None
        return need

    def append_fold(self, layer: int, start: int, k_st: np.ndarray, v_st: np.ndarray, lo: int,
                    ticks: tuple[int, int], fold_args: tuple) -> tuple[int, int, int]:
        """`decode_walk.append_walk`'s write with misses allowed (a head whose growing page is
        not resident takes no rows), the fold of the walk whose pages not resident are mapped,
        then the recency marks of the resident pages at ticks[1] unless a mapped page failed
        its check, in one compiled call (`decode_walk.append_fold` says what fold_args holds):
        (resident pages, mapped tokens, failed pages), or (-1, 0, 0) with nothing written
        when the walk does not apply. Outside a transaction (the marks are not journaled)."""
        assert self._journal is None, "append_fold writes outside a transaction only"
        lay = self._walk_tables(layer, k_st.shape[1], start + k_st.shape[0], lo)
        if lay is None:  # the tables do not cover the walk: it does not apply
            return -1, 0, 0
        heads = all_heads(k_st.shape[1])
        res = decode_walk.append_fold(lay.slot, lay.tokens, lay.last_use, self.k, self.v,
                                      heads, start, k_st, v_st, lo, ticks[0], ticks[1],
                                      *fold_args)
        if res[0] >= 0:
            self._account(lay, k_st.shape[0] * res[3] * self.row_bytes, 0)
        return res[:3]

    def walked(self, walks: np.ndarray, row_bytes: int) -> None:
        """Account the rows batched walks appended (`decode_walk.hot_walks`, which wrote them
        into resident pages in place): walks[layer] walks, row_bytes each."""
        for layer in np.flatnonzero(walks).tolist():
            self._account(self.layers[layer], int(walks[layer]) * row_bytes, 0)

    def forget_before(self, layer: int, token: int) -> int:
        """Evict `layer`'s resident pages that end at or before `token` (a sliding window no
        query will reach again); returns how many."""
        lay = self.layers.get(layer)
        if lay is None:
            return 0
        n_pages = max(0, token // self.page_tokens)
        gone = np.nonzero(lay.slot[:, :n_pages] >= 0)
        for h, p in zip(*gone, strict=True):
            self.evict(PageKey(layer, int(h), int(p) * self.page_tokens))
        return len(gone[0])

    def truncate(self, context_tokens: int) -> None:
        """Forget every resident row at or after `context_tokens` (not journaled)."""
        P = self.page_tokens
        for layer_id, lay in self.layers.items():
            for h, p in zip(*np.nonzero(lay.slot >= 0), strict=True):
                keep = context_tokens - int(p) * P
                if keep <= 0:
                    self.evict(PageKey(layer_id, int(h), int(p) * P))
                elif keep < lay.tokens[h, p]:
                    self._set(lay, int(h), int(p), int(lay.slot[h, p]), keep, lay.last_use[h, p])

    def clear(self) -> None:
        """Drop every resident page and release the pool (allocated again on the next admit)."""
        self._epoch += 1
        self.layers.clear()
        self.resident_bytes = self.held_slots = 0
        self._empty_pool()
        self._end()


_NO_TABLE = np.zeros((0, 0), dtype=np.int64)  # a layer without tables (walk_arrays; never written)


@functools.lru_cache(maxsize=16)
def all_heads(n: int) -> np.ndarray:
    """Table rows 0..n-1 (int64), one shared array per n (the kernels only read it)."""
    return np.arange(n, dtype=np.int64)
