"""Read tokenizer and chat metadata out of a GGUF file as plain Python values.

Holds `read_fields`, which accepts a `gguf.GGUFReader`, its `.fields` mapping, or a mapping of
already-decoded values (what tests and other loaders pass), and the GGUF key names used by
text/. It does not interpret the values; tokenizer.py and chat.py do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gguf import GGUFReader, ReaderField

from cfr_atlas.errors import ModelFormatError

KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_BOS = "tokenizer.ggml.bos_token_id"
KEY_EOS = "tokenizer.ggml.eos_token_id"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
TOKENIZER_KEYS = (
    KEY_MODEL, KEY_PRE, KEY_TOKENS, KEY_TOKEN_TYPE, KEY_MERGES, KEY_BOS, KEY_EOS, KEY_ADD_BOS,
    KEY_ADD_EOS,
)  # fmt: skip
# SentencePiece ("llama") vocabularies only: scores, unknown id, the space-prefix flag.
SPM_KEYS = ("tokenizer.ggml.scores", "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.add_space_prefix")
# Ids that end generation besides EOS (llama.cpp adds the FIM ones to its EOG set too).
KEYS_EXTRA_EOG = (
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)


def read_fields(source: GGUFReader | Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """Plain values for those of `keys` present in `source`; absent keys are left out."""
    if isinstance(source, GGUFReader):
        source = source.fields
    if not isinstance(source, Mapping):
        raise ModelFormatError(
            f"expected a gguf.GGUFReader or a mapping of GGUF fields, got {type(source).__name__}"
        )
    values = {}
    for key in keys:
        if key in source:
            value = source[key]
            values[key] = value.contents() if isinstance(value, ReaderField) else value
    return values
