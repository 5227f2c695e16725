"""Which leftover cache files are abandoned: an exclusive `flock` held for a file's whole life.

A writer (a sequence's page file, a block's temp file) takes `flock(LOCK_EX)` on the file right
after creating it and holds it until the file is gone; the kernel drops it when the process
ends, however it ends. Clean-up removes a file only if it can take that lock itself, so it
never deletes a live file of another process, another container sharing the folder (where
pids mean nothing: each has its own pid namespace) or another sequence of this process
(flock locks belong to open file descriptions, so they conflict within one process too).
A file of 0 bytes younger than `GRACE_SECONDS` is left alone: its writer may not have taken the
lock yet. Where `fcntl` is missing (Windows), clean-up falls back to the pid in the file name
and `psutil.pid_exists` (never `os.kill(pid, 0)`: on Windows that terminates the process).
This module decides nothing about what to keep; page_file.py and block_dir.py call it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

GRACE_SECONDS = 60.0


def hold_lock(fd: int) -> None:
    """Take the exclusive lock on our own new file (blocks only while a clean-up probes it)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (in this pid namespace)."""
    return psutil.pid_exists(pid)


def remove_if_abandoned(path: Path, pid: int | None = None) -> bool:
    """Delete `path` if no one holds its lock (no fcntl: if process `pid` is gone and is not
    this one); True if it was deleted."""
    if fcntl is None:
        if pid is None or pid == os.getpid() or process_alive(pid):
            return False
        path.unlink(missing_ok=True)
        return True
    try:
        fd = os.open(path, os.O_RDWR)  # writable: NFS emulates flock with write locks
    except OSError:  # vanished, or not ours to touch
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: the file is live
            return False
        st = os.fstat(fd)
        if st.st_size == 0 and time.time() - st.st_mtime < GRACE_SECONDS:
            return False
        try:
            if os.stat(path).st_ino != st.st_ino:  # replaced since we opened it
                return False
        except FileNotFoundError:
            return False
        path.unlink(missing_ok=True)  # still under our lock
        return True
    finally:
        os.close(fd)
