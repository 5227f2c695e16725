"""deepseek2 (MLA) from tiny files: absorbed attention through the latent K/V stream.

Against a float64 NumPy reference of the NON-absorbed form (tests/models/deepseek2_reference.py,
no engine code: agreement proves the absorption), across the query paths (direct, low rank),
the up-projection layouts (attn_k_b/attn_v_b, fused attn_kv_b), dense and MoE blocks (softmax
and sigmoid gating) and YaRN; budgeted == unbounded bitwise for both regenerators and several
budgets and policies; chunking never changes a bit; the cache stores one latent row per token.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from cfr_atlas.atlas import KeepSinksAndRecent
from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError, ModelFormatError
from cfr_atlas.models.session import Session
from cfr_atlas.testing.tiny_deepseek2 import write_tiny_deepseek2

sys.path.insert(0, str(Path(__file__).parent))
from deepseek2_reference import deepseek2_reference_logits  # noqa: E402

IDS = [5, 77, 300, 12, 40, 1000, 2000, 31, 9, 44, 4, 900]
CASES = {
    "lowrank-moe": dict(low_rank=True, moe=True),
    "direct-dense-fused": dict(low_rank=False, moe=False, fused=True),
    "direct-moe-sigmoid-yarn": dict(low_rank=False, moe=True, sigmoid=True,
                                    yarn=(4.0, 32, 0.1)),
}


@pytest.fixture(scope="module")
def ds_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek2")

    def make(case: str, qtype: str = "Q8_0"):
        path = folder / f"{case}-{qtype}.gguf"
        if not path.exists():
            write_tiny_deepseek2(path, qtype=qtype, **CASES[case])
        return path
    return make


@lru_cache(maxsize=4)
def _model(path):
    return load_model(path)


def _reader(path):
    from cfr_atlas.models.gguf_io import _Reader  # a parser only; no arithmetic is shared

    return _Reader(path, "r")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_float64_non_absorbed_reference(ds_file, case):
    path = ds_file(case)
    ref = deepseek2_reference_logits(_reader(path), IDS)
    got = _model(path).logits(IDS, storage_dtype="float32")
    # float32 absorbed vs float64 decompressed: measured max |diff| 4.4e-6..1.4e-5 (|logit| < 12)
    assert np.abs(got - ref).max() < 1e-4
    assert np.array_equal(got.argmax(1), ref.argmax(1))


# llama.cpp (llama-cpp-python 0.3.36) on the same files, our default float16 K/V. F32 weights
# isolate the architecture's math (absorption, YaRN, gating): measured max |diff| 0.008-0.018.
# Q8_0: llama.cpp rounds activations to Q8_0 blocks before each product, we multiply float32
# activations (our float64 reference agrees with us to 1.4e-5 on these files): the dense file
# measured 0.24; the MoE files differ more (max 0.58-3.7, argmax 92% of positions: their expert
# outputs are scaled by 2.5 and the tiny random logits are close), so CI compares those at F32.
LLAMACPP = [("lowrank-moe", "F32"), ("direct-dense-fused", "F32"),
            ("direct-moe-sigmoid-yarn", "F32"), ("direct-dense-fused", "Q8_0")]
LLAMACPP_TOL = {"F32": 0.05, "Q8_0": 0.35}


@pytest.mark.parametrize("case, qtype", LLAMACPP)
def test_logits_match_llama_cpp(ds_file, case, qtype, load_benchmark):
    pytest.importorskip("llama_cpp")
    llamacpp_logits = load_benchmark("llamacpp_ref").llamacpp_logits

    path = ds_file(case, qtype)
    theirs = llamacpp_logits(path, IDS, threads=1)
    ours = _model(path).logits(IDS)
    assert np.array_equal(ours.argmax(1), theirs.argmax(1))
    assert np.abs(ours - theirs).max() < LLAMACPP_TOL[qtype]


def test_logits_match_llama_cpp_fixture(ds_file):
    """The same comparison without llama.cpp (CI), from make_llamacpp_deepseek2_fixture.py's
    stored argmax and top-8 logits for the exact bytes written (sha256 checked)."""
    import hashlib
    import json

    fixture = json.loads((Path(__file__).parent / "data" / "llamacpp_deepseek2.json").read_text())
    assert fixture["ids"] == IDS and sorted(fixture["cases"]) == sorted(
        f"{c}/{q}" for c, q in LLAMACPP)
    for key, case in fixture["cases"].items():
        name, qtype = key.split("/")
        path = ds_file(name, qtype)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == case["sha256"], (
            f"{key}: the tiny file changed; rerun make_llamacpp_deepseek2_fixture.py")
        ours = _model(path).logits(IDS)
        assert ours.argmax(1).tolist() == case["argmax"], key
        top = np.array(case["top_ids"])
        diff = np.abs(np.take_along_axis(ours, top, 1) - np.array(case["top_logits"]))
        assert diff.max() < LLAMACPP_TOL[qtype], (key, diff.max())


def test_the_cache_holds_one_latent_row_per_token(ds_file):
    model = _model(ds_file("lowrank-moe"))
    c = model.net.config
    session = Session(model.net, kv_budget=None, storage_dtype="float32", page_tokens=16)
    cfg = session.atlas.config
    assert (cfg.head_dim, cfg.value_dim, cfg.stored_value_dim) == (48, 32, 0)  # r + R, r
    assert cfg.row_bytes == 48 * 4  # K only: V is a view of its first 32 columns
    model.net.forward_chunk(session, np.asarray(IDS))
    assert session.atlas.cache.v.shape[2] == 0
    assert session.atlas.telemetry().resident_bytes == len(IDS) * c.n_layers * 48 * 4
    assert c.kv_bytes(len(IDS), 4) == len(IDS) * c.n_layers * 48 * 4
    session.close()


@pytest.mark.parametrize("case", ["lowrank-moe", "direct-dense-fused"])
def test_chunked_prefill_equals_one_pass(ds_file, case):
    model = _model(ds_file(case))
    whole = model.logits(IDS)
    assert np.array_equal(model.logits(IDS, chunk_tokens=5), whole)
    assert np.array_equal(model.logits(IDS, chunk_tokens=1), whole)


@pytest.mark.parametrize("regen, budget, policy", [
    ("spill", "10%", None), ("spill", "6KiB", KeepSinksAndRecent(16, 16)),
    ("recompute", "210KiB", None), ("recompute", "200KiB", KeepSinksAndRecent(16, 32))])
@pytest.mark.parametrize("case", ["lowrank-moe", "direct-moe-sigmoid-yarn"])
def test_any_budget_equals_unbounded_bitwise(ds_file, tmp_path, case, regen, budget, policy):
    model = _model(ds_file(case))
    ids = list(np.random.default_rng(1).integers(0, 40000, 100))
    kv = {"page_tokens": 16, "chunk_tokens": 30, "context_limit": 256}  # full K/V 72 KiB
    base = model.logits(ids, **kv)
    got = model.logits(ids, kv_budget=budget, regenerator=regen, cache_dir=tmp_path,
                       policy=policy, **kv)
    assert model.last_telemetry["pages_regenerated"] > 0
    assert np.array_equal(got, base)


def test_generation_under_a_budget_equals_unbounded(ds_file, tmp_path):
    model = _model(ds_file("lowrank-moe"))
    prompt = list(np.random.default_rng(2).integers(0, 40000, 50))
    kv = {"page_tokens": 16, "context_limit": 256}
    full = model.generate(prompt, max_tokens=12, **kv)
    full_sha = model.last_telemetry["logits_sha256"]
    small = model.generate(prompt, max_tokens=12, kv_budget="10%", cache_dir=tmp_path, **kv)
    assert model.last_telemetry["pages_regenerated"] > 0
    assert (small, model.last_telemetry["logits_sha256"]) == (full, full_sha)


def _rewrite(src: Path, dst: Path, drop: str | None = None, set_: tuple | None = None) -> Path:
    """A copy of a tiny file with one metadata key dropped or replaced (string value)."""
    from gguf import GGUFWriter

    r = _reader(src)
    w = GGUFWriter(dst, "deepseek2")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name == drop:
            continue
        if set_ and f.name == set_[0]:
            continue
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    if set_:
        w.add_string(set_[0], set_[1])
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bad_metadata_is_a_typed_error(ds_file, tmp_path):
    src = ds_file("direct-dense-fused")
    missing = _rewrite(src, tmp_path / "a.gguf", drop="deepseek2.attention.kv_lora_rank")
    with pytest.raises(ModelFormatError, match="kv_lora_rank"):
        load_model(missing)
    linear = _rewrite(src, tmp_path / "b.gguf", set_=("deepseek2.rope.scaling.type", "linear"))
    with pytest.raises(ModelFormatError, match="linear"):
        load_model(linear)


def test_prefix_cache_is_refused_for_the_latent_stream(ds_file):
    model = _model(ds_file("direct-dense-fused"))
    with pytest.raises(ConfigError, match="latent"):
        Session(model.net, prefix=object())
