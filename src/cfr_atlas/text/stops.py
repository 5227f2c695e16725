"""`StopText`: generated token ids -> text pieces, cut at the first stop string.

The one copy of the stop-text rule, applied by the generation driver (`generate.Generation`)
that `Model.stream`, the CLI and the server all consume: a piece is released once it cannot be
the start of a stop string, an end-of-generation token ends the text without flushing held-back
bytes, and hitting the token limit flushes them. It does not sample, schedule or know about HTTP.
"""

from __future__ import annotations

from cfr_atlas.text.stream import StreamDecoder
from cfr_atlas.text.tokenizer import Tokenizer


class StopText:
    """`push(token) -> (text, hit_stop)`; then `end()` after EOS or `flush()` after the limit.

    Invariant: the pieces joined are the detokenized tokens cut before the first occurrence of
    any stop string (the stop string itself is never sent).
    """

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()):
        self._decoder = StreamDecoder(tokenizer)
        self._stops = tuple(s for s in stops if s)
        self._keep = max((len(s) - 1 for s in self._stops), default=0)  # chars held back
        self._held = ""

    def push(self, token: int) -> tuple[str, bool]:
        """Text that is now safe to send, and whether a stop string was hit (text cut there)."""
        held = self._held + self._decoder.push(token)
        cut = min((held.find(s) for s in self._stops if s in held), default=-1)
        if cut >= 0:
            self._held = ""
            return held[:cut], True
        n = len(held) - self._keep
        if n > 0:
            self._held = held[n:]
            return held[:n], False
        self._held = held
        return "", False

    def end(self) -> str:
        """Held-back text after an end-of-generation token (partial UTF-8 bytes dropped)."""
        held, self._held = self._held, ""
        return held

    def flush(self) -> str:
        """Held-back text and bytes after the token limit (a partial character -> U+FFFD)."""
        return self.end() + self._decoder.flush()
