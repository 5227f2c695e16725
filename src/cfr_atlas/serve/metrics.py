"""/metrics in Prometheus text format (version 0.0.4).

`RequestCounter` is ASGI middleware that counts responses by route and status at one point
(the response start), so handlers carry no metrics code; the scheduler's `SchedulerStats`
supply the rest: counters, gauges, and histograms of the batched steps (sequences and tokens
per forward pass) and of the time requests wait for a slot; with `--prefix-store`, the shared
Redis tier's `RemoteStats` add the cfr_atlas_prefix_store_* lines. Paths outside the served routes
share the label "other", so random URLs cannot grow the label set. This module does no model work.
"""

from __future__ import annotations

import threading
from collections import Counter

from cfr_atlas.serve.histogram import Histogram
from cfr_atlas.serve.scheduler import SchedulerStats

# (name, type, help, SchedulerStats field)
_SCHEDULER_METRICS = (
    ("cfr_atlas_jobs_submitted_total", "counter", "Jobs accepted into the queue.", "submitted"),
    ("cfr_atlas_jobs_rejected_total", "counter", "Requests refused with 429 (queue full).",
     "rejected"),
    ("cfr_atlas_jobs_completed_total", "counter", "Jobs that ran to the end.", "completed"),
    ("cfr_atlas_jobs_cancelled_total", "counter", "Jobs dropped because the client went away.",
     "cancelled"),
    ("cfr_atlas_jobs_failed_total", "counter", "Jobs that ended with an error.", "failed"),
    ("cfr_atlas_prompt_tokens_total", "counter", "Prompt tokens prefilled.", "prompt_tokens"),
    ("cfr_atlas_generated_tokens_total", "counter", "Tokens generated.", "generated_tokens"),
    ("cfr_atlas_hot_cache_hits_total", "counter", "K/V pages folded from the hot cache.",
     "hot_hits"),
    ("cfr_atlas_regenerations_total", "counter", "K/V pages regenerated (spill or recompute).",
     "regenerations"),
    ("cfr_atlas_active_sequences", "gauge", "Jobs being stepped now.", "active"),
    ("cfr_atlas_queue_depth", "gauge", "Jobs waiting for a slot.", "queued"),
    ("cfr_atlas_resident_kv_bytes", "gauge", "K/V bytes resident in the active sessions' hot "
     "caches.", "resident_kv_bytes"),
)

# (name, help, SchedulerStats field)
_HISTOGRAMS = (
    ("cfr_atlas_batch_size", "Sequences in one batched forward pass.", "batch_sizes"),
    ("cfr_atlas_batch_tokens", "Tokens (prompt chunks and decode tokens) in one batched "
     "forward pass.", "batch_tokens"),
    ("cfr_atlas_queue_seconds", "Seconds a request waited between submission and its first "
     "step.", "queue_seconds"),
)


# (name, type, help, RemoteStats field): the shared prefix store (kv/redis_store.py)
_STORE_METRICS = (
    ("cfr_atlas_prefix_store_hits_total", "counter", "Prefix blocks read from the shared store.",
     "hits"),
    ("cfr_atlas_prefix_store_misses_total", "counter", "Lookups that ended at a block the shared "
     "store does not hold.", "misses"),
    ("cfr_atlas_prefix_store_skipped_reads_total", "counter", "Lookups that skipped the store "
     "(breaker open).", "skipped_reads"),
    ("cfr_atlas_prefix_store_read_bytes_total", "counter", "Block bytes read and used.",
     "bytes_read"),
    ("cfr_atlas_prefix_store_writes_total", "counter", "Blocks written.", "writes"),
    ("cfr_atlas_prefix_store_present_total", "counter", "Writes skipped: the block was already "
     "stored.", "present"),
    ("cfr_atlas_prefix_store_written_bytes_total", "counter", "Block bytes written.",
     "bytes_written"),
    ("cfr_atlas_prefix_store_dropped_writes_total", "counter", "Writes dropped: queue full or "
     "breaker open.", "dropped"),
    ("cfr_atlas_prefix_store_errors_total", "counter", "Store errors and timeouts.", "errors"),
    ("cfr_atlas_prefix_store_breaker_opens_total", "counter", "Times the breaker opened.",
     "breaker_opens"),
    ("cfr_atlas_prefix_store_breaker_state", "gauge", "Breaker: 0 closed, 1 open, 2 half-open.",
     "breaker_state"),
    ("cfr_atlas_prefix_store_queued_bytes", "gauge", "Bytes waiting in the write-behind queue.",
     "queued_bytes"),
)
_STORE_REJECTS = ("corrupt", "incompatible", "token_mismatches")


class RequestCounts:
    """Response counts by (path, status); the middleware writes, /metrics reads."""

    def __init__(self, paths: set[str]):
        self.paths = paths
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, int]] = Counter()

    def add(self, path: str, status: int) -> None:
        with self._lock:
            self._counts[(path if path in self.paths else "other", status)] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._counts)


class RequestCounter:
    """ASGI middleware: counts each HTTP response into `counts` when it starts."""

    def __init__(self, app, counts: RequestCounts):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts.add(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def render(requests: dict[tuple[str, int], int], stats: SchedulerStats) -> str:
    lines = ["# HELP cfr_atlas_requests_total HTTP responses by path and status.",
             "# TYPE cfr_atlas_requests_total counter"]
    for (path, status), n in sorted(requests.items()):
        lines.append(f'cfr_atlas_requests_total{{path="{path}",status="{status}"}} {n}')
    for name, kind, help_text, field in _SCHEDULER_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {getattr(stats, field)}"]
    for name, help_text, field in _HISTOGRAMS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram",
                  *_histogram_lines(name, getattr(stats, field))]
    return "\n".join(lines) + "\n"


def render_store(stats) -> str:
    """The shared prefix store's lines ("" without a store: `stats` None)."""
    if stats is None:
        return ""
    lines = []
    for name, kind, help_text, field in _STORE_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {getattr(stats, field)}"]
    name = "cfr_atlas_prefix_store_rejected_total"
    lines += [f"# HELP {name} Stored blocks rejected and deleted, by reason.",
              f"# TYPE {name} counter",
              *(f'{name}{{reason="{r}"}} {getattr(stats, r)}' for r in _STORE_REJECTS)]
    return "\n".join(lines) + "\n"


def _histogram_lines(name: str, h: Histogram) -> list[str]:
    """Cumulative `_bucket{le=...}` lines, then `_sum` and `_count`."""
    out = [f'{name}_bucket{{le="{"+Inf" if b == float("inf") else f"{b:g}"}"}} {n}'
           for b, n in h.buckets()]
    return out + [f"{name}_sum {h.total:.9g}", f"{name}_count {h.count}"]
