"""Eviction policies of the expert store: strategy objects with `touch(key)` and `rank(keys)`.

A key is (layer, expert). `touch` records one use; `rank` orders eviction candidates, best
victim first. The store never asks a policy about a leased expert. Ties always break by the
key itself, so a run is deterministic. Policies decide speed only, never results.
"""

from __future__ import annotations

from collections import Counter

Key = tuple[int, int]


class LruPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self.tick, self.last = 0, {}

    def touch(self, key: Key) -> None:
        self.tick += 1
        self.last[key] = self.tick

    def rank(self, keys: list[Key]) -> list[Key]:
        return sorted(keys, key=lambda k: (self.last.get(k, 0), k))


class FrequencyPolicy(LruPolicy):
    """Least often used first (counts survive eviction), least recently used among equals."""

    name = "frequency"

    def __init__(self):
        super().__init__()
        self.count: Counter = Counter()

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.count[key] += 1

    def rank(self, keys: list[Key]) -> list[Key]:
        return sorted(keys, key=lambda k: (self.count[k], self.last.get(k, 0), k))


class PinnedPolicy(LruPolicy):
    """Pins the `n_pinned` most-routed experts of a routing profile ({key: times chosen}, e.g.
    `ExpertTelemetry.routing` of an earlier run): they are evicted only when nothing else can
    be; the rest by LRU."""

    name = "pinned"

    def __init__(self, profile: dict[Key, int], n_pinned: int):
        super().__init__()
        top = sorted(profile.items(), key=lambda kv: (-kv[1], kv[0]))[:max(n_pinned, 0)]
        self.pinned = frozenset(k for k, n in top if n > 0)

    def rank(self, keys: list[Key]) -> list[Key]:
        return sorted(keys, key=lambda k: (k in self.pinned, self.last.get(k, 0), k))


POLICIES = {"lru": LruPolicy, "frequency": FrequencyPolicy, "pinned": PinnedPolicy}
