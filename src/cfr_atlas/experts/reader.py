"""`DirectReader`: reads experts' file ranges into staging buffers on a pool of reader threads,
bypassing the OS page cache (O_DIRECT), for a model whose experts the page cache cannot keep.

Why: an expert that is not in the page cache reaches its slot either through the page cache
(posix_fadvise WILLNEED, then the repack faults the mapped pages in) or straight off the disk.
When the page cache cannot hold the experts (the machine, or the container's memory cgroup,
is smaller than the file), every page read through it is evicted again before its next use,
and the compute thread pays for both: the kernel allocating and inserting ~20,000 pages a 78 MB
token, and reclaiming as many to make room. Here each of an expert's matrices is one O_DIRECT
read (the disk writes into our buffer; no page is allocated or reclaimed) issued by one of
THREADS threads, so a step's ranges are in flight together. bench_moe, int8, the smallest
budget (docs/PERFORMANCE.md, "Session 42"): the file dropped from the page cache before each
token, 58 ms a token against 85 through the page cache; in a memory cgroup too small for the
file, 59 against 104. With the file cached the two are even, which is why "auto" reads
directly only when the experts do not fit.

Staging is a small cache of file bytes keyed by (layer, expert): `stage` starts the reads of
an expert if a buffer can be had within `capacity` bytes (else it declines, and the caller
reads through the page cache as before), `take` waits for them and hands out the bytes
(pinned until `release`), `release` frees the buffer for reuse once its reads are done, and
`keep` drops the staged keys a step has no use for. A staged key is never given up to make
room for another: a step that was told its expert is staged finds it there. The
bytes are the file's bytes (the file does not change), so which path an expert took changes no
bit of a slot. A failed read makes `take` return None (the caller reads the mapped bytes) and
is counted. O_DIRECT needs offsets, lengths and buffers aligned to the device's block: each
range is read from its 4 KiB boundary below to the one above (at most 8 KiB more a matrix)
into a 4 KiB-aligned part of the buffer. A filesystem that refuses O_DIRECT (tmpfs) gets plain
reads into the same buffers (`direct` False): the threads and the queue depth stay.
Not here: which experts to stage (source.py, store.py), the repack (slots.py).
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (covers 512-byte devices)
THREADS = 8  # reads in flight at once (each thread blocks in one pread, the GIL released)
IDLE_SECONDS = 1.0  # a reader thread without a read for this long ends (started again on use)


@dataclass
class _Staged:
    buf: np.ndarray  # 4 KiB-aligned bytes of the expert's ranges, each from its aligned start
    views: list[np.ndarray]  # per range: its own bytes inside buf
    left: int  # reads not yet ended
    ok: bool = True  # every ended read returned its bytes
    pins: int = 0  # takers between take and release
    dropped: bool = False  # released or dropped: the buffer is free once `left` is 0
    ended: threading.Lock = field(default_factory=threading.Lock)  # held until left is 0


@dataclass
class ReaderCounts:
    staged: int = 0  # experts whose ranges were read by the reader
    bytes_read: int = 0  # bytes the reader's reads returned (aligned spans)
    declined: int = 0  # stage requests refused for want of a buffer (read via the page cache)
    failed: int = 0  # takes whose reads failed (the caller read the mapped bytes)
    peak_bytes: int = 0  # most staging bytes allocated at once


def _spans(ranges) -> list[tuple[int, int, int]]:
    """Per (offset, length): (aligned file start, aligned span, where it sits in the buffer)."""
    out, pos = [], 0
    for off, n in ranges:
        lo = off - off % ALIGN
        span = -(-(off + n - lo) // ALIGN) * ALIGN
        out.append((lo, span, pos))
        pos += span
    return out


def aligned_empty(nbytes: int) -> np.ndarray:
    """nbytes of zeroed memory starting on an ALIGN boundary (touched now, not at the read)."""
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


class DirectReader:
    def __init__(self, path, capacity: int, threads: int = THREADS):
        self.path, self.capacity, self.threads = os.fspath(path), int(capacity), threads
        self.fd, self.direct = _open(self.path)
        self._old_fds: list[int] = []  # O_DIRECT descriptors replaced after EINVAL (closed last)
        self.lock = threading.Lock()
        self.staged: dict = {}  # key -> _Staged (taken or not)
        self.free: dict[int, list[np.ndarray]] = {}  # buffer size -> buffers ready for reuse
        self.allocated = 0  # bytes of every buffer (staged or free)
        self.counts = ReaderCounts()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (staged, dst, offset, need)
        self._workers: list[threading.Thread] = []
        self._pid = os.getpid()

    def stage(self, key, ranges) -> bool:
        """Start reading `ranges` ((file offset, length) each) for `key` unless already staged;
        False when no buffer fits in the capacity (nothing started)."""
        spans = _spans(ranges)
        size = spans[-1][1] + spans[-1][2]
        with self.lock:
            if key in self.staged:
                return True
            if self.fd is None:  # closed
                return False
            buf = self._buffer(size)
            if buf is None:
                self.counts.declined += 1
                return False
            views = [buf[pos + off - lo:pos + off - lo + n]
                     for (off, n), (lo, _, pos) in zip(ranges, spans, strict=True)]
            s = self.staged[key] = _Staged(buf, views, len(spans))
            s.ended.acquire()
            self.counts.staged += 1
            self._start()
            for (off, n), (lo, span, pos) in zip(ranges, spans, strict=True):
                self._jobs.put((s, buf[pos:pos + span], lo, off - lo + n))
        return True

    def take(self, key) -> list[np.ndarray] | None:
        """The staged bytes of `key` (one array per range), pinned until `release(key)`; None
        if `key` is not staged or a read failed (then nothing is pinned)."""
        with self.lock:
            s = self.staged.get(key)
            if s is None:
                return None
            s.pins += 1
        with s.ended:  # waits for the reads
            pass
        if not s.ok:
            with self.lock:
                self.counts.failed += 1
            self.release(key)
            return None
        return s.views

    def release(self, key) -> None:
        """Unpin `key` (after a take) or drop it unused; its buffer is reused once no taker
        holds it and its reads have ended."""
        with self.lock:
            s = self.staged.get(key)
            if s is not None:
                s.pins = max(s.pins - 1, 0)
                if s.pins == 0:
                    self._drop(key)

    def keep(self, wanted) -> None:
        """Drop every staged key for which `wanted(key)` is false and nobody holds (wrong
        predictions, once their step has said what it loads). Never a staged key a step is
        about to take: a buffer is only reused after its key is released or dropped here."""
        with self.lock:
            for key in [k for k, s in self.staged.items() if s.pins == 0 and not wanted(k)]:
                self._drop(key)

    def close(self) -> None:
        """Stop the threads (their reads in flight end first) and close the file."""
        with self.lock:
            workers = list(self._workers)
            for _ in workers:
                self._jobs.put(None)
        for t in workers:
            t.join()
        for fd in [self.fd, *self._old_fds]:
            if fd is not None:
                os.close(fd)
        self.fd, self._old_fds = None, []
        self.staged.clear()
        self.free.clear()
        self.allocated = 0

    def _drop(self, key) -> None:
        """(lock held) `key` is no longer staged; its buffer is free once its reads end."""
        s = self.staged.pop(key)
        s.dropped = True
        if s.left == 0:
            self.free.setdefault(s.buf.nbytes, []).append(s.buf)

    def _buffer(self, size: int) -> np.ndarray | None:
        """(lock held) A free buffer of `size` bytes or a new one within the capacity; else
        None."""
        if self.free.get(size):
            return self.free[size].pop()
        if self.allocated + size <= self.capacity:
            self.allocated += size
            self.counts.peak_bytes = max(self.counts.peak_bytes, self.allocated)
            return aligned_empty(size)
        return None

    def _start(self) -> None:
        """(lock held) Reader threads up to `threads` (again in a forked child, which has
        none). A thread ends after IDLE_SECONDS without a read, so a reader nobody closes
        leaves no thread behind; it decides so under the lock, and reads are queued under it,
        so a queued read always has a thread."""
        if self._pid != os.getpid():
            self._pid, self._workers, self._jobs = os.getpid(), [], queue.SimpleQueue()
        while len(self._workers) < self.threads:
            t = threading.Thread(target=self._work, name=f"cfr-expert-read-{len(self._workers)}",
                                 daemon=True)
            self._workers.append(t)
            t.start()

    def _work(self) -> None:
        """A reader thread: one read at a time off the queue until told to stop (None) or
        idle for IDLE_SECONDS."""
        me = threading.current_thread()
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self.lock:
                    if self._jobs.empty():
                        self._workers.remove(me)
                        return
                continue
            if job is None:
                with self.lock:
                    self._workers.remove(me)
                return
            s, dst, offset, need = job
            try:
                got = self._read(dst, offset, need)
            except Exception:  # (a closed reader's fd, ...): a failed read, never a lost one
                got = 0
            with self.lock:
                self.counts.bytes_read += got
                s.ok = s.ok and got >= need
                s.left -= 1
                if s.left == 0:
                    s.ended.release()
                    if s.dropped:
                        self.free.setdefault(s.buf.nbytes, []).append(s.buf)

    def _read(self, dst: np.ndarray, offset: int, need: int) -> int:
        """One aligned read into dst -> the bytes it returned (short of `need`: failed)."""
        got, fd = 0, self.fd
        try:
            while got < need:
                k = os.preadv(fd, [memoryview(dst)[got:]], offset + got)
                if k <= 0:
                    break
                got += k
        except OSError as e:
            if e.errno != errno.EINVAL or fd not in self._old_fds and not self._plain(fd):
                return 0
            return self._read(dst, offset, need)  # again, without O_DIRECT
        return got

    def _plain(self, fd: int) -> bool:
        """After EINVAL from `fd` under O_DIRECT (a device or filesystem that opened but will
        not read so): plain reads from now on. False when `fd` was a plain one already."""
        with self.lock:
            if not self.direct or fd != self.fd:
                return fd in self._old_fds
            self._old_fds.append(self.fd)
            self.fd, self.direct = os.open(self.path, os.O_RDONLY), False
            return True


def _open(path: str) -> tuple[int, bool]:
    """The file opened for O_DIRECT reads where the filesystem allows it (True), else plainly."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:
            pass
    return os.open(path, os.O_RDONLY), False
