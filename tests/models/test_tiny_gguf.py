"""Tests for the tiny GGUF writer (cfr_atlas.testing) and the float64 reference forward pass.

The writer is checked through gguf-py's own reader (metadata keys, tensor types, a tokenizer
that the `tokenizers` library loads), the reference through properties every causal LM has, and
the reference alone on the bundled SmolLM2 model (slow). Nothing here uses the engine.
"""

from __future__ import annotations

import jinja2
import numpy as np
import pytest
from gguf import GGUFReader, LlamaFileType, TokenType
from reference import reference_logits, rope
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cfr_atlas.errors import ConfigError
from cfr_atlas.testing import MATRIX_ROLES, SUPPORTED_QTYPES, tiny_model_path, write_tiny_gguf

IDS = [12, 300, 41, 77, 400, 5, 129, 256, 3, 99]  # any ids below the tiny vocab (432)
NORMS = ("attn_norm", "ffn_norm", "output_norm")


def meta(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    assert field is not None, f"missing metadata key {key}"
    return field.contents()


def tensor_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def role(name: str) -> str:
    """'blk.1.attn_q.weight' -> 'attn_q'; 'token_embd.weight' -> 'token_embd'."""
    return name.split(".")[-2]


# --- the file -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_metadata_as_llama_cpp_writes_it(tiny_gguf, arch):
    r = GGUFReader(tiny_gguf(arch=arch, rope_theta=5e5, context_length=2048))
    expected = {
        "general.architecture": arch,
        f"{arch}.block_count": 2,
        f"{arch}.context_length": 2048,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.rope.freq_base": 5e5,
        f"{arch}.rope.dimension_count": 16,
        "general.file_type": LlamaFileType.MOSTLY_Q8_0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.add_bos_token": False,
    }
    assert {k: meta(r, k) for k in expected} == expected
    assert meta(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert meta(r, "general.name")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vocab_size_agrees_everywhere(tiny_gguf, arch):
    r = GGUFReader(tiny_gguf(arch=arch, tied_embeddings=False))
    tokens = meta(r, "tokenizer.ggml.tokens")
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    assert 300 <= len(tokens) <= 600
    assert meta(r, f"{arch}.vocab_size") == len(tokens) == len(meta(r, "tokenizer.ggml.token_type"))
    assert shapes["token_embd.weight"] == shapes["output.weight"] == [64, len(tokens)]


def test_tokenizer_metadata(tiny_llama):
    r = GGUFReader(tiny_llama)
    tokens, types = meta(r, "tokenizer.ggml.tokens"), meta(r, "tokenizer.ggml.token_type")
    specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert {t for t, ty in zip(tokens, types, strict=True) if ty == TokenType.CONTROL} == specials
    assert all(
        ty == TokenType.NORMAL for t, ty in zip(tokens, types, strict=True) if t not in specials
    )
    assert tokens[meta(r, "tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert tokens[meta(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert len(set(tokens)) == len(tokens)
    vocab = set(tokens)
    for merge in meta(r, "tokenizer.ggml.merges"):
        a, b = merge.split(" ")
        assert {a, b, a + b} <= vocab, merge


def test_tokenizer_loads_in_tokenizers_and_compresses(tiny_llama):
    r = GGUFReader(tiny_llama)
    tokens = meta(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in meta(r, "tokenizer.ggml.merges")]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    enc = tk.encode("The capital of France is")
    assert enc.tokens == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    text = "Hello world, this is a tiny language model. Ünïcödé 🙂\n"
    ids = tk.encode(text).ids
    assert len(ids) < len(text.encode()) and tk.decode(ids) == text


def test_chat_template_is_chatml(tiny_llama):
    template = meta(GGUFReader(tiny_llama), "tokenizer.chat_template")
    messages = [{"role": "user", "content": "Hi"}]
    out = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES)
def test_every_matrix_in_requested_type_norms_f32(tiny_gguf, qtype):
    types = tensor_types(tiny_gguf(qtype=qtype, tied_embeddings=False))
    assert len(types) == 1 + 9 * 2 + 2
    for name, t in types.items():
        assert t == ("F32" if role(name) in NORMS else qtype), name
    r = GGUFReader(tiny_gguf(qtype=qtype, tied_embeddings=False))
    assert (
        meta(r, "general.file_type")
        == LlamaFileType[{"F32": "ALL_F32"}.get(qtype, f"MOSTLY_{qtype}")]
    )


def test_mixed_exercises_every_type(tiny_gguf):
    types = tensor_types(tiny_gguf(arch="qwen2", qtype="mixed"))
    matrices = {t for name, t in types.items() if role(name) in MATRIX_ROLES}
    assert matrices == set(SUPPORTED_QTYPES)
    assert all(t == "F32" for name, t in types.items() if role(name) not in MATRIX_ROLES)
    assert len({types[f"blk.{i}.attn_q.weight"] for i in range(2)}) == 2  # spread across layers


def test_qtype_dict_by_role(tiny_gguf):
    types = tensor_types(tiny_gguf(qtype={"token_embd": "F16", "ffn_down": "Q4_1"}))
    assert types["token_embd.weight"] == "F16"
    assert types["blk.1.ffn_down.weight"] == "Q4_1"
    assert types["blk.1.attn_q.weight"] == "Q8_0"  # unnamed roles keep the default


def test_qwen2_has_f32_qkv_biases_llama_has_none(tiny_qwen2, tiny_llama):
    qwen = tensor_types(tiny_qwen2)
    for i in range(2):
        for n in ("q", "k", "v"):
            assert qwen[f"blk.{i}.attn_{n}.bias"] == "F32"
    assert not any(name.endswith(".bias") for name in tensor_types(tiny_llama))
    assert "output.weight" not in qwen  # tied by default


@pytest.mark.parametrize(
    "kw",
    [
        {"arch": "gpt2"},
        {"qtype": "Q5_0"},
        {"qtype": {"attn_qq": "F32"}},
        {"n_heads": 3},
        {"n_kv_heads": 3},
        {"dim": 48, "n_heads": 2, "n_kv_heads": 1, "qtype": "Q4_0"},
    ],
)
def test_bad_parameters_raise_config_error(tmp_path, kw):
    with pytest.raises(ConfigError):
        write_tiny_gguf(tmp_path / "bad.gguf", **kw)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_odd_sizes_fine_when_unquantized(tmp_path):
    path = write_tiny_gguf(tmp_path / "f32.gguf", dim=48, n_heads=2, n_kv_heads=1, qtype="F32")
    assert reference_logits(path, IDS[:3]).shape == (3, 432)


def test_same_seed_same_bytes_other_seed_other_logits(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=7)
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=7)
    c = write_tiny_gguf(tmp_path / "c.gguf", seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert not np.allclose(reference_logits(a, IDS), reference_logits(c, IDS))


def test_tiny_model_path_caches_by_full_parameter_set(tmp_path):
    first = tiny_model_path(tmp_path, qtype="Q8_0")
    mtime = first.stat().st_mtime_ns
    assert tiny_model_path(tmp_path) == first  # defaults filled in before hashing
    assert first.stat().st_mtime_ns == mtime
    assert tiny_model_path(tmp_path, seed=1) != first
    with pytest.raises(TypeError):
        tiny_model_path(tmp_path, n_layer=3)


# --- the reference forward pass --------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1", "mixed"])
def test_reference_logits_finite_and_well_conditioned(tiny_gguf, arch, qtype):
    logits = reference_logits(tiny_gguf(arch=arch, qtype=qtype), IDS)
    assert logits.shape == (len(IDS), 432) and logits.dtype == np.float64
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.5).all() and np.abs(logits).max() < 50
    assert len(set(logits.argmax(axis=1))) > 1  # the prediction depends on the context


def test_untied_model_projects_with_output_weight(tiny_gguf):
    tied = reference_logits(tiny_gguf(), IDS)
    untied = reference_logits(tiny_gguf(tied_embeddings=False), IDS)
    assert (untied.std(axis=1) > 0.5).all()
    assert not np.allclose(untied, tied)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reference_is_causal(tiny_gguf, arch):
    path = tiny_gguf(arch=arch)
    full = reference_logits(path, IDS)
    for k in (1, 4, len(IDS) - 1):
        np.testing.assert_allclose(reference_logits(path, IDS[:k]), full[:k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0"])
def test_fine_quant_types_stay_close_to_f32(tiny_gguf, qtype):
    # Same seed draws the same floats, so only quantization error separates the files.
    exact = reference_logits(tiny_gguf(arch="qwen2", qtype="F32"), IDS)
    approx = reference_logits(tiny_gguf(arch="qwen2", qtype=qtype), IDS)
    assert np.abs(approx - exact).max() < 0.5 < np.abs(exact).max()


def test_rope_conventions():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8))
    pos = np.arange(5)
    for neox in (False, True):
        y = rope(x, pos, 10000.0, 8, neox)
        np.testing.assert_allclose(y[0], x[0], atol=0)  # position 0 is the identity
        np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))
    # NEOX on split halves == NORM on the same numbers laid out as adjacent pairs.
    interleave = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # norm slot j holds neox dim interleave[j]
    norm = rope(x[..., interleave], pos, 10000.0, 8, neox=False)
    np.testing.assert_allclose(norm, rope(x, pos, 10000.0, 8, neox=True)[..., interleave])
    # Only the first n_rot dims rotate.
    np.testing.assert_array_equal(rope(x, pos, 10000.0, 4, neox=False)[..., 4:], x[..., 4:])


@pytest.mark.slow
def test_reference_on_bundled_model_says_paris(bundled_model_path):
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocab
    reader = GGUFReader(bundled_model_path)  # parsed once: 49k tokens + 49k merges take seconds
    tokens = meta(reader, "tokenizer.ggml.tokens")
    assert [tokens[i] for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    logits = reference_logits(reader, ids)
    assert tokens[int(logits[-1].argmax())] == "ĠParis"
