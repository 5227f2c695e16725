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

`install()` also widens the stamp numba files a kernel under. numba keys a cached kernel by a
hash of its own source file only, yet a kernel compiles the code of the functions it calls
into its machine code: `decode_walk.append_fold` carries `fold._fold_item`, which carries
`fold_blocks`' intrinsics and `ops.activations.exp32`. After an update that changes fold.py but
not decode_walk.py, the cached `append_fold` would still hold the old fold, and the all-hot
decode path would compute with other arithmetic than the general path (a different result
for the same query: the batch invariance this project promises). So the stamp of every kernel
of this package is its own file's hash and `package_digest()`, a hash of all of the package's
sources: any change to the package's code makes every cached kernel of it stale, and they
compile anew on first use (the first run after an update prints that it is compiling).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

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


PACKAGE = Path(__file__).resolve().parent


@functools.cache
def package_digest() -> str:
    """A hash of every source file of this package (`kv.build.source_digest`), once a
    process."""
    from cfr_atlas.kv.build import source_digest

    return source_digest(PACKAGE)


def _in_package(path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(PACKAGE)
    except (OSError, TypeError, ValueError):
        return False


def _stamped(method):
    """A locator's `get_source_stamp`, with `package_digest()` added for this package's
    functions (module docstring)."""

    @functools.wraps(method)
    def stamp(self):
        own = method(self)
        if _in_package(getattr(self, "_py_file", None)):
            return own, package_digest()
        return own

    stamp.cfr_atlas_stamped = True
    return stamp


def install() -> bool:
    """Stamp this package's kernels with its sources' digest, and wrap numba's cache file
    `save` and `load` in a lock (once each); False without fcntl (then only the stamp)."""
    mixin = caching._SourceFileBackedLocatorMixin
    if not getattr(mixin.get_source_stamp, "cfr_atlas_stamped", False):
        mixin.get_source_stamp = _stamped(mixin.get_source_stamp)
    if fcntl is None:
        return False
    cls = caching.IndexDataCacheFile
    for name in ("save", "load"):
        method = getattr(cls, name)
        if not getattr(method, "cfr_atlas_locked", False):
            setattr(cls, name, _locked(method))
    return True
