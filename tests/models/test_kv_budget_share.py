"""`kv_budget` as a share of the full K/V at the context limit ("10%"): resolved to bytes in one
place (`resolve_kv_budget`) from the model's geometry and the storage dtype, exact like any
other budget, and a share outside (0%, 100%] refused with the field's name and an example."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError
from cfr_atlas.models.session import check_kv_budget, resolve_kv_budget

PAGE = 4


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama)


def full_bytes(model, limit: int, itemsize: int) -> int:
    """K + V of `limit` tokens: every layer, every K/V head, head_dim values each."""
    c = model.config
    return limit * 2 * c.n_layers * c.n_kv_heads * c.head_dim * itemsize


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float16", 2), ("bfloat16", 2)])
@pytest.mark.parametrize("share, num, den", [("10%", 1, 10), ("100%", 1, 1),
                                             ("12.5%", 1, 8), (" 50 %", 1, 2)])
def test_a_share_is_bytes_of_the_full_kv_at_the_context_limit(model, tmp_path, dtype, itemsize,
                                                              share, num, den):
    limit = 1000
    s = model.session(kv_budget=share, context_limit=limit, storage_dtype=dtype,
                      page_tokens=PAGE, cache_dir=tmp_path)
    assert s.budget == full_bytes(model, limit, itemsize) * num // den
    assert s.telemetry_summary()["budget_bytes"] == s.budget
    s.close()


@pytest.mark.parametrize("value", ["0%", "0.0%", "101%", "100.5%", "-5%", "%", "ten%", "1e1%",
                                   "10%%", "nan%", "1000%", "5 0%"])
def test_a_share_outside_0_to_100_is_refused_by_name(model, tmp_path, value):
    for call in (lambda: check_kv_budget(value), lambda: resolve_kv_budget(value, 10**6),
                 lambda: model.generate([1, 2, 3], max_tokens=1, kv_budget=value,
                                        cache_dir=tmp_path)):
        with pytest.raises(ConfigError, match=r"^kv_budget: .*e\.g\. 10%"):
            call()


def test_sizes_still_read_as_sizes():
    assert check_kv_budget("16MiB") == resolve_kv_budget("16MiB", 1) == 16 << 20
    assert check_kv_budget(" 7% ") == "7%" and resolve_kv_budget(4096, 1) == 4096


def test_generation_under_a_share_is_bitwise_the_unbounded_one(model, tmp_path):
    ids = np.random.default_rng(5).integers(0, 256, 150).tolist()
    kv = {"page_tokens": PAGE, "storage_dtype": "float32"}
    want = model.generate(ids, max_tokens=6, **kv)
    sha = model.last_telemetry["logits_sha256"]
    got = model.generate(ids, max_tokens=6, kv_budget="25%", cache_dir=tmp_path, **kv)
    t = model.last_telemetry
    assert got == want and t["logits_sha256"] == sha
    budget = full_bytes(model, len(ids) + 6, 4) // 4  # Model.generate's limit: prompt + max
    assert t["budget_bytes"] == budget and t["peak_allocated_kv_bytes"] <= budget
    assert t["pages_regenerated"] > 0  # the share really bit


def test_a_share_below_the_fixed_bytes_names_the_smallest(model, tmp_path):
    with pytest.raises(ConfigError, match="smallest accepted budget"):
        model.session(kv_budget="0.01%", context_limit=100, page_tokens=PAGE, cache_dir=tmp_path)
