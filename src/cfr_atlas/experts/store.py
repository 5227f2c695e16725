"""`ExpertStore`: routed experts held in a bounded pool of slots under one byte budget.

Invariants:
  * All expert weights the engine computes with live in `pool`, one (n_slots, slot_bytes) uint8
    array allocated once: `pool.nbytes <= budget`. A slot holds one expert's repacked gate|up
    and down tiles as views into its row (slots.py writes them, from the mapped file).
  * A slot is leased while a step computes with its expert, or while the prefetcher fills it,
    and is never evicted then.
  * A layer step's experts are planned whole (`plan`), the plan checked (`validate`), and only
    then are slots written; the slots the plan uses are reserved until the step ends, so the
    prefetcher never takes them. When the experts do not all fit, they run in turns of at most
    n_slots experts; results never depend on the turns (each token's expert outputs are summed
    in rank order by the caller after all turns). Once planned, the kernel is asked to read
    every expert the step will load whose bytes are not cached (`ExpertSource.advise`), so a
    cold step's reads are in flight together while the first loads are repacked. The next
    layer's predicted experts are asked for too (`read_ahead`), so their reads overlap this
    layer's compute.
  * The policy picks victims among unleased slots; it changes speed, never results. So does the
    prefetcher (prefetch.py): it only moves a load earlier, into a slot nobody uses.
  * `lock` (a Condition) guards the slot tables, leases and counters; slot bytes are written
    without it (a slot being written is reserved or leased, and becomes visible only when its
    key is installed under the lock). `step_lock` runs one layer step at a time.
Telemetry (counted at the points load, install, hit, route): see `ExpertTelemetry`.
Not here: routing math (models/moe.py), reading files (source.py hands over mapped arrays),
slot layouts and the repack (slots.py, repack.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from cfr_atlas.errors import CapacityError, ConfigError
from cfr_atlas.experts import slots
from cfr_atlas.experts.policies import LruPolicy, victim_slots
from cfr_atlas.experts.prefetch import Prefetcher
from cfr_atlas.experts.reader import ReaderCounts
from cfr_atlas.experts.source import ExpertSource
from cfr_atlas.kernel_threads import spare_core

Key = tuple[int, int]  # (layer, expert)


class Turn(NamedTuple):
    experts: list  # expert ids of the layer computed in this turn
    loads: list  # (key, slot) written before the turn, in order


@dataclass
class ExpertTelemetry:
    """What the store did. bytes_read: GGUF bytes read from the mapped file (prefetched ones
    included); bytes_moved: slot bytes written; last_step_*: since the model's last
    `begin_step`; resident/peak: bytes of slots holding an expert (pool_bytes is what is
    allocated). misses are loads a step waited for; the prefetcher's loads are `prefetched`."""

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
    prefetched: int = 0  # experts the prefetcher loaded into a slot ahead of their step
    prefetch_bytes_read: int = 0  # GGUF bytes of those loads (also in bytes_read)
    prefetch_hits: int = 0  # prefetched experts their step then used (a hit, no wait)
    prefetch_unused: int = 0  # prefetched experts their step did not use (a wrong prediction)
    prefetch_misses: int = 0  # loads a predicted step still waited for (not prefetched in time)
    routing: np.ndarray = field(default=None)  # (n_layers, n_experts) times chosen
    reads: ReaderCounts | None = None  # the direct reader's own counts, while it is on

    def __post_init__(self):
        if self.routing is None:
            self.routing = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)

    def summary(self) -> dict:
        keys = ("pool_bytes", "hits", "misses", "bytes_read", "bytes_moved",
                "last_step_bytes_moved", "last_step_misses", "resident_bytes",
                "peak_resident_bytes", "extra_turns", "prefetched", "prefetch_bytes_read",
                "prefetch_hits", "prefetch_unused", "prefetch_misses")
        reads = self.reads or ReaderCounts()
        return {**{"expert_" + k: int(getattr(self, k)) for k in keys},
                **{"expert_direct_" + k: int(v) for k, v in vars(reads).items()}}

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
    `before_alloc(pool_bytes)` runs before the pool is allocated (a host-memory check).
    prefetch: fill the slots of the experts predicted for the next layer on a background
    thread (only under a bounded budget; `use_prefetch` switches it). None: on only when that
    thread has a core the kernels do not use (`kernel_threads.spare_core`): beside kernels
    that keep every core busy its loads cost more than they hide (docs/MOE.md)."""

    def __init__(self, source: ExpertSource, budget: int | float | None = None, policy=None,
                 before_alloc=None, prefetch: bool | None = None):
        self.source = source
        self.n_layers, self.n_experts = len(source.layers), source.n_experts
        self.policy = policy or LruPolicy()
        self.layouts = slots.layouts(source)
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
        self._tiles: list[dict] = [{} for _ in range(n_slots)]  # per slot, per layout: views
        self.key_of: list[Key | None] = [None] * n_slots
        self.occ = np.full(n_slots, -1, dtype=np.int64)  # per slot: its key's id, -1 free
        self.slot_of: dict[Key, int] = {}
        self.leases = np.zeros(n_slots, dtype=np.int64)
        self.weights: list[tuple | None] = [None] * n_slots
        self.lock = threading.Condition(threading.RLock())
        self.step_lock = threading.RLock()
        self.reserved: frozenset = frozenset()  # slots of the running step's plan
        self.ahead: set[Key] = set()  # prefetched, not yet used by their step
        self.telemetry = ExpertTelemetry(self.n_layers, self.n_experts, pool_bytes=self.pool.nbytes)
        self.prefetcher: Prefetcher | None = None
        self.use_prefetch(spare_core() if prefetch is None else prefetch)
        if budget is None:
            for i, key in enumerate((lay, e) for lay in range(self.n_layers)
                                    for e in range(self.n_experts)):
                self._load(key, i)

    @property
    def policy(self):
        return self._policy

    @policy.setter
    def policy(self, policy) -> None:
        """The eviction policy, bound to this store's shape (its tables are per expert)."""
        policy.bind(self.n_layers, self.n_experts)
        self._policy = policy

    @property
    def n_slots(self) -> int:
        return len(self.key_of)

    @property
    def full_bytes(self) -> int:
        """Pool bytes holding every expert: what a 100% budget is."""
        return self.slot_bytes * self.n_layers * self.n_experts

    @property
    def bounded(self) -> bool:
        """True when not every expert fits (loads can happen; prefetching is worth it)."""
        return self.n_slots < self.n_layers * self.n_experts

    def use_prefetch(self, on: bool) -> None:
        """Switch the prefetcher on (bounded budgets only) or off; results never change."""
        with self.lock:
            if self.prefetcher is not None:
                self.prefetcher.stop()
                self.prefetcher.settle(self.n_layers)  # its load in flight ends first
            self.prefetcher = Prefetcher(self) if on and self.bounded else None

    def read_direct(self, experts: int) -> None:
        """Stage up to `experts` uncached experts at once off the disk, bypassing the page
        cache (ExpertSource.read_direct; 0: off). Only a bounded pool loads after the load, so
        an unbounded one keeps it off. Results never change."""
        self.source.read_direct(experts if self.bounded else 0)
        reader = self.source.reader
        self.telemetry.reads = None if reader is None else reader.counts

    def begin_step(self) -> None:
        self.telemetry.last_step_bytes_moved = self.telemetry.last_step_misses = 0

    def record_routing(self, layer: int, top: np.ndarray) -> None:
        """top (T, k) expert ids chosen by a layer's router."""
        self.telemetry.routing[layer] += np.bincount(top.reshape(-1), minlength=self.n_experts)

    def experts(self, layer: int, experts, ahead=None):
        """Yield (e, gate_up, down) for each distinct expert id in `experts`, each leased while
        the caller computes with it; turns when they do not all fit. `ahead`: the expert ids
        predicted for layer + 1, handed to the prefetcher once this step's plan is reserved
        (without a prefetcher, only their file ranges are asked for: `read_ahead`)."""
        with self.step_lock:
            with self.lock:
                if self.prefetcher is not None:
                    self.prefetcher.settle(layer)  # stale requests dropped, in-flight load done
                turns = self.plan(layer, sorted({int(e) for e in experts}))
                self.validate(layer, turns)
                self.reserved = frozenset(self._plan_slots(layer, turns))
                self._count_prediction(layer, turns)
                self.telemetry.extra_turns += len(turns) - 1
            # every load of the step asked for at once: the disk sees them all
            self.source.begin_step(layer, [key[1] for turn in turns for key, _ in turn.loads])
            if ahead is not None and self.prefetcher is not None:
                self.prefetcher.request(layer + 1, ahead)
            elif ahead is not None and layer + 1 < self.n_layers:
                self.read_ahead(layer + 1, ahead)
            try:
                for turn in turns:
                    yield from self._run(layer, turn)
            finally:
                with self.lock:
                    self.reserved = frozenset()
                    self.lock.notify_all()

    def _id(self, key: Key) -> int:
        """A key's id in `occ` and the policy's tables: layer * n_experts + expert."""
        return key[0] * self.n_experts + key[1]

    def wants_ahead(self, layer: int) -> bool:
        """Whether predicting `layer`'s experts can help: the pool is bounded and either the
        prefetcher loads predictions or some of the layer's bytes are not in the page cache
        (read-ahead has something to ask for)."""
        return self.bounded and 0 <= layer < self.n_layers and (
            self.prefetcher is not None or not self.source.cached(layer))

    def missing(self, layer: int, experts) -> list[Key]:
        """(lock held) The keys of `layer`'s distinct expert ids in range that are not
        resident, in id order."""
        return [(layer, e) for e in sorted({int(e) for e in experts})
                if 0 <= e < self.n_experts and (layer, e) not in self.slot_of]

    def read_ahead(self, layer: int, experts) -> None:
        """Ask the kernel to read the predicted experts of `layer` that are not resident into
        the page cache (no slot is taken: the prefetcher, when on, loads them too)."""
        with self.lock:
            keys = self.missing(layer, experts)
        self.source.advise(layer, [e for _, e in keys])

    def _run(self, layer: int, turn: Turn):
        """The turn's experts in order, each leased while the caller computes with it. The
        plan puts resident experts first, so they compute while the reads of the turn's loads
        (all asked for when the step began) are in flight; each load is written just before
        its expert computes, so every product overlaps the reads of the loads after it."""
        loads = dict(turn.loads)
        with self.lock:
            self.telemetry.hits += sum((layer, e) not in loads for e in turn.experts)
        for e in turn.experts:
            key = (layer, e)
            if key in loads:
                self._load(key, loads[key])
            with self.lock:
                s = self.slot_of[key]
                self.leases[s] += 1
                self.policy.touch(key)
            try:
                yield (e, *self.weights[s])
            finally:
                with self.lock:
                    self.leases[s] -= 1
                    self.lock.notify_all()

    def _plan_slots(self, layer: int, turns: list[Turn]) -> set[int]:
        loaded, used = {}, set()  # the plan's loads so far override the resident table
        for t in turns:
            loaded.update(t.loads)
            for e in t.experts:
                key = (layer, e)
                used.add(loaded[key] if key in loaded else self.slot_of[key])
        return used

    def _count_prediction(self, layer: int, turns: list[Turn]) -> None:
        """Prefetched experts of `layer` this step uses are prefetch hits, the others unused;
        a load this step waits for after a prediction is a prefetch miss."""
        t, used = self.telemetry, {(layer, e) for turn in turns for e in turn.experts}
        mine = {k for k in self.ahead if k[0] == layer}
        t.prefetch_hits += len(mine & used)
        t.prefetch_unused += len(mine - used)
        self.ahead -= mine
        if self.prefetcher is not None:
            self.prefetcher.judge(layer, len(mine & used), len(mine - used))
            if self.prefetcher.was_predicted(layer):
                t.prefetch_misses += sum(len(turn.loads) for turn in turns)

    def plan(self, layer: int, experts: list[int]) -> list[Turn]:
        """Turns for one layer step: resident experts first (no load), then the missing ones;
        each turn's loads take free slots, then the policy's victims among unleased slots not
        used in this turn (experts of earlier turns count as just used)."""
        keys = [(layer, e) for e in experts]
        if len(keys) <= self.n_slots and all(k in self.slot_of for k in keys):
            return [Turn(list(experts), [])]  # all resident: what the loop below gives
        order = [k for k in keys if k in self.slot_of] + [k for k in keys if k not in self.slot_of]
        occ, where = self.occ.copy(), dict(self.slot_of)  # the plan's view of the slots
        turns, done = [], []
        for i in range(0, len(order), self.n_slots):
            group = order[i:i + self.n_slots]
            need = [k for k in group if k not in where]
            slots_ = self._victims(occ, [where[k] for k in group if k in where], done, len(need))
            if len(slots_) < len(need):
                raise CapacityError(f"layer {layer}: {len(need)} experts to load but only "
                                    f"{len(slots_)} of {self.n_slots} slots are free or unleased")
            loads = list(zip(need, slots_, strict=True))
            for key, slot in loads:
                if occ[slot] >= 0:
                    where.pop(divmod(int(occ[slot]), self.n_experts), None)
                occ[slot], where[key] = self._id(key), slot
            turns.append(Turn([e for _, e in group], loads))
            done += [self._id(k) for k in group]
        return turns

    def _victims(self, occ: np.ndarray, group_slots: list[int], done: list[int],
                 n: int) -> list[int]:
        """n slots for a turn's loads: free ones first, then the policy's victims among the
        unleased experts outside the turn (`group_slots` hold the turn's resident experts),
        those of earlier turns (ids `done`) last; fewer if there are not enough. occ: the
        plan's key id per slot (-1 free)."""
        return victim_slots(self.policy, occ, self.leases, group_slots, done, n)

    def prefetch_slot(self, key: Key) -> int | None:
        """(lock held) A slot the prefetcher may fill with `key`: a free one, else the policy's
        victim among experts not leased, not in the running step's plan, not of `key`'s layer
        (its own experts are what the prediction is for) and not prefetched-and-unused, if the
        prefetcher trusts that layer's predictions; None if there is none. The one-load plan
        is validated like a step's."""
        def idle(s):
            return not self.leases[s] and s not in self.reserved

        free = [s for s, k in enumerate(self.key_of) if k is None and idle(s)]
        if not free and self.prefetcher.may_evict(key[0]):
            cands = np.array([s for s, k in enumerate(self.key_of) if k is not None and idle(s)
                              and k[0] != key[0] and k not in self.ahead], dtype=np.int64)
            free = cands[self.policy.order(self.occ[cands], 1)].tolist()
        if not free:
            return None
        self.validate(key[0], [Turn([key[1]], [(key, free[0])])])
        return free[0]

    def validate(self, layer: int, turns: list[Turn]) -> None:
        """Refuse a plan before any slot is written: experts out of range, a turn larger than
        the pool, a load without a slot, into a leased slot, or twice into one slot."""
        if not 0 <= layer < self.n_layers:
            raise CapacityError(f"layer {layer} is outside the store's {self.n_layers} layers")
        for t in turns:
            bad = [e for e in t.experts if not 0 <= e < self.n_experts]
            slots_ = [s for _, s in t.loads]
            if bad or len(t.experts) > self.n_slots or len(set(slots_)) != len(slots_) \
                    or any(not 0 <= s < self.n_slots or self.leases[s] for s in slots_) \
                    or len(t.loads) != sum(1 for k, _ in t.loads if k[0] == layer):
                raise CapacityError(
                    f"expert plan for layer {layer} refused: experts {t.experts} (valid 0.."
                    f"{self.n_experts - 1}), {len(t.experts)} in a turn for {self.n_slots} slots,"
                    f" loads into slots {slots_} of 0..{self.n_slots - 1} (leased: "
                    f"{[s for s in slots_ if 0 <= s < self.n_slots and self.leases[s]]})")

    def _load(self, key: Key, slot: int) -> None:
        """A load the step waits for: the slot is the plan's (reserved), so no lease."""
        with self.lock:
            self.evict(slot)
        weights = self.write(key, slot)
        with self.lock:
            self.install(key, slot, weights, prefetched=False)

    def evict(self, slot: int) -> None:
        """(lock held) Empty the slot; its expert, if any, is no longer resident."""
        old, t = self.key_of[slot], self.telemetry
        if old is not None:
            del self.slot_of[old]
            t.resident_bytes -= self.layouts[old[0]].nbytes
            if old in self.ahead:
                self.ahead.discard(old)
                t.prefetch_unused += 1
        self.key_of[slot], self.weights[slot], self.occ[slot] = None, None, -1

    def write(self, key: Key, slot: int) -> tuple:
        """(no lock) key's matrices into the slot's row -> (gate_up, down) over its views
        (the views of a slot for a layout are made once: their arrays do not change)."""
        layout = self.layouts[key[0]]
        tiles = self._tiles[slot].get(layout.parts)
        if tiles is None:
            tiles = self._tiles[slot][layout.parts] = slots.tile_views(self.pool[slot], layout)
        return slots.write(tiles, self.source, *key, layout)

    def install(self, key: Key, slot: int, weights: tuple, prefetched: bool) -> None:
        """(lock held) The written slot now holds `key`; counted as a load."""
        t, layout, raw = self.telemetry, self.layouts[key[0]], self.source.raw_bytes(key[0])
        self.weights[slot], self.key_of[slot], self.slot_of[key] = weights, key, slot
        self.occ[slot] = self._id(key)
        t.bytes_read += raw
        t.bytes_moved += layout.nbytes
        t.last_step_bytes_moved += layout.nbytes
        t.resident_bytes += layout.nbytes
        t.peak_resident_bytes = max(t.peak_resident_bytes, t.resident_bytes)
        if prefetched:
            t.prefetched += 1
            t.prefetch_bytes_read += raw
            self.ahead.add(key)
        else:
            t.misses += 1
            t.last_step_misses += 1
