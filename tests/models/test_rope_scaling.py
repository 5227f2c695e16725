"""RoPE scaling as llama.cpp applies it, on tiny GGUF files, against the float64 reference.

llama.cpp (ggml_rope_cache_init / rope_yarn) turns pair i by pos * freq_scale * theta^(-2i/n) /
ff[i], where ff is the optional `rope_freqs.weight` tensor (Llama 3.1/3.2: the converter bakes
"llama3" scaling into it) and freq_scale = 1 / `rope.scaling.factor` for type "linear", which is
also the default when `rope.scaling.type` is absent; "none" means 1. Any other type (yarn,
longrope, and "llama3" itself, which llama.cpp's loader refuses too) must be a ModelFormatError
naming it, never silently ignored.

Tolerance: max |engine - reference| <= REL_TOL * max |reference logit|, REL_TOL = 2e-5; measured
6.5e-7 (2 layers, float32 K/V vs float64). Each scaled file's reference logits differ from the
unscaled file's by more than 0.1 relative (measured 0.78 llama3, 0.99 linear), 5,000x the bound,
so a scaling that is dropped or applied twice cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import ReferenceError, reference_logits

from cfr_atlas import cli
from cfr_atlas.engine import load_model
from cfr_atlas.errors import ModelFormatError
from cfr_atlas.testing import llama3_rope_factors
from cfr_atlas.validate import validation_text

REL_TOL = 2e-5
N_ROT = 16  # the tiny models' head_dim
# Llama 3.1's recipe with an original context of 256 tokens, so that at theta 10^4 the 8 pairs
# fall in all three bands: kept (1), interpolated (4.78) and slowed by the factor (8)
LLAMA3 = llama3_rope_factors(N_ROT, 10000.0, original_context_length=256)


@pytest.fixture(scope="module")
def ids(tiny_llama) -> list[int]:
    return load_model(tiny_llama).tokenize(validation_text())[:400]


@pytest.fixture(scope="module")
def plain_ref(tiny_gguf, ids) -> np.ndarray:
    return reference_logits(tiny_gguf(), ids)


def check_matches_reference(path, ids, plain_ref) -> np.ndarray:
    got = load_model(path).logits(ids, storage_dtype="float32")  # the float32-tight bound
    ref = reference_logits(path, ids)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= REL_TOL * scale
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    assert np.abs(ref - plain_ref).max() > 0.1 * scale  # the scaling really changed the model
    return got


def test_llama3_factors_cover_all_three_bands():
    assert LLAMA3[:3] == [1.0, 1.0, 1.0] and LLAMA3[4:] == [8.0] * 4
    assert 1.0 < LLAMA3[3] < 8.0


def test_rope_freqs_weight_matches_reference(tiny_gguf, ids, plain_ref, tmp_path):
    path = tiny_gguf(rope_freq_factors=LLAMA3)
    check_matches_reference(path, ids, plain_ref)
    # recompute regenerates K through the same scaled rope: a budget changes no bit (pages of
    # 32 tokens in both runs, since the page size sets the fold's order of operations)
    # 400 tokens x 512 B of K/V = 200 KiB; the budget also holds recompute's 200 KiB of kept
    # inputs and 8 KiB of scratch, which leaves 64 KiB of hot pages
    model = load_model(path)
    full = model.logits(ids, page_tokens=32)
    budgeted = model.logits(ids, kv_budget="272KiB", regenerator="recompute", page_tokens=32,
                            cache_dir=tmp_path, chunk_tokens=64)
    assert model.last_telemetry["pages_regenerated"] > 0
    assert np.array_equal(budgeted, full)


@pytest.mark.parametrize("kind", ["linear", None])  # None: no type key, llama.cpp's "linear"
def test_linear_scaling_matches_reference(tiny_gguf, ids, plain_ref, kind):
    path = tiny_gguf(rope_scaling_type=kind, rope_scaling_factor=4.0)
    check_matches_reference(path, ids, plain_ref)


def test_rope_freqs_and_linear_factor_combine(tiny_gguf, ids, plain_ref):
    path = tiny_gguf(rope_freq_factors=LLAMA3, rope_scaling_type="linear", rope_scaling_factor=2.0)
    check_matches_reference(path, ids, plain_ref)


@pytest.mark.parametrize("kw", [dict(rope_scaling_type="none", rope_scaling_factor=4.0),
                                dict(rope_scaling_type="linear", rope_scaling_factor=0.0),
                                dict(rope_scaling_factor=1.0)])
def test_no_op_scalings_equal_the_plain_model_bitwise(tiny_gguf, tiny_llama, ids, kw):
    assert np.array_equal(load_model(tiny_gguf(**kw)).logits(ids[:50]),
                          load_model(tiny_llama).logits(ids[:50]))


@pytest.mark.parametrize("kind", ["yarn", "longrope", "llama3", "dynamic"])
def test_unsupported_scaling_type_is_refused_naming_it(tiny_gguf, capsys, kind):
    path = tiny_gguf(rope_scaling_type=kind, rope_scaling_factor=8.0)
    with pytest.raises(ModelFormatError, match=f"rope.scaling.type '{kind}' is not supported"):
        load_model(path)
    assert cli.main(["generate", "--model", str(path), "--max-tokens", "1", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and kind in err[0], err
    with pytest.raises(ReferenceError, match=kind):  # the reference refuses it as well
        reference_logits(path, [1, 2])


@pytest.mark.parametrize("kw, phrase", [
    (dict(rope_freq_factors=LLAMA3[:4]), "must hold 8 finite entries > 0"),
    (dict(rope_freq_factors=[0.0] + LLAMA3[1:]), "must hold 8 finite entries > 0"),
    (dict(rope_freq_factors=[float("nan")] + LLAMA3[1:]), "must hold 8 finite entries > 0"),
    (dict(rope_scaling_factor=-2.0), "must be a finite number >= 0"),
    (dict(arch="qwen2", rope_freq_factors=LLAMA3), "qwen2 does not use rope_freqs.weight"),
])  # fmt: skip
def test_bad_rope_metadata_is_a_model_format_error(tiny_gguf, kw, phrase):
    with pytest.raises(ModelFormatError, match=phrase):
        load_model(tiny_gguf(**kw))
