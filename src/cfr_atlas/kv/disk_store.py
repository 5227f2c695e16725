"""`DiskKvStore`: whole K/V blocks on disk, one file per block, under a byte budget.

A block lives at `<root>/<first 2 hex chars of its hash>/<hash hex>.kvb` (format in
block_format.py). Files are written to `.<hash>.<pid>.<random>.tmp` in the same folder,
fsynced, then `os.replace`d into place, so a reader sees a whole file or none.

Invariants (under `_lock`):
- `_index` holds every adopted or written file, least recently used first, with its size;
  `_bytes` == sum of those sizes + the sizes reserved by writes in flight <= budget_bytes;
- a block given to `put()` is in `_pending` until its file is in place (or it was refused for
  lack of room), so `get()` serves it at once; a full queue writes inline, nothing is dropped.

Reads never trust a hash alone: the stored token ids must equal the request's. A corrupt,
truncated or misfiled file is deleted and counted; an intact file of another signature or
format version is kept (another build or model may use it) and reported as incompatible.
On start, existing files are adopted by name (checked on first read; least recently used by
mtime, refreshed on every hit) and abandoned temp files (no writer holds their lock) are
removed. Eviction is by this store's own byte budget only, least recently used first, and
logged (`logging`, logger "cfr_atlas.kv.disk_store") and counted (`evictions`,
`evicted_bytes`); low free disk space never evicts anything: a write that would leave less than
`reserve_bytes` free, or that fails (disk full), is rejected and counted, and the block is
simply not cached. Processes may share a root (atomic renames, a vanished file is a miss) but
each keeps its own budget. The root is created 0700, block files 0600 (block_dir.py).
This module does not decide what to cache; prefix_cache.py does.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import queue
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cfr_atlas.errors import (
    CapacityError,
    ConfigError,
    CorruptBlockError,
    DimensionError,
    IncompatibleBlockError,
)
from cfr_atlas.kv.block_dir import FOLDER_MODE, block_path, same_inode, scan, write_atomic
from cfr_atlas.kv.block_format import decode_block, encode_block
from cfr_atlas.kv.block_hash import token_array
from cfr_atlas.kv.signature import CacheSignature, KvBlock


class ReadReason(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"
    INCOMPATIBLE = "incompatible"
    TOKEN_MISMATCH = "token-mismatch"


@dataclass(frozen=True)
class ReadOutcome:
    """The block (on a hit only) and why; `detail` carries the error message if any."""

    block: KvBlock | None
    reason: ReadReason
    detail: str = ""


@dataclass(frozen=True)
class StoreStats:
    blocks: int
    bytes: int  # files on disk + writes in flight
    hits: int
    misses: int
    corrupt: int
    incompatible: int
    token_mismatches: int
    evictions: int  # block files deleted to stay within budget_bytes (least recently used)
    evicted_bytes: int
    rejected: int  # blocks not stored: no room within budget / free disk, or a failed write
    read_seconds: float
    write_seconds: float


_COUNTERS = ("hits", "misses", "corrupt", "incompatible", "token_mismatches", "evictions",
             "evicted_bytes", "rejected", "read_seconds", "write_seconds")
log = logging.getLogger(__name__)


class DiskKvStore:
    """Persistent block files with LRU eviction and a background writer (see module docstring)."""

    def __init__(self, root: str | os.PathLike, *, budget_bytes: int, reserve_bytes: int = 1 << 30,
                 background: bool = True, queue_size: int = 32):
        checks = (("budget_bytes", budget_bytes, 0), ("reserve_bytes", reserve_bytes, 0),
                  ("queue_size", queue_size, 1))
        for name, value, low in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")
        self.root = Path(root).expanduser()
        self.budget_bytes, self.reserve_bytes = budget_bytes, reserve_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, KvBlock] = {}
        self._bytes = 0
        self._count = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self.writer_error: Exception | None = None  # last unexpected error of the writer thread
        try:
            self.root.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        except OSError as e:
            raise CapacityError(f"cannot create the K/V store {self.root}: {e.strerror}") from None
        self._adopt()
        self._queue: queue.Queue | None = None
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            self._thread = threading.Thread(target=self._worker, name="kv-disk-writer",
                                            daemon=True)
            self._thread.start()
        atexit.register(self.close)

    def path_for(self, block_hash: bytes) -> Path:
        return block_path(self.root, block_hash)

    # --- reading -------------------------------------------------------------------------------
    def get(self, block_hash: bytes, token_ids, signature: CacheSignature) -> ReadOutcome:
        """The block filed under `block_hash` if it is intact, of `signature`, and holds exactly
        `token_ids`; otherwise None and the reason (see module docstring)."""
        if not isinstance(block_hash, bytes) or len(block_hash) != 32:
            raise DimensionError(f"a block hash has 32 bytes, got {block_hash!r:.80}")
        t0 = time.perf_counter()
        outcome = self._get(block_hash, token_array(token_ids), signature)
        with self._lock:
            self._count[_COUNTER_OF[outcome.reason]] += 1
            self._count["read_seconds"] += time.perf_counter() - t0
        return outcome

    def _get(self, block_hash: bytes, tokens: np.ndarray, signature) -> ReadOutcome:
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            field = signature.first_mismatch(pending.signature)
            if field is not None:
                return ReadOutcome(None, ReadReason.INCOMPATIBLE, f"pending block: {field}")
            return self._match_tokens(pending, tokens)
        path = self.path_for(block_hash)
        try:
            data, inode = self._read(path)
        except FileNotFoundError:
            self._forget(block_hash)
            return ReadOutcome(None, ReadReason.MISS)
        except OSError as e:
            return ReadOutcome(None, ReadReason.MISS, f"{path}: {e.strerror}")
        try:
            if data is None:
                raise CorruptBlockError(f"file exceeds the store budget of {self.budget_bytes} B")
            block = decode_block(data, block_hash, signature)
        except IncompatibleBlockError as e:
            return ReadOutcome(None, ReadReason.INCOMPATIBLE, str(e))
        except CorruptBlockError as e:
            self._forget(block_hash, inode, delete=True)
            return ReadOutcome(None, ReadReason.CORRUPT, f"{path.name}: {e}")
        outcome = self._match_tokens(block, tokens)
        if outcome.block is not None:
            self._touch(block_hash, path, inode, len(data))
        return outcome

    @staticmethod
    def _match_tokens(block: KvBlock, tokens: np.ndarray) -> ReadOutcome:
        if np.array_equal(block.token_ids, tokens):
            return ReadOutcome(block, ReadReason.HIT)
        return ReadOutcome(None, ReadReason.TOKEN_MISMATCH,
                           f"stored block holds other token ids than the {len(tokens)} requested")

    def _read(self, path: Path) -> tuple[bytes | None, int]:
        """File bytes (None for a file larger than the whole budget: not read) and inode."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            return (None if st.st_size > self.budget_bytes else f.read()), st.st_ino

    def _touch(self, block_hash: bytes, path: Path, inode: int, size: int) -> None:
        """Mark a hit used: LRU order in memory, mtime on disk (the order a restart adopts)."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            elif same_inode(path, inode):  # written by another process since we started
                self._index[block_hash] = size
                self._bytes += size
        try:
            os.utime(path)
        except OSError:
            pass

    def _forget(self, block_hash: bytes, inode: int | None = None, delete: bool = False) -> None:
        """Drop a vanished file from the index; with `delete`, first remove the file we read
        (not one another writer has put in its place since)."""
        path = self.path_for(block_hash)
        with self._lock:
            if delete and same_inode(path, inode):
                path.unlink(missing_ok=True)
            if block_hash in self._index and not path.exists():
                self._bytes -= self._index.pop(block_hash)

    # --- writing -------------------------------------------------------------------------------
    def put(self, block: KvBlock) -> None:
        """Store `block` (readable at once); a block already on file is only marked used."""
        if not isinstance(block, KvBlock):
            raise TypeError(f"expected a KvBlock, got {type(block).__name__}")
        with self._lock:
            if self._closed:
                raise CapacityError(f"the K/V store {self.root} is closed")
            if block.hash in self._index:
                self._index.move_to_end(block.hash)
                return
            if block.hash in self._pending:
                return
            self._pending[block.hash] = block
            if self._queue is not None and not self._queue.full():
                self._queue.put_nowait(block.hash)  # under the lock: never behind close()'s stop
                return
        self._write(block.hash)  # no writer thread, or its queue is full: write inline

    def _write(self, block_hash: bytes) -> None:
        """Write a pending block's file, then retire it from `_pending` (whatever happens)."""
        t0, stored = time.perf_counter(), False
        try:
            stored = self._store_file(block_hash)
        finally:
            with self._lock:
                del self._pending[block_hash]
                self._count["rejected"] += not stored
                self._count["write_seconds"] += time.perf_counter() - t0

    def _store_file(self, block_hash: bytes) -> bool:
        with self._lock:
            block = self._pending[block_hash]
        data = encode_block(block)
        with self._lock:
            if not self._make_room(len(data)):
                return False
            self._bytes += len(data)  # reserved while the file is written
        try:
            write_atomic(self.path_for(block_hash), data)
        except OSError:
            with self._lock:
                self._bytes -= len(data)
            return False
        with self._lock:  # replaces a copy another process wrote and a hit adopted meanwhile
            self._bytes -= self._index.pop(block_hash, 0)
            self._index[block_hash] = len(data)
        return True

    def _make_room(self, size: int) -> bool:
        """Evict least recently used files until `size` more bytes fit the budget. False,
        evicting nothing, if the disk would keep less than the reserve free or the file is
        larger than the whole budget. Called under the lock."""
        if size > self.budget_bytes or (size and size > self._free_room()):
            return False
        evicted = freed = 0
        while self._index and self._bytes + size > self.budget_bytes:
            old, old_size = self._index.popitem(last=False)
            self.path_for(old).unlink(missing_ok=True)
            log.debug("K/V store %s: evicted %s (%d bytes)", self.root, old.hex(), old_size)
            self._bytes -= old_size
            evicted, freed = evicted + 1, freed + old_size
        if evicted:
            self._count["evictions"] += evicted
            self._count["evicted_bytes"] += freed
            log.info("K/V store %s: evicted %d least recently used block files (%d bytes) to "
                     "stay within its budget of %d bytes", self.root, evicted, freed,
                     self.budget_bytes)
        return self._bytes + size <= self.budget_bytes

    def _free_room(self) -> int:
        """Free disk space minus the reserve (0 if it cannot be read)."""
        try:
            return shutil.disk_usage(self.root).free - self.reserve_bytes
        except OSError:
            return 0

    def _worker(self) -> None:
        while True:
            block_hash = self._queue.get()
            try:
                if block_hash is None:
                    return
                self._write(block_hash)
            except Exception as e:  # a bug: counted as rejected by _write; keep the writer alive
                self.writer_error = e
            finally:
                self._queue.task_done()

    # --- lifecycle -----------------------------------------------------------------------------
    def _adopt(self) -> None:
        """Index existing block files (least recently used first), then evict to the budget
        (never for lack of free disk space: those files may be another model's)."""
        for block_hash, size in scan(self.root):
            self._index[block_hash] = size
            self._bytes += size
        with self._lock:
            self._make_room(0)

    def flush(self) -> None:
        """Wait until every queued block is on disk (or refused)."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Flush and stop the writer; idempotent. Later `put` calls raise CapacityError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()
        atexit.unregister(self.close)

    def __enter__(self) -> DiskKvStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(blocks=len(self._index), bytes=self._bytes, **self._count)


_COUNTER_OF = {ReadReason.HIT: "hits", ReadReason.MISS: "misses", ReadReason.CORRUPT: "corrupt",
               ReadReason.INCOMPATIBLE: "incompatible",
               ReadReason.TOKEN_MISMATCH: "token_mismatches"}
