"""Byte-level BPE tokenizer built from GGUF metadata (`tokenizer.ggml.model == "gpt2"`).

Holds `Tokenizer` (encode, decode, per-token bytes, special ids), the pre-tokenizer regex
table copied from llama.cpp's `llm_tokenizer_bpe`, and GPT-2's byte <-> unicode table.
Encoding runs on HF `tokenizers`: llama.cpp's regexes as `Split(isolated)` steps in order,
then `ByteLevel` without its own regex, a BPE model from the GGUF tokens and merges, and
CONTROL / USER_DEFINED tokens as added tokens matched before pre-tokenization. Text is encoded
without that matching unless the caller asks for it (`special=True`): user text that spells
`<|im_start|>` stays those characters, and only a chat template's own literals (see chat.py) or
an explicitly special-parsed prompt produce control ids. Decoding is done here from per-token
byte pieces, so `decode` and `StreamDecoder` agree byte for byte; no space clean-up is applied,
so `decode(encode(s)) == s`. SentencePiece ("llama") vocabularies are in spm.py (`from_gguf`
dispatches there); it does not hold WordPiece or Unigram vocabularies, chat templates
(chat.py) or streaming (stream.py).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from functools import cache
from typing import Any, NamedTuple

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from cfr_atlas.errors import ConfigError, DimensionError, ModelFormatError
from cfr_atlas.text import gguf_meta as meta


class TokenType(IntEnum):
    """GGUF `tokenizer.ggml.token_type` values (llama.cpp's LLAMA_TOKEN_TYPE_*)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class PreTokenizer(NamedTuple):
    """Regexes applied in order (each splits the previous pieces) and BPE flags."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token found in the vocab is one token
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

GPT2 = PreTokenizer((_GPT2,))
STARCODER = PreTokenizer((r"\p{N}", _GPT2))  # every digit its own pre-token
LLAMA3 = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
QWEN2 = PreTokenizer((_QWEN2,))
DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

# tokenizer.ggml.pre -> pre-tokenizer, as in llama.cpp's llama_vocab::impl::load.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": DEFAULT,
    **dict.fromkeys(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], GPT2),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"], STARCODER
    ),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"], LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], QWEN2),
}

# Control-token texts llama.cpp treats as end of generation whatever the metadata says.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
        "<end_of_utterance>",
    }
)  # fmt: skip


@cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's table inverted: printable latin-1 bytes map to themselves, the rest to U+0100+."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    table.update({chr(0x100 + n): b for n, b in enumerate(shifted)})
    return table


@cache
def _byte_level_translation() -> dict[int, str]:
    """str.translate table: byte-level chars -> the latin-1 char of their byte; every other
    char below U+0100 -> U+FFFF, which latin-1 cannot encode (so it marks non-byte-level text)."""
    table = {ord(c): chr(b) for c, b in _unicode_to_byte().items()}
    return {**{c: "\uffff" for c in range(0x100)}, **table}


def _piece_bytes(text: str, literal: bool) -> bytes:
    """Bytes a vocabulary entry stands for: byte-level chars decoded, or the literal text."""
    if literal:
        return text.encode("utf-8")
    try:  # one C-level pass instead of a dict lookup per char (49,152 entries at start-up)
        return text.translate(_byte_level_translation()).encode("latin-1")
    except UnicodeEncodeError:  # not byte-level text; HF's ByteLevel decoder falls back so too
        return text.encode("utf-8")


def _build_hf(
    tokens: Sequence[str], merges: Sequence[str], types: Sequence[int], pre: PreTokenizer
) -> HFTokenizer:
    vocab = {text: i for i, text in enumerate(tokens)}  # duplicates: last id wins, as llama.cpp
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelFormatError(f"tokenizer merge {merge!r} has no separating space")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges)
    except Exception as exc:  # tokenizers raises plain Exception for bad vocab/merges
        raise ModelFormatError(f"cannot build BPE from GGUF tokens/merges: {exc}") from exc
    hf = HFTokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    hf.decoder = decoders.ByteLevel()
    # Matched verbatim in the raw text before pre-tokenization; ids are their vocab ids.
    hf.add_special_tokens(_added(tokens, types, TokenType.CONTROL, special=True))
    hf.add_tokens(_added(tokens, types, TokenType.USER_DEFINED, special=False))
    return hf


def _plain(hf: HFTokenizer) -> HFTokenizer:
    """The same BPE model and pre-tokenizer with no added tokens: text is only ever text."""
    plain = HFTokenizer(hf.model)  # shares the model (vocab and merges), not a copy
    plain.pre_tokenizer = hf.pre_tokenizer
    plain.decoder = hf.decoder
    return plain


def _matcher(texts: Iterable[str]) -> re.Pattern | None:
    """Leftmost-longest matching of added-token texts, as `tokenizers` splits on them."""
    texts = sorted(set(texts), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _ids_of(types: Sequence[int], kind: TokenType) -> list[int]:
    return [i for i, t in enumerate(types) if t == kind]


def _added(tokens: Sequence[str], types: Sequence[int], kind: TokenType, special: bool):
    return [AddedToken(tokens[i], special=special, normalized=False) for i in _ids_of(types, kind)]


def _not_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at {e.start}"
    return "could not be tokenized"


def _resolve_pre(name: str | None) -> tuple[str, PreTokenizer]:
    if name in PRE_TOKENIZERS:
        return name, PRE_TOKENIZERS[name]
    warnings.warn(
        f"unknown tokenizer.ggml.pre {name!r}; falling back to the gpt2 pre-tokenizer, "
        "so token ids may differ from llama.cpp and HF",
        stacklevel=3,
    )
    return "gpt2", GPT2


class Tokenizer:
    """Text <-> token ids for one byte-level BPE vocabulary.

    Invariants: `decode(encode(s)) == s` for any str `s`; `token_to_piece(i)` is the exact
    bytes token i contributes to decoded text; `eos_ids` holds every id that ends generation.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        pre: str | None = "gpt2",
        bos_id: int | None = None,
        eos_id: int | None = None,
        extra_eog_ids: Iterable[int] = (),
        add_bos: bool | None = None,
        add_eos: bool = False,
    ):
        if token_types is None or len(token_types) == 0:
            token_types = [TokenType.NORMAL] * len(tokens)
        types = [int(t) for t in token_types]
        if len(types) != len(tokens):
            raise ModelFormatError(f"{len(types)} token types for {len(tokens)} tokens")
        self.vocab_size = len(tokens)
        self.pre, spec = _resolve_pre(pre)
        self.bos_id = self._check_id("bos_id", bos_id)
        self.eos_id = self._check_id("eos_id", eos_id)
        self.add_bos = spec.add_bos if add_bos is None else bool(add_bos)
        self.add_eos = bool(add_eos)
        self._tokens = list(tokens)
        self._control = frozenset(_ids_of(types, TokenType.CONTROL))
        literal = self._control | set(_ids_of(types, TokenType.USER_DEFINED))
        self._literal = literal  # ids whose piece is their text as written, not byte-level
        # token_to_piece fills this on first use: start-up decodes a few tokens, not 49,152
        self._pieces: list[bytes | None] = [None] * self.vocab_size
        self.eos_ids = self._end_of_generation(extra_eog_ids)
        self._hf = _build_hf(self._tokens, merges, types, spec)
        self._hf_text = _plain(self._hf)
        added = sorted(literal)
        self.added_texts = frozenset(self._tokens[i] for i in added)  # control + user-defined
        self._added_id = {t: self._hf.token_to_id(t) for t in self.added_texts}
        self._added_re = _matcher(self.added_texts)

    @classmethod
    def from_gguf(cls, source: GGUFReader | Mapping[str, Any]) -> Tokenizer:
        """Build from a `GGUFReader`, its `.fields`, or a mapping of decoded metadata values."""
        f = meta.read_fields(source, [*meta.TOKENIZER_KEYS, *meta.KEYS_EXTRA_EOG,
                                      *meta.SPM_KEYS])
        model = f.get(meta.KEY_MODEL)
        if model == "llama":  # SentencePiece: text/spm.py (imported here: it builds on this)
            from cfr_atlas.text.spm import SpmTokenizer

            return SpmTokenizer.from_fields(f)
        if model != "gpt2":
            raise ModelFormatError(
                f"tokenizer.ggml.model is {model!r}; cfr-atlas implements byte-level BPE "
                "('gpt2') and SentencePiece ('llama'), not WordPiece ('bert') or Unigram ('t5')"
            )
        for key in (meta.KEY_TOKENS, meta.KEY_MERGES):
            if key not in f:
                raise ModelFormatError(f"GGUF metadata lacks {key}")
        return cls(
            f[meta.KEY_TOKENS],
            f[meta.KEY_MERGES],
            f.get(meta.KEY_TOKEN_TYPE),
            pre=f.get(meta.KEY_PRE),
            bos_id=f.get(meta.KEY_BOS),
            eos_id=f.get(meta.KEY_EOS),
            extra_eog_ids=[f[k] for k in meta.KEYS_EXTRA_EOG if k in f],
            add_bos=f.get(meta.KEY_ADD_BOS),
            add_eos=bool(f.get(meta.KEY_ADD_EOS, False)),
        )

    def _check_id(self, name: str, token_id: int | None) -> int | None:
        if token_id is not None and not 0 <= int(token_id) < self.vocab_size:
            raise ModelFormatError(
                f"{name} {token_id} is outside the vocabulary of {self.vocab_size}"
            )
        return None if token_id is None else int(token_id)

    def _end_of_generation(self, extra_ids: Iterable[int]) -> frozenset[int]:
        ids = {self._check_id("end-of-generation id", i) for i in extra_ids}
        ids.add(self.eos_id)
        ids.update(i for i, t in enumerate(self._tokens) if t in END_OF_GENERATION_TEXTS)
        return frozenset(ids - {None})

    def encode(
        self, text: str, add_bos: bool | None = None, add_eos: bool | None = None, *,
        special: bool = False,
    ) -> list[int]:
        """str -> token ids. The text is text: `<|im_start|>` written in it is encoded as those
        characters, never as the control token. `special=True` (for a prompt the caller
        templated itself) maps control and user-defined token texts to their single ids.
        BOS/EOS are added per GGUF metadata unless `add_bos` / `add_eos` say otherwise.
        """
        if not isinstance(text, str):
            raise ConfigError("text", f"must be str, got {type(text).__name__}")
        hf = self._hf if special else self._hf_text
        try:
            ids = hf.encode(text, add_special_tokens=False).ids
        except TypeError:  # `tokenizers` refuses str that is not valid Unicode
            raise ConfigError("text", _not_unicode(text)) from None
        return self.wrap(ids, add_bos, add_eos)

    def wrap(self, ids: list[int], add_bos: bool | None = None,
             add_eos: bool | None = None) -> list[int]:
        """`ids` with BOS / EOS added per GGUF metadata unless told otherwise."""
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self._required("bos_id", self.bos_id))
        if self.add_eos if add_eos is None else add_eos:
            ids.append(self._required("eos_id", self.eos_id))
        return ids

    def split_special(self, text: str) -> list[str | int]:
        """`text` cut at added-token texts, as `encode(special=True)` cuts it: plain pieces
        (str) and the ids of the added tokens between them, in order."""
        return self._cut(text, self._added_re)

    def _cut(self, text: str, pattern) -> list[str | int]:
        """`text` cut at the matches of `pattern` (None: no cut): plain pieces and the ids of
        the added tokens matched, in order."""
        out: list[str | int] = []
        pos = 0
        for m in pattern.finditer(text) if pattern is not None else ():
            if m.start() > pos:
                out.append(text[pos:m.start()])
            out.append(self._added_id[m.group()])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    @staticmethod
    def _required(name: str, token_id: int | None) -> int:
        if token_id is None:
            raise ConfigError(name, "the model defines no such token")
        return token_id

    def token_to_piece(self, token_id: int) -> bytes:
        """Exact bytes token `token_id` adds to decoded text (may be part of a UTF-8 char)."""
        if not 0 <= token_id < self.vocab_size:
            raise DimensionError(
                f"token id {token_id} is outside the vocabulary of {self.vocab_size}"
            )
        piece = self._pieces[token_id]
        if piece is None:
            piece = _piece_bytes(self._tokens[token_id], token_id in self._literal)
            self._pieces[token_id] = piece
        return piece

    def is_control(self, token_id: int) -> bool:
        """True for CONTROL tokens (`<|im_start|>`, BOS/EOS...), the ones `skip_special` drops."""
        return token_id in self._control

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Token ids -> the raw bytes they stand for (possibly not valid UTF-8)."""
        return b"".join(
            self.token_to_piece(i) for i in ids if not (skip_special and i in self._control)
        )

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Token ids -> str; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (byte-level chars, e.g. 'Ġthe')."""
        self.token_to_piece(token_id)  # range check
        return self._tokens[token_id]
