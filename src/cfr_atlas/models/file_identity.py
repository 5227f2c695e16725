"""The content identity of a model file: SHA-256 of every byte, memoized per file version.

A prefix-cache hit must be this model's K/V, so the identity covers the whole file (header,
metadata and every tensor byte), not samples: two fine-tunes that differ in one attention
tensor must never share blocks. Hashing a 4 GB file takes seconds, so the digest is memoized
under the file's stat key (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns):

- in this process (a dict), and
- across processes in a small versioned JSON memo under the user's cache folder
  (`memo_path()`), written with a temp file and `os.replace`; an unreadable, corrupt or
  other-version memo is ignored and rewritten.

Any write to the file changes its mtime and ctime (ctime cannot be set back by `touch` or
`cp --preserve`), so a memoized digest is never reused for changed bytes. SHA-256 was picked
by measurement (docs/PREFIX_CACHE.md: it beats BLAKE2b here thanks to the CPU's SHA
instructions). This module knows nothing about GGUF; gguf_io.py calls it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import uuid
from pathlib import Path

MEMO_VERSION = 1
ALGORITHM = "sha256"
CHUNK_BYTES = 16 << 20
PROGRESS_FROM_BYTES = 1 << 30  # show a progress bar only for files this large
MEMO_ENTRIES = 64

_memo: dict[str, str] = {}
_lock = threading.Lock()


def memo_path() -> Path:
    """Where the persistent memo lives (tests monkeypatch this)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("cfr-atlas")) / "file-identity.json"


def stat_key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_digest(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the whole file, from the memo when this exact file version was hashed."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size == 0:
            return memo_digest(st, b"", Path(path).name)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return memo_digest(st, view, Path(path).name)
            finally:
                view.release()


def memo_digest(st: os.stat_result, data, name: str = "") -> str:
    """Hex SHA-256 of `data`, the whole content of the file version `st` describes (e.g. the
    memory map the weights are read from), memoized under `stat_key(st)`."""
    key = stat_key(st)
    with _lock:
        digest = _memo.get(key)
    if digest is None:
        digest = _load_memo().get(key)
    if digest is None:
        digest = hash_buffer(data, name)
        _store_memo(key, digest)
    with _lock:
        _memo[key] = digest
    return digest


def hash_buffer(data, name: str = "") -> str:
    """SHA-256 of a bytes-like object (a memory map), in 16 MiB chunks."""
    view = memoryview(data).cast("B")
    h = hashlib.new(ALGORITHM)
    try:
        with _progress(len(view), name) as bar:
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start:start + CHUNK_BYTES]
                h.update(chunk)  # hashlib releases the GIL on large buffers
                bar.update(len(chunk))
                chunk.release()
    finally:
        view.release()
    return h.hexdigest()


def _progress(size: int, name: str):
    from tqdm import tqdm

    return tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {name}", leave=False,
                disable=size < PROGRESS_FROM_BYTES)


def _load_memo() -> dict[str, str]:
    """The persistent memo's entries; {} when missing, unreadable, corrupt or another version."""
    try:
        data = json.loads(memo_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != MEMO_VERSION \
            or data.get("algorithm") != ALGORITHM or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items()
            if isinstance(k, str) and isinstance(v, str) and len(v) == 64}


def _store_memo(key: str, digest: str) -> None:
    """Add an entry (keeping the newest MEMO_ENTRIES); failures only cost a re-hash later."""
    entries = _load_memo()
    entries.pop(key, None)
    entries[key] = digest
    entries = dict(list(entries.items())[-MEMO_ENTRIES:])
    path = memo_path()
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            json.dump({"version": MEMO_VERSION, "algorithm": ALGORITHM, "entries": entries}, f)
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)


def forget_in_process() -> None:
    """Drop the in-process memo (tests: force the persistent memo or a re-hash)."""
    with _lock:
        _memo.clear()
