"""The folder layout of a `DiskKvStore`: file names, atomic writes, and the start-up scan.

    <root>/<first 2 hex chars of the hash>/<64 hex chars>.kvb      one block (block_format.py)
    <root>/<2 hex>/.<64 hex>.<pid>.<8 hex>.tmp                      a write in progress

A file appears under its final name only by `os.replace` of a complete, fsynced temp file in
the same folder, so a reader sees a whole file or none. Folders are created 0700 and files
0600 (the umask can only narrow that): cached K/V reveals what was prompted. The writer holds
an exclusive lock on its temp file until the rename (file_lock.py); the scan removes only temp
files whose lock it can take, so processes and containers sharing a root never delete each
other's writes in progress. This module holds no index or policy.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from cfr_atlas.kv.file_lock import hold_lock, remove_if_abandoned

FOLDER_MODE, FILE_MODE = 0o700, 0o600
_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
_TEMP = re.compile(r"\.[0-9a-f]{64}\.(\d+)\.[0-9a-f]+\.tmp")
_FOLDER = re.compile(r"[0-9a-f]{2}")


def block_path(root: Path, block_hash: bytes) -> Path:
    name = block_hash.hex()
    return root / name[:2] / f"{name}.kvb"


def write_atomic(path: Path, data: bytes) -> None:
    """Locked temp file (0600) in the same folder (0700), write, fsync, `os.replace` onto
    `path`."""
    path.parent.mkdir(mode=FOLDER_MODE, exist_ok=True)
    temp = path.parent / f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with open(fd, "wb") as f:
            hold_lock(fd)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(temp, path)  # still locked: the scan never sees an unlocked partial file
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def scan(root: Path) -> list[tuple[bytes, int]]:
    """(hash, size) of every block file, least recently modified first. Removes abandoned
    temp files (no writer holds their lock) and block files in the wrong folder (no lookup
    would ever reach them)."""
    found = []
    for folder in root.iterdir():
        if not (folder.is_dir() and _FOLDER.fullmatch(folder.name)):
            continue
        for path in folder.iterdir():
            temp = _TEMP.fullmatch(path.name)
            if temp:
                remove_if_abandoned(path, int(temp[1]))
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
