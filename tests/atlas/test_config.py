"""`AtlasConfig`: field checks name the field; the versioned JSON form round-trips and refuses
anything it does not understand (unknown fields, duplicate keys, other schema versions)."""

from __future__ import annotations

import json

import pytest

from cfr_atlas import AtlasConfig, ConfigError, KeepRecent, KeepSinksAndRecent

BASE = dict(page_tokens=8, head_dim=16)

BAD_FIELDS = [
    ("page_tokens", 0), ("page_tokens", -8), ("page_tokens", 8.0), ("page_tokens", True),
    ("page_tokens", "8"), ("page_tokens", 1 << 21), ("head_dim", 0), ("head_dim", 1 << 13),
    ("head_dim", 16.5), ("head_dim", None), ("hot_cache_bytes", -1),
    ("hot_cache_bytes", (1 << 40) + 1), ("hot_cache_bytes", 1.5e3), ("hot_cache_bytes", False),
    ("split_pages", 0), ("scale", 0.0), ("scale", -1.0), ("scale", float("nan")),
    ("scale", float("inf")), ("scale", True), ("scale", "0.1"),
    ("admit_regenerated_pages", 1), ("wipe_scratch_after_use", "yes"),
    ("storage_dtype", "float8"), ("storage_dtype", "fp16"), ("storage_dtype", None),
    ("storage_dtype", ["float16"]), ("max_scratch_tokens", 0), ("max_scratch_tokens", 4),
    ("max_scratch_tokens", 12), ("max_scratch_tokens", 8.0),
    ("max_scratch_tokens", (1 << 40) // 128 + 8),
]


@pytest.mark.parametrize("name,value", BAD_FIELDS, ids=[f"{n}={v!r}" for n, v in BAD_FIELDS])
def test_bad_field_raises_config_error_naming_it(name, value):
    with pytest.raises(ConfigError) as info:
        AtlasConfig(**{**BASE, name: value})
    assert info.value.field == name
    assert str(info.value).startswith(name)


@pytest.mark.parametrize("budgets,field", [
    ({-1: 100}, "layer_budgets (layer)"), ({True: 100}, "layer_budgets (layer)"),
    ({0: -5}, "layer_budgets[0]"), ({2: 2.5}, "layer_budgets[2]"),
    ({1: (1 << 40) + 1}, "layer_budgets[1]"),
])
def test_bad_layer_budgets(budgets, field):
    with pytest.raises(ConfigError) as info:
        AtlasConfig(**BASE, layer_budgets=budgets)
    assert info.value.field == field


def test_sizes_at_the_limits_are_accepted():
    big = AtlasConfig(page_tokens=1 << 20, head_dim=1 << 12, hot_cache_bytes=1 << 40,
                      storage_dtype="float32")
    assert big.page_bytes == (1 << 20) * 2 * (1 << 12) * 4 <= 1 << 40
    assert AtlasConfig(**BASE, max_scratch_tokens=24).scratch_pages == 3


def test_derived_sizes():
    cfg = AtlasConfig(page_tokens=8, head_dim=16, storage_dtype="bfloat16")
    assert (cfg.row_bytes, cfg.page_bytes, cfg.scratch_tokens) == (64, 512, 8)
    assert AtlasConfig(**BASE).query_scale() == 0.25
    assert AtlasConfig(**BASE, scale=0.5).query_scale() == 0.5


@pytest.mark.parametrize("cfg", [
    AtlasConfig(**BASE),
    AtlasConfig(page_tokens=4, head_dim=12, hot_cache_bytes=4096, scale=0.3,
                admit_regenerated_pages=True, max_scratch_tokens=12, wipe_scratch_after_use=False,
                storage_dtype="bfloat16", layer_budgets={3: 100, 0: 2048}, split_pages=5),
])
def test_json_round_trip(cfg):
    text = cfg.to_json()
    assert json.loads(text)["schema"] == 1
    back = AtlasConfig.from_json(text)
    assert back == cfg
    assert back.to_json() == text


def _json(**changes) -> str:
    body = json.loads(AtlasConfig(**BASE, layer_budgets={0: 64}).to_json())
    body.update(changes)
    return json.dumps(body)


BAD_JSON = {
    "unknown field": (_json(page_size=8), "page_size"),
    "duplicate key": ('{"schema": 1, "page_tokens": 8, "head_dim": 16, "page_tokens": 4}',
                      "page_tokens"),
    "duplicate nested key": ('{"schema": 1, "page_tokens": 8, "head_dim": 16, '
                             '"layer_budgets": {"0": 1, "0": 2}}', "0"),
    "missing page_tokens": ('{"schema": 1, "head_dim": 16}', "page_tokens"),
    "missing head_dim": ('{"schema": 1, "page_tokens": 8}', "head_dim"),
    "missing schema": ('{"page_tokens": 8, "head_dim": 16}', "schema"),
    "schema 2": (_json(schema=2), "schema"),
    "schema true": (_json(schema=True), "schema"),
    "schema string": (_json(schema="1"), "schema"),
    "page_tokens string": (_json(page_tokens="8"), "page_tokens"),
    "page_tokens float": (_json(page_tokens=8.0), "page_tokens"),
    "head_dim null": (_json(head_dim=None), "head_dim"),
    "admit as 0": (_json(admit_regenerated_pages=0), "admit_regenerated_pages"),
    "storage dtype number": (_json(storage_dtype=16), "storage_dtype"),
    "scale NaN": ('{"schema": 1, "page_tokens": 8, "head_dim": 16, "scale": NaN}', "scale"),
    "layer_budgets list": (_json(layer_budgets=[1, 2]), "layer_budgets"),
    "layer key not int": (_json(layer_budgets={"x": 1}), "layer_budgets"),
    "layer key negative": (_json(layer_budgets={"-1": 1}), "layer_budgets"),
    "layer budget string": (_json(layer_budgets={"0": "64"}), "layer_budgets[0]"),
    "not an object": ("[1, 2]", "json"),
    "not json": ("{page_tokens: 8", "json"),
}


@pytest.mark.parametrize("name", BAD_JSON)
def test_bad_json_raises_config_error(name):
    text, field = BAD_JSON[name]
    with pytest.raises(ConfigError) as info:
        AtlasConfig.from_json(text)
    assert info.value.field == field


@pytest.mark.parametrize("make", [lambda: KeepRecent(-1), lambda: KeepRecent(1.5),
                                  lambda: KeepSinksAndRecent(True, 4),
                                  lambda: KeepSinksAndRecent(4, -4)])
def test_policy_arguments_are_checked(make):
    with pytest.raises(ConfigError):
        make()
