"""Spilled K/V pages of one live sequence: a page file and the `SpillKv` regenerator.

Rows are written once, when the model computes them, already rounded to the storage dtype.
File layout (little-endian):

    file header  (64 B): magic b"CFRKVPG1", version u32, page_tokens u32, head_dim u32,
                         itemsize u32, sequence id (16 B), model identity (first 16 B of SHA-256)
    slot i       at 64 + i * slot_bytes, slot_bytes = 64 + 2 * page_tokens * head_dim * itemsize:
                 page header (64 B): magic b"PG", version u16, layer u32, kv_head u32,
                 start u64, n_tokens u32, crc32(K rows) u32, crc32(V rows) u32, sequence id (16 B)
                 then K rows (page_tokens x head_dim), then V rows

Slots are handed out in first-write order; the slot table and the expected checksums live in
memory (the file belongs to this process), so a file that is truncated, damaged, swapped for
another sequence's, or of another version is detected on read: `CorruptPageError`, never rows.
The file is created 0600 in a folder created 0700, and its sequence holds an exclusive lock on
it (file_lock.py) until `close()` removes it; `clean_stale()` removes only page files whose
lock it can take, so processes and containers sharing a cache folder never delete each other's
live page files, whatever their pids.
`prefetch` (the runtime's optional hint) reads up to `prefetch_pages` pages ahead on one
background thread; the verification happens on use, exactly as for a synchronous read.
This module does not decide what is resident; the Atlas does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import struct
import uuid
import zlib
from pathlib import Path

import numpy as np

from cfr_atlas.atlas.pages import PageKey
from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen
from cfr_atlas.errors import CapacityError, CorruptPageError
from cfr_atlas.kv.block_dir import FILE_MODE, FOLDER_MODE
from cfr_atlas.kv.file_lock import hold_lock, remove_if_abandoned

MAGIC, VERSION = b"CFRKVPG1", 1
_FILE_HDR = struct.Struct("<8sIIII16s16s")   # 64 bytes
_PAGE_HDR = struct.Struct("<2sHIIQIII16s")   # 46 bytes, padded to 64
HDR_BYTES = 64


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("cfr-atlas")) / "pages"


def clean_stale(folder: Path) -> int:
    """Remove page files no live sequence holds (see the module docstring); returns how many."""
    removed = 0
    for path in folder.glob("seq-*.kvp"):
        try:
            pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        removed += remove_if_abandoned(path, pid)
    return removed


class SpillKv:
    """Page file of one sequence; also its KvRegenerator (reads a page back into scratch)."""

    def __init__(self, folder: str | os.PathLike | None, page_tokens: int, head_dim: int,
                 dtype, model_id: str, prefetch_pages: int = 0):
        self.folder = Path(folder).expanduser() if folder else default_cache_dir()
        try:
            self.folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
            clean_stale(self.folder)
            self.seq_id = uuid.uuid4().bytes
            self.path = self.folder / f"seq-{os.getpid()}-{self.seq_id.hex()}.kvp"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
            hold_lock(self.fd)  # before the header: clean-up spares young empty files
        except OSError as e:
            raise CapacityError(f"cannot create a page file in {self.folder}: {e.strerror}; "
                                "pass a writable cache directory") from None
        self.page_tokens, self.head_dim, self.dtype = page_tokens, head_dim, dtype
        self.row_bytes = head_dim * dtype.itemsize
        self.slot_bytes = HDR_BYTES + 2 * page_tokens * self.row_bytes
        self.model_id = bytes.fromhex(model_id)[:16].ljust(16, b"\0")
        self.slots: dict[PageKey, list] = {}   # key -> [slot, n_tokens, crc_k, crc_v]
        self.bytes_written = 0
        self.prefetch_pages, self.prefetch_hits = prefetch_pages, 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")
        self._plan: collections.deque = collections.deque()
        self._inflight: collections.deque = collections.deque()
        header = _FILE_HDR.pack(MAGIC, VERSION, page_tokens, head_dim, dtype.itemsize,
                                self.seq_id, self.model_id)
        self._pwrite(header.ljust(HDR_BYTES, b"\0"), 0)

    # --- the regenerator's side of the session (shared with RecomputeKv, BlockSource) ---------
    keeps_mapped_blocks = False  # mapped prefix rows are copied into the page file

    def record(self, layer: int, pos0: int, x, k: np.ndarray, v: np.ndarray) -> None:
        """Fresh rows k, v (T, n_kv, hd) float32 of tokens pos0..: stored rounded to the
        storage dtype, per K/V head (x, the layer input, is not needed here)."""
        self.record_block(layer, pos0, round_rows(k, self.dtype).transpose(1, 0, 2),
                          round_rows(v, self.dtype).transpose(1, 0, 2))

    def record_block(self, layer: int, pos0: int, k_st: np.ndarray, v_st: np.ndarray) -> None:
        """Rows already in storage dtype, (n_kv, T, hd), e.g. a mapped prefix block's."""
        for h in range(k_st.shape[0]):
            self.write(layer, h, pos0, k_st[h], v_st[h])

    def allocations(self) -> dict[str, int]:
        return {"page_file_buffers": self.buffer_bytes()}

    # --- writing -------------------------------------------------------------------------------
    def write(self, layer: int, kv_head: int, start: int, k_st: np.ndarray, v_st: np.ndarray):
        """Append rows (T, D) in storage dtype for tokens start.. of one head, page by page."""
        P, pos, end = self.page_tokens, start, start + k_st.shape[0]
        while pos < end:
            page_start = pos - pos % P
            stop = min(end, page_start + P)
            key = PageKey(layer, kv_head, page_start)
            entry = self.slots.get(key)
            if entry is None or entry[1] > pos - page_start:   # new page, or a rewind
                slot = len(self.slots) if entry is None else entry[0]
                entry = self.slots[key] = [slot, pos - page_start, 0, 0]
            if entry[1] != pos - page_start:
                raise CorruptPageError(f"{key}: rows must be appended in order "
                                       f"(have {entry[1]}, writing from {pos - page_start})")
            kb = np.ascontiguousarray(k_st[pos - start:stop - start]).tobytes()
            vb = np.ascontiguousarray(v_st[pos - start:stop - start]).tobytes()
            base = HDR_BYTES + entry[0] * self.slot_bytes + HDR_BYTES
            off = (pos - page_start) * self.row_bytes
            if entry[1] == 0:
                entry[2] = entry[3] = 0
            self._pwrite(kb, base + off)
            self._pwrite(vb, base + P * self.row_bytes + off)
            entry[1] = stop - page_start
            entry[2], entry[3] = zlib.crc32(kb, entry[2]), zlib.crc32(vb, entry[3])
            self._pwrite(self._page_header(key, entry), HDR_BYTES + entry[0] * self.slot_bytes)
            pos = stop

    def _page_header(self, key: PageKey, entry) -> bytes:
        return _PAGE_HDR.pack(b"PG", VERSION, key.layer, key.kv_head, key.start_token, entry[1],
                              entry[2], entry[3], self.seq_id).ljust(HDR_BYTES, b"\0")

    def _pwrite(self, data: bytes, offset: int) -> None:
        try:
            n = os.pwrite(self.fd, data, offset)
        except OSError as e:
            raise CapacityError(f"writing page file {self.path}: {e.strerror}") from None
        if n != len(data):
            raise CapacityError(f"short write to {self.path} ({n} of {len(data)} bytes): "
                                "is the disk full?")
        self.bytes_written += n

    # --- reading (the KvRegenerator protocol) ----------------------------------------------
    def prefetch(self, pages: list[tuple[PageKey, range]]) -> None:
        """Start reading `pages` (the runtime's fold order) on a background thread, at most
        `prefetch_pages` ahead; replaces any earlier plan."""
        if self.prefetch_pages <= 0:
            return
        for _, _, fut in self._inflight:
            fut.cancel()  # not started: never read; running: finishes, its result dropped
        self._inflight.clear()
        self._plan = collections.deque((key, len(tokens)) for key, tokens in pages)
        self._refill()

    def _refill(self) -> None:
        while self._plan and len(self._inflight) < self.prefetch_pages:
            key, n = self._plan.popleft()
            self._inflight.append((key, n, self._pool.submit(self._read, key, n)))

    def buffer_bytes(self) -> int:
        """Bytes of page reads held or being filled now (read-ahead not yet used), each at
        its full size once started: header + K and V rows of its tokens."""
        return sum(HDR_BYTES + 2 * n * self.row_bytes for _, n, fut in list(self._inflight)
                   if not fut.cancelled())

    def regenerate_page(self, key: PageKey, tokens: range, k_out: np.ndarray,
                        v_out: np.ndarray) -> None:
        n = len(tokens)
        data = None
        while self._inflight:  # pages read ahead; anything not asked for in order is dropped
            k2, n2, fut = self._inflight.popleft()
            if (k2, n2) == (key, n):
                data = fut.result()
                self.prefetch_hits += 1
                break
        self._refill()
        head, kb, vb = data if data is not None else self._read(key, n)
        self._verify(key, n, head, kb, vb)
        k_out[...] = self._widen(kb, n)
        v_out[...] = self._widen(vb, n)

    def _read(self, key: PageKey, n: int) -> tuple[bytes, bytes, bytes]:
        entry = self.slots.get(key)
        if entry is None or entry[1] != n:
            raise CorruptPageError(f"{key}: page file holds {entry[1] if entry else 0} rows, "
                                   f"{n} requested")
        slot_off = HDR_BYTES + entry[0] * self.slot_bytes
        try:
            if os.fstat(self.fd).st_nlink == 0:
                raise CorruptPageError(f"{key}: page file {self.path} was deleted while the "
                                       "sequence was running")
            head = os.pread(self.fd, HDR_BYTES, slot_off)
            kb = os.pread(self.fd, n * self.row_bytes, slot_off + HDR_BYTES)
            vb = os.pread(self.fd, n * self.row_bytes,
                          slot_off + HDR_BYTES + self.page_tokens * self.row_bytes)
        except OSError as e:
            raise CorruptPageError(f"{key}: reading {self.path}: {e.strerror}") from None
        return head, kb, vb

    def _verify(self, key: PageKey, n: int, head: bytes, kb: bytes, vb: bytes) -> None:
        entry = self.slots[key]
        if len(head) < _PAGE_HDR.size or len(kb) != n * self.row_bytes or len(vb) != len(kb):
            raise CorruptPageError(f"{key}: page file {self.path} is truncated")
        magic, ver, layer, kvh, start, count, crc_k, crc_v, seq = _PAGE_HDR.unpack_from(head)
        if magic != b"PG" or ver != VERSION:
            raise CorruptPageError(f"{key}: bad page header (magic {magic!r}, version {ver})")
        if seq != self.seq_id or (layer, kvh, start) != tuple(key):
            raise CorruptPageError(f"{key}: page belongs to another sequence or page")
        if (count != n or (crc_k, crc_v) != (entry[2], entry[3])
                or zlib.crc32(kb) != crc_k or zlib.crc32(vb) != crc_v):
            raise CorruptPageError(f"{key}: checksum mismatch in {self.path}")

    def _widen(self, raw: bytes, n: int) -> np.ndarray:
        rows = np.frombuffer(raw, dtype=self.dtype.array_dtype).reshape(n, self.head_dim)
        return rows if self.dtype is StorageDtype.FLOAT32 else widen(rows, self.dtype)

    def close(self) -> None:
        self._inflight.clear()
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)  # while still holding the lock
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
