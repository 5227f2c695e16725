"""The Llama-family forward pass on tiny GGUF files: accuracy, batch invariance, exact budgets.

Tolerance against the float64 reference: the engine computes in float32 with float32
activations (the reference dequantizes the same stored weights to float64), so the error is
float32 rounding through 2 layers; we allow 2e-3 * max|logit| (observed ~1e-5 relative).

16-bit K/V (float16 is the default storage) against the reference with K/V rounded the same
way (`reference_logits(..., kv_round=...)`): ROUNDED_TOL = 1.5e-4 * max|logit|. Measured
(2026-11-30, 2 and 4 layers, F32/Q8_0/Q4_1, llama and qwen2): float16 <= 7.9e-5, bfloat16
<= 5.4e-5, while float16 storage against the unrounded reference (or float32 storage against
the rounded one) is >= 3.6e-4: the bound tells rounding as stored from no rounding.
"""

import numpy as np
import pytest
from reference import reference_logits

from cfr_atlas.atlas import LRU, KeepAll, KeepRecent, KeepSinksAndRecent, NeverAdmit
from cfr_atlas.engine import load_model
from cfr_atlas.models.session import fixed_kv_bytes

ROUNDED_TOL = 1.5e-4  # |engine - rounded reference| / max|logit|; see the module docstring
IDS = [5, 77, 300, 12, 9, 256, 257, 1, 42, 99, 150, 3, 7, 8, 431, 200, 18, 64, 65, 66, 10]


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return load_model(tiny_llama)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "mixed"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_float64_reference(tiny_gguf, arch, qtype):
    path = tiny_gguf(arch=arch, qtype=qtype, n_layers=2)
    got = load_model(path).logits(IDS, storage_dtype="float32")
    ref = reference_logits(path, IDS)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("n_layers", [2, 4])
def test_16bit_storage_matches_reference_rounding_the_same_way(tiny_gguf, arch, qtype, n_layers):
    path = tiny_gguf(arch=arch, qtype=qtype, n_layers=n_layers)
    model = load_model(path)
    unrounded = reference_logits(path, IDS)
    scale = np.abs(unrounded).max()
    default = model.logits(IDS)  # float16 K/V unless asked otherwise
    assert np.array_equal(default, model.logits(IDS, storage_dtype="float16"))
    for dtype in ("float16", "bfloat16"):
        ref = reference_logits(path, IDS, kv_round=dtype)
        got = default if dtype == "float16" else model.logits(IDS, storage_dtype=dtype)
        assert np.abs(got - ref).max() <= ROUNDED_TOL * scale, dtype
        assert np.abs(got - unrounded).max() > ROUNDED_TOL * scale, dtype  # rounding shows
        assert np.array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_logits_do_not_depend_on_chunking(llama, chunk):
    base = llama.logits(IDS, chunk_tokens=len(IDS))
    assert np.array_equal(llama.logits(IDS, chunk_tokens=chunk), base)


def test_next_logits_is_last_row(llama):
    assert np.array_equal(llama.next_logits(IDS), llama.logits(IDS)[-1])


@pytest.mark.parametrize("regen", ["spill", "recompute"])
@pytest.mark.parametrize("budget", [0, 1, 3, 8, 1000])  # in pages of one head
@pytest.mark.parametrize("policy", [KeepRecent(4), KeepSinksAndRecent(4, 4), LRU(), KeepAll(),
                                    NeverAdmit()])
def test_budgeted_logits_are_bitwise_equal(llama, tmp_path, budget, policy, regen):
    page = 4
    base = llama.logits(IDS, page_tokens=page)
    page_bytes = page * llama.config.head_dim * 2 * 2  # K + V of one page, float16 (default)
    # what the sequence allocates before any page is hot: scratch, staging, the page read
    # buffer (spill) or the kept layer inputs (recompute); the rest holds `budget` slots
    reserved = sum(fixed_kv_bytes(llama.config, regenerator=regen, page_tokens=page,
                                  context_limit=len(IDS)).values())
    got = llama.logits(IDS, page_tokens=page, kv_budget=reserved + budget * page_bytes,
                       policy=policy,
                       cache_dir=tmp_path, chunk_tokens=5, regenerator=regen)
    assert np.array_equal(got, base)
    if budget < 8:
        assert llama.last_telemetry["pages_regenerated"] > 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_budgeted_16bit_storage_is_bitwise_equal(llama, tmp_path, dtype):
    base = llama.logits(IDS, page_tokens=4, storage_dtype=dtype)
    got = llama.logits(IDS, page_tokens=4, storage_dtype=dtype, kv_budget="2KiB",
                       cache_dir=tmp_path, chunk_tokens=2)
    assert np.array_equal(got, base)
    f32 = llama.logits(IDS, page_tokens=4, storage_dtype="float32")
    assert not np.array_equal(f32, base)  # the storage dtype really is in effect
    assert np.abs(f32 - base).max() <= 0.05 * np.abs(f32).max()


def test_greedy_generation_is_deterministic_and_budget_independent(llama, tmp_path):
    a = llama.generate("the cat", max_tokens=12)
    b = llama.generate("the cat", max_tokens=12, kv_budget="2KiB", page_tokens=4,
                       cache_dir=tmp_path)
    assert a == b and len(a) > 0


def test_seeded_sampling_repeats(llama):
    kw = dict(max_tokens=10, temperature=0.9, top_k=40, seed=7)
    assert llama.generate("the dog", **kw) == llama.generate("the dog", **kw)
