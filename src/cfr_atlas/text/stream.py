"""Incremental detokenization: token ids in, complete UTF-8 text out.

Holds `StreamDecoder`. A character can span several byte-level tokens (an emoji is often four
one-byte tokens), so bytes of an unfinished character are held back until it completes; bytes
that can never form a character come out as U+FFFD, exactly as `Tokenizer.decode` does, so the
joined stream equals `decode(ids)`. It does not hold stop-string matching or sampling.
"""

from __future__ import annotations

import codecs

from cfr_atlas.text.tokenizer import Tokenizer


class StreamDecoder:
    """`push(id)` returns the text completed by that token; `flush()` ends the stream.

    Invariant: `"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids, skip_special)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by `token_id`; "" while a character is still partial."""
        if self._skip_special and self._tokenizer.is_control(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_to_piece(token_id))

    def flush(self) -> str:
        """Held-back bytes (U+FFFD for an unfinished character); the decoder is then reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
