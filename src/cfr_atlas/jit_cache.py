"""Processes take turns at numba's on-disk kernel cache.

numba's cache (`cache=True`) is not safe when two processes compile kernels of one module at
the same time (numba issue #4807, open): each reads the module's cache index, adds its new
kernel under the first free file number and writes the index back, so two processes can give
two different kernels the same data file, and a later run loads one kernel's machine code for
the other's signature and crashes (a segmentation fault, seen here with benchmark workers that
compiled side by side). That happens on a first run after install or upgrade, when a server and
a CLI, or several workers, start together.

`install()` (done when `cfr_atlas` is imported) registers a listener on numba's in-process
compiler lock, which numba takes whenever it compiles a kernel or loads one from the cache
(never on a call of a kernel already loaded). While any thread of this process holds that
lock, the process holds an exclusive `flock` on one lock file per installed package, so at
most one process at a time reads or writes the cache. A process that cannot have the lock
within `WAIT_S` (another stuck mid-compile) goes on without it, after saying so. Without
`fcntl` (Windows) nothing is locked.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path

from numba.core import event

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

WAIT_S = 600.0  # a compile of the largest kernel takes about a minute on a slow machine
POLL_S = 0.05


def lock_path() -> Path:
    """The lock file: in the package's `__pycache__` (where numba keeps its cache) when that is
    writable, else in the user cache directory, named after the package's path."""
    package = Path(__file__).resolve().parent
    here = package / "__pycache__"
    try:
        here.mkdir(exist_ok=True)
        if os.access(here, os.W_OK):
            return here / "numba-cache.lock"
    except OSError:
        pass
    import platformdirs

    tag = hashlib.sha256(str(package).encode()).hexdigest()[:16]
    return Path(platformdirs.user_cache_dir("cfr-atlas")) / f"numba-cache-{tag}.lock"


class CacheLock(event.Listener):
    """Holds the lock file's flock while this process is inside numba's compiler lock."""

    def __init__(self, path: Path, wait_s: float = WAIT_S):
        self.path, self.wait_s = path, wait_s
        self.acquired = 0  # times the flock was taken (tests)
        self._depth = 0
        self._fd = -1
        self._mutex = threading.Lock()

    def on_start(self, ev) -> None:
        # under the mutex, so another thread's nested start waits until the flock is held
        with self._mutex:
            self._depth += 1
            if self._depth == 1:
                self._acquire()

    def on_end(self, ev) -> None:
        with self._mutex:
            self._depth -= 1
            if self._depth == 0:
                self._release()

    def _acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return  # no lock file: numba's cache as it is
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    print(f"cfr-atlas: another process has held {self.path} for "
                          f"{self.wait_s:.0f} s; compiling without it", file=sys.stderr)
                    os.close(fd)
                    return
                time.sleep(POLL_S)
            except OSError:
                os.close(fd)
                return
        self._fd = fd
        self.acquired += 1

    def _release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing drops the flock


_installed: list[CacheLock] = []


def install() -> CacheLock | None:
    """Register the process's `CacheLock` (once); None without fcntl."""
    if fcntl is None:
        return None
    if not _installed:
        lock = CacheLock(lock_path())
        event.register("numba:compiler_lock", lock)
        _installed.append(lock)
    return _installed[0]
