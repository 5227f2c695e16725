"""Failure handling of budgeted sessions: clear typed errors, nothing leaked, others unharmed."""

import os

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import CapacityError, CorruptPageError
from cfr_atlas.generate import prefill
from cfr_atlas.kv import page_file
from cfr_atlas.models.session import fixed_kv_bytes

IDS = np.array([5, 77, 300, 12, 9, 256, 257, 1, 42, 99, 150, 3, 7, 8, 31, 200], dtype=np.int64)
KV = dict(kv_budget="3KiB", page_tokens=4)


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama)


def test_unwritable_cache_dir_is_a_clear_error(model, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(CapacityError, match="writable cache directory"):
        model.session(cache_dir=blocker / "pages", **KV)


def test_full_disk_fails_request_and_leaves_other_sequences_working(model, tmp_path,
                                                                    monkeypatch):
    base = model.logits(IDS, page_tokens=4)
    other = model.session(cache_dir=tmp_path, **KV)
    prefill(model.net, other, IDS[:8])
    victim = model.session(cache_dir=tmp_path, **KV)
    real = os.posix_fallocate

    def full(fd, offset, length):  # blocks for new pages are reserved before rows are stored
        if fd == victim.backend.fd:
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(page_file.os, "posix_fallocate", full)
    with pytest.raises(CapacityError, match="No space left"):
        prefill(model.net, victim, IDS)
    victim.close()
    assert victim.atlas.cache.resident_bytes == 0 and not victim.backend.path.exists()
    monkeypatch.setattr(page_file.os, "posix_fallocate", real)
    rest = prefill(model.net, other, IDS[8:], all_logits=True)
    assert np.array_equal(rest, base[8:])
    other.close()


def test_deleted_page_file_fails_with_corrupt_page_error(model, tmp_path):
    s = model.session(cache_dir=tmp_path, **KV)
    prefill(model.net, s, IDS[:12])
    s.backend.path.unlink()
    with pytest.raises(CorruptPageError, match="deleted"):
        prefill(model.net, s, IDS[12:])
    before = s.atlas.cache.resident_bytes
    assert before <= s.budget
    s.close()


@pytest.mark.parametrize("damage", ["flip K", "flip V", "zero", "foreign", "truncate"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_damaged_page_file_raises_corrupt_page_error(model, tmp_path, damage, dtype):
    """Damage written through the file (another process, the disk), not through the
    mapping: the fold that reads the page sees it and raises, on the decode path too."""
    s = model.session(cache_dir=tmp_path, storage_dtype=dtype, **KV)
    prefill(model.net, s, IDS[:12])
    spill = s.backend
    k_off = page_file.HDR_BYTES                              # slot 0: layer 0, head 0, page 0
    v_off = page_file.HDR_BYTES + len(spill.tokens) * spill.page_bytes
    with open(spill.path, "r+b") as f:
        if damage == "truncate":
            f.truncate(spill.file_bytes // 2)
        elif damage == "zero":
            f.seek(v_off)
            f.write(bytes(spill.page_bytes))
        else:
            off = {"flip K": k_off, "flip V": v_off, "foreign": v_off}[damage]
            f.seek(off)
            old = f.read(8)
            f.seek(off)
            # a flipped bit, or the V rows of another page (slot 1) in place of slot 0's
            f.write(bytes([old[0] ^ 0x40]) + old[1:] if damage != "foreign" else
                    spill._v[1].tobytes())
    with pytest.raises(CorruptPageError):
        for t in IDS[12:]:  # one token at a time: the decode path
            prefill(model.net, s, np.array([t]))
    s.close()


def test_page_files_removed_on_close_and_stale_files_cleaned(model, tmp_path):
    s = model.session(cache_dir=tmp_path, **KV)
    prefill(model.net, s, IDS[:6])
    assert s.backend.path.exists()
    s.close()
    assert list(tmp_path.glob("*.kvp")) == []
    stale = tmp_path / "seq-999999999-deadbeef.kvp"   # a pid that cannot be running
    stale.write_bytes(b"x")
    t = model.session(cache_dir=tmp_path, **KV)
    assert not stale.exists()
    t.close()


def test_two_sessions_share_a_cache_dir_without_collisions(model, tmp_path):
    a, b = model.session(cache_dir=tmp_path, **KV), model.session(cache_dir=tmp_path, **KV)
    assert a.backend.path != b.backend.path
    la = prefill(model.net, a, IDS, all_logits=True)
    lb = prefill(model.net, b, IDS, all_logits=True)
    assert np.array_equal(la, lb)
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_smallest_budget_reads_every_page_from_the_file_and_changes_nothing(model, tmp_path,
                                                                            dtype):
    base = model.logits(IDS, page_tokens=4, storage_dtype=dtype)
    # the smallest budget: scratch and staging; every page is read in place from the file
    smallest = sum(fixed_kv_bytes(model.config, page_tokens=4, context_limit=len(IDS),
                                  storage_dtype=dtype).values())
    got = model.logits(IDS, cache_dir=tmp_path, kv_budget=smallest, page_tokens=4,
                       chunk_tokens=3, storage_dtype=dtype)
    assert np.array_equal(got, base)
    assert model.last_telemetry["page_file_bytes_read"] > 0
    assert model.last_telemetry["peak_allocated_kv_bytes"] <= smallest
