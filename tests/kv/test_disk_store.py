"""DiskKvStore and the .kvb format: round trips, every corruption case, incompatible files
kept, token mismatches, LRU eviction under the byte and disk budgets, pending reads, restart
adoption in a new process, temp-file cleanup, and concurrent use from threads."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import tracemalloc
from collections import namedtuple

import numpy as np
import pytest
from kv_helpers import SIG, make_block, same_block, signature

from cfr_atlas.errors import CapacityError, CorruptBlockError, IncompatibleBlockError
from cfr_atlas.kv import DiskKvStore, ReadReason, decode_block, encode_block, encoded_size
from cfr_atlas.kv import disk_store as disk_store_module
from cfr_atlas.kv.file_lock import hold_lock

IDS = list(range(100, 132))  # 8 blocks of 4 tokens
FILE = encoded_size(SIG)


@pytest.fixture
def open_store(tmp_path):
    stores = []

    def make(background=False, budget_bytes=1 << 20, reserve_bytes=0, **kw) -> DiskKvStore:
        store = DiskKvStore(tmp_path / "kv", budget_bytes=budget_bytes,
                            reserve_bytes=reserve_bytes, background=background, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def _get(store, block, sig=SIG, tokens=None):
    return store.get(block.hash, block.token_ids if tokens is None else tokens, sig)


def test_encode_decode_round_trip_and_size():
    for sig in (SIG, signature(storage_dtype="float32"), signature(sliding_window=8)):
        block = make_block(IDS, 2, sig)
        data = encode_block(block)
        assert len(data) == encoded_size(sig) and data[:8] == b"CFRKVBLK"
        assert same_block(decode_block(data, block.hash, sig), block)


@pytest.mark.parametrize("background", [False, True])
def test_store_round_trip(open_store, background):
    store = open_store(background=background)
    blocks = [make_block(IDS, i) for i in range(3)]
    for block in blocks:
        store.put(block)
    store.flush()
    for block in blocks:
        out = _get(store, block)
        assert out.reason is ReadReason.HIT and same_block(out.block, block)
        assert store.path_for(block.hash).stat().st_size == FILE
    assert store.path_for(blocks[0].hash).parent.name == blocks[0].hash.hex()[:2]
    s = store.stats()
    assert (s.blocks, s.bytes, s.hits, s.misses, s.rejected) == (3, 3 * FILE, 3, 0, 0)
    assert _get(store, make_block(IDS, 5)).reason is ReadReason.MISS
    assert store.stats().misses == 1 and s.write_seconds > 0 and s.read_seconds > 0


def _flip(offset):
    def mutate(data: bytes) -> bytes:
        pos = offset % len(data)
        return data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1:]
    return mutate


def _huge_body(data: bytes) -> bytes:
    head = bytearray(data[:64])
    struct.pack_into("<Q", head, 56, 1 << 60)  # body length field
    return bytes(head) + data[64:100]


CORRUPTIONS = {
    "header: hash": _flip(20), "header: token count": _flip(48), "header: signature": _flip(70),
    "token ids": _flip(64 + len(SIG.to_bytes()) + 3), "body": _flip(FILE // 2),
    "checksum": _flip(-5), "truncated": lambda d: d[:-10],
    "shorter than a header": lambda d: d[:40],
    "wrong magic": lambda d: b"NOTKVBLK" + d[8:], "extra bytes": lambda d: d + b"\0",
    "huge declared size": _huge_body,
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corrupt_files_are_deleted_and_counted(open_store, case):
    store = open_store()
    block = make_block(IDS, 0)
    store.put(block)
    path = store.path_for(block.hash)
    path.write_bytes(CORRUPTIONS[case](path.read_bytes()))
    tracemalloc.start()
    out = _get(store, block)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.reason is ReadReason.CORRUPT and out.block is None, out
    assert peak < 4 * FILE + (1 << 16)  # nothing sized by a length field
    assert not path.exists()
    s = store.stats()
    assert (s.corrupt, s.blocks, s.bytes) == (1, 0, 0)
    assert _get(store, block).reason is ReadReason.MISS
    store.put(block)                                  # can be stored again
    assert _get(store, block).reason is ReadReason.HIT


def test_misfiled_block_is_corrupt(open_store):
    store = open_store()
    a, b = make_block(IDS, 0), make_block(IDS, 1)
    store.put(a)
    store.put(b)
    shutil.copy(store.path_for(a.hash), store.path_for(b.hash))
    out = _get(store, b)
    assert out.reason is ReadReason.CORRUPT and "misfiled" in out.detail
    assert not store.path_for(b.hash).exists() and _get(store, a).reason is ReadReason.HIT
    with pytest.raises(CorruptBlockError, match="misfiled"):
        decode_block(encode_block(a), b.hash, SIG)


def test_future_version_and_other_signatures_are_kept(open_store):
    store = open_store()
    block = make_block(IDS, 0)
    store.put(block)
    out = _get(store, block, signature(rope_theta=5e5))
    assert out.reason is ReadReason.INCOMPATIBLE and "rope_theta" in out.detail
    with pytest.raises(IncompatibleBlockError) as err:
        decode_block(store.path_for(block.hash).read_bytes(), block.hash, signature(n_layers=3))
    assert err.value.field == "n_layers"
    assert _get(store, block).reason is ReadReason.HIT        # the file was kept
    path = store.path_for(block.hash)
    data = path.read_bytes()
    path.write_bytes(data[:8] + struct.pack("<I", 3) + data[12:])
    out = _get(store, block)
    assert out.reason is ReadReason.INCOMPATIBLE and "version 3 (this build reads 2)" in out.detail
    assert path.exists() and store.stats().incompatible == 2 and store.stats().corrupt == 0


def test_token_mismatch_is_not_a_hit(open_store):
    store = open_store()
    block = make_block(IDS, 0)
    store.put(block)
    out = _get(store, block, tokens=block.token_ids + 1)
    assert out.reason is ReadReason.TOKEN_MISMATCH and out.block is None
    assert store.path_for(block.hash).exists() and store.stats().token_mismatches == 1


def test_lru_eviction_under_the_byte_budget(open_store):
    store = open_store(budget_bytes=FILE * 5 // 2)
    b0, b1, b2 = (make_block(IDS, i) for i in range(3))
    store.put(b0)
    store.put(b1)
    assert _get(store, b0).reason is ReadReason.HIT             # b1 is now least recently used
    store.put(b2)
    assert [store.path_for(b.hash).exists() for b in (b0, b1, b2)] == [True, False, True]
    s = store.stats()
    assert (s.evictions, s.blocks, s.bytes) == (1, 2, 2 * FILE)
    store.put(b0)                                               # already on file: no rewrite
    assert store.stats().evictions == 1


def test_low_free_disk_space_rejects_writes_and_never_evicts(open_store, monkeypatch):
    usage = namedtuple("usage", "total used free")
    free = {"bytes": 10 * FILE}
    monkeypatch.setattr(disk_store_module.shutil, "disk_usage",
                        lambda path: usage(0, 0, free["bytes"]))
    store = open_store()
    b0, b1 = make_block(IDS, 0), make_block(IDS, 1)
    store.put(b0)
    free["bytes"] = FILE // 2                    # the disk filled up: b1 is not cached
    store.put(b1)
    assert store.path_for(b0.hash).exists() and not store.path_for(b1.hash).exists()
    s = store.stats()
    assert (s.evictions, s.rejected, s.blocks) == (0, 1, 1)
    assert _get(store, b1).reason is ReadReason.MISS   # a miss, not an error
    store.close()
    free["bytes"] = 0                            # far inside the reserve: opening keeps all
    reserved = open_store(reserve_bytes=10 * FILE)
    assert reserved.stats().blocks == 1 and reserved.stats().evictions == 0
    assert _get(reserved, b0).reason is ReadReason.HIT


def test_eviction_is_by_budget_lru_logged_and_counted(open_store, caplog):
    store = open_store(budget_bytes=3 * FILE)
    blocks = [make_block(IDS, i) for i in range(5)]
    for block in blocks[:3]:
        store.put(block)
    assert _get(store, blocks[0]).reason is ReadReason.HIT      # blocks[1] is now the oldest
    with caplog.at_level("INFO", logger="cfr_atlas.kv.disk_store"):
        store.put(blocks[3])
        store.put(blocks[4])
    assert [store.path_for(b.hash).exists() for b in blocks] == [True, False, False, True, True]
    s = store.stats()
    assert (s.evictions, s.evicted_bytes, s.blocks, s.bytes) == (2, 2 * FILE, 3, 3 * FILE)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(f"({FILE} bytes)" in m and str(3 * FILE) in m for m in lines)
    store.close()
    smaller = open_store(budget_bytes=FILE)        # reopening under a smaller budget evicts LRU
    assert smaller.stats().evictions == 2 and smaller.stats().blocks == 1
    assert _get(smaller, blocks[4]).reason is ReadReason.HIT


def test_folders_are_0700_and_block_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = DiskKvStore(tmp_path / "a" / "kv", budget_bytes=1 << 20, reserve_bytes=0,
                            background=False)
        block = make_block(IDS, 0)
        store.put(block)
        store.close()
    finally:
        os.umask(old)
    path = store.path_for(block.hash)
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


HOLD_TEMP = """
import sys
from pathlib import Path
from cfr_atlas.kv import block_dir
block_dir.os.replace = lambda src, dst: (print("holding", flush=True), sys.stdin.readline(),
                                         block_dir.os._exit(0))
block_dir.write_atomic(Path(sys.argv[1]), b"a block being written")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_a_temp_file_held_by_another_process_survives_until_it_exits(open_store):
    store = open_store()
    target = store.path_for(make_block(IDS, 0).hash)
    proc = subprocess.Popen([sys.executable, "-c", HOLD_TEMP, str(target)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "holding"
        (temp,) = target.parent.glob("*.tmp")
        renamed = temp.with_name(f".{target.stem}.{_dead_pid()}.0badc0de.tmp")
        temp.rename(renamed)                      # its pid says dead (another container): kept
        open_store()
        assert renamed.exists()
    finally:
        proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0 and renamed.exists()  # died without cleaning up
    open_store()
    assert not renamed.exists() and not target.exists()


def test_block_larger_than_the_budget_is_rejected(open_store):
    store = open_store(budget_bytes=FILE - 1)
    store.put(make_block(IDS, 0))
    assert store.stats().rejected == 1 and store.stats().blocks == 0


def _gate_writer(monkeypatch) -> threading.Event:
    """Make the background writer wait for the returned event (inline writes do not)."""
    gate, real = threading.Event(), disk_store_module.write_atomic

    def gated(path, data):
        if threading.current_thread().name == "kv-disk-writer":
            assert gate.wait(10)
        real(path, data)

    monkeypatch.setattr(disk_store_module, "write_atomic", gated)
    return gate


def test_queued_blocks_are_readable_at_once_and_a_full_queue_writes_inline(open_store,
                                                                           monkeypatch):
    gate = _gate_writer(monkeypatch)
    store = open_store(background=True, queue_size=1)
    blocks = [make_block(IDS, i) for i in range(4)]
    for block in blocks:
        store.put(block)
        out = _get(store, block)
        assert out.reason is ReadReason.HIT and same_block(out.block, block)
    on_disk = [store.path_for(b.hash).exists() for b in blocks]
    assert on_disk[0] is False and sum(on_disk) >= 2          # the queue overflowed: inline
    gate.set()
    store.flush()
    assert all(store.path_for(b.hash).exists() for b in blocks)
    assert store.stats().rejected == 0 and store.stats().blocks == 4


def test_failed_write_leaves_no_temp_file_and_is_counted(open_store, monkeypatch):
    store = open_store()

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_store_module.os, "fsync", no_space, raising=True)
    block = make_block(IDS, 0)
    store.put(block)
    assert store.stats().rejected == 1 and store.stats().bytes == 0
    assert not [p for p in (store.root).rglob("*") if p.is_file()]
    assert _get(store, block).reason is ReadReason.MISS


def test_put_after_close_raises(open_store):
    store = open_store(background=True)
    store.close()
    store.close()
    with pytest.raises(CapacityError, match="closed"):
        store.put(make_block(IDS, 0))


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


RESTART = """
import hashlib, sys
import numpy as np
from cfr_atlas.kv import CacheSignature, DiskKvStore
root, sig_hex, hash_hex, ids = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
sig = CacheSignature.from_bytes(bytes.fromhex(sig_hex))
with DiskKvStore(root, budget_bytes=1 << 20, reserve_bytes=0) as store:
    blocks = store.stats().blocks
    out = store.get(bytes.fromhex(hash_hex), [int(t) for t in ids.split(",")], sig)
    digest = hashlib.sha256(out.block.k.tobytes() + out.block.v.tobytes()).hexdigest()
    print(blocks, out.reason.value, digest)
"""


def test_restart_adopts_files_in_a_new_process_and_cleans_temp_files(open_store):
    store = open_store(background=True)
    blocks = [make_block(IDS, i) for i in range(3)]
    for block in blocks:
        store.put(block)
    store.close()
    folder = store.path_for(blocks[0].hash).parent
    stale = folder / f".{blocks[0].hash.hex()}.{_dead_pid()}.0badc0de.tmp"
    live = folder / f".{blocks[1].hash.hex()}.{_dead_pid()}.00c0ffee.tmp"
    stale.write_bytes(b"half a block")
    live.write_bytes(b"a write in progress")
    held = os.open(live, os.O_RDONLY)
    hold_lock(held)  # a writer holds it, whatever its pid says
    misplaced = store.root / "00" / ("ff" * 32 + ".kvb")
    misplaced.parent.mkdir(exist_ok=True)
    misplaced.write_bytes(b"x")
    b = blocks[1]
    args = [str(store.root), SIG.to_bytes().hex(), b.hash.hex(), ",".join(map(str, b.token_ids))]
    proc = subprocess.run([sys.executable, "-c", RESTART, *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import hashlib
    want = hashlib.sha256(b.k.tobytes() + b.v.tobytes()).hexdigest()
    assert proc.stdout.split() == ["3", "hit", want]
    assert not stale.exists() and live.exists() and not misplaced.exists()
    os.close(held)


def test_adoption_evicts_least_recently_used_down_to_the_budget(open_store, tmp_path):
    store = open_store()
    blocks = [make_block(IDS, i) for i in range(3)]
    for i, block in enumerate(blocks):
        store.put(block)
        os.utime(store.path_for(block.hash), ns=(10**18 + i, 10**18 + [2, 0, 1][i]))
    store.close()
    again = DiskKvStore(store.root, budget_bytes=2 * FILE, reserve_bytes=0, background=False)
    assert again.stats().blocks == 2 and not again.path_for(blocks[1].hash).exists()
    again.close()


def test_concurrent_puts_and_gets(open_store):
    store = open_store(background=True, queue_size=2)
    ids = list(range(4 * 4 * 12))
    blocks = [make_block(ids, i) for i in range(len(ids) // 4)]
    errors = []

    def work(mine):
        rng = np.random.default_rng(len(mine))
        for block in mine:
            store.put(block)
            for other in rng.choice(len(blocks), 4):
                out = _get(store, blocks[other])
                if out.reason is ReadReason.HIT and not same_block(out.block, blocks[other]):
                    errors.append("wrong block")
                elif out.reason not in (ReadReason.HIT, ReadReason.MISS):
                    errors.append(out)
            if _get(store, block).reason is not ReadReason.HIT:
                errors.append(("own block not readable", block.hash.hex()))

    threads = [threading.Thread(target=work, args=(blocks[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    assert errors == []
    assert all(_get(store, b).reason is ReadReason.HIT for b in blocks)
    s = store.stats()
    assert (s.blocks, s.bytes, s.corrupt, s.rejected) == (len(blocks), len(blocks) * FILE, 0, 0)


def test_concurrent_use_under_eviction_keeps_the_accounting_exact(open_store):
    store = open_store(background=True, queue_size=2, budget_bytes=5 * FILE)
    ids = list(range(4 * 40))
    blocks = [make_block(ids, i) for i in range(40)]
    bad = []

    def work(mine):
        for i, block in enumerate(mine):
            store.put(block)
            out = _get(store, mine[i // 2])
            if out.reason not in (ReadReason.HIT, ReadReason.MISS) or \
                    (out.block is not None and not same_block(out.block, mine[i // 2])):
                bad.append(out)

    threads = [threading.Thread(target=work, args=(blocks[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    files = [p for p in store.root.rglob("*") if p.is_file()]
    s = store.stats()
    assert bad == [] and s.corrupt == 0 and s.rejected == 0
    assert s.bytes == sum(p.stat().st_size for p in files) == s.blocks * FILE <= 5 * FILE
    assert s.evictions == 40 - s.blocks
