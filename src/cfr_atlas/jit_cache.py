"""Processes take turns at numba's on-disk kernel cache files.

numba's cache (`cache=True`) is not safe when two processes save kernels of one function at
the same time (numba issue #4807, open): each reads the function's cache index, files its new
kernel under the first free data-file number and writes the index back, so two processes can
file two kernels under one number, and a later run loads one kernel's machine code for the
other's signature and crashes (a segmentation fault, seen here with benchmark workers that
compiled side by side). That happens on a first run after install or upgrade, when a server and
a CLI, or several workers, start together.

`install()` (done when `cfr_atlas` is imported) wraps numba's `IndexDataCacheFile.save` and
`.load` (read the index, then write or read a data file) in an exclusive `flock` on a lock
file beside the index (`<index>.lock`), so one process at a time reads or changes a function's
cache entries. Compiling is not serialized: only these few milliseconds of file work are. A
process that cannot have a lock within `WAIT_S` (another stuck mid-save) goes on without it,
after saying so. Without `fcntl` (Windows), or where the lock file cannot be created (a
read-only cache), nothing is locked.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from numba.core import caching

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

WAIT_S = 60.0  # a save or load takes milliseconds; a minute means a stuck process
POLL_S = 0.01


def lock_fd(path: str, wait_s: float = WAIT_S) -> int:
    """An open descriptor of lock file `path` holding its exclusive flock, or -1 (no lock file
    possible, or not had within wait_s: then a message says so)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return -1
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                print(f"cfr-atlas: another process has held {path} for {wait_s:.0f} s; "
                      "using numba's cache without it", file=sys.stderr)
                break
            time.sleep(POLL_S)
        except OSError:
            break
    os.close(fd)
    return -1


def _locked(method):
    """`method` of an IndexDataCacheFile, run holding the flock of its index's lock file."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        index = getattr(self, "_index_path", None)
        fd = -1 if index is None else lock_fd(index + ".lock")
        try:
            return method(self, *args, **kwargs)
        finally:
            if fd >= 0:
                os.close(fd)  # closing drops the flock

    run.cfr_atlas_locked = True
    return run


def install() -> bool:
    """Wrap numba's cache file `save` and `load` (once); False without fcntl."""
    if fcntl is None:
        return False
    cls = caching.IndexDataCacheFile
    for name in ("save", "load"):
        method = getattr(cls, name)
        if not getattr(method, "cfr_atlas_locked", False):
            setattr(cls, name, _locked(method))
    return True
