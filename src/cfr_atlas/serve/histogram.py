"""`Histogram`: a Prometheus-style histogram as plain data (bucket bounds, counts, sum).

Buckets are counted non-cumulatively here and made cumulative when read (`buckets()`), as the
text format wants (`le` upper bounds, the last one +Inf). Not thread-safe by itself: the
scheduler writes it under its lock and hands out copies. Rendering lives in metrics.py.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class Histogram:
    bounds: tuple[float, ...]  # ascending finite upper bounds; +Inf is implied
    counts: list[int] = field(default_factory=list)  # per bucket, len(bounds) + 1
    total: float = 0.0  # sum of every observed value

    def __post_init__(self):
        if list(self.bounds) != sorted(set(self.bounds)) or not all(
                math.isfinite(b) for b in self.bounds):
            raise ValueError(f"bounds must be finite and strictly ascending, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count `value` in the first bucket whose bound is >= it."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), cumulative, ending with (inf, count)."""
        out, n = [], 0
        for bound, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            n += c
            out.append((bound, n))
        return out

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)
