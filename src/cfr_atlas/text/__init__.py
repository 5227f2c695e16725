"""Text side of a model: tokenizer, chat template and streaming detokenizer, from GGUF metadata.

Holds byte-level BPE tokenization (`Tokenizer`), chat rendering (`ChatTemplate`),
`StreamDecoder` and `StopText` (the stop-string rule). It reads GGUF metadata but no tensors,
and knows nothing of the model, the K/V cache or sampling.
"""

from cfr_atlas.text.chat import CHATML_TEMPLATE, ChatTemplate, validate_messages
from cfr_atlas.text.stops import StopText
from cfr_atlas.text.stream import StreamDecoder
from cfr_atlas.text.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenType

__all__ = [
    "CHATML_TEMPLATE",
    "PRE_TOKENIZERS",
    "ChatTemplate",
    "StopText",
    "StreamDecoder",
    "TokenType",
    "Tokenizer",
    "validate_messages",
]
