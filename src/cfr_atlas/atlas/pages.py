"""Page identity and page arithmetic for the virtual K/V address space.

A page is `(layer, kv_head, start_token)`; it covers `[start, min(start + page_tokens, n))` of a
context of n tokens, so the last page may be partial and grows with the context. This module
holds only identity and index arithmetic, no storage.
"""

from __future__ import annotations

from typing import NamedTuple


class PageKey(NamedTuple):
    """Address of one page: frozen, hashable, ordered by (layer, kv_head, start_token)."""

    layer: int
    kv_head: int
    start_token: int


def page_count(context_tokens: int, page_tokens: int) -> int:
    """Number of pages covering `context_tokens` tokens (the last may be partial)."""
    return -(-context_tokens // page_tokens)


def page_len(start: int, context_tokens: int, page_tokens: int) -> int:
    """Tokens held by the page starting at `start` in a context of `context_tokens`."""
    return min(page_tokens, context_tokens - start)


def first_page(lowest_token: int, page_tokens: int) -> int:
    """Index of the page holding `lowest_token` (the first page a window can reach)."""
    return max(0, lowest_token) // page_tokens


def page_spans(start: int, end: int, page_tokens: int):
    """Pieces of tokens [start, end) cut at page boundaries: (page_start, lo, hi) with
    page_start <= lo < hi <= page_start + page_tokens, in order."""
    pos = start
    while pos < end:
        page_start = pos - pos % page_tokens
        hi = min(end, page_start + page_tokens)
        yield page_start, pos, hi
        pos = hi
