"""`Session`: the K/V state of one sequence — an Atlas, a regenerator, a policy, a position.

Unbounded (no `kv_budget`): every row the model computes stays resident in the hot cache; that
is the full-K/V baseline. Budgeted: the hot cache holds at most `budget - scratch` bytes and
the rest comes back from the regenerator ("spill": the sequence's page file, written as rows
are computed). Both run the same fold in the same page order, so logits are bitwise equal.
"""

from __future__ import annotations

import re

import numpy as np

from cfr_atlas.atlas import Atlas, AtlasConfig, KeepAll, KeepRecent, PageKey, round_rows, widen
from cfr_atlas.errors import ConfigError, RegeneratorError
from cfr_atlas.kv import SpillKv
from cfr_atlas.models.prefix import BlockBuilder, BlockSource, check_salt, salted_root
from cfr_atlas.models.recompute import RecomputeKv

UNBOUNDED = 1 << 40
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10,
          "MIB": 1 << 20, "GIB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(value, field: str = "kv_budget") -> int:
    """'16MiB', '4 GB', 1048576 -> bytes. Bad or negative sizes raise ConfigError(field)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(field, f"cannot read {value!r} as a size; use e.g. 512KiB, "
                                     "16MiB, 1GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 0 or n > UNBOUNDED:
        raise ConfigError(field, f"{n} bytes is outside [0, 2**40]")
    return n


class _NoRegenerator:
    """Unbounded sessions keep every row resident; a regeneration request is a bug."""

    def regenerate_page(self, key: PageKey, tokens, k_out, v_out):
        raise RegeneratorError(key, "unbounded session has no regenerator (page not resident)")


class Session:
    """K/V state of one sequence for a `LlamaModel` (see module docstring)."""

    def __init__(self, model, *, kv_budget=None, regenerator: str = "spill", policy=None,
                 storage_dtype: str = "float32", page_tokens: int = 256, cache_dir=None,
                 context_limit: int | None = None, prefetch_pages: int = 0, prefix=None,
                 cache_salt: str = ""):
        c = model.config
        self.model = model
        check_salt(cache_salt)  # keys the prefix blocks: other salts never share one
        self.context_limit = c.context_length if context_limit is None else context_limit
        probe = AtlasConfig(page_tokens=page_tokens, head_dim=c.head_dim,
                            storage_dtype=storage_dtype)
        if kv_budget is None:
            hot = UNBOUNDED
            self.budget = None
        else:
            self.budget = parse_bytes(kv_budget)
            # scratch (and the spill tier's read-ahead buffers) count against the budget
            ahead = prefetch_pages * probe.page_bytes if regenerator == "spill" else 0
            scratch = probe.scratch_bytes + ahead
            if self.budget < scratch:
                raise ConfigError("kv_budget", f"{self.budget} bytes is below the scratch "
                                               f"({scratch} bytes at page_tokens {page_tokens}, "
                                               f"{prefetch_pages} read-ahead pages)")
            hot = self.budget - scratch
        self.atlas = Atlas(AtlasConfig(page_tokens=page_tokens, head_dim=c.head_dim,
                                       hot_cache_bytes=hot, admit_regenerated_pages=True,
                                       storage_dtype=storage_dtype))
        # Unbounded: everything stays (the full-K/V baseline), whatever policy was given.
        # Budgeted default: the newest pages stay hot, the oldest are regenerated first.
        if self.budget is None:
            self.policy = KeepAll()
        else:
            self.policy = policy if policy is not None else KeepRecent(recent_tokens=UNBOUNDED)
        if self.budget is None:
            self.backend = _NoRegenerator()
        elif regenerator == "spill":
            self.backend = SpillKv(cache_dir, page_tokens, c.head_dim, probe.dtype,
                                   model.identity, prefetch_pages=prefetch_pages)
        elif regenerator == "recompute":
            self.backend = RecomputeKv(model)
        else:
            raise ConfigError("regenerator", f"unknown regenerator {regenerator!r} "
                                             "(choose: spill, recompute)")
        self.reserved_bytes = 0 if self.budget is None else self.budget - hot
        self.n_tokens = 0
        self.token_ids: list[int] = []
        self.cached_tokens = 0
        self._heads = list(range(c.n_kv_heads))
        # prefix reuse: a PrefixCache for this page size and dtype, when the model has one
        self.prefix = None if prefix is None else prefix.cache(page_tokens, storage_dtype)
        self._builder = None if self.prefix is None else \
            BlockBuilder(self.prefix, salted_root(self.prefix, cache_salt))

    def map_prefix(self, ids: np.ndarray) -> int:
        """At the start of a sequence: reuse the longest cached run of whole blocks of `ids`
        (leaving at least one token to compute); returns how many tokens were mapped."""
        if self.prefix is None or self.n_tokens or len(ids) < 2:
            return 0
        B = self.prefix.signature.block_tokens
        usable = (len(ids) - 1) // B * B
        blocks = self.prefix.lookup(self._builder.root, ids[:usable]) if usable else []
        if not blocks:
            return 0
        dtype = self.atlas.config.dtype
        for i, block in enumerate(blocks):
            for layer in range(self.model.config.n_layers):
                k = widen(block.k[layer], dtype).transpose(1, 0, 2)
                v = widen(block.v[layer], dtype).transpose(1, 0, 2)
                self.atlas.write_rows(layer, i * B, np.ascontiguousarray(k),
                                      np.ascontiguousarray(v), self.policy)
        self.backend = BlockSource(blocks, self.backend)
        self._builder.chain = [b.hash for b in blocks]
        n = len(blocks) * B
        self.n_tokens = self.cached_tokens = n
        self.token_ids = [int(t) for t in ids[:n]]
        return n

    def advance(self, ids: np.ndarray) -> None:
        """After a chunk went through every layer: count it, and cache blocks now whole."""
        self.n_tokens += len(ids)
        self.token_ids.extend(int(t) for t in ids)
        if self._builder is not None:
            self._builder.complete(self.token_ids, self.n_tokens)

    def store_kv(self, layer: int, pos0: int, x: np.ndarray, k: np.ndarray, v: np.ndarray):
        """Rows k, v (T, n_kv, hd) f32 of tokens pos0.. : the regenerator's copy first (so a full
        disk fails before the hot cache changes), then the hot cache as the policy allows."""
        backend = self.backend.rest if isinstance(self.backend, BlockSource) else self.backend
        if isinstance(backend, SpillKv) or self._builder is not None:
            dtype = self.atlas.config.dtype
            k_st, v_st = round_rows(k, dtype), round_rows(v, dtype)
            if self._builder is not None:
                self._builder.add_rows(layer, pos0, k_st, v_st)
            if isinstance(backend, SpillKv):
                for h in self._heads:
                    backend.write(layer, h, pos0, k_st[:, h], v_st[:, h])
        elif isinstance(backend, RecomputeKv):
            backend.write(layer, pos0, x)
        self.atlas.write_rows(layer, pos0, k, v, self.policy)

    def attend(self, layer: int, q: np.ndarray, context: int) -> np.ndarray:
        """q (T, n_kv, group, hd) -> (T, n_kv, group, hd) over the whole causal context."""
        return self.atlas.attend_heads(self.backend, layer, self._heads, q, context, self.policy)

    def telemetry_summary(self) -> dict:
        t = self.atlas.telemetry()
        c = self.model.config
        return {
            "budget_bytes": self.budget,
            "peak_resident_kv_bytes": t.peak_resident_bytes + self.reserved_bytes,
            "full_kv_bytes": self.n_tokens * c.kv_bytes_per_token(self.atlas.config.dtype.itemsize),
            "pages_regenerated": t.total.regenerations,
            "prompt_cached_tokens": self.cached_tokens,
            "hot_hit_rate": t.total.hit_rate,
            "regen_seconds": t.total.regen_seconds,
            "fold_seconds": t.total.fold_seconds,
        }

    def close(self) -> None:
        """Release the sequence: hot pages, page file, kept inputs."""
        self.atlas.reset()
        close = getattr(self.backend, "close", None)
        if close:
            close()
