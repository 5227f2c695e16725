"""Eviction policies of the expert store: strategy objects with `touch(key)` and `rank(keys)`.

A key is (layer, expert). `touch` records one use; `rank` orders eviction candidates, best
victim first (`rank(keys, n)`: only the first n of that order, without sorting the rest).
The store never asks a policy about a leased expert. Ties always break by the
key itself, so a run is deterministic. Policies decide speed only, never results.
"""

from __future__ import annotations

import heapq
from collections import Counter

Key = tuple[int, int]


def _first(ordered: list[tuple], n: int | None) -> list[Key]:
    """ordered: (sort values..., key) per candidate, distinct (they end with the key) -> the
    keys in that order, or the first n of them (a comprehension builds the tuples: a key
    function called per candidate cost ~1.6 us each on a 256-slot pool, every planned load)."""
    chosen = sorted(ordered) if n is None else heapq.nsmallest(n, ordered)
    return [t[-1] for t in chosen]


class LruPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self.tick, self.last = 0, {}

    def touch(self, key: Key) -> None:
        self.tick += 1
        self.last[key] = self.tick

    def rank(self, keys: list[Key], n: int | None = None) -> list[Key]:
        last = self.last
        return _first([(last.get(k, 0), k) for k in keys], n)


class FrequencyPolicy(LruPolicy):
    """Least often used first (counts survive eviction), least recently used among equals."""

    name = "frequency"

    def __init__(self):
        super().__init__()
        self.count: Counter = Counter()

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.count[key] += 1

    def rank(self, keys: list[Key], n: int | None = None) -> list[Key]:
        count, last = self.count, self.last
        return _first([(count[k], last.get(k, 0), k) for k in keys], n)


class PinnedPolicy(LruPolicy):
    """Pins the `n_pinned` most-routed experts of a routing profile ({key: times chosen}, e.g.
    `ExpertTelemetry.routing` of an earlier run): they are evicted only when nothing else can
    be; the rest by LRU."""

    name = "pinned"

    def __init__(self, profile: dict[Key, int], n_pinned: int):
        super().__init__()
        top = sorted(profile.items(), key=lambda kv: (-kv[1], kv[0]))[:max(n_pinned, 0)]
        self.pinned = frozenset(k for k, n in top if n > 0)

    def rank(self, keys: list[Key], n: int | None = None) -> list[Key]:
        pinned, last = self.pinned, self.last
        return _first([(k in pinned, last.get(k, 0), k) for k in keys], n)


POLICIES = {"lru": LruPolicy, "frequency": FrequencyPolicy, "pinned": PinnedPolicy}
