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


BUF = 1 << 16  # a staging buffer: room for any ranges the tests stage


def _ranges(draw_ranges):
    return [(off, min(n, SIZE - off)) for off, n in draw_ranges]


def _take(r, key, timeout=10.0):
    """r.take(key) on a thread: a regression that loses a read fails here instead of hanging
    the suite."""
    out = []
    t = threading.Thread(target=lambda: out.append(r.take(key)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"take({key!r}) still waiting after {timeout} s"
    return out[0]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, SIZE - 1), st.integers(1, 2 * ALIGN + 100)),
                min_size=1, max_size=3))
def test_staged_bytes_are_the_file_s_bytes_at_any_offset(data_file, drawn):
    path, data = data_file
    ranges = _ranges(drawn)
    r = DirectReader(path, 1 << 20, BUF)
    try:
        assert r.stage("k", ranges)
        got = _take(r, "k")
        assert [g.tobytes() for g in got] == [data[o:o + n].tobytes() for o, n in ranges]
        r.release("k")
        assert r.counts.failed == 0 and r.counts.staged == 1 and r.counts.taken == 1
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
    r = DirectReader(path, 3 * size, size)
    try:
        for i in range(40):  # stage, take, release: buffers are reused, never added
            assert r.stage(i, one)
            assert _take(r, i)[1].tobytes() == data[ALIGN + 5:3 * ALIGN + 5].tobytes()
            r.release(i)
        assert r.allocated == size and r.counts.peak_bytes == size
        staged = [k for k in range(100, 105) if r.stage(k, one)]  # staged, never taken
        assert staged == [100, 101, 102] and r.counts.declined == 2  # no staged key given up
        assert r.allocated <= r.capacity and r.counts.peak_bytes <= r.capacity
        held = _take(r, 102)
        _settle(r)  # a dropped buffer is reused once its reads end
        r.keep(lambda key: key == 101)  # 100 dropped; 102 is held, so it stays
        assert set(r.staged) == {101, 102} and held[0].tobytes() == data[100:3100].tobytes()
        assert r.stage(200, one) and not r.stage(201, one)  # 100's buffer, reused
        r.release(102)
        assert r.stage(201, one) and r.allocated == 3 * size
    finally:
        r.close()


def test_experts_of_different_sizes_share_the_buffers(data_file):
    """Layers whose experts differ in size (mixed formats) take any free buffer: one of the
    largest size each, so none is ever too small and none sits idle for want of a size."""
    path, _ = data_file
    small, large = [(0, 100)], [(100, 3 * ALIGN), (5 * ALIGN, 1000)]
    r = DirectReader(path, 2 * 6 * ALIGN, 6 * ALIGN)
    try:
        for i in range(30):
            for key in ((i, "s"), (i, "l")):
                assert r.stage(key, small if key[1] == "s" else large)
            r.keep(lambda key, i=i: key[0] == i)
            for key in ((i, "s"), (i, "l")):
                assert _take(r, key) is not None
                r.release(key)
        assert r.counts.declined == 0 and r.allocated == 2 * 6 * ALIGN
        assert not r.stage("huge", [(0, 7 * ALIGN)])  # larger than a buffer: not staged
    finally:
        r.close()


def test_a_failed_read_hands_out_nothing_and_is_counted(data_file, monkeypatch):
    path, _ = data_file
    r = DirectReader(path, 1 << 20, BUF)

    def broken(fd, bufs, off):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(reader_mod.os, "preadv", broken)
    try:
        assert r.stage("k", [(10, 100)])
        assert _take(r, "k") is None and r.counts.failed == 1
        assert "k" not in r.staged  # nothing pinned, its buffer free again
    finally:
        monkeypatch.undo()
        r.close()


def test_a_read_that_raises_anything_still_ends_and_a_closed_reader_stages_nothing(data_file,
                                                                                   monkeypatch):
    """A reader thread never dies with a read in flight: `take` would wait forever."""
    path, _ = data_file
    r = DirectReader(path, 1 << 20, BUF)

    def odd(fd, bufs, off):
        raise TypeError("not an OSError")

    monkeypatch.setattr(reader_mod.os, "preadv", odd)
    try:
        assert r.stage("k", [(10, 100)])
        assert _take(r, "k") is None and r.counts.failed == 1
    finally:
        monkeypatch.undo()
        r.close()
    assert not r.stage("late", [(0, 10)]) and r.take("late") is None


def test_o_direct_refused_at_read_falls_back_to_plain_reads(data_file, monkeypatch):
    """Every thread's read still returns its bytes, however slowly the plain descriptor
    opens (threads that hit EINVAL meanwhile wait for it, once)."""
    path, data = data_file
    r = DirectReader(path, 1 << 20, BUF)
    first_fd, real_read, real_open = r.fd, os.preadv, os.open

    def picky(fd, bufs, off):  # a filesystem that opens O_DIRECT but will not read so
        if fd == first_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_read(fd, bufs, off)

    def slow_open(*a):
        time.sleep(0.02)
        return real_open(*a)

    monkeypatch.setattr(reader_mod.os, "preadv", picky)
    monkeypatch.setattr(reader_mod.os, "open", slow_open)
    try:
        ranges = [(o, 777) for o in (0, 3000, 5000, 7000, 9000, 11000, 13000, 15000)]
        assert all(r.stage(i, [rg]) for i, rg in enumerate(ranges))
        for i, (o, n) in enumerate(ranges):
            assert _take(r, i)[0].tobytes() == data[o:o + n].tobytes()
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
    r = DirectReader(path, 1 << 20, BUF)
    monkeypatch.undo()
    try:
        assert not r.direct
        assert r.stage("k", [(SIZE - 50, 50)])  # the file's last bytes
        assert _take(r, "k")[0].tobytes() == data[-50:].tobytes()
    finally:
        r.close()


def test_a_file_replaced_at_its_path_is_never_read(data_file, tmp_path):
    """The staged bytes must be the mapped file's: a descriptor of another version of the
    file is refused, and the store then reads through the page cache (a warning, no error)."""
    path, _ = data_file
    st = os.stat(path)
    version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    DirectReader(path, 1 << 20, BUF, version).close()  # its own version: fine
    with pytest.raises(reader_mod.FileChangedError):
        DirectReader(path, 1 << 20, BUF, version[:3] + (version[3] + 1,))
    from cfr_atlas.experts import ExpertSource
    src = ExpertSource([], path=path, version=version[:3] + (version[3] + 1,))
    src.layers = [()]  # staged_bytes needs a layer; none of its matrices is read here
    src.staged_bytes = lambda: BUF
    with pytest.warns(RuntimeWarning, match="changed since the model mapped it"):
        assert not src.read_direct(4)
    assert src.reader is None


def test_idle_reader_threads_end_and_come_back_when_needed(data_file, monkeypatch):
    path, data = data_file
    monkeypatch.setattr(reader_mod, "IDLE_SECONDS", 0.3)
    r = DirectReader(path, 1 << 20, BUF, threads=3)
    try:
        assert r.stage("a", [(0, 10)]) and _take(r, "a")[0].tobytes() == data[:10].tobytes()
        assert 1 <= len(r._workers) <= 3
        end = time.monotonic() + 10
        while r._workers:  # no read for IDLE_SECONDS: every thread ends
            assert time.monotonic() < end
            time.sleep(0.01)
        assert r.stage("b", [(SIZE - 10, 10)])
        assert _take(r, "b")[0].tobytes() == data[-10:].tobytes()
    finally:
        r.close()


def test_close_ends_the_reader_s_threads_and_staging_after_it_declines(data_file):
    path, _ = data_file
    r = DirectReader(path, 1 << 20, BUF)
    assert r.stage("k", [(0, 10)])
    _take(r, "k")
    workers = list(r._workers)
    r.close()
    assert workers and not any(t.is_alive() for t in workers)
    assert not r.stage("j", [(0, 10)]) and r._workers == []


def test_a_forked_child_stages_nothing(data_file, monkeypatch):
    path, _ = data_file
    r = DirectReader(path, 1 << 20, BUF)
    try:
        monkeypatch.setattr(reader_mod.os, "getpid", lambda: -1)  # as in a forked child
        assert not r.stage("k", [(0, 10)]) and not r.staged
    finally:
        monkeypatch.undo()
        r.close()


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
        assert t["expert_direct_taken"] > 0  # staged bytes were what the slots were filled from
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
    """Usage without the reclaimable page cache (active or inactive; shared memory is not
    reclaimable), and the lowest of the cgroup's and its parents' limits."""
    mib = 1 << 20
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/box/inner\n1:cpu:/\n", {
        "memory/box/inner/memory.limit_in_bytes": f"{300 * mib}\n",
        "memory/box/inner/memory.usage_in_bytes": f"{250 * mib}\n",
        "memory/box/inner/memory.stat":
            f"cache 1\ntotal_cache {120 * mib}\ntotal_shmem {20 * mib}\n"
            f"total_active_file {90 * mib}\ntotal_inactive_file {10 * mib}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.usage_in_bytes": f"{400 * mib}\n", "memory/memory.stat": ""})
    assert expert_memory.available_memory() == (300 - 250 + 100) * mib
    (tmp_path / "cgroup/memory/box").mkdir(exist_ok=True)
    (tmp_path / "cgroup/memory/box/memory.limit_in_bytes").write_text(f"{200 * mib}\n")
    (tmp_path / "cgroup/memory/box/memory.usage_in_bytes").write_text(f"{180 * mib}\n")
    (tmp_path / "cgroup/memory/box/memory.stat").write_text("total_cache 0\n")
    assert expert_memory.available_memory() == 20 * mib  # the parent's limit is lower


def test_available_memory_reads_v2_and_ignores_an_unlimited_cgroup(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "0::/box\n", {
        "box/memory.max": "max\n", "box/memory.current": "5\n", "box/memory.stat": ""})
    assert expert_memory.available_memory() == 10**12
    (tmp_path / "cgroup/box/memory.max").write_text("1000\n")
    (tmp_path / "cgroup/box/memory.stat").write_text("anon 5\nfile 3\nshmem 1\n")
    assert expert_memory.available_memory() == 1000 - (5 - (3 - 1))
    (tmp_path / "cgroup/box/memory.max").write_text("")  # an empty file: no limit read
    assert expert_memory.available_memory() == 10**12


def test_a_cgroup_path_not_under_the_mount_is_read_at_its_root(tmp_path, monkeypatch):
    """A container without its own cgroup namespace sees the host's path; its own cgroup is
    the mount's root."""
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/docker/abc123\n", {
        "memory/memory.limit_in_bytes": "1000\n", "memory/memory.usage_in_bytes": "600\n",
        "memory/memory.stat": "total_cache 100\ntotal_shmem 0\n"})
    assert expert_memory.available_memory() == 1000 - (600 - 100)
