"""Chained block hashes: deterministic SHA-256, prefix-closed, unambiguous field encoding,
whole blocks only, extra keys separate chains."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.kv import block_hash, chain_hashes, root_hash

ROOT = root_hash(b"model")
ids_st = st.lists(st.integers(0, 2**40), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ids=ids_st, cut=st.integers(0, 60), block=st.integers(1, 7))
def test_a_prefix_chain_is_a_prefix_of_the_longer_chain(ids, cut, block):
    full = chain_hashes(ROOT, ids, block)
    short = chain_hashes(ROOT, ids[:cut], block)
    assert len(full) == len(ids) // block and len(short) == len(ids[:cut]) // block
    assert full[:len(short)] == short


@settings(max_examples=100, deadline=None)
@given(a=ids_st, b=ids_st)
def test_different_block_contents_give_different_chains(a, b):
    ha, hb = chain_hashes(ROOT, a, 3), chain_hashes(ROOT, b, 3)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (a[:3 * (i + 1)] == b[:3 * (i + 1)])


def test_only_whole_blocks_are_hashed_and_the_chain_is_sha256():
    assert chain_hashes(ROOT, [1, 2, 3], 4) == []
    (h,) = chain_hashes(ROOT, [1, 2, 3, 4, 5], 4)
    assert h == block_hash(ROOT, [1, 2, 3, 4]) and len(h) == 32
    tokens = np.array([1, 2, 3, 4], dtype="<i8").tobytes()
    data = (b"D" + (21).to_bytes(8, "little") + b"cfr-atlas/kv-block/v1" + b"P"
            + (32).to_bytes(8, "little") + ROOT + b"T" + (32).to_bytes(8, "little") + tokens
            + b"N" + (8).to_bytes(8, "little") + (0).to_bytes(8, "little"))
    assert h == hashlib.sha256(data).digest()


def test_fields_are_length_prefixed():
    assert root_hash(b"m", ["ab", "c"]) != root_hash(b"m", ["a", "bc"])
    assert root_hash(b"m", ["ab"]) != root_hash(b"m", [b"ab"])   # typed
    assert root_hash(b"m", [1]) != root_hash(b"m", ["1"])
    assert root_hash(b"mx") != root_hash(b"m", ["x"])
    assert block_hash(ROOT, [1, 2]) != block_hash(ROOT, [1], [2])


def test_extra_keys_and_roots_separate_chains():
    ids = list(range(8))
    plain = chain_hashes(ROOT, ids, 4)
    assert chain_hashes(ROOT, ids, 4, ["adapter-a"]) != plain
    assert chain_hashes(root_hash(b"other model"), ids, 4) != plain
    assert chain_hashes(ROOT, np.arange(8, dtype=np.int32), 4) == plain


def test_stable_across_processes():
    """No salted hash(): another interpreter (another PYTHONHASHSEED) gets the same bytes."""
    code = ("from cfr_atlas.kv.block_hash import chain_hashes, root_hash;"
            "print(chain_hashes(root_hash(b'model', ['a']), list(range(9)), 4)[-1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == chain_hashes(root_hash(b"model", ["a"]), range(9), 4)[-1].hex()


def test_bad_inputs_are_refused():
    with pytest.raises(DimensionError, match="integer"):
        chain_hashes(ROOT, [1.5, 2.0], 1)
    with pytest.raises(DimensionError, match=r"\[0, 2\*\*63\)"):
        chain_hashes(ROOT, [3, -1], 1)
    with pytest.raises(ConfigError, match="block_tokens"):
        chain_hashes(ROOT, [1], 0)
    with pytest.raises(ConfigError, match="extra_keys"):
        root_hash(b"m", [0.5])
    with pytest.raises(ConfigError, match="extra_keys"):
        root_hash(b"m", [True])
    with pytest.raises(DimensionError, match="32 bytes"):
        block_hash(b"short", [1])
