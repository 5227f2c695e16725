"""llguidance's token mask over our two vocabulary kinds: the tiny byte-level BPE one and the
tiny SentencePiece one (JSON's punctuation only as byte-fallback tokens there). Random walks
through the mask always end in JSON that validates, control tokens are never allowed, and the
end-of-generation token only when the JSON is complete."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from test_spm import _tiny

from cfr_atlas.errors import ConfigError
from cfr_atlas.testing import build_vocab
from cfr_atlas.text import Tokenizer
from cfr_atlas.text.grammar import TokenGrammar

SCHEMA = {"type": "object", "properties": {
    "a": {"enum": ["x y", "é\"", "12", "tab\t"]}, "b": {"type": "boolean"},
    "c": {"type": "integer", "minimum": 0, "maximum": 99},
    "d": {"type": "array", "items": {"const": "ab"}, "maxItems": 2}},
    "required": ["a", "b", "c", "d"], "additionalProperties": False}


def _bpe() -> Tokenizer:
    tokens, merges, types = build_vocab()
    return Tokenizer(tokens, merges, types, bos_id=len(tokens) - 3, eos_id=len(tokens) - 1,
                     add_bos=False)


@pytest.mark.parametrize("make", [_bpe, _tiny], ids=["bpe", "spm"])
def test_random_walks_through_the_mask_validate(make):
    tok = make()
    grammar = TokenGrammar(tok)
    control = [i for i in range(tok.vocab_size) if tok.is_control(i) and i not in tok.eos_ids]
    rng = np.random.default_rng(0)
    for _ in range(20):
        c = grammar.constraint(SCHEMA)
        out: list[int] = []
        while True:
            allowed = c.allowed()
            assert not allowed[control].any()
            token = int(rng.choice(np.flatnonzero(allowed)))
            if token in tok.eos_ids:
                break
            out.append(token)
            c.advance(token)
            assert len(out) < 200
        jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)
        eos = sorted(tok.eos_ids)
        assert c.allowed()[eos].any()


def test_eos_is_refused_before_the_json_is_complete():
    tok = _bpe()
    c = TokenGrammar(tok).constraint(SCHEMA)
    assert not c.allowed()[sorted(tok.eos_ids)].any()
    for t in tok.encode('{"a":"12"'):
        c.advance(t)
    assert not c.allowed()[sorted(tok.eos_ids)].any()


def test_unusable_schema_is_a_config_error():
    with pytest.raises(ConfigError, match="format"):
        TokenGrammar(_bpe()).constraint({"type": "object", "required": 5})
    with pytest.raises(ConfigError, match="format"):
        TokenGrammar(_bpe()).constraint([1, 2])
