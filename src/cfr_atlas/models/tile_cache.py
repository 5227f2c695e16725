"""A persistent cache of a model's repacked weight tiles, memory-mapped by later loads.

Loading repacks every quantized matrix into the kernels' row tiles (quant/tiles.py). For the
bundled SmolLM2-135M Q4_1 that is ~0.45 s of CPU, most of it first-touch page faults of 106 MB
of new int8 tiles (docs/PERFORMANCE.md "Start-up"). The tiles are a pure function of the file's
bytes and of the repack code, so the first load writes them to one file per (model, matmul
arithmetic) and later loads map that file copy-on-write: the tiles are then file-backed, clean
page-cache pages shared by every process that maps the file (the kernel may drop them under
memory pressure and read them back) instead of anonymous memory, and bitwise the repacked ones
(the file holds their bytes). Nothing writes to the tiles; a write would stay private.

File layout (little-endian):

    offset  size  field
    0       8     magic b"CFRTILES"
    8       4     format version u32 (VERSION)
    12      4     H, header bytes u32
    16      32    SHA-256 of the header
    48      32    SHA-256 of the data (every byte from D to the end)
    80      H     header, JSON: the key (model identity, arithmetic, code), data bytes, and per
                  weight its qtype, its tiles' type and fields (an array: dtype, shape and
                  offset in the data; an int: its value)
    D             data, D = 80 + H rounded up to PAGE; every array starts at a multiple of ALIGN

Never stale: the key holds the GGUF's content identity (SHA-256 of every byte, file_identity),
the arithmetic and `code_version()` (a digest of the quant and models sources and the NumPy
version); another key is a miss and the file is rewritten. Never damaged: magic, version, the
header's SHA-256 and the sizes are checked at open (a damaged or truncated file is a miss, with
a warning), and the data's SHA-256 on a thread (hashlib releases the GIL) while the loader and
the tokenizer run; `verify()` joins it, and the caller repacks when it fails. Files are
written to a temp name, then `os.replace`d; the folder keeps the most recently used files
within KEEP_BYTES (a file is used when a load maps it).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import mmap
import os
import struct
import threading
import uuid
from pathlib import Path

import numpy as np

MAGIC, VERSION = b"CFRTILES", 1
_HEAD = struct.Struct("<8sII32s32s")  # 80 bytes
PAGE, ALIGN = 4096, 64
MAX_HEADER_BYTES = 64 << 20
DEFAULT_MAX_BYTES = 2 << 30  # the default folder caches models whose tiles are at most this
KEEP_BYTES = 4 << 30  # the folder's budget; least recently used files beyond it are deleted
TILE_MODULES = "cfr_atlas.quant."  # tiles' types are named in the header; only these load

log = logging.getLogger(__name__)


def default_dir() -> Path:
    """$CFR_ATLAS_TILES if set (the test suite points it at a temporary folder), else the
    per-user folder (~/.cache/cfr-atlas/tiles on Linux)."""
    folder = os.environ.get("CFR_ATLAS_TILES")
    if folder:
        return Path(folder).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("cfr-atlas")) / "tiles"


def code_version() -> str:
    """What besides the file decides the tiles' bytes: the repack code and the loaders (a
    digest of the quant/ and models/ sources, ~3 ms) and NumPy's version."""
    from cfr_atlas.kv.build import source_digest

    root = Path(__file__).resolve().parents[1]
    return f"{source_digest(root / 'quant')}.{source_digest(root / 'models')}.np{np.__version__}"


class TileCache:
    """One model's tile file: `repack` serves a weight's tiles from it, or repacks and records
    them; `verify` joins the checksum of a mapped file; `save` writes the recorded tiles.
    read=False never maps the file (the rebuild after a failed checksum)."""

    def __init__(self, folder: str | os.PathLike, identity: str, arithmetic: str, *,
                 max_bytes: int | None = None, read: bool = True):
        self.key = {"model": identity, "arithmetic": arithmetic, "code": code_version()}
        self.path = Path(folder) / f"{identity[:32]}-{arithmetic}.tiles"
        self.max_bytes = max_bytes
        self.entries: dict[str, dict] = {}  # weight name -> header entry of the mapped file
        self.recorded: dict[str, tuple] = {}  # weight name -> (qtype name, tiles) repacked now
        self.hits = 0
        self._map: mmap.mmap | None = None
        self._data = 0
        self._sum_ok: list[bool] = []
        self._checker: threading.Thread | None = None
        if read:
            self._open()

    # --- reading ---------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            with open(self.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # missing, unreadable or empty: a miss
            return
        try:
            header, data, digest = _parse(mapped)
        except ValueError as e:
            log.warning("cfr-atlas: tile cache %s is damaged (%s); repacking the weights",
                        self.path, e)
            mapped.close()
            return
        if header["key"] != self.key:  # another code version: rewritten by save()
            mapped.close()
            return
        self._map, self._data, self.entries = mapped, data, header["weights"]
        try:
            os.utime(self.path)  # most recently used: the last file eviction deletes
        except OSError:
            pass
        self._checker = threading.Thread(target=self._check_sum, args=(digest,),
                                         name="cfr-atlas-tile-sum", daemon=True)
        self._checker.start()

    def _check_sum(self, digest: bytes) -> None:
        view = memoryview(self._map)
        try:
            self._sum_ok.append(hashlib.sha256(view[self._data:]).digest() == digest)
        finally:
            view.release()

    def repack(self, name: str, codec, rows: np.ndarray) -> tuple:
        """The tiles of weight `name` (codec.repack(rows)): views of the mapped file when it
        holds them, else repacked now and recorded for `save`."""
        entry = self.entries.get(name)
        if entry is not None and entry["qtype"] == codec.qtype.name:
            self.hits += 1
            return _tiles(entry, self._map, self._data)
        tiles = codec.repack(rows)
        self.recorded[name] = (codec.qtype.name, tiles)
        return tiles

    def verify(self) -> bool:
        """True unless a mapped file failed its checksum (then its tiles must not be used:
        reload with TileCache(read=False), which repacks and rewrites the file)."""
        if self._checker is None:
            return True
        self._checker.join()
        if self._sum_ok == [True]:
            return True
        log.warning("cfr-atlas: tile cache %s failed its checksum; repacking the weights",
                    self.path)
        return False

    # --- writing ---------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write the tiles repacked by this load when no valid file was mapped (None when
        nothing was written: a hit, nothing recorded, more than max_bytes, or an OSError,
        which only costs a repack next time)."""
        if self._map is not None or not self.recorded:
            return None
        header, blobs, size = _layout(self.key, self.recorded)
        if self.max_bytes is not None and size > self.max_bytes:
            return None
        body = json.dumps(header).encode()
        start = _data_start(len(body))
        h = hashlib.sha256()
        temp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(temp, "wb") as f:
                f.write(bytes(_HEAD.size) + body)
                f.write(bytes(start - _HEAD.size - len(body)))
                at = 0
                for offset, a in blobs:  # zeros up to each array, then its bytes
                    gap = bytes(offset - at)
                    data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                    f.write(gap)
                    f.write(data)
                    h.update(gap)
                    h.update(data)
                    at = offset + a.nbytes
                f.seek(0)
                f.write(_HEAD.pack(MAGIC, VERSION, len(body), hashlib.sha256(body).digest(),
                                   h.digest()))
            os.replace(temp, self.path)
        except OSError as e:
            log.warning("cfr-atlas: could not write the tile cache %s: %s", self.path, e)
            return None
        finally:
            temp.unlink(missing_ok=True)  # gone already after the replace
        _evict(self.path.parent, keep=self.path)
        return self.path


def _parse(mapped: mmap.mmap) -> tuple[dict, int, bytes]:
    """(header, data start, digest) of a mapped file; ValueError naming the first problem."""
    if len(mapped) < _HEAD.size:
        raise ValueError(f"{len(mapped)} bytes, shorter than the {_HEAD.size}-byte preamble")
    magic, version, n, header_sum, digest = _HEAD.unpack_from(mapped)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"magic {magic!r} version {version}, expected {MAGIC!r} {VERSION}")
    if n > min(MAX_HEADER_BYTES, len(mapped) - _HEAD.size):
        raise ValueError(f"header of {n} bytes in a file of {len(mapped)}")
    body = bytes(mapped[_HEAD.size:_HEAD.size + n])
    if hashlib.sha256(body).digest() != header_sum:
        raise ValueError("the header does not match its checksum")
    try:
        header = json.loads(body)
        data, size = _data_start(n), int(header["data_bytes"])
        entries = header["weights"]
        header["key"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable header: {e}") from None
    if data + size != len(mapped):
        raise ValueError(f"{len(mapped)} bytes, the header says {data + size} (truncated?)")
    if not isinstance(entries, dict):
        raise ValueError("unreadable header: weights is not a table")
    return header, data, digest


def _tiles(entry: dict, mapped: mmap.mmap, data: int) -> tuple:
    """The tiles NamedTuple of a header entry, its arrays views of the mapping."""
    module, _, name = entry["type"].rpartition(".")
    if not module.startswith(TILE_MODULES):
        raise ValueError(f"tile type {entry['type']!r} is not one of cfr_atlas.quant's")
    cls = getattr(importlib.import_module(module), name)
    fields = []
    for f in entry["fields"]:
        if isinstance(f, int):
            fields.append(f)
            continue
        dtype, shape = np.dtype(f["dtype"]), tuple(f["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        a = np.frombuffer(mapped, dtype=dtype, count=count, offset=data + f["offset"])
        fields.append(a.reshape(shape))
    return cls(*fields)


def _layout(key: dict, recorded: dict[str, tuple]) -> tuple[dict, list, int]:
    """The header, the (offset, array) pairs and the data bytes of the recorded tiles."""
    weights, blobs, size = {}, [], 0
    for name, (qtype, tiles) in recorded.items():
        fields = []
        for value in tiles:
            if isinstance(value, np.ndarray):
                size = -(-size // ALIGN) * ALIGN
                le = value.dtype.newbyteorder("<")
                fields.append({"dtype": le.str, "shape": list(value.shape), "offset": size})
                blobs.append((size, value.astype(le, copy=False)))
                size += value.nbytes
            else:
                fields.append(int(value))
        kind = type(tiles)
        weights[name] = {"qtype": qtype, "type": f"{kind.__module__}.{kind.__qualname__}",
                         "fields": fields}
    return {"key": key, "data_bytes": size, "weights": weights}, blobs, size


def _data_start(header_bytes: int) -> int:
    return -(-(_HEAD.size + header_bytes) // PAGE) * PAGE


def _evict(folder: Path, keep: Path) -> None:
    """Delete the least recently used tile files of `folder` while they take more than
    KEEP_BYTES together (never `keep`, the file just written)."""
    try:
        stats = [(p, p.stat()) for p in folder.glob("*.tiles")]
        stats.sort(key=lambda ps: ps[1].st_mtime, reverse=True)
        total = 0
        for p, st in stats:
            total += st.st_size
            if total > KEEP_BYTES and p != keep:
                p.unlink(missing_ok=True)
    except OSError:  # a file another process just replaced or deleted: next time
        pass
