"""MoE feed-forward for qwen2moe, qwen3moe, olmoe and Mixtral-style llama, from tiny files.

Against a float64 NumPy reference (tests/models/moe_reference.py, no engine code) and against
llama.cpp (llama-cpp-python) on the same files; routing rules; row independence (chunked
prefill and batched rows give the same bits as one whole pass).
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError
from cfr_atlas.models.moe import route, softmax_rows
from cfr_atlas.testing.tiny_moe import MOE_ARCHS, RESIDUAL_OUTPUTS, random_blocks

sys.path.insert(0, str(Path(__file__).parent))
from moe_reference import moe_reference_logits  # noqa: E402

IDS = [5, 77, 300, 12, 40, 1000, 2000, 31, 9, 44, 4, 900]
# llama.cpp, Q8_0 weights: it rounds activations to Q8_0 blocks, we multiply float32 activations
# (measured max |diff| 0.12-0.23 over these 12 positions); F32 weights: only its f16 K/V differs
LLAMACPP_TOL = {"Q8_0": 0.35, "F32": 0.02}
BLOCK_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])  # GGUF's Q4_0 block


@lru_cache(maxsize=8)
def _model(path):
    return load_model(path)


def _reader(path):
    """gguf's reader, with the engine's faster parsing of the 49k-string vocabulary (a parser
    only: the reference's arithmetic shares nothing with the engine)."""
    from cfr_atlas.models.gguf_io import _Reader

    return _Reader(path, "r")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_float64_reference(moe_file, arch):
    path = moe_file(arch)
    ref = moe_reference_logits(_reader(path), IDS)
    got = _model(path).logits(IDS, storage_dtype="float32")
    assert np.abs(got - ref).max() < 1e-4  # measured 2.5e-6..3.6e-6 (float32 vs float64)
    assert np.array_equal(got.argmax(1), ref.argmax(1))


@pytest.mark.parametrize("qtype", ["Q8_0", "F32"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_llama_cpp(moe_file, arch, qtype, load_benchmark):
    pytest.importorskip("llama_cpp")
    llamacpp_logits = load_benchmark("llamacpp_ref").llamacpp_logits

    path = moe_file(arch, qtype)
    theirs = llamacpp_logits(path, IDS, threads=1)
    ours = _model(path).logits(IDS)
    assert np.array_equal(ours.argmax(1), theirs.argmax(1))
    assert np.abs(ours - theirs).max() < LLAMACPP_TOL[qtype]


def test_logits_match_llama_cpp_fixture(moe_file):
    """The same comparison without llama.cpp installed (CI): its argmax at every position and
    its top-8 logits per position, stored by make_llamacpp_moe_fixture.py for the exact bytes
    write_tiny_moe writes (sha256 checked, so a changed writer cannot pass on stale data)."""
    import hashlib
    import json

    fixture = json.loads((Path(__file__).parent / "data" / "llamacpp_moe.json").read_text())
    assert fixture["ids"] == IDS
    assert len(fixture["cases"]) == 2 * len(MOE_ARCHS)
    for key, case in fixture["cases"].items():
        arch, qtype = key.split("/")
        path = moe_file(arch, qtype)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == case["sha256"], (
            f"{key}: the tiny file changed; rerun tests/models/make_llamacpp_moe_fixture.py")
        ours = _model(path).logits(IDS)
        assert ours.argmax(1).tolist() == case["argmax"], key
        top = np.array(case["top_ids"])
        diff = np.abs(np.take_along_axis(ours, top, 1) - np.array(case["top_logits"]))
        assert diff.max() < LLAMACPP_TOL[qtype], (key, diff.max())


def test_softmax_rows_sums_each_row_in_expert_order():
    x = np.random.default_rng(5).normal(0, 4, (7, 61)).astype(np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    s = e[:, 0].copy()
    for j in range(1, e.shape[1]):  # the order the docstring promises, one rounding per add
        s += e[:, j]
    assert np.array_equal(softmax_rows(x), e / s[:, None])
    assert np.array_equal(softmax_rows(x[2:3]), softmax_rows(x)[2:3])  # rows independent


def test_route_ties_go_to_the_lowest_expert_id():
    logits = np.array([[0.0, 1.0, 1.0, 0.5, 1.0]], dtype=np.float32)
    top, w = route(logits, 2, norm=False)
    assert top.tolist() == [[1, 2]]
    p = softmax_rows(logits)
    assert np.array_equal(w, p[:, [1, 2]])  # weights are the probabilities before renorm


def test_route_renormalizes_and_scales():
    logits = np.array([[3.0, 1.0, 2.0, -1.0]], dtype=np.float32)
    top, w = route(logits, 2, norm=True)
    assert top.tolist() == [[0, 2]]
    assert abs(float(w.sum()) - 1.0) < 1e-6
    _, ws = route(logits, 2, norm=True, scale=2.5)
    assert np.array_equal(ws, w * np.float32(2.5))


@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe"])
def test_chunked_prefill_and_batches_equal_one_pass(moe_file, arch):
    model = _model(moe_file(arch))
    whole = model.logits(IDS)
    assert np.array_equal(model.logits(IDS, chunk_tokens=5), whole)
    assert np.array_equal(model.logits(IDS, chunk_tokens=1), whole)


def test_budget_on_a_dense_model_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="no experts"):
        load_model(tiny_llama, expert_budget="1MiB")


@pytest.mark.parametrize("regen, budget", [("spill", "16KiB"), ("recompute", "72KiB")])
def test_kv_budget_regenerates_qk_normed_rows_exactly(moe_file, tmp_path, regen, budget):
    """olmoe's QK-norm spans all heads: recompute replays the whole projection per head."""
    model = _model(moe_file("olmoe"))
    ids = list(np.random.default_rng(0).integers(0, 40000, 120))
    kv = {"page_tokens": 16, "chunk_tokens": 40}
    base = model.logits(ids, **kv)
    got = model.logits(ids, kv_budget=budget, regenerator=regen, cache_dir=tmp_path, **kv)
    assert model.last_telemetry["pages_regenerated"] > 0
    assert np.array_equal(got, base)


# --- the benchmark's test weights: routing that stays diverse with depth --------------------


def test_residual_scale_scales_only_what_writes_into_the_residual_stream(moe_file):
    """residual_scale multiplies the attention output and the expert and shared-expert down
    projections (a power of two here, so exactly); every other tensor is the same draw."""
    plain = {t.name: np.array(t.data) for t in _reader(moe_file("qwen2moe", "F32")).tensors}
    small = {t.name: np.array(t.data)
             for t in _reader(moe_file("qwen2moe", "F32", residual_scale=0.25)).tensors}
    assert plain.keys() == small.keys()
    scaled = [n for n in plain if n.endswith(RESIDUAL_OUTPUTS)]
    assert len(scaled) == 3 * 2  # three per layer, two layers
    for name in plain:
        want = plain[name] * np.float32(0.25) if name in scaled else plain[name]
        assert np.array_equal(small[name], want), name


def test_random_blocks_scale_their_block_scales():
    one = random_blocks(np.random.default_rng(3), (2, 4, 64), "Q4_0").view(BLOCK_Q4_0)
    half = random_blocks(np.random.default_rng(3), (2, 4, 64), "Q4_0", 0.5).view(BLOCK_Q4_0)
    assert np.array_equal(half["qs"], one["qs"])
    assert np.array_equal(half["d"], (one["d"].astype(np.float32) / 2).astype(np.float16))


def _top_quarter_share(path, ids) -> list[float]:
    model = load_model(path)
    model.logits(ids)
    return [r["skew"] for r in model.experts.telemetry.routing_report()]


def test_small_residual_scale_keeps_deep_routing_diverse(tmp_path):
    """A deep random model sends every token to the same experts in its later layers (hidden
    states converge with depth); with the residual writes scaled down they stay diverse."""
    from cfr_atlas.testing.tiny_moe import write_tiny_moe

    ids = list(np.random.default_rng(1).integers(0, 40000, 160))
    kw = dict(arch="qwen3moe", n_layers=8, dim=128, n_experts=16, n_used=2, skew=1.0)
    plain = _top_quarter_share(write_tiny_moe(tmp_path / "a.gguf", **kw), ids)
    small = _top_quarter_share(write_tiny_moe(tmp_path / "b.gguf", residual_scale=0.01, **kw),
                               ids)
    print(f"\ntop-quarter share per layer, plain {plain}, residual_scale 0.01 {small}")
    assert min(plain[-3:]) > max(small) + 0.2  # measured 0.76 against 0.40
