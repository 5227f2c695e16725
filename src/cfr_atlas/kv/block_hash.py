"""Chained SHA-256 identities of whole K/V blocks: the prefix index's keys.

    root     = H(field "D" ROOT_DOMAIN,  field "M" model identity, extras)
    block_i  = H(field "D" BLOCK_DOMAIN, field "P" block_{i-1} (root for i = 0),
                 field "T" token ids of block i as int64 little-endian, extras)
    extras   = field "N" count, then one typed field per key ("s" str utf-8, "b" bytes,
               "i" int64 little-endian)
    field    = tag (1 byte) + payload length (u64 little-endian) + payload

Every field is length-prefixed, so no two different inputs share an encoding (["ab", "c"] and
["a", "bc"] hash differently). A block's hash names its whole prefix, so the chain of a prefix
is a prefix of the chain of any longer sequence. Only whole blocks have hashes; a partial tail
has none. Extra keys carry whatever changes K/V besides the tokens (an adapter id, an image
digest); sampling parameters never do. The model identity should be `CacheSignature.to_bytes()`
so every field that changes K/V separates the chains. Hashes come from `hashlib`, never from
the process-salted built-in `hash()`. This module stores nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from cfr_atlas.errors import ConfigError, DimensionError

BlockHash = bytes  # 32 bytes of SHA-256
HASH_BYTES = 32
ROOT_DOMAIN = b"cfr-atlas/kv-root/v1"
BLOCK_DOMAIN = b"cfr-atlas/kv-block/v1"
ExtraKey = str | bytes | int


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(8, "little") + payload


def _extras(extra_keys: Sequence[ExtraKey]) -> bytes:
    parts = [_field(b"N", len(extra_keys).to_bytes(8, "little"))]
    for key in extra_keys:
        if isinstance(key, str):
            parts.append(_field(b"s", key.encode("utf-8")))
        elif isinstance(key, bytes):
            parts.append(_field(b"b", key))
        elif isinstance(key, int) and not isinstance(key, bool) and -(1 << 63) <= key < 1 << 63:
            parts.append(_field(b"i", key.to_bytes(8, "little", signed=True)))
        else:
            raise ConfigError("extra_keys", "each key must be a str, bytes or an int64, "
                                            f"got {type(key).__name__} {key!r}")
    return b"".join(parts)


def token_array(ids) -> np.ndarray:
    """Token ids (a sequence or an integer array) -> 1-D int64 array; negatives are refused."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DimensionError(f"token ids must be a 1-D integer sequence, got {arr.dtype} "
                             f"of shape {arr.shape}")
    if (arr < 0).any() or (arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max):
        raise DimensionError(f"token ids must be in [0, 2**63), got {arr.min()}..{arr.max()}")
    return arr.astype(np.int64)


def root_hash(model_identity: bytes, extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """The parent of block 0: the model identity (pass `CacheSignature.to_bytes()`) and keys."""
    data = _field(b"D", ROOT_DOMAIN) + _field(b"M", bytes(model_identity)) + _extras(extra_keys)
    return hashlib.sha256(data).digest()


def block_hash(parent: BlockHash, token_ids, extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """The hash of one whole block given its parent's hash (or the root) and its token ids."""
    if len(parent) != HASH_BYTES:
        raise DimensionError(f"a parent hash has {HASH_BYTES} bytes, got {len(parent)}")
    tokens = token_array(token_ids).astype("<i8").tobytes()
    data = _field(b"D", BLOCK_DOMAIN) + _field(b"P", parent) + _field(b"T", tokens) + \
        _extras(extra_keys)
    return hashlib.sha256(data).digest()


def chain_hashes(root: BlockHash, ids, block_tokens: int,
                 extra_keys: Sequence[ExtraKey] = ()) -> list[BlockHash]:
    """Hashes of the len(ids) // block_tokens whole blocks of `ids`, in order."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ConfigError("block_tokens", f"must be a positive integer, got {block_tokens!r}")
    tokens = token_array(ids)
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = block_hash(parent, tokens[start:start + block_tokens], extra_keys)
        hashes.append(parent)
    return hashes
