"""An opt-in LOSSY K/V codec, TurboQuant-style: rotate, quantize, store; reconstruct on read.

APPROXIMATE BY DESIGN. Nothing here runs unless a session asks for `regenerator="turboquant"`
(with a kv_budget); every output made with it is labelled approximate (the session's telemetry
says `approximate: True`, the CLI prints a warning). Exact K/V remains the default and the
brand; docs/ATTENTION.md lists its measured error.

Encoding one row x (D,) float32, in chunks of C channels (C the largest power of two <= 128
dividing D): flip signs by a fixed pseudo-random +-1 vector (seeded, the same for every row),
rotate each chunk by the orthonormal Walsh-Hadamard transform (ops.wht: spreads an outlier
channel over the whole chunk), then per chunk s = max |y| and codes q = round(y / s * L) in
[-L, L], L = 2^(bits - 1) - 1, kept as int8, s as float32. Decoding: y' = q s / L, the inverse
rotation (wht is its own inverse), the same sign flips. Error per element in the rotated space
<= s / (2L); the rotation is orthonormal, so a chunk's L2 error is at most sqrt(C) s / (2L).

`TurboQuantKv` is a session regenerator (the shape of models/session.py's `_NoRegenerator`):
it records every fresh row encoded (D + Dv bytes of codes per token and head plus 4 bytes per
chunk) and reconstructs a cold page's rows on demand. Hot pages stay exact.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas.pages import PageKey
from cfr_atlas.atlas.storage import widen
from cfr_atlas.errors import CapacityError, ConfigError, CorruptPageError
from cfr_atlas.ops import wht


def chunk_size(d: int) -> int:
    """The largest power of two <= 128 dividing d."""
    c = 1
    while c < 128 and d % (2 * c) == 0:
        c *= 2
    return c


def _signs(d: int, seed: int) -> np.ndarray:
    return np.where(np.random.default_rng(seed).random(d) < 0.5, -1, 1).astype(np.float32)


def encode(rows: np.ndarray, bits: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """rows (n, D) f32 -> (codes (n, D) int8, scales (n, D / C) f32)."""
    n, d = rows.shape
    c, top = chunk_size(d), np.float32(2 ** (bits - 1) - 1)
    y = wht((rows * _signs(d, seed)).reshape(n, d // c, c))
    s = np.abs(y).max(axis=2)
    safe = np.where(s > 0, s, np.float32(1))
    codes = np.clip(np.rint(y / safe[..., None] * top), -top, top).astype(np.int8)
    return codes.reshape(n, d), s.astype(np.float32)


def decode(codes: np.ndarray, scales: np.ndarray, bits: int, seed: int = 0) -> np.ndarray:
    """(codes (n, D) int8, scales (n, D / C)) -> rows (n, D) f32 (approximate)."""
    n, d = codes.shape
    c, top = chunk_size(d), np.float32(2 ** (bits - 1) - 1)
    y = codes.reshape(n, d // c, c).astype(np.float32) * (scales / top)[..., None]
    return wht(y).reshape(n, d) * _signs(d, seed)


class TurboQuantKv:
    """Encoded K and V rows of one sequence for `capacity` tokens, preallocated (counted in the
    budget as `codec_rows`); cold pages are reconstructed from them (lossy)."""

    keeps_mapped_blocks = False
    bytes_read = 0
    approximate = True

    def __init__(self, dtype, *, n_layers: int, n_kv_heads: int, head_dim: int,
                 value_dim: int, capacity: int, bits: int = 8, seed: int = 0):
        if not 2 <= bits <= 8:
            raise ConfigError("codec_bits", f"must be in [2, 8], got {bits}")
        self.dtype, self.bits, self.seed, self.capacity = dtype, bits, seed, capacity
        shape = (n_layers, n_kv_heads, capacity)
        self.k = np.zeros(shape + (head_dim,), dtype=np.int8)
        self.v = np.zeros(shape + (value_dim,), dtype=np.int8)
        self.ks = np.zeros(shape + (head_dim // chunk_size(head_dim),), dtype=np.float32)
        self.vs = np.zeros(shape + (max(value_dim, 1) // chunk_size(max(value_dim, 1)),),
                           dtype=np.float32)
        self.n_tokens = np.zeros(n_layers, dtype=np.int64)

    @staticmethod
    def bytes_for(n_layers, n_kv_heads, head_dim, value_dim, capacity) -> int:
        """What the preallocated arrays take (int8 codes and float32 chunk scales)."""
        per = head_dim + value_dim + 4 * (head_dim // chunk_size(head_dim)
                                          + max(value_dim, 1) // chunk_size(max(value_dim, 1)))
        return n_layers * n_kv_heads * capacity * per

    def record(self, layer: int, pos0: int, x, k_st: np.ndarray, v_st: np.ndarray) -> None:
        """Fresh rows (T, H, D) in storage dtype of tokens pos0..: encoded and kept."""
        n = k_st.shape[0]
        if pos0 + n > self.capacity:
            raise CapacityError(f"the codec keeps {self.capacity} tokens (the context limit); "
                                f"token {pos0 + n - 1} is past them")
        for h in range(k_st.shape[1]):
            k = widen(np.ascontiguousarray(k_st[:, h]), self.dtype)
            self.k[layer, h, pos0:pos0 + n], self.ks[layer, h, pos0:pos0 + n] = \
                encode(k, self.bits, self.seed)
            if v_st.shape[2]:
                v = widen(np.ascontiguousarray(v_st[:, h]), self.dtype)
                self.v[layer, h, pos0:pos0 + n], self.vs[layer, h, pos0:pos0 + n] = \
                    encode(v, self.bits, self.seed + 1)
        self.n_tokens[layer] = pos0 + n

    def record_block(self, layer, pos0, k_st, v_st) -> None:
        self.record(layer, pos0, None, k_st.transpose(1, 0, 2), v_st.transpose(1, 0, 2))

    def regenerate_page(self, key: PageKey, tokens: range, k_out, v_out) -> None:
        a, b = tokens.start, tokens.stop
        if b > self.n_tokens[key.layer]:
            raise CorruptPageError(f"{key}: the codec holds {self.n_tokens[key.layer]} tokens")
        L, h = key.layer, key.kv_head
        k_out[...] = decode(self.k[L, h, a:b], self.ks[L, h, a:b], self.bits, self.seed)
        if v_out.shape[1]:
            v_out[...] = decode(self.v[L, h, a:b], self.vs[L, h, a:b], self.bits, self.seed + 1)

    def allocations(self) -> dict[str, int]:
        return {"codec_rows": self.k.nbytes + self.v.nbytes + self.ks.nbytes + self.vs.nbytes}

    def table_bytes(self) -> int:
        return self.n_tokens.nbytes

    def close(self) -> None:
        self.k = self.v = self.ks = self.vs = np.zeros((0, 0, 0, 0), dtype=np.int8)
