"""Direct expert reads (experts/reader.py): uncached experts read off the disk into staging
buffers by reader threads, bypassing the page cache. Speed only, never a bit of the logits.

The reader against the file's own bytes (ranges at any offset, the file's last bytes, O_DIRECT
refused at open or at read, a failed read); staging bounded by its capacity however many
experts pass through it (the bytes allocated, not the experts staged); the store's logits
with direct reads equal the all-resident run's (np.array_equal) for both arithmetics, chunked
prefill and decode, with the page cache made to look empty so every load is staged; what
"auto" chooses; the CLI's flag.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError
from cfr_atlas.experts import reader as reader_mod
from cfr_atlas.experts import source as source_mod
from cfr_atlas.experts.reader import ALIGN, DirectReader
from cfr_atlas.models import expert_memory

IDS = [5, 77, 300, 12, 40, 1000, 2000, 31, 9, 44, 4, 900, 17, 23]
SIZE = 5 * ALIGN + 1234  # a file that does not end on a block boundary


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "bytes.bin"
    data = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data


def _ranges(draw_ranges):
    return [(off, min(n, SIZE - off)) for off, n in draw_ranges]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, SIZE - 1), st.integers(1, 2 * ALIGN + 100)),
                min_size=1, max_size=3))
def test_staged_bytes_are_the_file_s_bytes_at_any_offset(data_file, drawn):
    path, data = data_file
    ranges = _ranges(drawn)
    r = DirectReader(path, capacity=1 << 20)
    try:
        assert r.stage("k", ranges)
        got = r.take("k")
        assert [g.tobytes() for g in got] == [data[o:o + n].tobytes() for o, n in ranges]
        r.release("k")
        assert r.counts.failed == 0 and r.counts.staged == 1
    finally:
        r.close()


def _settle(r, timeout=10.0):
    end = time.monotonic() + timeout
    while any(s.left for s in list(r.staged.values())):
        assert time.monotonic() < end, "reads did not end"
        time.sleep(0.001)


def test_staging_never_allocates_past_its_capacity(data_file):
    path, data = data_file
    one = [(100, 3000), (ALIGN + 5, 2 * ALIGN)]  # 4 KiB + 12 KiB of aligned spans
    size = 4 * ALIGN
    r = DirectReader(path, capacity=3 * size)
    try:
        for i in range(40):  # stage, take, release: buffers are reused, never added
            assert r.stage(i, one)
            assert r.take(i)[1].tobytes() == data[ALIGN + 5:3 * ALIGN + 5].tobytes()
            r.release(i)
        assert r.allocated == size and r.counts.peak_bytes == size
        staged = [k for k in range(100, 105) if r.stage(k, one)]  # staged, never taken
        assert staged == [100, 101, 102] and r.counts.declined == 2  # no staged key given up
        assert r.allocated <= r.capacity and r.counts.peak_bytes <= r.capacity
        held = r.take(102)
        _settle(r)  # a dropped buffer is reused once its reads end
        r.keep(lambda key: key == 101)  # 100 dropped; 102 is held, so it stays
        assert set(r.staged) == {101, 102} and held[0].tobytes() == data[100:3100].tobytes()
        assert r.stage(200, one) and not r.stage(201, one)  # 100's buffer, reused
        r.release(102)
        assert r.stage(201, one) and r.allocated == 3 * size
    finally:
        r.close()


def test_a_failed_read_hands_out_nothing_and_is_counted(data_file, monkeypatch):
    path, _ = data_file
    r = DirectReader(path, capacity=1 << 20)

    def broken(fd, bufs, off):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(reader_mod.os, "preadv", broken)
    try:
        assert r.stage("k", [(10, 100)])
        assert r.take("k") is None and r.counts.failed == 1
        assert "k" not in r.staged  # nothing pinned, its buffer free again
    finally:
        monkeypatch.undo()
        r.close()


def test_a_read_that_raises_anything_still_ends_and_a_closed_reader_stages_nothing(data_file,
                                                                                   monkeypatch):
    """A reader thread never dies with a read in flight: `take` would wait forever."""
    path, _ = data_file
    r = DirectReader(path, capacity=1 << 20)

    def odd(fd, bufs, off):
        raise TypeError("not an OSError")

    monkeypatch.setattr(reader_mod.os, "preadv", odd)
    try:
        assert r.stage("k", [(10, 100)])
        assert r.take("k") is None and r.counts.failed == 1
    finally:
        monkeypatch.undo()
        r.close()
    assert not r.stage("late", [(0, 10)]) and r.take("late") is None


def test_o_direct_refused_at_read_falls_back_to_plain_reads(data_file, monkeypatch):
    path, data = data_file
    r = DirectReader(path, capacity=1 << 20)
    first_fd, real = r.fd, os.preadv

    def picky(fd, bufs, off):  # a filesystem that opens O_DIRECT but will not read so
        if fd == first_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    monkeypatch.setattr(reader_mod.os, "preadv", picky)
    try:
        ranges = [(o, 777) for o in (0, 5000, 9000, 13000)]
        assert all(r.stage(i, [rg]) for i, rg in enumerate(ranges))
        for i, (o, n) in enumerate(ranges):
            assert r.take(i)[0].tobytes() == data[o:o + n].tobytes()
            r.release(i)
        assert not r.direct and r.counts.failed == 0
    finally:
        monkeypatch.undo()
        r.close()


def test_o_direct_refused_at_open_reads_plainly(data_file, monkeypatch):
    path, data = data_file
    real = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(p, flags, *a)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)
    r = DirectReader(path, capacity=1 << 20)
    monkeypatch.undo()
    try:
        assert not r.direct
        assert r.stage("k", [(SIZE - 50, 50)])  # the file's last bytes
        assert r.take("k")[0].tobytes() == data[-50:].tobytes()
    finally:
        r.close()


def test_idle_reader_threads_end_and_come_back_when_needed(data_file, monkeypatch):
    path, data = data_file
    monkeypatch.setattr(reader_mod, "IDLE_SECONDS", 0.05)
    r = DirectReader(path, capacity=1 << 20, threads=3)
    try:
        assert r.stage("a", [(0, 10)]) and r.take("a")[0].tobytes() == data[:10].tobytes()
        assert len(r._workers) == 3
        end = time.monotonic() + 10
        while r._workers:  # no read for IDLE_SECONDS: every thread ends
            assert time.monotonic() < end
            time.sleep(0.01)
        assert r.stage("b", [(SIZE - 10, 10)]) and r.take("b")[0].tobytes() == data[-10:].tobytes()
    finally:
        r.close()


def test_close_leaves_no_reader_thread(data_file):
    path, _ = data_file
    r = DirectReader(path, capacity=1 << 20)
    assert r.stage("k", [(0, 10)])
    r.take("k")
    r.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("cfr-expert-read")]


@pytest.fixture
def cold(monkeypatch):
    """The page cache looks empty: every expert a step loads is staged (or advised)."""
    monkeypatch.setattr(source_mod, "resident_pages", lambda a, n: np.zeros(
        -(-(a % mmap.PAGESIZE + n) // mmap.PAGESIZE), bool))


@pytest.mark.parametrize("matmul", ["float", "int8"])
def test_logits_with_direct_reads_equal_the_all_resident_run(moe_file, matmul, cold):
    model = load_model(moe_file("qwen3moe", "Q4_0"), matmul=matmul)
    base = model.logits(IDS, chunk_tokens=5)
    model.generate(IDS, max_tokens=5)
    decode = model.last_telemetry["logits_sha256"]
    k = model.net.config.n_experts_used
    for slots_ in (1, k, 3 * k):  # turns, one layer's top-k, more
        store = model.net.set_experts(slots_ * model.net.experts.slot_bytes, reads="direct")
        assert store.source.reader is not None
        assert np.array_equal(model.logits(IDS, chunk_tokens=5), base)
        model.generate(IDS, max_tokens=5)
        assert model.last_telemetry["logits_sha256"] == decode
        t = store.telemetry.summary()
        assert t["expert_direct_staged"] > 0 and t["expert_direct_failed"] == 0
        assert 0 < t["expert_direct_peak_bytes"] <= store.source.reader.capacity
        assert store.source.reader.capacity == 3 * k * store.source.staged_bytes()
        assert store.pool.nbytes == t["expert_pool_bytes"] <= slots_ * store.slot_bytes
    model.net.experts.source.close()


def test_a_predicted_expert_is_read_once_and_a_wrong_one_dropped(model, cold):
    """Read ahead for the next layer, then loaded by its step: staged once, taken there; a
    prediction the step does not load is dropped when the step begins."""
    store = model.net.set_experts(4 * model.net.experts.slot_bytes, reads="direct")
    store.use_prefetch(False)
    list(store.experts(0, [1], ahead=np.array([2, 6, 7])))
    r = store.source.reader
    assert r.counts.staged == 4 and set(r.staged) == {(1, 2), (1, 6), (1, 7)}
    list(store.experts(1, [2, 6]))
    assert r.counts.staged == 4 and not r.staged  # 2, 6 taken from staging; 7 dropped
    model.net.set_experts(None)


def test_an_unbounded_store_never_reads_directly(model):
    store = model.net.set_experts(None, reads="direct")  # every expert loaded at load
    assert store.source.reader is None and store.telemetry.reads is None


def test_auto_reads_directly_when_the_page_cache_cannot_keep_the_experts(model, monkeypatch):
    class Memory:
        available = 0

    monkeypatch.setattr(expert_memory.psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(expert_memory, "check_host_memory", lambda *a: None)  # its own test
    small = 2 * model.net.experts.slot_bytes
    Memory.available = 10**12  # plenty: the page cache is a second tier, keep it
    assert model.net.set_experts(small).source.reader is None
    Memory.available = model.net.experts.pool.nbytes + 1000  # not the experts' file bytes
    assert model.net.set_experts(small).source.reader is not None
    assert model.net.set_experts(small, reads="cached").source.reader is None
    with pytest.raises(ConfigError, match="expert_reads"):
        model.net.set_experts(small, reads="fast")
    model.net.set_experts(None)


def _fake_cgroup(tmp_path, monkeypatch, proc: str, files: dict) -> None:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(expert_memory, "CGROUP_ROOT", root)
    real = expert_memory.Path

    def fake_path(p, *a):
        return real(tmp_path / "self_cgroup") if str(p) == "/proc/self/cgroup" else real(p, *a)

    (tmp_path / "self_cgroup").write_text(proc)
    monkeypatch.setattr(expert_memory, "Path", fake_path)

    class Host:
        available = 10**12

    monkeypatch.setattr(expert_memory.psutil, "virtual_memory", lambda: Host)


def test_available_memory_is_a_v1_memory_cgroup_s_limit_less_its_usage(tmp_path, monkeypatch):
    mib = 1 << 20
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/box\n1:cpu:/\n", {
        "memory/box/memory.limit_in_bytes": f"{300 * mib}\n",
        "memory/box/memory.usage_in_bytes": f"{250 * mib}\n",
        "memory/box/memory.stat": f"cache 1\ntotal_inactive_file {100 * mib}\n"})
    assert expert_memory.available_memory() == (300 - 250 + 100) * mib


def test_available_memory_reads_v2_and_ignores_an_unlimited_cgroup(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "0::/box\n", {
        "box/memory.max": "max\n", "box/memory.current": "5\n", "box/memory.stat": ""})
    assert expert_memory.available_memory() == 10**12
    (tmp_path / "cgroup/box/memory.max").write_text("1000\n")
    (tmp_path / "cgroup/box/memory.stat").write_text("anon 5\ninactive_file 3\n")
    assert expert_memory.available_memory() == 1000 - (5 - 3)
