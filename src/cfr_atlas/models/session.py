"""`Session`: the K/V state of one sequence — an Atlas, a regenerator, a policy, a position.

Unbounded (no `kv_budget`): every row the model computes stays resident in the hot cache; that
is the full-K/V baseline. Budgeted: the hot cache holds at most `budget - scratch` bytes and
the rest comes back from the regenerator ("spill": the sequence's page file, written as rows
are computed). Both run the same fold in the same page order, so logits are bitwise equal.
"""

from __future__ import annotations

import re

import numpy as np

from cfr_atlas.atlas import Atlas, AtlasConfig, KeepAll, KeepRecent, PageKey, round_rows
from cfr_atlas.errors import ConfigError, RegeneratorError
from cfr_atlas.kv import SpillKv
from cfr_atlas.models.recompute import RecomputeKv

UNBOUNDED = 1 << 40
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10,
          "MIB": 1 << 20, "GIB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(value) -> int:
    """'16MiB', '4 GB', 1048576 -> bytes. Bad or negative sizes raise ConfigError."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError("kv_budget", f"cannot read {value!r} as a size; use e.g. 512KiB, "
                                           "16MiB, 1GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 0 or n > UNBOUNDED:
        raise ConfigError("kv_budget", f"{n} bytes is outside [0, 2**40]")
    return n


class _NoRegenerator:
    """Unbounded sessions keep every row resident; a regeneration request is a bug."""

    def regenerate_page(self, key: PageKey, tokens, k_out, v_out):
        raise RegeneratorError(key, "unbounded session has no regenerator (page not resident)")


class Session:
    """K/V state of one sequence for a `LlamaModel` (see module docstring)."""

    def __init__(self, model, *, kv_budget=None, regenerator: str = "spill", policy=None,
                 storage_dtype: str = "float32", page_tokens: int = 256, cache_dir=None,
                 context_limit: int | None = None, prefetch_pages: int = 2):
        c = model.config
        self.model = model
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
        self._heads = list(range(c.n_kv_heads))

    def store_kv(self, layer: int, pos0: int, x: np.ndarray, k: np.ndarray, v: np.ndarray):
        """Rows k, v (T, n_kv, hd) f32 of tokens pos0.. : the regenerator's copy first (so a full
        disk fails before the hot cache changes), then the hot cache as the policy allows."""
        if isinstance(self.backend, SpillKv):
            dtype = self.atlas.config.dtype
            k_st, v_st = round_rows(k, dtype), round_rows(v, dtype)
            for h in self._heads:
                self.backend.write(layer, h, pos0, k_st[:, h], v_st[:, h])
        elif isinstance(self.backend, RecomputeKv):
            self.backend.write(layer, pos0, x)
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
