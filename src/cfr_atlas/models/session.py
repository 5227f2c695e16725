"""`Session`: the K/V state of one sequence — an Atlas, a regenerator, a policy, a position.

Unbounded (no `kv_budget`): every row the model computes stays resident in the hot cache; that
is the full-K/V baseline. Budgeted: `kv_budget` bounds the bytes really allocated for the
sequence's K/V (`fixed_kv_bytes`: scratch, staging rows, page-file read buffers, recompute's
kept inputs for `context_limit` tokens; then prefix blocks held; the hot cache's slot pool
gets the rest and is allocated once). The rest of the K/V comes back from the regenerator
("spill": the sequence's page file, written as rows are computed). Both run the same fold in
the same page order, so logits are bitwise equal. The one exception is opt-in and labelled:
regenerator "turboquant" keeps cold rows through a lossy codec (kv/turboquant.py), and its
telemetry says `approximate: True`. `allocations()` measures what is held, by
category, from the arrays themselves. A budget is bytes ("16MiB") or a share of the full K/V
at `context_limit` ("10%"), made bytes in one place, `resolve_kv_budget`. K/V rows are stored
as `storage_dtype`, float16 unless asked otherwise (`DEFAULT_STORAGE_DTYPE`; "float32" and
"bfloat16" are the others).
"""

from __future__ import annotations

import re

import numpy as np

from cfr_atlas.atlas import Atlas, AtlasConfig, KeepAll, KeepRecent, PageKey, widen
from cfr_atlas.atlas.pages import page_count
from cfr_atlas.atlas.storage import DEFAULT_STORAGE_DTYPE
from cfr_atlas.errors import ConfigError, RegeneratorError
from cfr_atlas.kv import SpillKv
from cfr_atlas.kv.turboquant import TurboQuantKv
from cfr_atlas.models.prefix import BlockBuilder, BlockSource, check_salt, held_bytes, salted_root
from cfr_atlas.models.recompute import RecomputeKv

UNBOUNDED = 1 << 40
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10,
          "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "K": 1 << 10, "M": 1 << 20,
          "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value, field: str = "kv_budget") -> int:
    """'16MiB', '4 GB', 1048576 -> bytes. Bad or negative sizes raise ConfigError(field)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(field, f"cannot read {value!r} as a size; use e.g. 512KiB, "
                                     "16MiB, 1GiB")
        number = m.group(1)
        if len(number) > 24:  # no size has that many digits; float() would reach inf
            raise ConfigError(field, f"{len(number)}-digit size is outside [0, 2**40]")
        n = int(float(number) * _UNITS[m.group(2).upper()])
    if n < 0 or n > UNBOUNDED:
        raise ConfigError(field, f"{n} bytes is outside [0, 2**40]")
    return n


def full_kv_bytes(config, context_limit: int, storage_dtype: str = DEFAULT_STORAGE_DTYPE) -> int:
    """K + V bytes of `context_limit` tokens in the storage dtype, every layer and head: what a
    percentage budget ("10%") is a share of."""
    probe = AtlasConfig(page_tokens=1, head_dim=config.head_dim, storage_dtype=storage_dtype)
    return config.kv_bytes(context_limit, probe.dtype.itemsize)


def parse_share(value, field: str = "kv_budget") -> float | None:
    """'10%' -> 10.0 (percent); None if `value` is not a percentage; outside (0%, 100%] or
    unreadable: ConfigError(field)."""
    if not isinstance(value, str) or not value.strip().endswith("%"):
        return None
    m = re.fullmatch(r"\s*([0-9]{1,3}(?:\.[0-9]{1,6})?)\s*%\s*", value)
    percent = float(m.group(1)) if m else -1.0
    if not 0.0 < percent <= 100.0:
        raise ConfigError(field, f"cannot read {value!r} as a share of the full K/V at the "
                                 "context limit; use a percentage in (0%, 100%], e.g. 10%")
    return percent


def check_kv_budget(value, field: str = "kv_budget") -> int | str:
    """A budget checked before the model is known: bytes, or a valid percentage kept as text
    (resolved later, against a context limit, by `resolve_kv_budget`)."""
    return value.strip() if parse_share(value, field) is not None else parse_bytes(value, field)


def resolve_kv_budget(value, full_bytes: int, field: str = "kv_budget") -> int:
    """A K/V budget in bytes: a size (see `parse_bytes`) or a percentage of `full_bytes`, the
    full K/V at the context limit (`full_kv_bytes`; "10%" -> full_bytes // 10, rounded down).
    The one place a percentage becomes bytes."""
    percent = parse_share(value, field)
    return parse_bytes(value, field) if percent is None else int(full_bytes * percent) // 100


def fixed_kv_bytes(config, *, regenerator: str = "spill", page_tokens: int = 256,
                   storage_dtype: str = DEFAULT_STORAGE_DTYPE, context_limit: int | None = None
                   ) -> dict[str, int]:
    """Bytes a budgeted sequence allocates before any page stays hot, by category.

    scratch: one page slot (K + V, storage dtype); staging: the float32 rows regenerators
    write (2 x page_tokens x head_dim x 4); recompute_inputs (recompute): n_layers x dim x 4
    bytes for each of `context_limit` tokens. Spill allocates nothing more: its pages are read
    in place from the page file's mapping (the OS page cache, file-backed memory).
    """
    probe = AtlasConfig(page_tokens=page_tokens, head_dim=config.head_dim,
                        storage_dtype=storage_dtype, value_dim=config.value_dim)
    limit = config.context_length if context_limit is None else context_limit
    out = {"scratch": probe.scratch_pages * probe.page_bytes,
           "staging": probe.scratch_bytes - probe.scratch_pages * probe.page_bytes}
    if regenerator == "recompute":
        out["recompute_inputs"] = limit * config.n_layers * config.dim * 4
    elif regenerator == "turboquant":  # lossy, opt-in: the encoded rows of the whole limit
        out["codec_rows"] = TurboQuantKv.bytes_for(config.n_layers, config.n_kv_heads,
                                                   config.head_dim, probe.stored_value_dim,
                                                   limit)
    elif regenerator != "spill":
        raise ConfigError("regenerator", f"unknown regenerator {regenerator!r} "
                                         "(choose: spill, recompute, or the lossy turboquant)")
    return out


class _NoRegenerator:
    """Unbounded sessions keep every row resident; a regeneration request is a bug.

    Also the shape of every session regenerator (SpillKv, RecomputeKv, BlockSource): the Atlas's
    `regenerate_page` (and optionally `map_pages`), plus `record` / `record_block` of fresh or
    mapped rows (`records_rows`: False when `record` keeps nothing; True if absent),
    `allocations()` and `table_bytes()` of what it holds, `bytes_read` from a file
    outside the fold's mapping, `keeps_mapped_blocks`, and `close()`.
    """

    keeps_mapped_blocks = False  # mapped rows go to the (unbounded) hot cache
    records_rows = False  # `record` keeps nothing (Session.records_rows)
    bytes_read = 0

    def record(self, layer, pos0, x, k, v) -> None:
        """Nothing to keep: every row stays in the hot cache."""

    def record_block(self, layer, pos0, k_st, v_st) -> None:
        """Nothing to keep: every row stays in the hot cache."""

    def allocations(self) -> dict[str, int]:
        return {}

    def table_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing held outside the hot cache."""

    def regenerate_page(self, key: PageKey, tokens, k_out, v_out):
        raise RegeneratorError(key, "unbounded session has no regenerator (page not resident)")


class Session:
    """K/V state of one sequence for a `LlamaModel` (see module docstring)."""

    def __init__(self, model, *, kv_budget=None, regenerator: str = "spill", policy=None,
                 storage_dtype: str = DEFAULT_STORAGE_DTYPE, page_tokens: int = 256, cache_dir=None,
                 context_limit: int | None = None, prefix=None,
                 cache_salt: str = ""):
        c = model.config
        self.model = model
        check_salt(cache_salt)  # keys the prefix blocks: other salts never share one
        self.context_limit = c.context_length if context_limit is None else context_limit
        # value_dim: None, or V is a view of K's first columns (MLA's latent, one shared head)
        self._geometry = dict(page_tokens=page_tokens, head_dim=c.head_dim,
                              storage_dtype=storage_dtype, value_dim=c.value_dim)
        if prefix is not None and c.value_dim is not None:
            raise ConfigError("prefix_cache", f"{c.arch} keeps a latent K/V stream; the prefix "
                                              "cache does not hold one yet")
        self.budget = None if kv_budget is None else resolve_kv_budget(
            kv_budget, full_kv_bytes(c, self.context_limit, storage_dtype))
        self.fixed = {} if self.budget is None else fixed_kv_bytes(
            c, regenerator=regenerator, page_tokens=page_tokens, storage_dtype=storage_dtype,
            context_limit=self.context_limit)
        self.reserved_bytes = sum(self.fixed.values())
        if self.budget is not None and self.budget < self.reserved_bytes:
            parts = ", ".join(f"{k} {v:,}" for k, v in self.fixed.items())
            raise ConfigError("kv_budget", f"{self.budget:,} bytes is below the "
                                           f"{self.reserved_bytes:,} bytes this sequence "
                                           f"allocates before any page stays hot ({parts}; "
                                           f"page_tokens {page_tokens}, context_limit "
                                           f"{self.context_limit}); the smallest accepted "
                                           f"budget is {self.reserved_bytes:,} bytes")
        self.atlas = self._new_atlas(0)
        # Unbounded: everything stays (the full-K/V baseline), whatever policy was given.
        # Budgeted default: the newest pages stay hot, the oldest are regenerated first.
        if self.budget is None:
            self.policy = KeepAll()
        else:
            self.policy = policy if policy is not None else KeepRecent(recent_tokens=UNBOUNDED)
        if self.budget is None:
            self.backend = _NoRegenerator()
        elif regenerator == "spill":
            self.backend = SpillKv(cache_dir, page_tokens, c.head_dim,
                                   self.atlas.config.dtype, model.identity,
                                   n_layers=c.n_layers, n_kv_heads=c.n_kv_heads,
                                   context_tokens=self.context_limit,
                                   value_dim=self.atlas.config.stored_value_dim)
        elif regenerator == "turboquant":  # LOSSY (kv/turboquant.py): outputs are approximate
            self.backend = TurboQuantKv(self.atlas.config.dtype, n_layers=c.n_layers,
                                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                        value_dim=self.atlas.config.stored_value_dim,
                                        capacity=self.context_limit)
        else:
            self.backend = RecomputeKv(model, capacity_tokens=self.context_limit)
        # True only when a lossy regenerator serves cold pages: every output is then labelled
        self.approximate = bool(getattr(self.backend, "approximate", False))
        self.n_tokens = 0
        self.token_ids: list[int] = []
        self.cached_tokens = 0
        # sliding-window layers: {layer: window}; their pages before the window are dropped
        self._windows = {i: w for i in range(c.n_layers) if (w := c.window(i)) is not None}
        # prefix reuse: a PrefixCache for this page size and dtype, when the model has one
        self.prefix = None if prefix is None else prefix.cache(page_tokens, storage_dtype)
        self._builder = None if self.prefix is None else \
            BlockBuilder(self.prefix, salted_root(self.prefix, cache_salt))
        self._peak_allocated = self.allocated_bytes()

    def _new_atlas(self, held_elsewhere: int) -> Atlas:
        """An Atlas whose slot pool gets what the budget leaves after the fixed bytes and
        `held_elsewhere` (prefix blocks); never more than the context limit can fill.
        Unbounded: the pool grows (no budget to preallocate) up to what the context can fill."""
        c = self.model.config
        probe = AtlasConfig(**self._geometry)
        pages = c.n_layers * c.n_kv_heads * page_count(self.context_limit, probe.page_tokens)
        if self.budget is None:
            return Atlas(AtlasConfig(**self._geometry, admit_regenerated_pages=True,
                                     hot_cache_bytes=min(UNBOUNDED, pages * probe.page_bytes)))
        hot = min(self.budget - self.reserved_bytes - held_elsewhere, pages * probe.page_bytes)
        return Atlas(AtlasConfig(**self._geometry, hot_cache_bytes=max(0, hot),
                                 admit_regenerated_pages=True, preallocate_hot_cache=True))

    def map_prefix(self, ids: np.ndarray) -> int:
        """At the start of a sequence: reuse the longest cached run of whole blocks of `ids`
        (leaving at least one token to compute); returns how many tokens were mapped.

        Spill and unbounded sessions copy the blocks' rows into the page file / hot cache and
        hold no block; recompute has no layer inputs for them, so it keeps the blocks (counted
        in its budget: it maps only as many as the budget can hold)."""
        if self.prefix is None or self.n_tokens or len(ids) < 2:
            return 0
        B = self.prefix.signature.block_tokens
        usable = (len(ids) - 1) // B * B
        blocks = self.prefix.lookup(self._builder.root, ids[:usable]) if usable else []
        if blocks and self.backend.keeps_mapped_blocks:
            blocks = blocks[:(self.budget - self.reserved_bytes) // held_bytes(blocks[:1])]
            if blocks:
                self.atlas = None  # the empty pool goes before the smaller one is made
                self.atlas = self._new_atlas(held_bytes(blocks))
                self.backend = BlockSource(blocks, self.backend)
        if not blocks:
            return 0
        dtype = self.atlas.config.dtype
        for i, block in enumerate(blocks):
            for layer in range(self.model.config.n_layers):
                self.backend.record_block(layer, i * B, block.k[layer], block.v[layer])
                k = widen(block.k[layer], dtype).transpose(1, 0, 2)
                v = widen(block.v[layer], dtype).transpose(1, 0, 2)
                self.atlas.write_rows(layer, i * B, np.ascontiguousarray(k),
                                      np.ascontiguousarray(v), self.policy)
        self._builder.chain = [b.hash for b in blocks]
        n = len(blocks) * B
        self.n_tokens = self.cached_tokens = n
        self.token_ids = [int(t) for t in ids[:n]]
        self._sample_peak()
        return n

    def advance(self, ids: np.ndarray) -> None:
        """After a chunk went through every layer: count it, and cache blocks now whole."""
        self.n_tokens += len(ids)
        self.token_ids.extend(int(t) for t in ids)
        if self._builder is not None:  # first: a block reads every layer's rows, window or not
            self._builder.complete(self.token_ids, self.n_tokens, self._page_rows)
        for layer, window in self._windows.items():  # the next query is at n_tokens
            self.atlas.forget_before(layer, max(0, self.n_tokens - window + 1))
        self._sample_peak()

    def _page_rows(self, layer: int, head: int, start: int, n: int):
        return self.atlas.page_rows(self.backend, PageKey(layer, head, start), n)

    def store_attend(self, layer: int, pos0: int, x: np.ndarray, k: np.ndarray, v: np.ndarray,
                     q: np.ndarray, **score) -> np.ndarray:
        """Rows k, v (T, n_kv, hd) f32 of tokens pos0.. stored, then q (T, n_kv, group, hd)
        attended over the context they end -> (T, n_kv, group, hd). The rows are checked and
        rounded once; the regenerator's copy comes first (so a full disk fails before the hot
        cache changes), then `Atlas.write_attend` writes the hot cache as the policy allows
        and attends (a decode step whose pages are all hot is one compiled walk). `score`: the
        Atlas's scale / softcap / window options (a window reads only its pages)."""
        k_st, v_st = self.atlas.stored_rows(pos0, k, v)
        self.backend.record(layer, pos0, x, k_st, v_st)
        return self.atlas.write_attend(self.backend, layer, pos0, k_st, v_st, q, self.policy,
                                       **score)

    def decode_attend(self, layer: int, pos0: int, x: np.ndarray, k_st: np.ndarray,
                      v_st: np.ndarray, q: np.ndarray, out: np.ndarray, recorded: bool = False,
                      **score) -> np.ndarray:
        """`store_attend` for the decode step (models/decode.py), whose kernel has checked and
        rounded the rows as `Atlas.stored_rows` does (k_st, v_st) and checked q (finite,
        float32, C-contiguous); score: scale and window at most. The regenerator's copy
        first (unless `recorded`: the caller made it, `record_rows`), then
        `Atlas.decode_attend` (the compiled walk, into out) or, when that does not apply,
        `Atlas.write_attend`: the same calls store_attend makes after its checks."""
        if not recorded:
            self.backend.record(layer, pos0, x, k_st, v_st)
        attn = self.atlas.decode_attend(self.backend, layer, pos0, k_st, v_st, q, out, **score)
        if attn is None:
            attn = self.atlas.write_attend(self.backend, layer, pos0, k_st, v_st, q, self.policy,
                                           **score)
        return attn

    def record_rows(self, layer: int, pos0: int, x: np.ndarray, k_st: np.ndarray,
                    v_st: np.ndarray) -> None:
        """The regenerator's copy of a decode token's rows, for a caller that attends for this
        session itself (a batched walk, atlas/batch_walk.py), as `decode_attend` makes it."""
        self.backend.record(layer, pos0, x, k_st, v_st)

    def records_rows(self) -> bool:
        """Whether the regenerator keeps a copy of a decode token's rows (`record_rows` does
        something): False for one that keeps none (unbounded, every row resident)."""
        return getattr(self.backend, "records_rows", True)

    def batch_walk_atlas(self):
        """This session's Atlas when its decode walks may join a batched call (its regenerator
        maps no pages: those walks read the mapping, per session), else None."""
        return self.atlas if getattr(self.backend, "map_pages", None) is None else None

    # --- memory ------------------------------------------------------------------------------
    def allocations(self) -> dict[str, int]:
        """Bytes held now for this sequence's K/V, by category, from the arrays' nbytes."""
        out = {**self.atlas.allocations(), "recompute_inputs": 0, "prefix_blocks": 0}
        out.update(self.backend.allocations())  # the regenerator reports its own arrays
        return out

    def allocated_bytes(self) -> int:
        return sum(self.allocations().values())

    def _sample_peak(self) -> None:
        self._peak_allocated = max(self._peak_allocated, self.allocated_bytes())

    def telemetry_summary(self) -> dict:
        t = self.atlas.telemetry()
        c = self.model.config
        self._sample_peak()
        alloc = self.allocations()
        return {
            "budget_bytes": self.budget,
            "peak_resident_kv_bytes": t.peak_resident_bytes + self.reserved_bytes,
            "allocated_kv_bytes": sum(alloc.values()),
            "peak_allocated_kv_bytes": self._peak_allocated,
            "allocated_kv_by_category": alloc,
            "kv_table_bytes": t.table_bytes + self.backend.table_bytes(),
            "page_file_bytes_read": t.total.bytes_mapped + self.backend.bytes_read,
            "full_kv_bytes": c.kv_bytes(self.n_tokens, self.atlas.config.dtype.itemsize),
            "pages_regenerated": t.total.regenerations,
            "prompt_cached_tokens": self.cached_tokens,
            "approximate": self.approximate,
            "hot_hit_rate": t.total.hit_rate,
            "regen_seconds": t.total.regen_seconds,
            "fold_seconds": t.total.fold_seconds,
        }

    def close(self) -> None:
        """Release the sequence: hot pages, page file, kept inputs, held blocks."""
        self.atlas.reset()
        self.backend.close()
