"""Eviction policies of the expert store: strategy objects with `touch(key)` and `tables()`.

A key is (layer, expert); its id is layer * n_experts + expert (`bind` sizes a policy's
tables for a store's shape; the store binds the policy it is given). `touch` records one use.
A policy's order is stated by two per-id int64 tables (`tables()`): the best victim has the
smallest (first[id], second[id], id), so ties break by the key's order and a run is
deterministic. `order(ids, n)` / `rank(keys, n)` give that order over candidates, and
`victim_slots` picks a step's victims among a pool's slots in one compiled call (a Python
loop over a 256-slot pool cost ~0.3-0.6 ms a planned load). The store never asks a policy
about a leased expert. Policies decide speed only, never results.
"""

from __future__ import annotations

import numpy as np
from numba import njit

Key = tuple[int, int]


class LruPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self.tick, self.n_layers, self.n_experts = 0, 0, 0
        self.last = np.zeros(0, dtype=np.int64)  # per id: tick of its last use (0: never)

    def bind(self, n_layers: int, n_experts: int) -> None:
        """Size the tables for a store of n_layers x n_experts (a no-op when they fit it
        already, so a bound policy keeps what it learned)."""
        if (n_layers, n_experts) != (self.n_layers, self.n_experts):
            self.n_layers, self.n_experts = n_layers, n_experts
            self._tables(n_layers * n_experts)

    def _tables(self, n: int) -> None:
        self.tick, self.last = 0, np.zeros(n, dtype=np.int64)
        self._none = np.zeros(n, dtype=np.int64)

    def id(self, key: Key) -> int:
        layer, e = key
        if not (0 <= layer < self.n_layers and 0 <= e < self.n_experts):
            raise IndexError(f"expert {key} is outside the policy's {self.n_layers} layers x "
                             f"{self.n_experts} experts (bind it to the store's shape)")
        return layer * self.n_experts + e

    def touch(self, key: Key) -> None:
        self.tick += 1
        self.last[self.id(key)] = self.tick

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(first, second): per id, the victim order's keys (smallest first, then the id)."""
        return self._none, self.last

    def order(self, ids: np.ndarray, n: int | None = None) -> np.ndarray:
        """Positions into `ids` (distinct int64 key ids), best victim first; the first n."""
        first, second = self.tables()
        return np.lexsort((ids, second[ids], first[ids]))[:n]

    def rank(self, keys: list[Key], n: int | None = None) -> list[Key]:
        """`keys` in the policy's order, best victim first; only the first n when given."""
        ids = np.fromiter((self.id(k) for k in keys), dtype=np.int64, count=len(keys))
        return [keys[i] for i in self.order(ids, n)]


class FrequencyPolicy(LruPolicy):
    """Least often used first (counts survive eviction), least recently used among equals."""

    name = "frequency"

    def _tables(self, n: int) -> None:
        super()._tables(n)
        self.count = np.zeros(n, dtype=np.int64)

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.count[self.id(key)] += 1

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        return self.count, self.last


class PinnedPolicy(LruPolicy):
    """Pins the `n_pinned` most-routed experts of a routing profile ({key: times chosen}, e.g.
    `ExpertTelemetry.routing` of an earlier run): they are evicted only when nothing else can
    be; the rest by LRU."""

    name = "pinned"

    def __init__(self, profile: dict[Key, int], n_pinned: int):
        super().__init__()
        top = sorted(profile.items(), key=lambda kv: (-kv[1], kv[0]))[:max(n_pinned, 0)]
        self.pinned = frozenset(k for k, n in top if n > 0)

    def _tables(self, n: int) -> None:
        super()._tables(n)
        self.is_pinned = np.zeros(n, dtype=np.int64)  # 1: pinned (ranked after the rest)
        for layer, e in self.pinned:  # a profile of another shape pins only what exists here
            if 0 <= layer < self.n_layers and 0 <= e < self.n_experts:
                self.is_pinned[layer * self.n_experts + e] = 1

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        return self.is_pinned, self.last


POLICIES = {"lru": LruPolicy, "frequency": FrequencyPolicy, "pinned": PinnedPolicy}


@njit(cache=True, nogil=True)
def _victims(occ, leases, excluded, done, first, second, n):
    """The body of `victim_slots` (occ: key id per slot, -1 free)."""
    S = occ.size
    out = np.empty(n, dtype=np.int64)
    m = 0
    for s in range(S):  # free, unleased slots first, in slot order
        if m < n and occ[s] < 0 and leases[s] == 0:
            out[m] = s
            m += 1
    if m == n:
        return out
    out_of_play = np.zeros(S, dtype=np.bool_)
    for s in excluded:
        out_of_play[s] = True
    late = np.zeros(S, dtype=np.int64)  # 1: an expert of an earlier turn (ranked last)
    for s in range(S):
        if occ[s] >= 0:
            for d in done:
                if occ[s] == d:
                    late[s] = 1
    while m < n:  # n is a turn's loads: a few scans of the pool
        best = -1
        for s in range(S):
            if occ[s] < 0 or leases[s] != 0 or out_of_play[s]:
                continue
            if best >= 0:
                i, j = occ[s], occ[best]
                a = (late[s], first[i], second[i], i)
                b = (late[best], first[j], second[j], j)
                if not a < b:
                    continue
            best = s
        if best < 0:
            break
        out_of_play[best] = True
        out[m] = best
        m += 1
    return out[:m]


def victim_slots(policy, occ: np.ndarray, leases: np.ndarray, excluded: list[int],
                 done: list[int], n: int) -> list[int]:
    """n slots of a pool for a turn's loads: free unleased ones first (slot order), then the
    policy's victims among the unleased slots not in `excluded`, experts whose id is in
    `done` (earlier turns of the step) last; fewer if there are not enough. occ: the key id
    each slot holds (-1: free)."""
    if n <= 0:
        return []
    first, second = policy.tables()
    return _victims(occ, leases, np.asarray(excluded, dtype=np.int64),
                    np.asarray(done, dtype=np.int64), first, second, n).tolist()
