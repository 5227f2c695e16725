"""Shared test helpers for text/: a tiny hand-made byte-level BPE vocabulary.

A plain module (not conftest) so tests can import it by a unique name. The bundled SmolLM2
model comes from the root conftest's `bundled_model_path` fixture.
"""

import functools


def _byte_alphabet() -> list[str]:
    """GPT-2 byte-level chars in byte order (byte b -> this char)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "r l", "Ġwo rl", "Ġworl d", "1 2"]
USER_DEFINED = ["<tool>"]
TINY_VOCAB_SIZE = len(CONTROL) + 256 + len(MERGES) + len(USER_DEFINED)  # 270


def byte_id(b: int) -> int:
    """Id of the tiny vocab's token for byte `b`."""
    return len(CONTROL) + b


def tiny_fields(**overrides) -> dict:
    """GGUF-style metadata: 3 control tokens, 256 byte tokens, merge results, one user token.

    An override of None removes the key.
    """
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = [*CONTROL, *_byte_alphabet(), *merged, *USER_DEFINED]
    types = [3] * len(CONTROL) + [1] * (256 + len(merged)) + [4] * len(USER_DEFINED)
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


@functools.cache
def tiny_tokenizer():
    """One shared tiny Tokenizer (hypothesis tests cannot take function-scoped fixtures)."""
    from cfr_atlas.text import Tokenizer

    return Tokenizer.from_gguf(tiny_fields())
