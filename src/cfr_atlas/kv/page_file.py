"""Spilled K/V pages of one live sequence: a memory-mapped page file and the `SpillKv` regenerator.

Rows are written once, when the model computes them, already rounded to the storage dtype, and
read back in place: the fold reads a cold page straight from the mapping (the OS page cache, or
the disk through it) and verifies its checksum in the same kernel call (`map_pages`).

File layout (little-endian), sized for the sequence's context limit when it is created (a
sparse file: blocks are allocated page by page, `posix_fallocate`, as rows arrive, so a full
disk is an error on write, never a fault on a mapped store):

    header (4096 B): magic b"CFRKVPG3", version u32, page_tokens u32, head_dim u32, itemsize u32,
                     n_layers u32, n_kv_heads u32, pages per head u32, value width u32 (head_dim,
                     or 0 when V is a view of K, MLA), sequence id (16 B), model identity (first
                     16 B of its SHA-256)
    K slab: slot s = (layer * n_kv_heads + kv_head) * pages + page, K^T (head_dim, page_tokens)
    V slab: the same slots, V (page_tokens, value width); empty when the width is 0

One layer's pages of one head are one sequential range in each slab, in fold order. Rows not
yet written are zero. The page tables (rows held, checksum of each page, page_sum.py) live in
memory: the file belongs to this process, so a file that is truncated, deleted, damaged or
overwritten with other bytes is detected on read (`CorruptPageError`), never folded.
Mapped pages are not this sequence's allocation: the kernel keeps them in its page cache and
reclaims them under memory pressure (they show as file-backed RSS, `RssFile`). Outside the
guarantee, by its size: a file truncated by another process in the microseconds between the
size check of a fold and its reads ends this process with SIGBUS (the mapping has no pages to
read); the file is 0600 in a 0700 folder, so only the same user can do it. Likewise, bytes
changed in the file while a fold is running are caught only if they change before the fold's
check of that page (it checksums each page right after folding it, from cache): damage before
a read is always caught, a concurrent rewrite during one fold may not be. On a tmpfs cache
folder (often /tmp) the pages are shared memory: counted as RssShmem, charged to the memory
cgroup and reclaimable only to swap; give `cache_dir` a disk-backed folder for out-of-core.
Linux only (posix_fallocate, shared mmap); elsewhere use recompute or no budget.

The file is created 0600 in a folder created 0700, and its sequence holds an exclusive lock on
it (file_lock.py) until `close()` removes it; `clean_stale()` removes only page files whose
lock it can take, so processes and containers sharing a cache folder never delete each other's
live page files, whatever their pids.
This module does not decide what is resident; the Atlas does.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import struct
import threading
import uuid
from pathlib import Path

import numpy as np
from numba import njit

from cfr_atlas.atlas.page_sum import page_checksum, row_delta, rows_delta
from cfr_atlas.atlas.pages import PageKey, page_count
from cfr_atlas.atlas.runtime import MappedPages
from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen
from cfr_atlas.errors import CapacityError, CorruptPageError
from cfr_atlas.kv.block_dir import FILE_MODE, FOLDER_MODE
from cfr_atlas.kv.file_lock import hold_lock, remove_if_abandoned
from cfr_atlas.os_pages import MADV_POPULATE_READ, MADVISE, cached

MAGIC, VERSION = b"CFRKVPG3", 3
_FILE_HDR = struct.Struct("<8sIIIIIIII16s16s")
HDR_BYTES = 4096  # the slabs start page-aligned


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


# A layer whose folds read at least this fraction of its written pages from the file is read
# whole, in file order (dense: `_Puller`, or the kernel's read-around); below it, only the
# needed ranges are asked for (sparse). Measured at 4,096
# tokens with the page file evicted before each token, one process, interleaved: with every
# page needed, the kernel's read-around took 231 ms a token against 327 ms with exact hints;
# with about half the pages hot, 601 ms against 303 ms.
DENSE = 0.75
READ_AHEAD_LAYERS = 3  # layers past the one being folded whose pages are asked for


def _advise(fd: int, ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel to start reading `ranges` of the file (POSIX_FADV_WILLNEED). A hint
    only: the fold reads the pages either way. Not free: the kernel walks cached pages (~8 us
    for 512 KiB, ~100 us for 3 MiB, measured), hence `_cached` first, and it allocates and
    submits the reads of uncached ones (~150 us per 512 KiB range, measured), hence
    `_Reader`."""
    for offset, length in ranges:
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            return  # e.g. the file was closed meanwhile


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` sorted, and merged where they touch or overlap. (Merging across gaps of hot
    pages was measured slower: with the hot pages spread, it reads the whole file.)"""
    out: list[list[int]] = []
    for offset, length in sorted(ranges):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + length - out[-1][0])
        else:
            out.append([offset, length])
    return [(a, n) for a, n in out]


class _Reader:
    """A thread that submits the read-ahead hints, so the compute thread does not spend
    ~5 ms a layer in the kernel's read submission; it runs while the compute thread is in a
    kernel (they release the GIL) or waits on a page. Started on the first hint."""

    def __init__(self, fd: int, n_layers: int):
        self._fd, self._queue = fd, queue.SimpleQueue()
        self.pending = [False] * n_layers  # queued and not yet submitted
        self._thread = threading.Thread(target=self._run, name="cfr-atlas-read-ahead",
                                        daemon=True)
        self._thread.start()

    def submit(self, layer: int, ranges: list[tuple[int, int]]) -> None:
        if not self.pending[layer]:
            self.pending[layer] = True
            self._queue.put((layer, ranges))

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            layer, ranges = job
            _advise(self._fd, ranges)
            self.pending[layer] = False

    def stop(self) -> None:
        """Wait for the hint being submitted (the descriptor stays open until then)."""
        self._queue.put(None)
        self._thread.join()


class _Puller:
    """Threads that read a dense layer's pages into memory before its fold needs them: one
    per slab (K, V), each walking its slab's ranges layer by layer in file order with
    madvise(MADV_POPULATE_READ), which faults the pages in as the fold would but without the
    GIL, so the compute thread folds layer L while the layers after it are read. Measured
    under a 10% budget, page file evicted before each token, one process, interleaved:
    143-184 ms a token against 219-248 ms with the fold faulting alone at 4,096 tokens, 432
    against 683 ms at 8,192 (docs/VIRTUAL_KV.md). Raw, with no compute, two such streams
    read 1.3-1.6x as fast as one sequential read of the file.

    `pull` queues a layer; `wait` blocks until both streams are past it (or `WAIT_S`, after
    which the fold's own faults read what is left: a timing bound, never a result). Where the
    kernel refuses the advice (before Linux 5.14), `supported` turns False and the page file
    leaves dense layers to the kernel's read-around, as before."""

    WAIT_S = 30.0

    def __init__(self, n_layers: int, streams: int):
        self.supported = True
        self._queues = [queue.SimpleQueue() for _ in range(streams)]
        self._done = [[threading.Event() for _ in range(n_layers)] for _ in range(streams)]
        self.pending = [False] * n_layers  # pulled and not yet waited for
        self._stopping = False
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"cfr-atlas-pull-{i}") for i in range(streams)]
        for t in self._threads:
            t.start()

    def pull(self, layer: int, ranges: list[list[tuple[int, int]]]) -> None:
        """Queue `layer`: ranges[i] (address, length) for stream i."""
        self.pending[layer] = True
        for q, done, rs in zip(self._queues, self._done, ranges, strict=True):
            done[layer].clear()
            q.put((layer, rs))

    def wait(self, layer: int) -> None:
        for done in self._done:
            done[layer].wait(self.WAIT_S)
        self.pending[layer] = False

    def _run(self, i: int) -> None:
        while (job := self._queues[i].get()) is not None:
            layer, ranges = job
            for address, length in ranges:
                if self._stopping or not self.supported:
                    break
                a = address - address % mmap.PAGESIZE
                if MADVISE(a, length + address - a, MADV_POPULATE_READ) != 0:
                    if ctypes.get_errno() == errno.EINVAL:
                        self.supported = False  # an older kernel: the faults read
                    break  # e.g. EFAULT: the fold's own checks report a damaged file
            self._done[i][layer].set()

    def stop(self) -> None:
        """Skip what is queued, wait for the read in progress (the mapping stays until then)."""
        self._stopping = True
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()


@njit(cache=True, nogil=True)
def _write_rows(k_map, v_map, tokens, sums, slot0, pos0, k_st, v_st):
    """Store rows k_st, v_st (T, n_kv, D) of tokens pos0.. : K^T columns and V rows of each
    head's pages (slots slot0[h] + page), keeping rows held and checksums current. A write
    before a page's end first clears the rows after it (a rewind). Returns -1, or the head *
    2**32 + page of a write that would leave a gap (nothing written for it)."""
    n_t, n_kv, d = k_st.shape
    p_tok = v_map.shape[1]
    for h in range(n_kv):
        for t in range(n_t):
            page, j = divmod(pos0 + t, p_tok)
            s = slot0[h] + page
            have = tokens[s]
            if have > j:  # rewind: rows j.. go back to zero
                sums[s] -= rows_delta(np.ascontiguousarray(k_map[s, :, j:have].T),
                                      np.ascontiguousarray(v_map[s, j:have]), j)
                k_map[s, :, j:have] = 0
                v_map[s, j:have] = 0
                tokens[s] = have = j
            if have != j:
                return h * (1 << 32) + page
            k_map[s, :, j] = k_st[t, h]
            v_map[s, j] = v_st[t, h]
            sums[s] += row_delta(k_st[t, h], v_st[t, h], j)
            tokens[s] = j + 1
    return -1


class SpillKv:
    """Page file of one sequence; also its KvRegenerator (pages are read in place)."""

    keeps_mapped_blocks = False  # mapped prefix rows are copied into the page file

    def __init__(self, folder: str | os.PathLike | None, page_tokens: int, head_dim: int,
                 dtype: StorageDtype, model_id: str, *, n_layers: int, n_kv_heads: int,
                 context_tokens: int, value_dim: int | None = None):
        self.folder = Path(folder).expanduser() if folder else default_cache_dir()
        self.page_tokens, self.head_dim, self.dtype = page_tokens, head_dim, dtype
        # stored V width: head_dim, or 0 when V is a view of K (AtlasConfig.stored_value_dim)
        self.value_dim = head_dim if value_dim is None else value_dim
        self.n_layers, self.n_kv_heads = n_layers, n_kv_heads
        self.n_pages = page_count(context_tokens, page_tokens)
        n_slots = n_layers * n_kv_heads * self.n_pages
        self.page_bytes = page_tokens * head_dim * dtype.itemsize  # one K page
        self.v_page_bytes = page_tokens * self.value_dim * dtype.itemsize  # one V page
        self.file_bytes = HDR_BYTES + n_slots * (self.page_bytes + self.v_page_bytes)
        self.fd = -1
        if not (hasattr(os, "posix_fallocate") and hasattr(mmap, "MAP_SHARED")):
            raise CapacityError("the spill page file needs Linux (posix_fallocate, shared "
                                "mmap); on this system use regenerator='recompute' or no "
                                "kv_budget")
        model_tag = bytes.fromhex(model_id)[:16].ljust(16, b"\0")  # ValueError: not hex
        try:
            self.folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
            clean_stale(self.folder)
            self.seq_id = uuid.uuid4().bytes
            self.path = self.folder / f"seq-{os.getpid()}-{self.seq_id.hex()}.kvp"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
            hold_lock(self.fd)  # before the header: clean-up spares young empty files
            header = _FILE_HDR.pack(MAGIC, VERSION, page_tokens, head_dim, dtype.itemsize,
                                    n_layers, n_kv_heads, self.n_pages, self.value_dim,
                                    self.seq_id, model_tag)
            self._pwrite(header.ljust(HDR_BYTES, b"\0"), 0)
            os.ftruncate(self.fd, self.file_bytes)  # sparse: no blocks until rows arrive
            self._mm = mmap.mmap(self.fd, self.file_bytes, flags=mmap.MAP_SHARED)
        except OSError as e:
            if self.fd >= 0:
                self.path.unlink(missing_ok=True)
            self._close_fd()
            raise CapacityError(f"cannot create a page file of {self.file_bytes:,} bytes in "
                                f"{self.folder}: {e.strerror}; pass a writable cache "
                                "directory with room for it") from None
        shape = (n_slots, head_dim, page_tokens)
        dt = dtype.array_dtype
        self._k = np.frombuffer(self._mm, dtype=dt, count=n_slots * head_dim * page_tokens,
                                offset=HDR_BYTES).reshape(shape)
        self._v = np.frombuffer(self._mm, dtype=dt, count=n_slots * self.value_dim * page_tokens,
                                offset=HDR_BYTES + n_slots * self.page_bytes
                                ).reshape(n_slots, page_tokens, self.value_dim)
        # per slot, as (n_layers, n_kv_heads, pages) views: rows held, checksum (page_sum.py)
        self.tokens = np.zeros(n_slots, dtype=np.int64)
        self.sums = np.zeros(n_slots, dtype=np.uint32)
        grid = (n_layers, n_kv_heads, self.n_pages)
        self._tokens3, self._sums3 = self.tokens.reshape(grid), self.sums.reshape(grid)
        self._slots3 = np.arange(n_slots, dtype=np.int64).reshape(grid)
        self._reserved = [0] * n_layers  # pages of every head of a layer with disk blocks
        self._all_heads = np.arange(n_kv_heads, dtype=np.int64)
        self._all_heads_bytes = self._all_heads.tobytes()
        self._reader: _Reader | None = None
        self._puller: _Puller | None = None  # started on the first cold dense layer
        self._base = self._k.ctypes.data - HDR_BYTES  # the mapping's address (for mincore)
        # per layer, the pages its last fold read from the file (all, until it first folds),
        # and the read-ahead ranges they give (rebuilt when either changes)
        self._want = np.ones(grid, dtype=np.bool_)
        self._ahead: dict[int, tuple[int, int, list]] = {}  # layer -> (pages, version, ranges)
        self._want_version = [0] * n_layers
        self._sparse = [False] * n_layers  # see _remember
        self._remembered: list[tuple | None] = [None] * n_layers  # _remember's last arguments
        # the layer whose one-row write just checked the file and its pages (`_write`): its
        # fold, next, need not check them again (-1: none)
        self._written = -1
        self._probed = (-1, 0)  # (token, layer) of the last one-row write that probed the cache
        self._row_bytes = (head_dim + self.value_dim) * dtype.itemsize  # one token's K + V
        self.bytes_written = 0
        self.bytes_read = 0  # by `regenerate_page` (copies); the fold's reads are the Atlas's


    # --- the regenerator's side of the session (shared with RecomputeKv, BlockSource) ---------
    def record(self, layer: int, pos0: int, x, k: np.ndarray, v: np.ndarray) -> None:
        """Fresh rows k, v (T, n_kv, hd) of tokens pos0.., in the storage dtype (as the Atlas's
        `stored_rows` gives them) or float32, then rounded here (x, the layer input, is not
        needed)."""
        if k.dtype != self.dtype.array_dtype or v.dtype != self.dtype.array_dtype:
            k, v = round_rows(k, self.dtype), round_rows(v, self.dtype)
        self._write(layer, pos0, np.ascontiguousarray(k), np.ascontiguousarray(v))

    def record_block(self, layer: int, pos0: int, k_st: np.ndarray, v_st: np.ndarray) -> None:
        """Rows already in storage dtype, (n_kv, T, hd), e.g. a mapped prefix block's."""
        self._write(layer, pos0, np.ascontiguousarray(k_st.transpose(1, 0, 2)),
                    np.ascontiguousarray(v_st.transpose(1, 0, 2)))

    def _write(self, layer: int, pos0: int, k_st: np.ndarray, v_st: np.ndarray) -> None:
        """Rows (T, n_kv, hd) in storage dtype of tokens pos0.. into the mapped pages."""
        n = k_st.shape[0]
        if pos0 + n > self.n_pages * self.page_tokens:
            raise CapacityError(f"the page file holds {self.n_pages * self.page_tokens} tokens "
                                f"(the context limit); token {pos0 + n - 1} is past them")
        self._check_file()
        self._written = -1
        last = (pos0 + n - 1) // self.page_tokens
        if last >= self._reserved[layer]:
            self._reserve(layer, last + 1)
        if n == 1:
            self._fetch_write_target(layer, pos0)
            self._written = layer
        gap = _write_rows(self._k, self._v, self.tokens, self.sums, self._slots3[layer, :, 0],
                          pos0, k_st, v_st)
        if gap >= 0:
            head, page = divmod(int(gap), 1 << 32)
            raise CorruptPageError(f"{PageKey(layer, head, page * self.page_tokens)}: rows must "
                                   f"be appended in order (writing token {pos0})")
        self.bytes_written += (k_st.size + v_st.size) * self.dtype.itemsize

    def _fetch_write_target(self, layer: int, pos0: int) -> None:
        """Before a one-row store of token pos0: a store into an uncached mapped page reads it
        first. In a dense layer, a cold target page means a cold layer: it is pulled (`_pull`)
        with the cold layers after it. The first dense layer a token writes stands for the
        later ones (asking whether a layer is cached costs ~10 us; the page cache drops the
        least recently read pages first, and every token reads the layers in order, so the
        first layer's pages go first): a later layer is only waited for while its pull runs.
        In a sparse layer (`MADV_RANDOM`), exactly the K and V pages of every head are asked
        for at once (the faults alone would read them one by one, synchronously)."""
        if not self._sparse[layer]:
            # the first store of a decode step reaches a layer before its fold does: a cold
            # layer (its oldest page the fold reads, as `_read_ahead` asks; the target page is
            # one of those pages) starts the pulls here (the store's fault would read 8 MiB
            # around the page on its own, competing with them), and the fold that follows
            # does not ask again
            if pos0 == self._probed[0] and layer > self._probed[1]:  # this token probed
                puller = self._puller
                if puller is not None and puller.pending[layer]:
                    puller.wait(layer)
                return
            self._probed = (pos0, layer)
            self._pull(layer, lambda: self._cold(layer))
            return
        slots = self._slots3[layer, :, pos0 // self.page_tokens]
        if not cached(self._base + HDR_BYTES + int(slots[0]) * self.page_bytes):
            _advise(self.fd, [r for s in slots.tolist() for r in self._page_ranges(s, 1)])

    def allocations(self) -> dict[str, int]:
        """Nothing of the budget: the pages live in the OS page cache (file-backed)."""
        return {}

    def table_bytes(self) -> int:
        return (self.tokens.nbytes + self.sums.nbytes + self._slots3.nbytes
                + self._all_heads.nbytes + self._want.nbytes)

    def _reserve(self, layer: int, pages: int) -> None:
        """Allocate disk blocks for the first `pages` pages of every head of `layer` (ENOSPC
        here, as an error, not as a SIGBUS on a store into a hole of the mapping)."""
        have = self._reserved[layer]
        for s in self._slots3[layer, :, 0].tolist():
            for base, size in self._slabs():
                try:
                    os.posix_fallocate(self.fd, base + (s + have) * size, (pages - have) * size)
                except OSError as e:
                    raise CapacityError(f"reserving {(pages - have) * size:,} bytes "
                                        f"in page file {self.path}: {e.strerror}; is the disk "
                                        "full?") from None
        self._reserved[layer] = pages

    def _pwrite(self, data: bytes, offset: int) -> None:
        n = os.pwrite(self.fd, data, offset)
        if n != len(data):
            raise OSError(28, f"short write ({n} of {len(data)} bytes)")

    def _check_file(self) -> None:
        """The mapping is only safe to touch while the file is whole (see module docstring)."""
        try:
            st = os.fstat(self.fd)
        except OSError as e:
            raise CorruptPageError(f"page file {self.path}: {e.strerror}") from None
        if st.st_nlink == 0:
            raise CorruptPageError(f"page file {self.path} was deleted while the sequence was "
                                   "running")
        if st.st_size < self.file_bytes:
            raise CorruptPageError(f"page file {self.path} is truncated ({st.st_size:,} of "
                                   f"{self.file_bytes:,} bytes)")

    # --- reading (the KvRegenerator protocol) ----------------------------------------------
    def map_pages(self, layer: int, heads: np.ndarray, lo: int, lens: np.ndarray,
                  need: np.ndarray) -> MappedPages:
        """Pages lo.. of `heads` (lens[i] rows each) where `need` (H, NP) is set, readable in
        place from the mapping; pages not held with exactly those rows are `missing`."""
        written, self._written = self._written, -1
        if written != layer:  # else the write just before this fold checked the file
            self._check_file()
        hi = lo + len(lens)
        every = heads.tobytes() == self._all_heads_bytes  # every head, in order
        if not (0 <= layer < self.n_layers and hi <= self.n_pages and (every or (
                len(heads) and 0 <= heads.min() and heads.max() < self.n_kv_heads))):
            raise CorruptPageError(f"layer {layer}, heads {heads.tolist()}, pages {lo}..{hi - 1} "
                                   f"are outside this page file ({self.n_layers} layers, "
                                   f"{self.n_kv_heads} K/V heads, {self.n_pages} pages)")
        if every:  # views, no gathers
            slot, tokens = self._slots3[layer, :, lo:hi], self._tokens3[layer, :, lo:hi]
            sums = self._sums3[layer, :, lo:hi]
        else:
            slot, tokens = self._slots3[layer, heads, lo:hi], self._tokens3[layer, heads, lo:hi]
            sums = self._sums3[layer, heads, lo:hi]
        self._remember(layer, heads, lo, hi, need)
        self._read_ahead(layer, pulled=written == layer)
        return MappedPages(self._k, self._v, slot, sums, need & (tokens != lens))

    def regenerate_page(self, key: PageKey, tokens: range, k_out: np.ndarray,
                        v_out: np.ndarray) -> None:
        """Rows (n, D) float32 of one page from the mapping: copied first, then the copy is
        verified (what is returned is what was checked)."""
        n, page = len(tokens), key.start_token // self.page_tokens
        self._check_file()
        if not (0 <= key.layer < self.n_layers and 0 <= key.kv_head < self.n_kv_heads
                and 0 <= page < self.n_pages):
            raise CorruptPageError(f"{key}: outside this page file ({self.n_layers} layers, "
                                   f"{self.n_kv_heads} K/V heads, {self.n_pages} pages)")
        s = int(self._slots3[key.layer, key.kv_head, page])
        if self.tokens[s] != n:
            raise CorruptPageError(f"{key}: page file holds {self.tokens[s]} rows, {n} requested")
        k_page, v_page = self._k[s].copy(), self._v[s].copy()
        if page_checksum(k_page, v_page) != self.sums[s]:
            raise CorruptPageError(f"{key}: checksum mismatch in {self.path}")
        k_out[...] = widen(np.ascontiguousarray(k_page[:, :n].T), self.dtype)
        v_out[...] = widen(v_page[:n], self.dtype)
        self.bytes_read += n * self._row_bytes

    def _remember(self, layer: int, heads: np.ndarray, lo: int, hi: int,
                  need: np.ndarray) -> None:
        """What this fold of `layer` reads from the file (`need`, pages lo..hi of `heads`):
        its next read-ahead asks for those pages only (hot ones and those before a sliding
        window are left on the disk). A call with the arguments of the layer's last call
        changes nothing (the decode steps' usual case), so it returns at once."""
        same = (heads.tobytes(), lo, hi, need.tobytes())
        if self._remembered[layer] == same:
            return
        self._remembered[layer] = same
        want = self._want[layer, heads]
        new = np.zeros_like(want)
        new[:, lo:hi] = need
        if not np.array_equal(want, new):
            self._want[layer, heads] = new
            self._want_version[layer] += 1
            pages = self._reserved[layer]
            sparse = bool(pages and self._want[layer, :, :pages].mean() < DENSE)
            if sparse != self._sparse[layer]:
                self._sparse[layer] = sparse
                self._set_access(layer, sparse)

    def _set_access(self, layer: int, sparse: bool) -> None:
        """The kernel's way of reading `layer`'s slots: `MADV_NORMAL` (a fault reads 8 MiB
        around the page; the pages of a dense layer are read as fast as a sequential read) or,
        for a sparse layer, `MADV_RANDOM` (a fault reads its page; `_read_ahead` asks for the
        needed ranges, so the hot pages between them stay on the disk)."""
        advice = mmap.MADV_RANDOM if sparse else mmap.MADV_NORMAL
        span = self.n_kv_heads * self.n_pages
        for base, size in self._slabs():
            start = base + layer * span * size
            a = start - start % mmap.PAGESIZE
            b = -(-(start + span * size) // mmap.PAGESIZE) * mmap.PAGESIZE
            try:
                self._mm.madvise(advice, a, min(b, self.file_bytes) - a)
            except (OSError, ValueError):
                return  # a hint

    def _read_ahead(self, layer: int, pulled: bool = False) -> None:
        """Before `layer`'s fold: pages not cached are read ahead. A dense layer found cold
        starts `_Puller` on it and on every cold dense layer after it; the fold then waits for
        this layer's pages (it would otherwise fault on them itself, a second stream at the
        disk). Sparse layers: hints for this layer's and the next READ_AHEAD_LAYERS layers'
        needed pages (the last layers' wrap to the first of the next token). The oldest page
        of a layer (its first range) stands for all of it: the page cache evicts the oldest
        first. `pulled`: the one-row write just before this fold saw to this layer's pages
        (`_fetch_write_target`: probed them, or, for a later dense layer of the token, waited
        for their pull if one ran)."""
        if not (self._sparse[layer] or pulled):
            self._pull(layer, lambda: self._cold(layer))
        for step in range(READ_AHEAD_LAYERS + 1):
            ahead = (layer + step) % self.n_layers
            if not self._sparse[ahead]:
                continue  # dense layers are pulled (above), not hinted
            if self._cold(ahead):
                if self._reader is None:
                    self._reader = _Reader(self.fd, self.n_layers)
                self._reader.submit(ahead, self._ranges(ahead))

    def _pull(self, layer: int, cold) -> None:
        """Dense `layer`'s pages in memory before it is read or written: wait for its pull if
        one is under way, else, if `cold()` says the pages are not cached, pull it and the
        cold dense layers after it, then wait for it."""
        puller = self._puller
        if MADVISE is None or (puller is not None and not puller.supported):
            return  # the kernel's read-around
        if not (puller is not None and puller.pending[layer]):
            if not cold():
                return
            self._pull_from(layer)
        self._puller.wait(layer)

    def _cold(self, layer: int) -> bool:
        """Whether `layer`'s oldest needed page (its first range) is not in the page cache."""
        ranges = self._ranges(layer)
        return bool(ranges) and not cached(self._base + ranges[0][0])

    def _pull_from(self, layer: int) -> None:
        """Queue `layer` and each later dense layer whose pages are not cached (this token's)
        on the pull threads, one per slab. Which layers are cold is decided before the first
        is queued: a running pull's read-around can bring in the next layer's first page, and
        must not make it look cached while its other pages are not."""
        slabs = self._slabs()
        if self._puller is None:
            self._puller = _Puller(self.n_layers, len(slabs))
        cold = [ahead for ahead in range(layer, self.n_layers) if not self._sparse[ahead]
                and not self._puller.pending[ahead] and self._cold(ahead)]
        for ahead in cold:
            per_slab = [[] for _ in slabs]
            for offset, length in self._ranges(ahead):
                i = sum(offset >= base for base, _ in slabs) - 1
                per_slab[i].append((self._base + offset, length))
            self._puller.pull(ahead, per_slab)

    def _ranges(self, layer: int) -> list[tuple[int, int]]:
        """(offset, length) of the written pages `layer`'s last fold read from the file: per
        head, one range per run of such pages in each slab (kept until the layer gains a page
        or its fold reads other pages)."""
        pages, version = self._reserved[layer], self._want_version[layer]
        memo = self._ahead.get(layer)
        if memo is None or memo[:2] != (pages, version):
            ranges = []
            for h, row in enumerate(self._want[layer, :, :pages]):
                row = row.copy()
                row[-1:] = True  # the page the next row is written to (a store reads it first)
                edges = np.flatnonzero(np.diff(row, prepend=False, append=False)).tolist()
                s0 = int(self._slots3[layer, h, 0])
                for a, b in zip(edges[::2], edges[1::2], strict=True):
                    ranges += self._page_ranges(s0 + a, b - a)
            memo = self._ahead[layer] = (pages, version, _coalesce(ranges))
        return memo[2]

    def _page_ranges(self, slot: int, pages: int) -> list[tuple[int, int]]:
        """(offset, length) in each slab of `pages` slots from `slot`."""
        return [(base + slot * size, pages * size) for base, size in self._slabs()]

    def _slabs(self) -> list[tuple[int, int]]:
        """(file offset, bytes per page) of the K slab, then the V slab when V is stored."""
        k = (HDR_BYTES, self.page_bytes)
        v = (HDR_BYTES + len(self.tokens) * self.page_bytes, self.v_page_bytes)
        return [k, v] if self.v_page_bytes else [k]

    # --- out of core -------------------------------------------------------------------------
    def evict_page_cache(self) -> None:
        """Write the file back and drop its pages from the OS page cache (a benchmark's cold
        start): the next fold reads them from the disk."""
        os.fdatasync(self.fd)
        self._mm.madvise(mmap.MADV_DONTNEED)  # our mappings of the pages (data stays in file)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Unmap (once nothing reads the mapping), remove the file, release the lock."""
        puller, self._puller = getattr(self, "_puller", None), None
        if puller is not None:
            puller.stop()  # before the mapping goes
        self._k = self._v = None
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive somewhere: unmapped when it goes
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)  # while still holding the lock
        self._close_fd()

    def _close_fd(self) -> None:
        reader, self._reader = getattr(self, "_reader", None), None
        if reader is not None:
            reader.stop()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
