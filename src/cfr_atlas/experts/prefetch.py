"""`Prefetcher`: loads the experts predicted for the next layer into idle slots on one
background thread, while the current layer computes.

The model predicts layer i+1's experts by running that layer's router on layer i's input (the
residual stream changes little between layers) and hands them over once layer i's plan is
reserved (`ExpertStore.experts(..., ahead=...)`). For each predicted expert not resident, the
thread, under the store's lock, takes a slot (`ExpertStore.prefetch_slot`: free, else the
policy's victim among slots not leased, not in the running step's plan, not of layer i+1 and
not prefetched-and-unused; evicting only while layer i+1's recent predictions were mostly used,
`may_evict`), validates that one-load plan, evicts the slot and leases it; then,
without the lock, writes the expert (numba, nogil: it runs beside the compute thread's
kernels); then installs it under the lock. When no slot is idle it waits for a lease or a
reservation to end (the attention of the next layer is such a window) and retries.

`settle(layer)`, called when layer `layer`'s step begins, drops queued experts of that layer
and earlier (the step loads what it still misses itself) and waits for an in-flight load to
finish, so the step plans over settled tables. A wrong prediction costs a load and an eviction,
never a result: nothing is computed with a slot before its key is installed, and the prefetcher
never takes a leased or reserved slot. The kernel is also asked to read the predicted ranges
(posix_fadvise WILLNEED) when they are queued. The thread exits after IDLE_SECONDS without
work, so a replaced store leaves no thread behind. Not here: the prediction (models/moe.py),
slot choice and counters (store.py).
"""

from __future__ import annotations

import threading
from collections import deque

from cfr_atlas.kernel_threads import run_kernels_alone

IDLE_SECONDS = 0.5
TRUST_TO_EVICT = 0.5  # evict for a layer's predictions only while at least this share was used
PROBATION = 0.05  # trust regained per request while below (so a layer is tried again)


class Prefetcher:
    def __init__(self, store):
        self.store, self.queue = store, deque()
        self.floor = -1  # layers <= floor have started their step: their requests are stale
        self.loading = None  # (key, slot) being written by the thread
        self.predicted: set[int] = set()  # layers with a request since their last step
        self.thread: threading.Thread | None = None
        self.stopped = False
        self.trust = [1.0] * store.n_layers  # per layer: recent share of prefetched experts used

    def request(self, layer: int, experts) -> None:
        """Queue `layer`'s predicted expert ids that are not resident; start the thread."""
        store = self.store
        with store.lock:
            if self.stopped or not 0 <= layer < store.n_layers:
                return
            queued = set(self.queue)
            keys = [k for k in store.missing(layer, experts) if k not in queued]
            self.predicted.add(layer)
            if self.trust[layer] < TRUST_TO_EVICT:
                self.trust[layer] += PROBATION
            store.source.advise(layer, [e for _, e in keys])
            self.queue.extend(keys)
            if keys and self.thread is None:
                self.thread = threading.Thread(target=self._work, name="expert-prefetch",
                                               daemon=True)
                self.thread.start()
            store.lock.notify_all()

    def judge(self, layer: int, used: int, unused: int) -> None:
        """(lock held) A step of `layer` used `used` of its prefetched experts, not `unused`."""
        if used + unused:
            self.trust[layer] = 0.5 * self.trust[layer] + 0.5 * used / (used + unused)

    def may_evict(self, layer: int) -> bool:
        """(lock held) Whether loading a prediction of `layer` may evict a resident expert:
        only while its predictions have mostly been used (a wrong one evicts a useful expert
        and loads a useless one); below that, free slots only, and trust creeps back."""
        return self.trust[layer] >= TRUST_TO_EVICT

    def was_predicted(self, layer: int) -> bool:
        """(lock held) Whether `layer` had a request since its last step; clears it."""
        hit = layer in self.predicted
        self.predicted.discard(layer)
        return hit

    def settle(self, layer: int) -> None:
        """(lock held) Layer `layer`'s step begins: drop stale requests, wait for the load in
        flight (the lock is released while waiting)."""
        self.floor = layer
        self.queue = deque(k for k in self.queue if k[0] > layer)
        while self.loading is not None:
            self.store.lock.wait()

    def stop(self) -> None:
        """(lock held) No further loads; the thread ends after its current one."""
        self.stopped = True
        self.queue.clear()
        self.store.lock.notify_all()

    def _work(self) -> None:
        # the compute thread's kernels keep both cores; a second team of workers here would
        # make every team sleep at its barriers (kernel_threads.py)
        run_kernels_alone()
        store = self.store
        while True:
            with store.lock:
                job = self._next()
                if job is None:
                    self.thread = None
                    return
                self.loading = job
            key, slot = job
            weights = None
            try:
                weights = store.write(key, slot)
            finally:
                with store.lock:
                    store.leases[slot] -= 1
                    if weights is not None:
                        store.install(key, slot, weights, prefetched=True)
                    else:  # the write failed: the slot stays empty, the thread ends
                        self.stopped, self.thread = True, None
                    self.loading = None
                    store.lock.notify_all()

    def _next(self):
        """(lock held) The next (key, slot) to write, its slot evicted and leased; None when
        stopped or idle for IDLE_SECONDS."""
        store = self.store
        while not self.stopped:
            while self.queue:
                key = self.queue[0]
                if key[0] <= self.floor or key in store.slot_of:
                    self.queue.popleft()
                    continue
                slot = store.prefetch_slot(key)
                if slot is None:
                    break  # nothing idle now: wait for a lease or a reservation to end
                self.queue.popleft()
                store.evict(slot)
                store.leases[slot] += 1
                return key, slot
            if not store.lock.wait(timeout=IDLE_SECONDS):
                self.queue.clear()
                return None
        return None
