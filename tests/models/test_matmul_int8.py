"""A model loaded with matmul="int8" keeps every exactness guarantee of the float path: logits
bitwise independent of chunking, of the K/V budget and of the regenerator (spill and recompute,
which replays the K/V projections through per-head weights of the same arithmetic), on tiny
models with one format and with all formats mixed (K and V of different types)."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError

IDS = np.random.default_rng(0).integers(0, 256, size=96).astype(np.int64)


@pytest.fixture(scope="module", params=["Q4_1", "mixed"])
def models(request, tiny_gguf):
    path = tiny_gguf(arch="llama", qtype=request.param, n_layers=2)
    return load_model(path, matmul="int8"), load_model(path)


def test_int8_is_close_to_float_but_its_own_arithmetic(models):
    int8, flt = models
    a, b = int8.logits(IDS), flt.logits(IDS)
    assert not np.array_equal(a, b)  # the int8 path really ran
    assert np.max(np.abs(a - b)) <= 0.05 * np.max(np.abs(b))


def test_chunking_does_not_change_int8_logits(models):
    int8, _ = models
    base = int8.logits(IDS)
    assert np.array_equal(int8.logits(IDS, chunk_tokens=7), base)
    assert np.array_equal(int8.logits(IDS, chunk_tokens=1)[:40], int8.logits(IDS[:40]))


@pytest.mark.parametrize("regen", ["spill", "recompute"])
def test_budget_and_regenerator_do_not_change_int8_logits(models, tmp_path, regen):
    int8, _ = models
    base = int8.logits(IDS, page_tokens=4)
    kept_inputs = 0 if regen == "spill" else 96 * 2 * 64 * 4  # recompute keeps layer inputs
    got = int8.logits(IDS, kv_budget=3072 + 768 + kept_inputs, page_tokens=4, regenerator=regen,
                      cache_dir=tmp_path, chunk_tokens=10)
    assert np.array_equal(got, base)
    assert int8.last_telemetry["pages_regenerated"] > 0


def test_int8_prefix_identity_differs(models):
    int8, flt = models
    assert int8.identity != flt.identity and len(int8.identity) == len(flt.identity)


def test_unknown_matmul_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match=r"matmul: 'fp8' is not one of \['float', 'int8'\]"):
        load_model(tiny_llama, matmul="fp8")


@pytest.fixture(scope="module", params=["gemma3", "deepseek2"])
def other_family(request, tmp_path_factory):
    from cfr_atlas.testing.tiny_deepseek2 import write_tiny_deepseek2
    from cfr_atlas.testing.tiny_gemma3 import write_tiny_gemma3

    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    write = write_tiny_gemma3 if request.param == "gemma3" else write_tiny_deepseek2
    return load_model(write(path, qtype="Q8_0"), matmul="int8")


def test_other_families_take_the_refined_integer_head(other_family):
    """Gemma 3 and DeepSeek2 load the head in the int8 layout and apply matmul_refined (not one
    8-bit pass); their int8 logits stay independent of chunking."""
    net = other_family.net
    head = net.weights.output if hasattr(net, "weights") else net.output
    assert head.integer
    h = np.random.default_rng(1).standard_normal((3, head.shape[1])).astype(np.float32)
    assert not np.array_equal(head.matmul_refined(h), head.matmul(h))
    ids = IDS[:40]
    base = other_family.logits(ids)
    assert np.array_equal(other_family.logits(ids, chunk_tokens=7), base)
    last = net.forward_chunk(other_family.session(), ids, all_logits=False, hidden=True)
    apply = net.head if hasattr(net, "head") else head.matmul_refined  # DeepSeek2: no cap
    assert np.array_equal(apply(last), base[-1:])  # the normed final row through the head
