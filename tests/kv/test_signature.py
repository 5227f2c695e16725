"""CacheSignature (fields, first mismatch, versioned bytes), block layout against the sliding
window, and KvBlock shape checks."""

from __future__ import annotations

import dataclasses
import platform
import struct

import numpy as np
import pytest
from kv_helpers import SIG, make_block, signature

from cfr_atlas.errors import BlockLayoutError, ConfigError, CorruptBlockError, DimensionError
from cfr_atlas.kv import BlockLayout, CacheSignature, KvBlock, aligned_block_size


def test_round_trip_and_first_mismatch():
    sig = signature(sliding_window=4096, storage_dtype="bfloat16")
    assert CacheSignature.from_bytes(sig.to_bytes()) == sig
    assert CacheSignature.from_bytes(SIG.to_bytes()) == SIG and SIG.sliding_window is None
    assert SIG.first_mismatch(SIG) is None
    assert SIG.first_mismatch(signature(rope_theta=5e5, head_dim=16)) == "head_dim"
    assert SIG.first_mismatch(signature(format_version=2)) == "format_version"
    names = [f.name for f in dataclasses.fields(CacheSignature)]
    assert names == ["model_id", "architecture", "n_layers", "n_kv_heads", "head_dim",
                     "storage_dtype", "block_tokens", "rope_theta", "rope_mode",
                     "sliding_window", "format_version", "package_version", "kernel_build"]
    assert SIG.first_mismatch(signature(package_version="9.9")) == "package_version"
    assert SIG.first_mismatch(signature(kernel_build="other cpu")) == "kernel_build"


def test_from_bytes_refuses_anything_but_one_exact_encoding():
    raw = SIG.to_bytes()
    with pytest.raises(CorruptBlockError, match="version 1"):
        CacheSignature.from_bytes(raw[:4] + struct.pack("<H", 1) + raw[6:])
    with pytest.raises(CorruptBlockError, match="magic"):
        CacheSignature.from_bytes(b"XSIG" + raw[4:])
    for cut in (0, 5, 10, len(raw) - 1):
        with pytest.raises(CorruptBlockError, match="truncated"):
            CacheSignature.from_bytes(raw[:cut])
    with pytest.raises(CorruptBlockError, match="1 trailing bytes"):
        CacheSignature.from_bytes(raw + b"\0")
    bad_dtype = raw.replace(b"float16", b"float17")
    with pytest.raises(CorruptBlockError, match="storage_dtype"):
        CacheSignature.from_bytes(bad_dtype)


def test_fields_are_checked():
    with pytest.raises(ConfigError, match="n_layers"):
        signature(n_layers=0)
    with pytest.raises(ConfigError, match="rope_theta"):
        signature(rope_theta=float("nan"))
    with pytest.raises(ConfigError, match="model_id"):
        signature(model_id="")
    with pytest.raises(BlockLayoutError, match="block_tokens 4 does not divide"):
        signature(sliding_window=10)


def test_block_size_alignment_with_the_window():
    assert aligned_block_size(4096, 16) == 16
    assert aligned_block_size(4000, 48) == 40
    assert aligned_block_size(7, 4) == 1
    assert aligned_block_size(12, 100) == 12
    BlockLayout(16, 4096)
    BlockLayout(48, None)
    with pytest.raises(BlockLayoutError) as err:
        BlockLayout(48, 4000)
    assert "48" in str(err.value) and "4000" in str(err.value) and "= 40" in str(err.value)


def test_kv_block_checks_its_arrays():
    block = make_block(list(range(8)), 1)
    assert block.k.shape == (2, 2, 4, 8) and block.token_ids.tolist() == [4, 5, 6, 7]
    assert block.nbytes == 2 * 2 * 2 * 4 * 8 * 2 + 4 * 8 + 32
    with pytest.raises(DimensionError, match="k must be uint16"):
        KvBlock(block.hash, block.token_ids, SIG, block.k.astype(np.float32), block.v)
    with pytest.raises(DimensionError, match="token_ids"):
        KvBlock(block.hash, block.token_ids[:3], SIG, block.k, block.v)
    with pytest.raises(DimensionError, match="32 bytes"):
        KvBlock(b"x", block.token_ids, SIG, block.k, block.v)


def test_signature_carries_this_build_and_its_fingerprint_is_overridable(monkeypatch):
    from cfr_atlas.kv import build

    fp = build.kernel_fingerprint()
    for part in ("numpy", "numba", "llvmlite", "cpu", "features", platform.python_version()):
        assert part in fp, (part, fp)
    assert SIG.package_version == build.package_version() and SIG.kernel_build == fp
    monkeypatch.setattr(build, "kernel_fingerprint", lambda: "another machine")
    monkeypatch.setattr(build, "package_version", lambda: "9.9.9")
    other = dataclasses.replace(SIG)  # fields given explicitly: unchanged
    assert other == SIG
    fresh = CacheSignature(**{f.name: getattr(SIG, f.name) for f in dataclasses.fields(SIG)
                              if f.name not in ("package_version", "kernel_build")})
    assert (fresh.package_version, fresh.kernel_build) == ("9.9.9", "another machine")
    assert SIG.first_mismatch(fresh) == "package_version"
    assert CacheSignature.from_bytes(fresh.to_bytes()) == fresh


def test_package_version_names_the_sources_so_an_edited_checkout_misses(tmp_path):
    from cfr_atlas.kv import build

    assert build.package_version().endswith("+src." + build.source_digest())
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "rope.py").write_text("x = 1\n")
    before = build.source_digest(tmp_path)
    (tmp_path / "ops" / "rope.py").write_text("x = 2\n")  # one character of one kernel
    assert build.source_digest(tmp_path) != before
