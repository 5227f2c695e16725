"""Test support for tests/kv: small signatures, deterministic blocks, a no-regeneration guard.
Nothing here is a test."""

from __future__ import annotations

import dataclasses

import numpy as np

from cfr_atlas.kv import CacheSignature, KvBlock, chain_hashes, root_hash

SIG = CacheSignature(model_id="ab" * 32, architecture="llama", n_layers=2, n_kv_heads=2,
                     head_dim=8, storage_dtype="float16", block_tokens=4, rope_theta=10000.0,
                     rope_mode="normal")


def signature(**changes) -> CacheSignature:
    return dataclasses.replace(SIG, **changes)


def make_block(ids, index: int = 0, sig: CacheSignature = SIG, seed: int = 0) -> KvBlock:
    """Block `index` of the token sequence `ids`, with hash from the chain and random rows."""
    B = sig.block_tokens
    hashes = chain_hashes(root_hash(sig.to_bytes()), ids, B)
    rng = np.random.default_rng([seed, index])
    dt = sig.dtype.array_dtype
    if dt == np.uint16:
        k = rng.integers(0, 0x7C00, sig.block_shape, dtype=np.uint16)  # finite float16 bits
        v = rng.integers(0, 0x7C00, sig.block_shape, dtype=np.uint16)
    else:
        k = rng.standard_normal(sig.block_shape).astype(np.float32)
        v = rng.standard_normal(sig.block_shape).astype(np.float32)
    tokens = np.asarray(ids[index * B:(index + 1) * B], dtype=np.int64)
    return KvBlock(hashes[index], tokens, sig, k, v)


def same_block(a: KvBlock, b: KvBlock) -> bool:
    return (a.hash == b.hash and np.array_equal(a.token_ids, b.token_ids)
            and a.signature == b.signature and np.array_equal(a.k, b.k)
            and np.array_equal(a.v, b.v))


class NoRegeneration:
    """A backend for an all-hot baseline: any regeneration is a test failure."""

    def regenerate_page(self, key, tokens, k_out, v_out):
        raise AssertionError(f"baseline regenerated {key}")
