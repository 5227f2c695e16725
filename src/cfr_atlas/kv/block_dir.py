"""The folder layout of a `DiskKvStore`: file names, atomic writes, and the start-up scan.

    <root>/<first 2 hex chars of the hash>/<64 hex chars>.kvb      one block (block_format.py)
    <root>/<2 hex>/.<64 hex>.<pid>.<8 hex>.tmp                      a write in progress

A file appears under its final name only by `os.replace` of a complete, fsynced temp file in
the same folder, so a reader sees a whole file or none. A temp file is left over only by a
process that died mid-write; the scan removes those of processes no longer running (and, at
start, our own pid's: this store has not written yet). This module holds no index or policy.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
_TEMP = re.compile(r"\.[0-9a-f]{64}\.(\d+)\.[0-9a-f]+\.tmp")
_FOLDER = re.compile(r"[0-9a-f]{2}")


def block_path(root: Path, block_hash: bytes) -> Path:
    name = block_hash.hex()
    return root / name[:2] / f"{name}.kvb"


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same folder, write, fsync, `os.replace` onto `path`."""
    path.parent.mkdir(exist_ok=True)
    temp = path.parent / f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def scan(root: Path) -> list[tuple[bytes, int]]:
    """(hash, size) of every block file, least recently modified first. Removes temp files of
    dead processes and block files in the wrong folder (no lookup would ever reach them)."""
    found = []
    for folder in root.iterdir():
        if not (folder.is_dir() and _FOLDER.fullmatch(folder.name)):
            continue
        for path in folder.iterdir():
            temp = _TEMP.fullmatch(path.name)
            if temp and (int(temp[1]) == os.getpid() or not process_alive(int(temp[1]))):
                path.unlink(missing_ok=True)
            elif _NAME.fullmatch(path.name) and path.name[:2] != folder.name:
                path.unlink(missing_ok=True)
            elif _NAME.fullmatch(path.name):
                try:
                    st = path.stat()
                except FileNotFoundError:  # removed by another process meanwhile
                    continue
                found.append((st.st_mtime_ns, bytes.fromhex(path.name[:64]), st.st_size))
    return [(block_hash, size) for _, block_hash, size in sorted(found)]


def same_inode(path: Path, inode: int | None) -> bool:
    """True if `path` still names the file we opened (not a replacement written since)."""
    try:
        return inode is not None and path.stat().st_ino == inode
    except OSError:
        return False


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (files named after dead ones are leftovers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
