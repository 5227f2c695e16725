"""`ExpertStore`: routed experts held in a bounded pool of slots under one byte budget.

Invariants:
  * All expert weights the engine computes with live in `pool`, one (n_slots, slot_bytes) uint8
    array allocated once: `pool.nbytes <= budget`. A slot holds one expert's repacked gate|up
    and down tiles as views into its row; loading repacks the expert's GGUF ranges (a transient
    copy of one expert) and copies them into the slot.
  * A slot is leased while a step computes with its expert and is never evicted then.
  * A layer step's experts are planned whole (`plan`), the plan checked (`validate`), and only
    then are slots written. When the experts do not all fit, they run in turns of at most
    n_slots experts; results never depend on the turns (each token's expert outputs are summed
    in rank order by the caller after all turns).
  * The policy picks victims among unleased slots; it changes speed, never results.
Telemetry (counted at the three points load, hit, route): see `ExpertTelemetry`.
Not here: routing math (models/moe.py), reading files (source.py hands over mapped arrays).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from cfr_atlas.errors import CapacityError, ConfigError
from cfr_atlas.experts.policies import LruPolicy
from cfr_atlas.experts.source import ExpertSource
from cfr_atlas.quant import QuantWeight

ALIGN = 64  # bytes; every tile array in a slot starts on a cache line
Key = tuple[int, int]  # (layer, expert)


class _Part(NamedTuple):
    offset: int
    dtype: np.dtype
    shape: tuple


class _Layout(NamedTuple):
    """Where one expert's tile arrays sit in a slot row, per matrix (gate|up, down)."""

    parts: tuple  # per matrix: tuple of _Part or a plain value (a non-array tile field)
    nbytes: int


class Turn(NamedTuple):
    experts: list  # expert ids of the layer computed in this turn
    loads: list  # (key, slot) written before the turn, in order


@dataclass
class ExpertTelemetry:
    """What the store did. bytes_read: GGUF bytes copied from the mapped file; bytes_moved:
    slot bytes written (repacked); last_step_*: since the model's last `begin_step`;
    resident/peak: bytes of slots holding an expert (pool_bytes is what is allocated)."""

    n_layers: int
    n_experts: int
    pool_bytes: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_moved: int = 0
    last_step_bytes_moved: int = 0
    last_step_misses: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    extra_turns: int = 0
    prefetched: int = 0  # experts whose file ranges were read ahead (posix_fadvise WILLNEED)
    prefetch_used: int = 0  # of those, loaded by the next step of their layer
    routing: np.ndarray = field(default=None)  # (n_layers, n_experts) times chosen

    def __post_init__(self):
        if self.routing is None:
            self.routing = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)

    def summary(self) -> dict:
        keys = ("pool_bytes", "hits", "misses", "bytes_read", "bytes_moved",
                "last_step_bytes_moved", "last_step_misses", "resident_bytes",
                "peak_resident_bytes", "extra_turns", "prefetched", "prefetch_used")
        return {"expert_" + k: int(getattr(self, k)) for k in keys}

    def routing_report(self) -> list[dict]:
        """Per layer: picks per expert, and skew = share of picks taken by the most-chosen
        quarter of the experts (0.25 = uniform, 1.0 = all in that quarter)."""
        out = []
        for layer, counts in enumerate(self.routing):
            top = np.sort(counts)[::-1][:max(1, len(counts) // 4)]
            total = int(counts.sum())
            out.append({"layer": layer, "counts": counts.tolist(),
                        "skew": float(top.sum() / total) if total else 0.0})
        return out


class ExpertStore:
    """Bounded expert pool; see the module docstring. budget: bytes (int), a share of all
    experts (float in (0, 1]) or None (every expert resident, filled at load, never evicted).
    `before_alloc(pool_bytes)` runs before the pool is allocated (a host-memory check)."""

    def __init__(self, source: ExpertSource, budget: int | float | None = None, policy=None,
                 before_alloc=None):
        self.source, self.policy = source, policy or LruPolicy()
        self.n_layers, self.n_experts = len(source.layers), source.n_experts
        self.layouts = _layouts(source)
        self.slot_bytes = max(lay.nbytes for lay in self.layouts)
        n_all = self.n_layers * self.n_experts
        if isinstance(budget, float):  # a share of every expert's slot
            budget = int(budget * self.slot_bytes * n_all)
        n_slots = n_all if budget is None else min(budget // self.slot_bytes, n_all)
        if n_slots < 1:
            raise ConfigError("expert_budget", f"{budget} bytes hold no expert: one expert "
                              f"takes {self.slot_bytes} bytes (the smallest budget)")
        if before_alloc is not None:
            before_alloc(n_slots * self.slot_bytes)
        self.pool = np.empty((n_slots, self.slot_bytes), dtype=np.uint8)
        self.key_of: list[Key | None] = [None] * n_slots
        self.slot_of: dict[Key, int] = {}
        self.leases = [0] * n_slots
        self.weights: list[tuple | None] = [None] * n_slots
        self.lock = threading.RLock()
        self.predicted: dict[int, set] = {}  # layer -> experts read ahead, not yet loaded
        self.telemetry = ExpertTelemetry(self.n_layers, self.n_experts, pool_bytes=self.pool.nbytes)
        if budget is None:
            for i, key in enumerate((lay, e) for lay in range(self.n_layers)
                                    for e in range(self.n_experts)):
                self._load(key, i)

    @property
    def n_slots(self) -> int:
        return len(self.key_of)

    @property
    def full_bytes(self) -> int:
        """Pool bytes holding every expert: what a 100% budget is."""
        return self.slot_bytes * self.n_layers * self.n_experts

    @property
    def bounded(self) -> bool:
        """True when not every expert fits (loads can happen; read-ahead is worth it)."""
        return self.n_slots < self.n_layers * self.n_experts

    def prefetch(self, layer: int, experts) -> int:
        """Read ahead the file ranges of `layer`'s experts that are not resident (the kernel
        does the I/O; no slot is touched); -> how many."""
        if not 0 <= layer < self.n_layers:
            return 0
        missing = {int(e) for e in experts if (layer, int(e)) not in self.slot_of}
        for e in sorted(missing):
            self.source.advise(layer, e)
        self.predicted[layer] = missing
        self.telemetry.prefetched += len(missing)
        return len(missing)

    def begin_step(self) -> None:
        self.telemetry.last_step_bytes_moved = self.telemetry.last_step_misses = 0

    def record_routing(self, layer: int, top: np.ndarray) -> None:
        """top (T, k) expert ids chosen by a layer's router."""
        self.telemetry.routing[layer] += np.bincount(top.reshape(-1), minlength=self.n_experts)

    def experts(self, layer: int, experts):
        """Yield (e, gate_up, down) for each distinct expert id in `experts`, each leased while
        the caller computes with it; turns when they do not all fit."""
        with self.lock:
            turns = self.plan(layer, sorted({int(e) for e in experts}))
            self.validate(layer, turns)
            self.telemetry.extra_turns += len(turns) - 1
            ahead = self.predicted.pop(layer, set())
            self.telemetry.prefetch_used += sum(k[1] in ahead for t in turns for k, _ in t.loads)
            for turn in turns:
                yield from self._run(layer, turn)

    def _run(self, layer: int, turn: Turn):
        loaded = {key for key, _ in turn.loads}
        for key, slot in turn.loads:
            self._load(key, slot)
        slots = [self.slot_of[(layer, e)] for e in turn.experts]
        self.telemetry.hits += sum((layer, e) not in loaded for e in turn.experts)
        for s in slots:
            self.leases[s] += 1
        try:
            for e, s in zip(turn.experts, slots, strict=True):
                self.policy.touch((layer, e))
                yield (e, *self.weights[s])
        finally:
            for s in slots:
                self.leases[s] -= 1

    def plan(self, layer: int, experts: list[int]) -> list[Turn]:
        """Turns for one layer step: resident experts first (no load), then the missing ones;
        each turn's loads take free slots, then the policy's victims among unleased slots not
        used in this turn (experts of earlier turns count as just used)."""
        keys = [(layer, e) for e in experts]
        order = [k for k in keys if k in self.slot_of] + [k for k in keys if k not in self.slot_of]
        occupant, where = list(self.key_of), dict(self.slot_of)
        turns, done = [], []
        for i in range(0, len(order), self.n_slots):
            group = order[i:i + self.n_slots]
            need = [k for k in group if k not in where]
            slots = self._victims(occupant, set(group), done, len(need))
            if len(slots) < len(need):
                raise CapacityError(f"layer {layer}: {len(need)} experts to load but only "
                                    f"{len(slots)} of {self.n_slots} slots are free or unleased")
            loads = list(zip(need, slots, strict=True))
            for key, slot in loads:
                where.pop(occupant[slot], None)
                occupant[slot], where[key] = key, slot
            turns.append(Turn([e for _, e in group], loads))
            done += group
        return turns

    def _victims(self, occupant, group: set, done: list, n: int) -> list[int]:
        if n == 0:
            return []
        free = [s for s, k in enumerate(occupant) if k is None]
        taken = [k for s, k in enumerate(occupant)
                 if k is not None and k not in group and not self.leases[s]]
        recent = set(done)
        ranked = (self.policy.rank([k for k in taken if k not in recent])
                  + self.policy.rank([k for k in taken if k in recent]))
        slot = {k: s for s, k in enumerate(occupant) if k is not None}
        return (free + [slot[k] for k in ranked])[:n]

    def validate(self, layer: int, turns: list[Turn]) -> None:
        """Refuse a plan before any slot is written: experts out of range, a turn larger than
        the pool, a load without a slot, into a leased slot, or twice into one slot."""
        if not 0 <= layer < self.n_layers:
            raise CapacityError(f"layer {layer} is outside the store's {self.n_layers} layers")
        for t in turns:
            bad = [e for e in t.experts if not 0 <= e < self.n_experts]
            slots = [s for _, s in t.loads]
            if bad or len(t.experts) > self.n_slots or len(set(slots)) != len(slots) \
                    or any(not 0 <= s < self.n_slots or self.leases[s] for s in slots) \
                    or len(t.loads) != sum(1 for k, _ in t.loads if k[0] == layer):
                raise CapacityError(
                    f"expert plan for layer {layer} refused: experts {t.experts} (valid 0.."
                    f"{self.n_experts - 1}), {len(t.experts)} in a turn for {self.n_slots} slots,"
                    f" loads into slots {slots} of 0..{self.n_slots - 1} (leased: "
                    f"{[s for s in slots if 0 <= s < self.n_slots and self.leases[s]]})")

    def _load(self, key: Key, slot: int) -> None:
        """Evict the slot's expert (if any) and copy `key`'s repacked matrices into it."""
        t, old = self.telemetry, self.key_of[slot]
        if old is not None:
            del self.slot_of[old]
            t.resident_bytes -= self.layouts[old[0]].nbytes
        self.key_of[slot], self.weights[slot] = None, None
        mats = self.source.build(*key)
        layout = self.layouts[key[0]]
        self.weights[slot] = tuple(_into(self.pool[slot], w, parts)
                                   for w, parts in zip(mats, layout.parts, strict=True))
        self.key_of[slot], self.slot_of[key] = key, slot
        t.misses += 1
        t.last_step_misses += 1
        t.bytes_read += self.source.raw_bytes(key[0])
        t.bytes_moved += layout.nbytes
        t.last_step_bytes_moved += layout.nbytes
        t.resident_bytes += layout.nbytes
        t.peak_resident_bytes = max(t.peak_resident_bytes, t.resident_bytes)


def _into(row: np.ndarray, w: QuantWeight, parts: tuple) -> QuantWeight:
    """Copy w's tile arrays into `row` at `parts`; the same weight over the slot's views."""
    tiles = []
    for a, part in zip(w.tiles, parts, strict=True):
        if not isinstance(a, np.ndarray):
            tiles.append(a)
            continue
        n = int(np.prod(part.shape)) * part.dtype.itemsize
        view = row[part.offset:part.offset + n].view(part.dtype).reshape(part.shape)
        np.copyto(view, a)
        tiles.append(view)
    return QuantWeight(w.name, w.qtype, w.shape, type(w.tiles)(*tiles), w.codec)


def _layouts(source: ExpertSource) -> list[_Layout]:
    """Per layer, the slot layout of its experts (measured on expert 0, shared by every expert
    of the layer: they have one shape and format); layers with equal formats share one."""
    memo, out = {}, []
    for layer, mats in enumerate(source.layers):
        sig = tuple((m.ggml_type, m.rows, m.cols) for m in mats)
        if sig not in memo:
            memo[sig] = _layout(source.build(layer, 0))
        out.append(memo[sig])
    return out


def _layout(weights) -> _Layout:
    off, parts = 0, []
    for w in weights:
        mine = []
        for a in w.tiles:
            if not isinstance(a, np.ndarray):
                mine.append(a)
                continue
            mine.append(_Part(off, a.dtype, a.shape))
            off += -(-a.nbytes // ALIGN) * ALIGN
        parts.append(tuple(mine))
    return _Layout(tuple(parts), off)
