"""Page-cache and process-memory tools for the memory benchmark (Linux).

What the process holds (/proc/self/status), whether a file's pages sit in the OS page cache
(mincore on a fresh mapping), evicting a file from the page cache (fsync, then
posix_fadvise DONTNEED: clean pages of a file nobody maps are dropped), and a plain sequential
read of a file from disk, the bandwidth a cold page-file read is compared against; a memory
cgroup to run in, so a file cannot stay cached (`MemoryCgroup`). Nothing here knows about models
or sessions.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import numpy as np

READ_CHUNK = 16 << 20  # sequential read size of the plain file read, bytes


def rss() -> dict[str, int]:
    """RssAnon / RssFile / RssShmem of this process, bytes (Linux /proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def resident_fraction(path) -> float | None:
    """Fraction of `path`'s pages in the OS page cache now (mincore on a fresh mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        vec = np.zeros(-(-size // mmap.PAGESIZE), dtype=np.uint8)
        ok = libc.mincore(addr, size, vec.ctypes.data) == 0
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return float((vec & 1).mean()) if ok else None


def disk_read_bytes(path) -> int | None:
    """Bytes read so far from the block device holding `path` (its /sys stat: sectors read x
    512), or None where that cannot be had. The difference over a span of time is what the
    disk actually read then, read-ahead and every other reader of the device included."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            return int(f.read().split()[2]) * 512
    except (OSError, ValueError, IndexError):
        return None


def drop_file_cache(path) -> None:
    """Flush `path`'s dirty pages and ask the kernel to drop its cached pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sequential_read(path, length: int | None = None, drop: bool = True) -> dict:
    """Evict `path` from the page cache (unless `drop` is False: then the read fills it), then
    read it front to back in 16 MiB reads (its first `length` bytes, default all)."""
    if drop:
        drop_file_cache(path)
    resident = resident_fraction(path)
    want = os.path.getsize(path) if length is None else length
    buf, n = bytearray(READ_CHUNK), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        while n < want and (k := os.preadv(fd, [memoryview(buf)[:min(READ_CHUNK, want - n)]],
                                           n)):
            n += k
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"bytes": n, "seconds": seconds, "gb_per_s": n / seconds / 1e9,
            "resident_before": resident}


def scattered_read(path, ranges) -> dict:
    """Evict `path` from the page cache, then read the (offset, length) `ranges`: every range
    asked of the kernel at once (posix_fadvise WILLNEED), then each read in offset order. What
    this disk gives reads of these sizes and places with nothing else running."""
    drop_file_cache(path)
    ranges = sorted(ranges)
    buf = bytearray(max((n for _, n in ranges), default=1))
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for off, n in ranges:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        for off, n in ranges:
            total += os.preadv(fd, [memoryview(buf)[:n]], off)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9}


class MemoryCgroup:
    """A memory cgroup of `limit` bytes this process runs in while the `with` block lasts: the
    page cache its reads fill after entering is charged to it, so a file larger than the limit
    cannot stay cached (a machine or container too small for it). cgroup v1's memory controller
    or v2's; needs the right to make cgroups (root). `why_not()` says why one cannot be made
    here (None: it can). Charges made before entering stay where they were (v1 moves none).
    On leaving, the process goes back to the cgroup it was in (and its limits)."""

    def __init__(self, limit: int, name: str = "cfr-atlas-bench"):
        self.limit, self.name, self.dir, self.home = limit, f"{name}-{os.getpid()}", None, None

    @staticmethod
    def _roots():
        v1 = Path("/sys/fs/cgroup/memory")
        if (v1 / "memory.limit_in_bytes").exists():
            yield v1, "memory.limit_in_bytes"
        v2 = Path("/sys/fs/cgroup")
        if "memory" in _read(v2 / "cgroup.subtree_control").split():
            yield v2, "memory.max"

    @classmethod
    def why_not(cls) -> str | None:
        roots = list(cls._roots())
        if not roots:
            return "no cgroup memory controller"
        if not os.access(roots[0][0], os.W_OK):
            return f"{roots[0][0]} is not writable (not root)"
        return None

    def __enter__(self):
        root, limit_file = next(self._roots())
        self.dir = root / self.name
        self.dir.mkdir()
        (self.dir / limit_file).write_text(str(self.limit))
        self.home = self._current(root)
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))
        return self

    @staticmethod
    def _current(root: Path) -> Path:
        """The cgroup this process is in now under `root` (where `__exit__` puts it back)."""
        v2 = root == Path("/sys/fs/cgroup")
        for line in _read("/proc/self/cgroup").splitlines():
            _, controllers, path = line.split(":", 2)
            if (controllers == "") if v2 else ("memory" in controllers.split(",")):
                d = root / path.strip("/")
                return d if d.is_dir() else root
        return root

    def peak(self) -> int | None:
        for f in ("memory.max_usage_in_bytes", "memory.peak"):
            if (self.dir / f).exists():
                return int(_read(self.dir / f) or 0)
        return None

    def __exit__(self, *exc):
        (self.home / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(50):  # rmdir waits for the moved task to be accounted out
            try:
                self.dir.rmdir()
                break
            except OSError:
                time.sleep(0.02)


def _read(path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
