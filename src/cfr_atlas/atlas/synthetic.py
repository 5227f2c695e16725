"""`SyntheticKv`: a deterministic reference regenerator for tests and benchmarks.

Row values are a pure function of (seed, layer, kv_head, token, dim): a counter-based hash
(SplitMix64 finaliser) mapped to [-1, 1), vectorized over a page. Regenerating any range gives
the same rows as `full()` slices, so it is the ground truth the runtime is compared against.
It is not a model: the rows carry no meaning.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas.pages import PageKey
from cfr_atlas.errors import PageError

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class SyntheticKv:
    """Deterministic K/V rows; any object with `regenerate_page` is a KvRegenerator."""

    def __init__(self, seed: int, n_layers: int, n_kv_heads: int, head_dim: int):
        self.seed, self.n_layers, self.n_kv_heads, self.head_dim = seed, n_layers, n_kv_heads, \
            head_dim
        self.calls = 0

    def rows(self, layer: int, kv_head: int, tokens: range, which: int) -> np.ndarray:
        """K (which=0) or V (which=1) rows of `tokens`: (len(tokens), head_dim) float32."""
        if not (0 <= layer < self.n_layers and 0 <= kv_head < self.n_kv_heads):
            raise PageError(f"layer {layer} / kv_head {kv_head} outside "
                            f"{self.n_layers} layers x {self.n_kv_heads} heads")
        with np.errstate(over="ignore"):
            tok = np.arange(tokens.start, tokens.stop, dtype=np.uint64)[:, None]
            dim = np.arange(self.head_dim, dtype=np.uint64)[None, :]
            base = _mix(np.uint64(self.seed) * np.uint64(0x9E3779B97F4A7C15)
                        + np.uint64((layer * 65536 + kv_head) * 2 + which))
            x = _mix(base ^ (tok * np.uint64(0x100000001B3) + dim * np.uint64(0x9E3779B1)))
        return ((x >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -23)) - np.float32(1)

    def regenerate_page(self, key: PageKey, tokens: range, k_out: np.ndarray,
                        v_out: np.ndarray) -> None:
        self.calls += 1
        k_out[...] = self.rows(key.layer, key.kv_head, tokens, 0)
        v_out[...] = self.rows(key.layer, key.kv_head, tokens, 1)

    def full(self, layer: int, kv_head: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole K and V (n, head_dim) float32 of a context of n tokens."""
        return self.rows(layer, kv_head, range(n), 0), self.rows(layer, kv_head, range(n), 1)
