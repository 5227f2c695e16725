"""What the OS page cache holds of a mapped file, and asking the kernel to read it: the few
libc calls (through ctypes, which releases the GIL) that the K/V page file (kv/page_file.py)
and the expert store (experts/source.py) share. Linux; where a call cannot be had, its name
is None and `cached` answers False (callers then hint or read as if nothing were cached).
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

MADV_POPULATE_READ = 22  # Linux >= 5.14: fault a range of the mapping in, reading it


def libc(name: str, argtypes: list):
    """libc's function `name` (returning int, errno kept), or None where it cannot be had."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


# madvise(addr, length, advice): Python's `mmap.madvise` holds the GIL while the kernel reads;
# a ctypes call releases it
MADVISE = libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_MINCORE = libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])  # addr, len, vec


def cached(address: int) -> bool:
    """Whether the mapped file page holding `address` is in the OS page cache: mincore, which
    only looks (~1 us). A read with RWF_NOWAIT would also answer, but it starts the kernel's
    read-ahead (8 MiB here) as a side effect. Without mincore, False."""
    page = address - address % mmap.PAGESIZE
    vec = getattr(_local, "vec", None)
    if vec is None:
        vec = _local.vec = (ctypes.c_ubyte * 1)()
    if _MINCORE is None or _MINCORE(page, mmap.PAGESIZE, vec) != 0:
        return False
    return bool(vec[0] & 1)


def resident_pages(address: int, length: int) -> np.ndarray | None:
    """Per page of the mapped range [address, address + length) (page-aligned outward), True
    where the page is in the OS page cache (mincore's bit 0; its other bits are reserved): one
    call for a whole span (~20 us for 3,200 pages, against a ctypes call per page asked
    about). None without mincore or when the call fails."""
    first = address - address % mmap.PAGESIZE
    n = -(-(address + length - first) // mmap.PAGESIZE)
    vec = np.empty(n, dtype=np.uint8)
    if _MINCORE is None or _MINCORE(first, n * mmap.PAGESIZE, vec.ctypes.data) != 0:
        return None
    return (vec & 1).view(bool)


_local = threading.local()  # each thread's one-byte answer buffer for mincore
