"""SentencePiece ("llama") vocabularies: a tiny scored vocab against an independent reference of
llama.cpp's SPM merge loop; the real Gemma 3 vocab against llama.cpp's ids (a JSON fixture
saved from llama.cpp, and live when llama_cpp is importable)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfr_atlas.errors import ModelFormatError
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.text import Tokenizer
from cfr_atlas.text.spm import SpmTokenizer

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "gemma3_llamacpp_ids.json"
N, C, U, B = 1, 3, 4, 6  # token types: normal, control, user-defined, byte
BYTES = [f"<0x{b:02X}>" for b in range(256)]
WORDS = ["a", "b", "c", "ab", "bc", "abc", "▁", "▁a", "▁ab", "▁abc", "ca", "cab", "é", "▁é",
         "1", "12", "x", "xx", "xxx", "b▁", "\n", "."]
TOKENS = ["<unk>", "<s>", "</s>", "<ctl>", "  ", "\n\n", *BYTES, *WORDS]
TYPES = [2, C, C, C, U, U, *[B] * 256, *[N] * len(WORDS)]
# Distinct scores, not ordered by length or id, so the merge order is the scores'.
SCORES = [0.0] * (6 + 256) + [-((i * 7919) % 97) - i / 1000 for i in range(len(WORDS))]


def _tiny(**kw) -> SpmTokenizer:
    args = {"bos_id": 1, "eos_id": 2, "unk_id": 0, "add_space_prefix": False} | kw
    return SpmTokenizer(TOKENS, SCORES, TYPES, **args)


def reference_spm(text: str, prefix: bool = False) -> list[int]:
    """llama.cpp's llm_tokenizer_spm on one fragment, written from its description: merge the
    adjacent pair whose text is in the vocab with the highest score (leftmost on ties), then
    characters outside the vocab become byte tokens."""
    vocab = {t: i for i, t in enumerate(TOKENS)}
    syms = list(((" " if prefix else "") + text).replace(" ", "▁"))
    while True:
        best = None
        for k in range(len(syms) - 1):
            joined = syms[k] + syms[k + 1]
            if joined in vocab and (best is None or SCORES[vocab[joined]] > best[0]):
                best = (SCORES[vocab[joined]], k)
        if best is None:
            break
        k = best[1]
        syms[k:k + 2] = [syms[k] + syms[k + 1]]
    out = []
    for s in syms:
        out += [vocab[s]] if s in vocab else [vocab[BYTES[b]] for b in s.encode("utf-8")]
    return out


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abcx1. é\nZ", max_size=24))
def test_merges_follow_scores_like_llamacpp(text):
    tok = _tiny()
    expected = []
    for part in text.split("  "):  # "  " is user-defined: matched before merging
        pieces = part.split("\n\n")
        for j, p in enumerate(pieces):
            expected += reference_spm(p) + ([TOKENS.index("\n\n")] if j < len(pieces) - 1 else [])
        expected.append(TOKENS.index("  "))
    assert tok.encode(text, add_bos=False) == expected[:-1]
    assert tok.decode(tok.encode(text, add_bos=False)) == text  # round trip
    assert tok.decode(tok.encode(text), skip_special=True) == text


def test_byte_fallback_bos_and_space_prefix():
    tok = _tiny()
    ids = tok.encode("a🙂")
    assert ids[0] == 1 and [tok.id_to_token(i) for i in ids[2:]] == ["<0xF0>", "<0x9F>",
                                                                       "<0x99>", "<0x82>"]
    assert tok.decode(ids, skip_special=True) == "a🙂"
    pre = _tiny(add_space_prefix=True)
    assert pre.encode("ab", add_bos=False) == reference_spm("ab", prefix=True)
    assert pre.id_to_token(pre.encode("ab", add_bos=False)[0]) == "▁ab"


def test_user_text_never_becomes_control():
    tok = _tiny()
    plain = tok.encode("<ctl>a", add_bos=False)
    assert TOKENS.index("<ctl>") not in plain
    assert tok.encode("<ctl>a", add_bos=False, special=True) == [3, TOKENS.index("a")]


def test_control_text_spelled_by_mergeable_pieces_stays_pieces():
    """A vocabulary whose pieces could merge into "<ctl>" (as "<ct" + "l>"): user text keeps
    them apart; only special-text matching gives the control id."""
    pieces = ["<", "c", "t", "l", ">", "a", "<c", "<ct", "l>"]
    tokens = ["<unk>", "<s>", "</s>", "<ctl>", *BYTES, *pieces]
    types = [2, C, C, C, *[B] * 256, *[N] * len(pieces)]
    scores = [0.0, 0.0, 0.0, 10.0, *[0.0] * 256, *[-float(i) for i in range(len(pieces))]]
    tok = SpmTokenizer(tokens, scores, types, bos_id=1, eos_id=2, unk_id=0,
                       add_space_prefix=False)
    plain = tok.encode("<ctl>a", add_bos=False)
    assert 3 not in plain and tok.decode(plain) == "<ctl>a"
    assert [tokens[i] for i in plain] == ["<ct", "l>", "a"]
    assert tok.encode("<ctl>a", add_bos=False, special=True) == [3, tokens.index("a")]


def test_bad_vocab_is_typed():
    with pytest.raises(ModelFormatError, match="3 tokens, 2 scores"):
        SpmTokenizer(["a", "b", "c"], [0.0, 0.0], None)


# --- the real vocabularies (Gemma 3: SentencePiece; Qwen2.5: qwen2 BPE) -----------------------


@pytest.fixture(scope="module")
def gemma_tok(real_model) -> SpmTokenizer:
    # the engine's reader (gguf's, with the vocabulary parsed lazily): gguf's own reader makes a
    # NumPy view per string of the 262,144-token vocabulary, ~20 s on 2 busy cores
    return Tokenizer.from_gguf(GGUFFile(real_model("gemma3-270m")).reader)


@pytest.mark.model
def test_gemma3_ids_equal_llamacpp_fixture(gemma_tok):
    cases = json.loads(FIXTURE.read_text())
    assert len(cases) >= 8
    for case in cases:
        assert gemma_tok.encode(case["text"]) == case["ids"], case["text"]
        assert gemma_tok.decode(case["ids"], skip_special=True) == case["text"]


@pytest.mark.model
def test_gemma3_ids_equal_llamacpp_live(gemma_tok, real_model):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    llm = llama_cpp.Llama(str(real_model("gemma3-270m")), vocab_only=True, verbose=False)
    for case in json.loads(FIXTURE.read_text()):
        text = case["text"]
        assert gemma_tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False)


def test_no_chat_template_is_a_typed_error():
    from cfr_atlas.errors import NoChatTemplateError
    from cfr_atlas.text.chat import ChatTemplate

    template = ChatTemplate.from_gguf({}, _tiny())  # no template, no ChatML tokens: base model
    with pytest.raises(NoChatTemplateError, match="no tokenizer.chat_template"):
        template.encode(_tiny(), [{"role": "user", "content": "hi"}])


@pytest.mark.model
def test_qwen2_ids_equal_llamacpp_fixture(real_model):
    tok = Tokenizer.from_gguf(GGUFFile(real_model("qwen2.5-coder-0.5b")).reader)
    assert tok.pre == "qwen2"
    for case in json.loads((DATA / "qwen2_llamacpp_ids.json").read_text()):
        assert tok.encode(case["text"]) == case["ids"], case["text"]
