"""The `.kvb` file format of one K/V block: `encode_block` and `decode_block`.

Layout (little-endian; S = signature bytes, N = tokens, body = K + V bytes):

    offset      size  field
    0           8     magic b"CFRKVBLK"
    8           4     file format version u32 (FILE_VERSION)
    12          4     S u32
    16          32    block hash (SHA-256 chain hash, see block_hash.py)
    48          4     N u32 (== signature.block_tokens)
    52          4     reserved u32, 0
    56          8     body u64 (== signature.block_kv_bytes)
    64          S     cache signature (CacheSignature.to_bytes())
    64+S        8N    token ids, int64
    64+S+8N     body  K then V, each (n_layers, n_kv_heads, block_tokens, head_dim), storage dtype
    end-32      32    SHA-256 of every byte before it

The checksum is SHA-256 rather than crc32: a block that passes is used as exact K/V, and a
missed corruption is a silently wrong answer, so a 2**-32 miss rate per damaged file is not
good enough for a cache that lives for months. The cost is small next to what a block saves
(measured 1.7 GB/s for SHA-256 vs 2.4 GB/s for crc32 on the dev machine; recomputing a block is
a prefill of block_tokens tokens). It guards against accidents, not against someone who can
write the cache folder.

`decode_block` checks, in order: length, magic, version, declared sizes against the real size
(before anything is allocated or sliced from a length field), checksum, hash (a misfiled
block), signature syntax and geometry, then signature equality. Damage raises
`CorruptBlockError`; another version or signature raises `IncompatibleBlockError` (the file is
intact, just not ours). This module does no I/O.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from cfr_atlas.errors import CorruptBlockError, IncompatibleBlockError
from cfr_atlas.kv.signature import CacheSignature, KvBlock

MAGIC, FILE_VERSION = b"CFRKVBLK", 2  # 2: signature v2 (package version, kernel build)
_HEAD = struct.Struct("<8sII32sIIQ")  # 64 bytes
SUM_BYTES = 32
MAX_SIGNATURE_BYTES = 1 << 16


def encode_block(block: KvBlock) -> bytes:
    """The complete file bytes of `block` (header, body, checksum)."""
    sig = block.signature.to_bytes()
    le = block.k.dtype.newbyteorder("<")
    k, v = block.k.astype(le, copy=False), block.v.astype(le, copy=False)
    head = _HEAD.pack(MAGIC, FILE_VERSION, len(sig), block.hash, len(block.token_ids), 0,
                      k.nbytes + v.nbytes)
    h = hashlib.sha256()
    parts = [head, sig, block.token_ids.astype("<i8").tobytes(), k.tobytes(), v.tobytes()]
    for part in parts:
        h.update(part)
    parts.append(h.digest())
    return b"".join(parts)


def encoded_size(signature: CacheSignature) -> int:
    """Bytes of the file of any block under `signature`."""
    return (_HEAD.size + len(signature.to_bytes()) + 8 * signature.block_tokens
            + signature.block_kv_bytes + SUM_BYTES)


def decode_block(data: bytes, expected_hash: bytes,
                 expected_signature: CacheSignature) -> KvBlock:
    """Parse and check file bytes; the block's arrays are read-only views of `data`."""
    data = memoryview(data).cast("B")
    sig_len, n_tokens, body = _check_head(data)
    if hashlib.sha256(data[:-SUM_BYTES]).digest() != bytes(data[-SUM_BYTES:]):
        raise CorruptBlockError("block file checksum mismatch")
    stored_hash = bytes(data[16:48])
    if stored_hash != expected_hash:
        raise CorruptBlockError(f"block file holds block {stored_hash.hex()[:16]}..., "
                                f"filed as {expected_hash.hex()[:16]}... (misfiled)")
    at = _HEAD.size
    sig = CacheSignature.from_bytes(data[at:at + sig_len])
    if n_tokens != sig.block_tokens or body != sig.block_kv_bytes:
        raise CorruptBlockError(f"block file declares {n_tokens} tokens and {body} body bytes, "
                                f"its signature implies {sig.block_tokens} and "
                                f"{sig.block_kv_bytes}")
    field = expected_signature.first_mismatch(sig)
    if field is not None:
        raise IncompatibleBlockError(field, f"stored block differs in {field}: "
                                            f"{getattr(sig, field)!r} (wanted "
                                            f"{getattr(expected_signature, field)!r})")
    at += sig_len
    ids = np.frombuffer(data, dtype="<i8", count=n_tokens, offset=at).astype(np.int64, copy=False)
    at += 8 * n_tokens
    le = sig.dtype.array_dtype.newbyteorder("<")
    n = body // 2 // le.itemsize
    k = np.frombuffer(data, dtype=le, count=n, offset=at).reshape(sig.block_shape)
    v = np.frombuffer(data, dtype=le, count=n, offset=at + body // 2).reshape(sig.block_shape)
    native = sig.dtype.array_dtype
    return KvBlock(stored_hash, ids, sig, k.astype(native, copy=False),
                   v.astype(native, copy=False))


def _check_head(data: memoryview) -> tuple[int, int, int]:
    """Magic, version and declared sizes against len(data); returns (S, N, body)."""
    size = len(data)
    if size < _HEAD.size + SUM_BYTES:
        raise CorruptBlockError(f"block file of {size} bytes is shorter than a header "
                                f"({_HEAD.size + SUM_BYTES})")
    magic, version, sig_len, _, n_tokens, reserved, body = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(f"not a K/V block file (magic {bytes(magic)!r})")
    if version != FILE_VERSION:
        raise IncompatibleBlockError("file_version", f"block file format version {version} "
                                                     f"(this build reads {FILE_VERSION})")
    declared = _HEAD.size + sig_len + 8 * n_tokens + body + SUM_BYTES  # Python ints: no overflow
    if reserved != 0 or sig_len > MAX_SIGNATURE_BYTES or body % 2 or declared != size:
        raise CorruptBlockError(f"block file declares {declared} bytes (signature {sig_len}, "
                                f"{n_tokens} tokens, body {body}, reserved {reserved}), "
                                f"it has {size}")
    return sig_len, n_tokens, body
