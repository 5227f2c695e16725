"""`AtlasConfig`: the runtime's frozen configuration, its checks and its versioned JSON form.

Every size is checked with exact integer arithmetic when the config is built: zero, negative,
non-integer, boolean or absurd values (a page or budget over 2**40 bytes) raise `ConfigError`
naming the field. JSON is parsed with duplicate keys rejected during parsing (`object_pairs_hook`),
then every field is type-checked; unknown fields and other schema versions are refused.
This module holds no cache or attention state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field

from cfr_atlas.atlas.storage import StorageDtype
from cfr_atlas.errors import ConfigError

SCHEMA_VERSION = 1
MAX_BYTES = 1 << 40  # a hard ceiling on any single size: no laptop holds a 1 TiB K/V page
MAX_HEAD_DIM = 1 << 12
MAX_PAGE_TOKENS = 1 << 20


def _int_field(name: str, value, *, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum or value > maximum:
        raise ConfigError(name, f"must be in [{minimum}, {maximum}], got {value}")
    return value


def _float_field(name: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(name, f"must be a finite{' positive' if positive else ''} number, "
                                f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class AtlasConfig:
    """Page geometry, hot-cache budget and scratch sizing for one `Atlas`.

    page_tokens: tokens per page; head_dim: K row width (and V's, unless value_dim is set);
    value_dim: None, V rows of head_dim stored beside K; or v in [1, head_dim]: V is the first v
    columns of each stored K row, a view of K's bytes, no V stored (MLA's shared latent: K =
    [latent; rope key], V = latent); hot_cache_bytes: ceiling on resident K + V bytes (0 = nothing
    stays hot); layer_budgets: optional {layer: bytes} ceilings inside the global one;
    max_scratch_tokens: scratch rows for regenerated pages (a multiple of pages, at least one page);
    split_pages: pages per fold partition (a fixed split, merged in order, so the result never
    depends on thread count or budget); preallocate_hot_cache: allocate the hot cache's whole slot
    pool (hot_cache_bytes // page_bytes slots) at its first admission, instead of growing it (a
    budgeted sequence: no reallocation, no copy, never above budget).
    """

    page_tokens: int
    head_dim: int
    hot_cache_bytes: int = 0
    scale: float | None = None
    admit_regenerated_pages: bool = False
    max_scratch_tokens: int | None = None
    wipe_scratch_after_use: bool = True
    storage_dtype: str = "float32"
    layer_budgets: dict[int, int] | None = field(default=None, hash=False)
    split_pages: int = 4
    preallocate_hot_cache: bool = False
    value_dim: int | None = None

    def __post_init__(self):
        _int_field("page_tokens", self.page_tokens, minimum=1, maximum=MAX_PAGE_TOKENS)
        _int_field("head_dim", self.head_dim, minimum=1, maximum=MAX_HEAD_DIM)
        if self.value_dim is not None:
            _int_field("value_dim", self.value_dim, minimum=1, maximum=self.head_dim)
        _int_field("hot_cache_bytes", self.hot_cache_bytes, minimum=0, maximum=MAX_BYTES)
        _int_field("split_pages", self.split_pages, minimum=1, maximum=1 << 20)
        if self.scale is not None:
            _float_field("scale", self.scale, positive=True)
        for name in ("admit_regenerated_pages", "wipe_scratch_after_use", "preallocate_hot_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        try:
            StorageDtype(self.storage_dtype)
        except ValueError:
            raise ConfigError("storage_dtype", f"must be one of float32, float16, bfloat16, "
                                               f"got {self.storage_dtype!r}") from None
        if self.page_bytes > MAX_BYTES:
            raise ConfigError("page_tokens", f"a page of {self.page_tokens} x {self.head_dim} "
                                             f"takes {self.page_bytes} bytes (> 2**40)")
        scratch = self.scratch_tokens
        _int_field("max_scratch_tokens", scratch, minimum=self.page_tokens,
                   maximum=MAX_BYTES // max(1, self.page_bytes // self.page_tokens))
        if scratch % self.page_tokens:
            raise ConfigError("max_scratch_tokens", f"{scratch} is not a multiple of "
                                                    f"page_tokens {self.page_tokens}")
        for layer, budget in (self.layer_budgets or {}).items():
            _int_field("layer_budgets (layer)", layer, minimum=0, maximum=1 << 20)
            _int_field(f"layer_budgets[{layer}]", budget, minimum=0, maximum=MAX_BYTES)

    # --- derived sizes -------------------------------------------------------------------
    @functools.cached_property  # the decode path reads it per layer
    def dtype(self) -> StorageDtype:
        return StorageDtype(self.storage_dtype)

    @functools.cached_property
    def stored_value_dim(self) -> int:
        """Width of the stored V rows: head_dim, or 0 when V is a view of K (value_dim set)."""
        return self.head_dim if self.value_dim is None else 0

    @functools.cached_property
    def out_dim(self) -> int:
        """Width of an attention output row (the V width the fold reads)."""
        return self.head_dim if self.value_dim is None else self.value_dim

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes of one token's stored K + V rows for one head."""
        return (self.head_dim + self.stored_value_dim) * self.dtype.itemsize

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of one full page (K + V)."""
        return self.page_tokens * self.row_bytes

    @property
    def scratch_tokens(self) -> int:
        return self.page_tokens if self.max_scratch_tokens is None else self.max_scratch_tokens

    @property
    def scratch_pages(self) -> int:
        return self.scratch_tokens // self.page_tokens

    @property
    def scratch_bytes(self) -> int:
        """Scratch slots plus the float32 staging rows regenerators fill (one page of K and V)."""
        staging = self.page_tokens * (self.head_dim + self.stored_value_dim) * 4
        return self.scratch_pages * self.page_bytes + staging

    def query_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    # --- JSON ----------------------------------------------------------------------------
    def to_json(self) -> str:
        body = {"schema": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "layer_budgets" and value is not None:
                value = {str(k): v for k, v in sorted(value.items())}
            body[f.name] = value
        return json.dumps(body, indent=2)

    @classmethod
    def from_json(cls, text: str) -> AtlasConfig:
        try:
            body = json.loads(text, object_pairs_hook=_reject_duplicates)
        except json.JSONDecodeError as e:
            raise ConfigError("json", f"not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ConfigError("json", f"top level must be an object, got {type(body).__name__}")
        schema = body.pop("schema", None)
        if schema != SCHEMA_VERSION or isinstance(schema, bool):
            raise ConfigError("schema", f"unsupported schema version {schema!r} "
                                        f"(this build reads {SCHEMA_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown field (known: {', '.join(sorted(known))})")
        for required in ("page_tokens", "head_dim"):
            if required not in body:
                raise ConfigError(required, "required field is missing")
        budgets = body.get("layer_budgets")
        if budgets is not None:
            if not isinstance(budgets, dict):
                raise ConfigError("layer_budgets", "must be an object {layer: bytes}")
            body["layer_budgets"] = {_layer_key(k): v for k, v in budgets.items()}
        return cls(**body)


def _reject_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(key, "duplicate key in JSON")
        seen[key] = value
    return seen


def _layer_key(text: str) -> int:
    if not text.isdigit():
        raise ConfigError("layer_budgets",
                          f"layer keys must be non-negative integers, got {text!r}")
    return int(text)
