"""A prefix-cache hit is always this model's K/V, built this way, for this client.

- Two GGUF files that share the header and the three 64 KiB samples the old identity hashed,
  but differ in one byte of blk.0.attn_k.weight, get different identities and never share a
  block: the second model sees 0 cached tokens and its own uncached logits, bitwise.
- The identity is the SHA-256 of the whole file, memoized in-process and in a versioned memo
  file (a corrupt memo is ignored and rewritten; a changed file is hashed again).
- Another package version or kernel-build fingerprint is a miss.
- `cache_salt` keys the blocks: other salt, no hit; same salt, hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time

import gguf
import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError
from cfr_atlas.kv import build
from cfr_atlas.models import file_identity
from cfr_atlas.models.gguf_io import GGUFFile

PAGE = 4
IDS = [5, 77, 300, 12, 9, 256, 257, 1, 42, 99, 150, 3, 7, 8, 31, 200, 18, 64, 65, 66, 10, 11]
CACHED = (len(IDS) - 1) // PAGE * PAGE
OLD_SAMPLE = 64 << 10


@pytest.fixture(autouse=True)
def private_memo(tmp_path, monkeypatch):
    """Every test hashes for real, with its own memo file."""
    monkeypatch.setattr(file_identity, "memo_path", lambda: tmp_path / "memo" / "identity.json")
    file_identity.forget_in_process()
    yield
    file_identity.forget_in_process()


def old_identity(path) -> str:
    """The identity before issue 9: header + tensor table + three 64 KiB samples."""
    reader = gguf.GGUFReader(path)
    end = min(t.data_offset for t in reader.tensors)
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(end))
        for at in (end, (end + size) // 2, max(end, size - OLD_SAMPLE)):
            f.seek(at)
            h.update(f.read(OLD_SAMPLE))
    return h.hexdigest()


@pytest.fixture(scope="module")
def twins(tiny_gguf, tmp_path_factory):
    """(a, b, offset): b is a with one quant byte of blk.0.attn_k.weight changed at `offset`."""
    a = tiny_gguf(dim=256, hidden_dim=512, n_heads=4, n_kv_heads=2)  # ~1.4 MB: room to hide
    b = tmp_path_factory.mktemp("twins") / "b.gguf"
    shutil.copyfile(a, b)
    t = next(t for t in gguf.GGUFReader(a).tensors if t.name == "blk.0.attn_k.weight")
    offset = int(t.data_offset) + 34 * 7 + 2 + 5  # Q8_0 block 7: a weight byte, not the scale
    data = bytearray(b.read_bytes())
    data[offset] ^= 0x40
    b.write_bytes(bytes(data))
    return a, b, offset


def test_twins_fool_the_old_sampled_identity_but_not_the_full_hash(twins):
    a, b, offset = twins
    reader = gguf.GGUFReader(a)
    end, size = min(t.data_offset for t in reader.tensors), os.path.getsize(a)
    for at in (end, (end + size) // 2, max(end, size - OLD_SAMPLE)):
        assert not at <= offset < at + OLD_SAMPLE  # the old samples never looked there
    assert old_identity(a) == old_identity(b)
    ida, idb = GGUFFile(a).identity(), GGUFFile(b).identity()
    assert ida != idb
    assert ida == hashlib.sha256(a.read_bytes()).hexdigest()
    assert idb == hashlib.sha256(b.read_bytes()).hexdigest()


def test_twins_never_share_prefix_blocks(twins, tmp_path):
    a, b, _ = twins
    folder = tmp_path / "prefix"
    ma = load_model(a, prefix_cache=folder)
    first = ma.next_logits(IDS, page_tokens=PAGE)
    ma.next_logits(IDS, page_tokens=PAGE)
    assert ma.last_telemetry["prompt_cached_tokens"] == CACHED  # the cache works for a
    ma.prefix.close()
    mb = load_model(b, prefix_cache=folder)
    got = mb.next_logits(IDS, page_tokens=PAGE)
    assert mb.last_telemetry["prompt_cached_tokens"] == 0
    assert np.array_equal(got, load_model(b).next_logits(IDS, page_tokens=PAGE))
    assert not np.array_equal(got, first)  # the changed weight matters: sharing would show
    assert mb.prefix.disk.stats().hits == 0
    mb.prefix.close()


def test_identity_is_memoized_in_process_and_on_disk(tiny_llama, monkeypatch):
    want = hashlib.sha256(tiny_llama.read_bytes()).hexdigest()
    calls = []
    real = file_identity.hash_buffer
    monkeypatch.setattr(file_identity, "hash_buffer", lambda data, name="": calls.append(1)
                        or real(data, name))
    assert file_identity.file_digest(tiny_llama) == want and len(calls) == 1
    assert file_identity.file_digest(tiny_llama) == want and len(calls) == 1   # in-process
    file_identity.forget_in_process()
    assert GGUFFile(tiny_llama).identity() == want and len(calls) == 1          # memo file
    memo = file_identity.memo_path()
    assert stat.S_IMODE(memo.stat().st_mode) == 0o600
    entries = json.loads(memo.read_text())["entries"]
    assert list(entries.values()) == [want]
    assert list(memo.parent.glob("*.tmp")) == []


@pytest.mark.parametrize("garbage", [b"{not json", b"[]", b'{"version": 99, "entries": {}}',
                                     b"\xff\xfe"])
def test_corrupt_memo_is_ignored_and_rewritten(tiny_llama, garbage):
    memo = file_identity.memo_path()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_bytes(garbage)
    want = hashlib.sha256(tiny_llama.read_bytes()).hexdigest()
    assert file_identity.file_digest(tiny_llama) == want
    assert json.loads(memo.read_text())["entries"] != {}


def test_a_wrong_memo_entry_is_never_used_for_a_changed_file(tiny_llama, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(tiny_llama, path)
    first = file_identity.file_digest(path)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    time.sleep(0.05)  # past the kernel's coarse timestamp tick (a few ms)
    path.write_bytes(bytes(data))                   # same size, same inode
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime
    second = file_identity.file_digest(path)
    assert second != first and second == hashlib.sha256(bytes(data)).hexdigest()


@pytest.mark.parametrize("change", ["kernel_fingerprint", "package_version"])
def test_another_build_misses(tiny_llama, tmp_path, monkeypatch, change):
    folder = tmp_path / "prefix"
    m = load_model(tiny_llama, prefix_cache=folder)
    want = m.next_logits(IDS, page_tokens=PAGE)
    m.prefix.close()
    monkeypatch.setattr(build, change, lambda: "something else")
    other = load_model(tiny_llama, prefix_cache=folder)
    got = other.next_logits(IDS, page_tokens=PAGE)
    assert other.last_telemetry["prompt_cached_tokens"] == 0
    assert np.array_equal(got, want) and other.prefix.disk.stats().hits == 0
    other.next_logits(IDS, page_tokens=PAGE)      # its own blocks do hit
    assert other.last_telemetry["prompt_cached_tokens"] == CACHED
    other.prefix.close()
    monkeypatch.undo()
    again = load_model(tiny_llama, prefix_cache=folder)  # and the original build's still do
    again.next_logits(IDS, page_tokens=PAGE)
    assert again.last_telemetry["prompt_cached_tokens"] == CACHED
    again.prefix.close()


def test_cache_salt_keys_the_blocks(tiny_llama, tmp_path):
    m = load_model(tiny_llama, prefix_cache=tmp_path / "prefix")
    cold = load_model(tiny_llama).next_logits(IDS, page_tokens=PAGE)
    assert np.array_equal(m.next_logits(IDS, page_tokens=PAGE, cache_salt="a"), cold)
    assert m.last_telemetry["prompt_cached_tokens"] == 0
    assert np.array_equal(m.next_logits(IDS, page_tokens=PAGE, cache_salt="b"), cold)
    assert m.last_telemetry["prompt_cached_tokens"] == 0        # another salt: nothing shared
    m.next_logits(IDS, page_tokens=PAGE)
    assert m.last_telemetry["prompt_cached_tokens"] == 0        # nor with no salt
    assert np.array_equal(m.next_logits(IDS, page_tokens=PAGE, cache_salt="a"), cold)
    assert m.last_telemetry["prompt_cached_tokens"] == CACHED   # the same salt hits
    text = m.generate(IDS, max_tokens=3, page_tokens=PAGE, cache_salt="b")
    assert m.last_telemetry["prompt_cached_tokens"] == CACHED
    assert text == load_model(tiny_llama).generate(IDS, max_tokens=3, page_tokens=PAGE)
    m.prefix.close()


@pytest.mark.parametrize("salt", [7, None, b"a", "x" * 5000])
def test_bad_salt_is_a_config_error(tiny_llama, tmp_path, salt):
    for prefix in (None, tmp_path / "prefix"):
        m = load_model(tiny_llama, prefix_cache=prefix)
        with pytest.raises(ConfigError, match="cache_salt"):
            m.next_logits(IDS, page_tokens=PAGE, cache_salt=salt, kv_budget="3KiB",
                          cache_dir=tmp_path / "pages")
        assert list(tmp_path.glob("pages/*")) == []  # refused before a page file exists
        if m.prefix:
            m.prefix.close()


def test_a_file_replaced_while_opening_is_refused(tiny_llama, tmp_path, monkeypatch):
    from cfr_atlas.errors import ModelFormatError
    from cfr_atlas.models import gguf_io

    path = tmp_path / "m.gguf"
    shutil.copyfile(tiny_llama, path)
    real = gguf_io._Reader  # the start-up reader GGUFFile opens files with

    def replacing(p, mode="r"):
        reader = real(p, mode)                 # maps the old file, then a re-export lands
        shutil.copyfile(tiny_llama, tmp_path / "new.gguf")
        os.replace(tmp_path / "new.gguf", path)
        return reader

    monkeypatch.setattr(gguf_io, "_Reader", replacing)
    with pytest.raises(ModelFormatError, match="changed while it was being opened"):
        GGUFFile(path)
