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
    real = os.pwrite

    def full(fd, data, offset):
        if fd == victim.backend.fd and offset > 4096:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(page_file.os, "pwrite", full)
    with pytest.raises(CapacityError, match="No space left"):
        prefill(model.net, victim, IDS)
    victim.close()
    assert victim.atlas.cache.resident_bytes == 0 and not victim.backend.path.exists()
    monkeypatch.setattr(page_file.os, "pwrite", real)
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


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_page_file_raises_corrupt_page_error(model, tmp_path, damage):
    s = model.session(cache_dir=tmp_path, **KV)
    prefill(model.net, s, IDS[:12])
    path = s.backend.path
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[page_file.HDR_BYTES * 2 + 5] ^= 0x40      # a K row byte of the first slot
    elif damage == "header":
        data[page_file.HDR_BYTES + 4] ^= 0x01          # the first slot's layer field
    else:
        data = data[: len(data) // 2]
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(bytes(data))
    with pytest.raises(CorruptPageError):
        prefill(model.net, s, IDS[12:])
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


@pytest.mark.parametrize("prefetch", [0, 2, 8])
def test_prefetch_depth_changes_nothing(model, tmp_path, prefetch):
    base = model.logits(IDS, page_tokens=4)
    # the smallest budget: scratch, staging and the page reads (in progress + read ahead)
    smallest = sum(fixed_kv_bytes(model.config, page_tokens=4, context_limit=len(IDS),
                                  prefetch_pages=prefetch).values())
    got = model.logits(IDS, cache_dir=tmp_path, kv_budget=smallest, page_tokens=4,
                       prefetch_pages=prefetch, chunk_tokens=3)
    assert np.array_equal(got, base)
