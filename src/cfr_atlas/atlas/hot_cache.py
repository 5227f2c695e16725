"""The hot cache: resident K/V pages under a byte budget, with exact accounting and undo.

Storage is one growable slab per layer: `k` (slots, head_dim, page_tokens) holds K pages
transposed (the fold's score loop runs across keys), `v` (slots, page_tokens, head_dim) holds
V rows, both in the storage dtype; a page occupies one slot. `admit` and `grow` take rows.
Per layer, three tables indexed [kv_head, page_index] say where a page lives (`slot`, -1 when
not resident), how many tokens it holds (`tokens`) and when it was last used (`last_use`, a
call counter). The fold reads the tables with NumPy, so an all-hot call costs no per-page
Python.

Invariants (checked by the stateful test):
- resident_bytes == sum over resident pages of tokens * row_bytes, and per layer likewise;
- resident_bytes <= budget and layer_bytes[layer] <= layer budget, always;
- a slot is in exactly one of: a table entry, the free list, the pending list.

Transactions: `begin()` opens a journal. Evicted slots go to a pending list instead of the
free list, so their rows survive until `commit()`; `rollback()` replays the journal backwards,
restoring all three tables (recency included) and the accounting exactly. The slab grows
(never beyond what the budget can hold, plus the pending slots of one call); it is a ceiling,
not a preallocation.
No timing or telemetry code lives here: mutators return counts, the runtime records them.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas.config import AtlasConfig
from cfr_atlas.atlas.pages import PageKey


class _Layer:
    """Slab, free list and page tables of one layer."""

    def __init__(self, config: AtlasConfig):
        self.config = config
        dt = config.dtype.array_dtype
        self.k = np.zeros((0, config.head_dim, config.page_tokens), dtype=dt)  # K^T pages
        self.v = np.zeros((0, config.page_tokens, config.head_dim), dtype=dt)
        self.free: list[int] = []
        self.slot = np.full((0, 0), -1, dtype=np.int64)
        self.tokens = np.zeros((0, 0), dtype=np.int64)
        self.last_use = np.zeros((0, 0), dtype=np.int64)
        self.bytes = 0

    def ensure_table(self, heads: int, pages: int) -> None:
        h0, p0 = self.slot.shape
        if heads <= h0 and pages <= p0:
            return
        h1, p1 = max(heads, h0), max(pages, 2 * p0, 8)
        for name, fill in (("slot", -1), ("tokens", 0), ("last_use", 0)):
            old = getattr(self, name)
            new = np.full((h1, p1), fill, dtype=np.int64)
            new[:h0, :p0] = old
            setattr(self, name, new)

    def take_slot(self, max_slots: int) -> int:
        if not self.free:
            cap = self.k.shape[0]
            new_cap = max(cap + 1, min(2 * cap, max_slots), 1)
            k = np.zeros((new_cap,) + self.k.shape[1:], dtype=self.k.dtype)
            v = np.zeros((new_cap,) + self.v.shape[1:], dtype=self.v.dtype)
            k[:cap], v[:cap] = self.k, self.v
            self.k, self.v = k, v
            self.free.extend(range(new_cap - 1, cap - 1, -1))
        return self.free.pop()


class HotCache:
    """Resident pages of one sequence under `config.hot_cache_bytes` (see module docstring)."""

    def __init__(self, config: AtlasConfig):
        self.config = config
        self.row_bytes, self.page_tokens = config.row_bytes, config.page_tokens
        self.layers: dict[int, _Layer] = {}
        self.resident_bytes = 0
        self._journal: list[tuple] | None = None
        self._pending: list[tuple[int, int]] = []  # (layer, slot) evicted inside a transaction
        # The ranking of resident pages by policy priority, valid while the set of resident
        # pages (the epoch counts admissions and evictions), the policy, the context and, for
        # policies that rank by recency, the call stay the same. Sizes are read live.
        self._epoch = 0
        self._ranked: tuple | None = None

    # --- lookups ---------------------------------------------------------------------------
    def layer(self, layer: int) -> _Layer:
        lay = self.layers.get(layer)
        if lay is None:
            lay = self.layers[layer] = _Layer(self.config)
        return lay

    def budget(self) -> int:
        return self.config.hot_cache_bytes

    def layer_budget(self, layer: int) -> int:
        budgets = self.config.layer_budgets or {}
        return budgets.get(layer, self.config.hot_cache_bytes)

    def resident_pages(self) -> int:
        return sum(int((lay.slot >= 0).sum()) for lay in self.layers.values())

    def allocated_bytes(self) -> int:
        return sum(lay.k.nbytes + lay.v.nbytes for lay in self.layers.values())

    def max_slots(self, layer: int) -> int:
        return max(1, self.layer_budget(layer) // self.config.page_bytes + 1)

    # --- transactions ------------------------------------------------------------------------
    def begin(self) -> None:
        self._journal = []

    def commit(self) -> None:
        for layer, slot in self._pending:
            self.layers[layer].free.append(slot)
        self._pending.clear()
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
            nbytes = tokens * self.row_bytes
            if op == "admit":
                lay.slot[head, page] = -1
                lay.tokens[head, page] = 0
                lay.free.append(slot)
                self._account(lay, -nbytes)
            elif op == "evict":
                lay.slot[head, page] = slot
                lay.tokens[head, page] = tokens
                lay.last_use[head, page] = last_use
                self._pending.remove((layer, slot))
                self._account(lay, nbytes)
            else:  # "grow": tokens is the growth
                lay.tokens[head, page] -= tokens
                self._account(lay, -nbytes)
        self._journal = None

    def _log(self, *entry) -> None:
        if self._journal is not None:
            self._journal.append(entry)

    def _account(self, lay: _Layer, nbytes: int) -> None:
        lay.bytes += nbytes
        self.resident_bytes += nbytes

    # --- mutators --------------------------------------------------------------------------
    def evict(self, key: PageKey) -> None:
        self._epoch += 1  # the cached ranking no longer lists the resident pages
        self._evict(key)

    def _evict(self, key: PageKey) -> None:
        lay = self.layers[key.layer]
        page = key.start_token // self.page_tokens
        slot, tokens = int(lay.slot[key.kv_head, page]), int(lay.tokens[key.kv_head, page])
        lay.slot[key.kv_head, page] = -1
        lay.tokens[key.kv_head, page] = 0
        self._account(lay, -tokens * self.row_bytes)
        if self._journal is not None:
            self._pending.append((key.layer, slot))
        else:
            lay.free.append(slot)
        self._log("evict", key.layer, key.kv_head, page, slot, tokens,
                  int(lay.last_use[key.kv_head, page]))

    def make_room(self, key: PageKey, nbytes: int, policy, context_tokens: int, tick: int) -> int:
        """Evict lower-priority pages so `nbytes` more fit; -1 if impossible (nothing evicted).

        Only pages of strictly lower priority than the incoming one may leave, lowest first.
        A layer over its own budget gives up its own pages; the global budget takes any layer's.
        """
        lay = self.layer(key.layer)
        need_layer = lay.bytes + nbytes - self.layer_budget(key.layer)
        need_global = self.resident_bytes + nbytes - self.budget()
        if need_layer <= 0 and need_global <= 0:
            return 0
        if nbytes > min(self.budget(), self.layer_budget(key.layer)):
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
        for i, victim in sorted(chosen, reverse=True):
            del ranked[i]  # the ranking stays valid: only these members left
            self._evict(victim)
        return len(chosen)

    def _pick(self, ranked, incoming, protect, need, chosen, layer, freed=0) -> int:
        """Add ranked pages (lowest first, of `layer` if given) to `chosen` until `need` bytes
        are freed or the priorities reach `incoming`; returns the bytes freed so far."""
        taken = {i for i, _ in chosen}
        for i, (prio, victim) in enumerate(ranked):
            if freed >= need or not prio < incoming:
                break
            if i in taken or victim == protect or (layer is not None and victim.layer != layer):
                continue
            chosen.append((i, victim))
            freed += self._size(victim)
        return freed

    def _ranking(self, policy, context_tokens: int, tick: int) -> list:
        """Every resident page as (priority, key, bytes), lowest priority first; rebuilt only
        when residency, the policy, the context or the call changed (a fold that keeps
        rejecting admissions pays for one ranking, not one per page)."""
        recency = getattr(policy, "ranks_by_recency", True)
        state = (self._epoch, id(policy), context_tokens, tick if recency else None)
        if self._ranked is None or self._ranked[0] != state:
            out = []
            for layer, lay in self.layers.items():
                if not lay.bytes:
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

    def _size(self, key: PageKey) -> int:
        return self.page_state(key)[1] * self.row_bytes

    def admit(self, key: PageKey, k_rows: np.ndarray, v_rows: np.ndarray, tick: int) -> None:
        """Copy rows (n, D) in storage dtype into a fresh slot; room must have been made."""
        self._epoch += 1
        lay = self.layer(key.layer)
        page = key.start_token // self.page_tokens
        lay.ensure_table(key.kv_head + 1, page + 1)
        slot = lay.take_slot(self.max_slots(key.layer) + len(self._pending))
        n = k_rows.shape[0]
        lay.k[slot, :, :n] = k_rows.T
        lay.v[slot, :n] = v_rows
        lay.slot[key.kv_head, page] = slot
        lay.tokens[key.kv_head, page] = n
        lay.last_use[key.kv_head, page] = tick
        self._account(lay, n * self.row_bytes)
        self._log("admit", key.layer, key.kv_head, page, slot, n, tick)

    def grow(self, key: PageKey, k_rows: np.ndarray, v_rows: np.ndarray, tick: int) -> None:
        """Append rows to a resident partial page; room must have been made."""
        lay = self.layers[key.layer]
        page = key.start_token // self.page_tokens
        slot, n0 = int(lay.slot[key.kv_head, page]), int(lay.tokens[key.kv_head, page])
        n = k_rows.shape[0]
        lay.k[slot, :, n0:n0 + n] = k_rows.T
        lay.v[slot, n0:n0 + n] = v_rows
        lay.tokens[key.kv_head, page] = n0 + n
        lay.last_use[key.kv_head, page] = tick
        self._account(lay, n * self.row_bytes)
        self._log("grow", key.layer, key.kv_head, page, slot, n, tick)

    def page_state(self, key: PageKey) -> tuple[int, int]:
        """(slot, tokens) of a page; slot -1 when not resident."""
        lay = self.layers.get(key.layer)
        page = key.start_token // self.page_tokens
        if lay is None or key.kv_head >= lay.slot.shape[0] or page >= lay.slot.shape[1]:
            return -1, 0
        return int(lay.slot[key.kv_head, page]), int(lay.tokens[key.kv_head, page])

    def clear(self) -> None:
        self._epoch += 1
        self.layers.clear()
        self.resident_bytes = 0
        self._pending.clear()
        self._journal = None
