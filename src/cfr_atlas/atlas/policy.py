"""Residency policies: which pages stay hot and which leave first.

A policy is a strategy object with two methods:

- `admits(key, page_tokens, context_tokens) -> bool`: should this page be resident at all?
- `keep_priority(key, page_tokens, context_tokens, last_use) -> tuple`: higher stays longer;
  the cache evicts the lowest first, and never evicts a page for one of lower priority.
  A policy whose priority ignores `last_use` says so with `ranks_by_recency = False`, so the
  cache may keep its ranking across calls.

Policies decide cost and residency only. The runtime folds every causal page whatever the
policy says, so no policy can change a result. Nothing here touches arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

from cfr_atlas.atlas.pages import PageKey
from cfr_atlas.errors import ConfigError


def _check_tokens(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, f"must be a non-negative integer, got {value!r}")


def _in_recent(key: PageKey, page_tokens: int, context_tokens: int, recent: int) -> bool:
    return key.start_token + page_tokens > context_tokens - recent


@dataclass(frozen=True)
class NeverAdmit:
    """Nothing stays hot: every page is regenerated on every call."""

    ranks_by_recency = False

    def admits(self, key: PageKey, page_tokens: int, context_tokens: int) -> bool:
        return False

    def keep_priority(self, key, page_tokens, context_tokens, last_use) -> tuple:
        return (0, last_use)


@dataclass(frozen=True)
class KeepAll:
    """Everything that fits stays hot; when full, the least recently used page leaves."""

    def admits(self, key: PageKey, page_tokens: int, context_tokens: int) -> bool:
        return True

    def keep_priority(self, key, page_tokens, context_tokens, last_use) -> tuple:
        return (last_use, key.start_token)


@dataclass(frozen=True)
class LRU(KeepAll):
    """Least recently used leaves first (the same order as KeepAll, named for what it does)."""


@dataclass(frozen=True)
class KeepRecent:
    """Pages overlapping the last `recent_tokens` tokens stay hot; older pages leave first."""

    recent_tokens: int
    ranks_by_recency = False

    def __post_init__(self):
        _check_tokens("recent_tokens", self.recent_tokens)

    def admits(self, key: PageKey, page_tokens: int, context_tokens: int) -> bool:
        return _in_recent(key, page_tokens, context_tokens, self.recent_tokens)

    def keep_priority(self, key, page_tokens, context_tokens, last_use) -> tuple:
        # No recency tie-break: pages of one age never displace each other, so a fold that
        # scans more pages than fit keeps a stable resident set instead of churning.
        recent = _in_recent(key, page_tokens, context_tokens, self.recent_tokens)
        return (int(recent), key.start_token)


@dataclass(frozen=True)
class KeepSinksAndRecent:
    """The first `sink_tokens` tokens (attention sinks) and the last `recent_tokens` stay hot."""

    sink_tokens: int
    recent_tokens: int
    ranks_by_recency = False

    def __post_init__(self):
        _check_tokens("sink_tokens", self.sink_tokens)
        _check_tokens("recent_tokens", self.recent_tokens)

    def admits(self, key: PageKey, page_tokens: int, context_tokens: int) -> bool:
        return key.start_token < self.sink_tokens or _in_recent(
            key, page_tokens, context_tokens, self.recent_tokens)

    def keep_priority(self, key, page_tokens, context_tokens, last_use) -> tuple:
        sink = key.start_token < self.sink_tokens
        recent = _in_recent(key, page_tokens, context_tokens, self.recent_tokens)
        return (int(sink) * 2 + int(recent), key.start_token)
