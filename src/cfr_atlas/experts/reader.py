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
token, 57-58 ms a token against 85 through the page cache; in a memory cgroup too small for
the file, 59-60 against 76-104 (two runs). With the file cached the page cache is memory
speed, which is why "auto" reads directly only when the experts do not fit.

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
into a 4 KiB-aligned part of the buffer. A filesystem that refuses O_DIRECT (tmpfs before
Linux 6.6) gets plain reads into the same buffers (`direct` False): the threads and the queue
depth stay. Every descriptor is checked to be the version of the file the caller maps (a file
replaced at the same path would otherwise give other bytes). A forked child stages nothing.
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
    taken: int = 0  # takes that handed out staged bytes
    peak_bytes: int = 0  # most staging bytes allocated at once


def span_bound(n: int) -> int:
    """The most bytes a range of n bytes takes once rounded out to ALIGN on both sides,
    wherever it starts."""
    return -(-n // ALIGN) * ALIGN + ALIGN


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
    """nbytes starting on an ALIGN boundary, zeroed by writing them (so their pages exist
    before the first read, not faulted in by it)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    out = raw[start:start + nbytes]
    out.fill(0)
    return out


class DirectReader:
    """path: the file; capacity: staging bytes at most, in buffers of `buffer_bytes` each (one
    expert's ranges, rounded out: every buffer fits every expert, so any free one will do);
    version: (st_dev, st_ino, st_size, st_mtime_ns) of the file the caller maps. A descriptor
    whose file is not that version is refused (FileChangedError at construction; a failed
    read later): the staged bytes must be the mapped bytes."""

    def __init__(self, path, capacity: int, buffer_bytes: int, version: tuple | None = None,
                 threads: int = THREADS):
        self.path, self.threads, self.version = os.fspath(path), threads, version
        self.buffer_bytes = int(buffer_bytes)
        self.capacity = int(capacity) // self.buffer_bytes * self.buffer_bytes
        self.fd, self.direct = _open(self.path, version)
        self._old_fds: list[int] = []  # O_DIRECT descriptors replaced after EINVAL (closed last)
        self.lock = threading.Lock()
        self.closed = False
        self.staged: dict = {}  # key -> _Staged (taken or not)
        self.free: list[np.ndarray] = []  # buffers ready for reuse
        self.allocated = 0  # bytes of every buffer (staged or free)
        self.counts = ReaderCounts()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (staged, dst, offset, need)
        self._workers: list[threading.Thread] = []
        self._pid = os.getpid()

    def stage(self, key, ranges) -> bool:
        """Start reading `ranges` ((file offset, length) each) for `key` unless already staged;
        False when no buffer fits in the capacity, the ranges do not fit a buffer, the reader
        is closed or this is a forked child (nothing started; the caller reads the mapping)."""
        spans = _spans(ranges)
        size = spans[-1][1] + spans[-1][2]
        with self.lock:
            if key in self.staged:
                return True
            if self.closed or self._pid != os.getpid() or size > self.buffer_bytes:
                return False
            buf = self._buffer()
            if buf is None:
                self.counts.declined += 1
                return False
            try:
                self._start()
            except RuntimeError:  # no thread could be started: read through the mapping
                self.free.append(buf)
                return False
            views = [buf[pos + off - lo:pos + off - lo + n]
                     for (off, n), (lo, _, pos) in zip(ranges, spans, strict=True)]
            s = self.staged[key] = _Staged(buf, views, len(spans))
            s.ended.acquire()
            self.counts.staged += 1
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
        with self.lock:
            self.counts.taken += 1
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
        """Stop the threads (reads queued before end first) and close the file. Staging after
        this declines."""
        with self.lock:
            self.closed = True
            workers = list(self._workers)
            for _ in workers:
                self._jobs.put(None)
        for t in workers:
            t.join()
        with self.lock:
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
            self.free.append(s.buf)

    def _buffer(self) -> np.ndarray | None:
        """(lock held) A free buffer or a new one within the capacity; else None."""
        if self.free:
            return self.free.pop()
        if self.allocated + self.buffer_bytes <= self.capacity:
            self.allocated += self.buffer_bytes
            self.counts.peak_bytes = max(self.counts.peak_bytes, self.allocated)
            return aligned_empty(self.buffer_bytes)
        return None

    def _start(self) -> None:
        """(lock held) Reader threads up to `threads`. A thread ends after IDLE_SECONDS
        without a read, so a reader nobody closes leaves no thread behind; it decides so under
        the lock, and reads are queued under it, so a queued read always has a thread. A
        thread is counted once it has started."""
        while len(self._workers) < self.threads:
            t = threading.Thread(target=self._work, name=f"cfr-expert-read-{len(self._workers)}",
                                 daemon=True)
            t.start()
            self._workers.append(t)

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
                        self._forget(me)
                        return
                continue
            if job is None:
                with self.lock:
                    self._forget(me)
                return
            s, dst, offset, need = job
            try:
                got = self._read(dst, offset, need)
            except Exception:  # never a lost read: its taker would wait forever
                got = 0
            with self.lock:
                self.counts.bytes_read += got
                s.ok = s.ok and got >= need
                s.left -= 1
                if s.left == 0:
                    s.ended.release()
                    if s.dropped:
                        self.free.append(s.buf)

    def _forget(self, me) -> None:
        """(lock held) A thread that ends leaves the list (it may end before being listed)."""
        if me in self._workers:
            self._workers.remove(me)

    def _read(self, dst: np.ndarray, offset: int, need: int) -> int:
        """One aligned read into dst -> the bytes it returned (short of `need`: failed). After
        EINVAL under O_DIRECT the read is tried once more on the plain descriptor."""
        for _ in range(2):
            fd, got = self.fd, 0
            try:
                while got < need:
                    k = os.preadv(fd, [memoryview(dst)[got:]], offset + got)
                    if k <= 0:
                        break
                    got += k
                return got
            except OSError as e:
                if e.errno != errno.EINVAL or self._plain(fd) == fd:
                    return 0
        return 0

    def _plain(self, fd: int) -> int:
        """After EINVAL from `fd` (a device or filesystem that opened O_DIRECT but will not
        read so): the descriptor to read with now, a plain one (opened once, by the first
        thread to get here; `fd` itself when it was plain already or none can be had)."""
        with self.lock:
            if fd != self.fd or not self.direct:
                return self.fd if fd != self.fd else fd
            try:
                new = _open(self.path, self.version, direct=False)[0]
            except OSError:
                return fd
            self._old_fds.append(self.fd)
            self.fd, self.direct = new, False
            return new


class FileChangedError(OSError):
    """The file at the path is not the version the caller maps."""


def _open(path: str, version: tuple | None, direct: bool = True) -> tuple[int, bool]:
    """The file opened for O_DIRECT reads where the filesystem allows it (True), else plainly;
    FileChangedError if it is not `version`."""
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    fd, got = None, False
    if flag:
        try:
            fd, got = os.open(path, os.O_RDONLY | flag), True
        except OSError:
            pass
    if fd is None:
        fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    if version is not None and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != version:
        os.close(fd)
        raise FileChangedError(f"{path} has changed since the model mapped it")
    return fd, got
