"""Telemetry: counters the runtime updates at a few named points, rendered as a table.

`Telemetry` holds cumulative counters; `Atlas.attend` also keeps the counters of its last call in
`last_call`. Caches and policies never touch these; the runtime records what they return.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Counters:
    """One set of counters (per call or cumulative). Bytes are K + V in the storage dtype."""

    calls: int = 0
    pages_folded: int = 0
    hot_hits: int = 0
    regenerations: int = 0
    admissions: int = 0
    admission_rejections: int = 0
    evictions: int = 0
    tokens_consumed: int = 0
    bytes_regenerated: int = 0
    bytes_mapped: int = 0  # of those, read in place from a regenerator's mapping (page file)
    pages_skipped: int = 0  # causal pages a sparse selection did not read (atlas/sparse.py)
    regen_seconds: float = 0.0
    fold_seconds: float = 0.0

    def add(self, other: Counters) -> None:
        for name in _COUNTER_NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def add_walk(self, walk: Counters) -> None:
        """`add` of a compiled walk's counters (calls, pages folded, hot hits, tokens, fold
        seconds, and the mapped pages' regenerations and bytes; every other counter of a walk
        is 0) plus the call of the write before it: the per-layer decode path's bookkeeping
        without a loop over every field."""
        self.calls += walk.calls + 1
        self.pages_folded += walk.pages_folded
        self.hot_hits += walk.hot_hits
        self.tokens_consumed += walk.tokens_consumed
        self.fold_seconds += walk.fold_seconds
        self.regenerations += walk.regenerations
        self.bytes_mapped += walk.bytes_mapped
        self.bytes_regenerated += walk.bytes_regenerated

    @property
    def hit_rate(self) -> float:
        return self.hot_hits / self.pages_folded if self.pages_folded else 0.0


_COUNTER_NAMES = tuple(f.name for f in dataclasses.fields(Counters))


@dataclass
class Telemetry:
    """Cumulative counters, the last call's counters, and residency now / at peak.

    resident_bytes / peak_resident_bytes count the rows held (logical); held_bytes the slots
    they occupy (what the budget is charged); allocated_bytes / peak_allocated_bytes the arrays
    as allocated (hot-cache pool + scratch + staging, sum of nbytes); table_bytes the int64 page
    tables (bookkeeping that grows with the context, outside the budget).
    """

    total: Counters = field(default_factory=Counters)
    last_call: Counters = field(default_factory=Counters)
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    resident_pages: int = 0
    scratch_bytes: int = 0
    budget_bytes: int = 0
    held_bytes: int = 0
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    table_bytes: int = 0

    def table(self) -> str:
        """A readable two-column table (last call | cumulative)."""
        rows = [("metric", "last call", "total")]
        for f in dataclasses.fields(Counters):
            a, b = getattr(self.last_call, f.name), getattr(self.total, f.name)
            fmt = "{:.4f}" if isinstance(a, float) else "{:,}"
            rows.append((f.name, fmt.format(a), fmt.format(b)))
        rows.append(("hot hit rate", f"{self.last_call.hit_rate:.1%}",
                     f"{self.total.hit_rate:.1%}"))
        for name in ("resident_bytes", "peak_resident_bytes", "resident_pages", "scratch_bytes",
                     "budget_bytes", "held_bytes", "allocated_bytes", "peak_allocated_bytes",
                     "table_bytes"):
            rows.append((name, "", f"{getattr(self, name):,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}" for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
