"""Constrained decoding: a JSON schema (or "any JSON") -> the set of tokens allowed next.

Holds `TokenGrammar` (a vocabulary prepared once per tokenizer) and `Constraint` (one
sequence's grammar state: `allowed()` -> a (vocab,) bool mask, `advance(token)`). The
schema-to-grammar and token-mask step is llguidance's (Microsoft's Rust library, numpy
bindings, no torch): it reads each token's exact bytes (`Tokenizer.token_to_piece`, so the
byte-level BPE and the SentencePiece vocabularies are handled alike, byte-fallback tokens
included), and computes a mask lazily from an Earley parser over a token trie (~0.4 ms per
token on SmolLM2's 49,152 tokens; preparing the vocabulary ~0.2 s, once). Control tokens are
marked with llguidance's 0xFF prefix so no grammar can emit them; the end-of-generation ids are
allowed exactly when the grammar accepts. xgrammar (pulls torch) and outlines-core (regex
index built per schema, token strings re-derived heuristically) were the alternatives.

It does not sample, and does not touch logits: the caller applies the mask to the sampler's
input only (`Sampler.sample(..., allowed=)`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from cfr_atlas.errors import ConfigError
from cfr_atlas.text.tokenizer import Tokenizer

ANY_JSON = {"type": "object"}  # Ollama's format "json" / OpenAI's json_object: an object
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no runs of whitespace to loop on


class _Vocab:
    """The tokenizer as llguidance's TokenizerWrapper reads it."""

    def __init__(self, tokenizer: Tokenizer):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [(b"\xff" if tokenizer.is_control(i) else b"") + tokenizer.token_to_piece(i)
                       for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size)
                                  if tokenizer.is_control(i)]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_bos=False, add_eos=False)


class TokenGrammar:
    """A tokenizer's vocabulary prepared for llguidance; `constraint(schema)` per request."""

    def __init__(self, tokenizer: Tokenizer):
        import llguidance

        self._llg = llguidance
        self.vocab_size = tokenizer.vocab_size
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tokenizer)),
                                                 eos_token=sorted(tokenizer.eos_ids))

    def constraint(self, schema: Mapping | None, field: str = "format") -> Constraint:
        """A fresh grammar state for JSON matching `schema` (None: any JSON object). A schema
        llguidance cannot compile is a ConfigError naming `field`."""
        if not isinstance(schema, Mapping | None):
            raise ConfigError(field, f"must be a JSON schema object, got {type(schema).__name__}")
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(
                json.dumps(ANY_JSON if schema is None else schema), overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise ConfigError(field, f"is not a usable JSON schema: {str(exc)[:200]}") from None
        return self._matcher(grammar, field, "JSON schema")

    def constraint_lark(self, lark: str, field: str) -> Constraint:
        """A fresh grammar state for text matching the Lark grammar `lark` (llguidance's
        dialect, `%json {schema}` included)."""
        return self._matcher(self._llg.LLMatcher.grammar_from_lark(lark), field, "grammar")

    def _matcher(self, grammar: str, field: str, what: str) -> Constraint:
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConfigError(field, f"is not a usable {what}: {matcher.get_error()[:300]}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One sequence's grammar state. `allowed()` -> (vocab,) bool, then `advance(token)` with
    the token sampled from it."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """Tokens the grammar allows next (bit i of word i // 32, little-endian)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._check()
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].astype(bool)

    def advance(self, token: int) -> None:
        self._matcher.consume_token(int(token))
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConfigError("format", f"the grammar failed: {self._matcher.get_error()[:300]}")
