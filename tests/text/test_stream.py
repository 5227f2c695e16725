"""StreamDecoder: held-back partial characters, agreement with decode, flush and specials."""

from hypothesis import given, settings
from hypothesis import strategies as st
from text_helpers import TINY_VOCAB_SIZE, byte_id, tiny_tokenizer

from cfr_atlas.text import StreamDecoder


def stream(tok, ids, skip_special=False):
    dec = StreamDecoder(tok, skip_special=skip_special)
    return [dec.push(i) for i in ids], dec.flush()


def test_emoji_and_cjk_split_into_byte_tokens(smollm):
    text = "Party 🎉🤖 time: 中文字符 and 👨‍👩‍👧‍👦!"
    ids = smollm.encode(text)
    pieces = [smollm.token_to_piece(i) for i in ids]
    assert any(_is_partial(p) for p in pieces), "text should need byte-level tokens"
    chunks, tail = stream(smollm, ids)
    assert "".join(chunks) + tail == text
    assert tail == "" and not any("\ufffd" in c for c in chunks)
    assert "" in chunks  # some pushes had to wait for the rest of a character


def _is_partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_tiny_four_byte_char_waits_for_last_byte(tiny):
    ids = [byte_id(b) for b in "🎉".encode()]
    chunks, tail = stream(tiny, ids)
    assert chunks == ["", "", "", "🎉"] and tail == ""


def test_flush_emits_replacement_for_unfinished_char_and_resets(tiny):
    dec = StreamDecoder(tiny)
    assert dec.push(byte_id(0xE4)) == ""  # first byte of a 3-byte char
    assert dec.flush() == "\ufffd"
    assert dec.push(byte_id(ord("a"))) == "a"


def test_skip_special(tiny):
    ids = [1, byte_id(ord("h")), 2]
    assert "".join(stream(tiny, ids)[0]) == "<|im_start|>h<|im_end|>"
    assert "".join(stream(tiny, ids, skip_special=True)[0]) == "h"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, TINY_VOCAB_SIZE - 1), max_size=40), st.booleans())
def test_stream_equals_decode_for_any_ids(ids, skip_special):
    tok = tiny_tokenizer()
    chunks, tail = stream(tok, ids, skip_special)
    assert "".join(chunks) + tail == tok.decode(ids, skip_special=skip_special)
