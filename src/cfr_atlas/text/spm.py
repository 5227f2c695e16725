"""SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`) as llama.cpp tokenizes them.

llama.cpp's SPM tokenizer (llm_tokenizer_spm): the text is first cut at USER_DEFINED token
texts (always) and CONTROL token texts (only when parsing special tokens); each remaining text
fragment gets a leading space if `add_space_prefix` and it is the first fragment or follows a
token, spaces become U+2581 ("▁"), and then, starting from single characters, the adjacent pair
whose concatenation is the vocabulary entry with the highest score is merged, leftmost first on
ties, until no pair is in the vocabulary; characters left outside the vocabulary become their
UTF-8 bytes' `<0xXX>` tokens (byte fallback).

The merging runs on HF `tokenizers`: a BPE model whose merges are every split (left, right) of
every vocabulary entry into two entries, ranked by the entry's score, highest first (what HF's
SentencePiece converter does), with `byte_fallback`. With distinct scores this is the same
greedy order; HF breaks rank ties leftmost, as llama.cpp does. `SpmTokenizer` keeps the
`Tokenizer` interface (encode / decode / pieces / control ids), so chat.py and generation use it
unchanged. It does not implement Unigram (`t5`) or WordPiece vocabularies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from cfr_atlas.errors import ConfigError, ModelFormatError
from cfr_atlas.text import gguf_meta as meta
from cfr_atlas.text.tokenizer import Tokenizer, TokenType, _ids_of, _matcher, _not_unicode

SPACE = "\u2581"  # "▁": how SentencePiece writes a space inside pieces
KEY_SCORES, KEY_UNK, KEY_SPACE_PREFIX = meta.SPM_KEYS


def _byte_of(text: str) -> int | None:
    """`<0xAB>` -> 0xAB; None for any other text."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def spm_piece(text: str, kind: int) -> bytes:
    """Bytes a vocabulary entry adds to decoded text, as llama.cpp's token_to_piece."""
    if kind == TokenType.BYTE and (b := _byte_of(text)) is not None:
        return bytes([b])
    if kind in (TokenType.NORMAL, TokenType.UNDEFINED, TokenType.UNUSED):
        return text.replace(SPACE, " ").encode("utf-8")
    return text.encode("utf-8")  # CONTROL / USER_DEFINED / UNKNOWN: their literal text


def spm_merges(tokens: Sequence[str], scores: Sequence[float],
               types: Sequence[int] | None = None) -> list[tuple[str, str]]:
    """Every (left, right) with left, right and left+right in the vocabulary, ranked by the
    score of left+right, highest first (ties by id: stable sort). No merge makes a CONTROL
    token (`types`): pieces of user text never join into one, so a control token comes only
    from special-text matching. llama.cpp's merge loop has no such rule; the two differ only
    on text that spells a control token out of mergeable pieces."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, str, str]] = []
    for text, i in vocab.items():
        if types is not None and types[i] == TokenType.CONTROL:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                found.append((-float(scores[i]), i, left, right))
    found.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in found]


def _build_spm(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
               unk: str | None) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        bpe = models.BPE(vocab, spm_merges(tokens, scores, types), unk_token=unk,
                         byte_fallback=True,
                         fuse_unk=True)
    except Exception as exc:  # tokenizers raises plain Exception for bad vocab/merges
        raise ModelFormatError(f"cannot build the SentencePiece BPE from GGUF tokens: {exc}") \
            from exc
    return HFTokenizer(bpe)  # no normalizer, no pre-tokenizer: one fragment is one "word"


class SpmTokenizer(Tokenizer):
    """Text <-> token ids for one SentencePiece (BPE-scored) vocabulary, as llama.cpp.

    Invariants: `decode(encode(s)) == s` when `add_space_prefix` is off; user text never
    becomes a CONTROL token (USER_DEFINED texts, e.g. Gemma's runs of spaces, are always
    matched, as llama.cpp matches them).
    """

    def __init__(self, tokens: Sequence[str], scores: Sequence[float],
                 token_types: Sequence[int] | None = None, *, bos_id: int | None = None,
                 eos_id: int | None = None, unk_id: int | None = None,
                 extra_eog_ids: Iterable[int] = (), add_bos: bool | None = None,
                 add_eos: bool = False, add_space_prefix: bool = True):
        types = [int(t) for t in token_types] if token_types is not None and len(
            token_types) else [int(TokenType.NORMAL)] * len(tokens)
        if not len(types) == len(scores) == len(tokens):
            raise ModelFormatError(f"{len(tokens)} tokens, {len(scores)} scores, "
                                   f"{len(types)} token types: must be equal")
        self.vocab_size = len(tokens)
        self.pre = "spm"
        self.bos_id = self._check_id("bos_id", bos_id)
        self.eos_id = self._check_id("eos_id", eos_id)
        unk_id = self._check_id("unknown_token_id", unk_id)
        self.add_bos = True if add_bos is None else bool(add_bos)  # llama.cpp's SPM default
        self.add_eos = bool(add_eos)
        self.add_space_prefix = bool(add_space_prefix)
        self._tokens = list(tokens)
        self._control = frozenset(_ids_of(types, TokenType.CONTROL))
        user = _ids_of(types, TokenType.USER_DEFINED)
        self._pieces = [spm_piece(t, k) for t, k in zip(self._tokens, types, strict=True)]
        self.eos_ids = self._end_of_generation(extra_eog_ids)
        self._hf = _build_spm(self._tokens, scores, types,
                              None if unk_id is None else tokens[unk_id])
        vocab = {t: i for i, t in enumerate(self._tokens)}  # last id wins, as llama.cpp
        self.added_texts = frozenset(self._tokens[i] for i in [*self._control, *user])
        self._added_id = {t: vocab[t] for t in self.added_texts}
        self._added_re = _matcher(self.added_texts)
        self._user_re = _matcher(self._tokens[i] for i in user)

    @classmethod
    def from_fields(cls, f: dict) -> SpmTokenizer:
        """From decoded GGUF metadata (see `Tokenizer.from_gguf`, which dispatches here)."""
        for key in (meta.KEY_TOKENS, KEY_SCORES):
            if key not in f:
                raise ModelFormatError(f"GGUF metadata lacks {key}")
        return cls(f[meta.KEY_TOKENS], f[KEY_SCORES], f.get(meta.KEY_TOKEN_TYPE),
                   bos_id=f.get(meta.KEY_BOS), eos_id=f.get(meta.KEY_EOS), unk_id=f.get(KEY_UNK),
                   extra_eog_ids=[f[k] for k in meta.KEYS_EXTRA_EOG if k in f],
                   add_bos=f.get(meta.KEY_ADD_BOS), add_eos=bool(f.get(meta.KEY_ADD_EOS, False)),
                   add_space_prefix=bool(f.get(KEY_SPACE_PREFIX, True)))

    def _fragments(self, text: str, special: bool) -> list[str | int]:
        """`text` cut at added-token texts: control ones only if `special`, user ones always."""
        return self._cut(text, self._added_re if special else self._user_re)

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None, *,
               special: bool = False) -> list[int]:
        """str -> token ids, as llama.cpp's SPM tokenizer (see the module docstring)."""
        if not isinstance(text, str):
            raise ConfigError("text", f"must be str, got {type(text).__name__}")
        ids: list[int] = []
        after_token = True
        for part in self._fragments(text, special):
            if isinstance(part, int):
                ids.append(part)
                after_token = True
                continue
            prefix = " " if self.add_space_prefix and after_token else ""
            try:
                ids += self._hf.encode((prefix + part).replace(" ", SPACE),
                                       add_special_tokens=False).ids
            except TypeError:  # `tokenizers` refuses str that is not valid Unicode
                raise ConfigError("text", _not_unicode(part)) from None
            after_token = False
        return self.wrap(ids, add_bos, add_eos)
