"""ADAPTERS.md's conformance sequence on the bundled SmolLM2-135M, for both regenerators.

1. rows: for every layer and K/V head, the rows each regenerator writes for the first, a
   middle and the partial last page equal the rows the unbounded path stored (bitwise);
2. attention: a fold over regenerated pages equals the fold over stored pages (bitwise);
3. logits: a budgeted run equals the unbounded run at every position (bitwise).
CONFORMANCE_TOKENS (default 2048: eight 256-token pages per layer and head, the last partial)
sets the context of steps 1-2; step 3 uses 1,024 tokens. Both keep the suite short: the prefill
of 4,096 tokens cost ~48 s per regenerator on 2 cores; `cfr-atlas validate` runs step 3 at
8,192 by default, and the real models validate at 4,096 in tests/models/test_real_models.py.
"""

import os

import numpy as np
import pytest

from cfr_atlas.atlas import Atlas, AtlasConfig, NeverAdmit, PageKey, round_rows, widen
from cfr_atlas.engine import load_model
from cfr_atlas.generate import prefill
from cfr_atlas.validate import run_validation, validation_text

pytestmark = pytest.mark.slow
N = int(os.environ.get("CONFORMANCE_TOKENS", "2048"))
PAGE = 256


@pytest.fixture(scope="module")
def model(bundled_model_path):
    return load_model(bundled_model_path)


@pytest.fixture(scope="module")
def ids(model):
    return np.array(model.tokenize(validation_text())[:N - 3], dtype=np.int64)  # partial tail


def _stored_rows(session, key: PageKey, n: int):
    rows = session.atlas.cache.read(key, n)
    assert rows is not None, "the unbounded path must hold every page"
    dt = session.atlas.config.dtype
    return widen(rows[0], dt), widen(rows[1], dt)


@pytest.mark.parametrize("regen", ["spill", "recompute"])
def test_rows_then_attention_match_the_stored_path(model, ids, tmp_path, regen):
    c = model.config
    s = model.session(kv_budget="4GiB", regenerator=regen, page_tokens=PAGE, cache_dir=tmp_path,
                      context_limit=N)
    prefill(model.net, s, ids)  # budget holds everything: rows resident AND in the regenerator
    n_pages = -(-len(ids) // PAGE)
    rng = np.random.default_rng(0)
    for layer in range(c.n_layers):
        for head in range(c.n_kv_heads):
            for p in (0, n_pages // 2, n_pages - 1):
                key = PageKey(layer, head, p * PAGE)
                n = min(PAGE, len(ids) - p * PAGE)
                k_ref, v_ref = _stored_rows(s, key, n)
                k, v = np.empty_like(k_ref), np.empty_like(v_ref)
                s.backend.regenerate_page(key, range(key.start_token, key.start_token + n), k, v)
                # float32 rows, rounded once by the runtime (ADAPTERS.md): spill's are already
                # in the storage dtype, recompute's are the full path's rows before rounding
                dt = s.atlas.config.dtype
                k, v = (widen(round_rows(r, dt), dt) for r in (k, v))
                assert np.array_equal(k, k_ref) and np.array_equal(v, v_ref), key
        q = rng.standard_normal((1, c.n_kv_heads, c.group, c.head_dim)).astype(np.float32)
        stored = s.atlas.attend_heads(s.backend, layer, range(c.n_kv_heads), q, len(ids))
        cold = Atlas(AtlasConfig(page_tokens=PAGE, head_dim=c.head_dim,
                                 storage_dtype=s.atlas.config.storage_dtype))
        regenerated = cold.attend_heads(s.backend, layer, range(c.n_kv_heads), q, len(ids),
                                        NeverAdmit())
        assert np.array_equal(stored, regenerated)
        assert cold.telemetry().total.regenerations == c.n_kv_heads * n_pages
    s.close()


@pytest.fixture(scope="module")
def unbounded_logits(model, ids):
    return model.logits(ids[:1024])


@pytest.mark.parametrize("regen", ["spill", "recompute"])
def test_budgeted_logits_match_at_every_position(model, ids, unbounded_logits, tmp_path, regen):
    part, base = ids[:1024], unbounded_logits
    # recompute also pays for its kept layer inputs (69,120 B per token here)
    inputs = 0 if regen == "spill" else len(part) * model.config.n_layers * model.config.dim * 4
    got = model.logits(part, kv_budget=(1 << 20) + inputs, regenerator=regen,
                       cache_dir=tmp_path, chunk_tokens=100)
    assert np.array_equal(got, base)
    assert model.last_telemetry["pages_regenerated"] > 0


def test_validate_small(model, tmp_path):
    report = run_validation(model, tokens=600, kv_budget="1MiB", continuation=8,
                            cache_dir=tmp_path, progress=False)
    assert report.passed, report.table()
    assert report.telemetry["peak_resident_kv_bytes"] <= 1 << 20


@pytest.mark.parametrize("compare", ["hidden", "logits"])
def test_validate_detects_one_changed_bit(model, tmp_path, monkeypatch, compare):
    """Both modes pass on the real engine, and fail at the right position when the budgeted
    session's result differs in one bit of one row of a middle chunk (hidden states in "hidden"
    mode, logits in "logits" mode: whatever that mode compares).

    One run per mode: the changed chunk is checked equal to the full session's before its bit
    is changed, and every other position and the continuation are the report's (a second run
    without the change would compare the same numbers again)."""
    kw = dict(tokens=300, kv_budget="1MiB", continuation=4, chunk_tokens=128, cache_dir=tmp_path,
              progress=False, compare=compare)
    forward = model.net.forward_chunk
    full_rows, changed = [], []

    def one_bit_off(session, ids, **opts):
        out = forward(session, ids, **opts)
        if session.n_tokens == 256:  # after the second chunk: the full session runs first
            if session.budget is None:
                full_rows.append(out.copy())
            else:
                assert np.array_equal(out, full_rows[-1])  # the real engine passes here too
                out[5, 3] = np.nextafter(out[5, 3], np.float32(np.inf))
                changed.append((5, 3))  # the entry whose bit changed
        return out

    monkeypatch.setattr(model.net, "forward_chunk", one_bit_off)
    report = run_validation(model, **kw)
    assert len(full_rows) == len(changed) == 1
    assert not report.passed and report.first_mismatch == 128 + 5
    assert report.positions_equal == 299
    assert report.continuation_equal and len(report.tokens_full) == 4  # passed but for the bit


def test_greedy_generation_is_deterministic_run_to_run(model, tmp_path):
    prompt = model.chat_ids([{"role": "user", "content": "Name three colours."}])
    first = model.generate(prompt, max_tokens=24)
    fingerprint = model.last_telemetry["logits_sha256"]
    assert model.generate(prompt, max_tokens=24) == first
    assert model.last_telemetry["logits_sha256"] == fingerprint
    budgeted = model.generate(prompt, max_tokens=24, kv_budget="512KiB", cache_dir=tmp_path)
    assert budgeted == first and model.last_telemetry["logits_sha256"] == fingerprint


@pytest.mark.parametrize("dtype, per_token", [(None, 23_040), ("float32", 46_080)])
def test_full_kv_bytes_per_token_of_the_storage_dtype(model, ids, dtype, per_token):
    """float16 by default: 2 x 30 layers x 3 K/V heads x 64 x 2 bytes = 23,040 per token."""
    kv = {} if dtype is None else {"storage_dtype": dtype}
    model.logits(ids[:16], **kv)
    assert model.last_telemetry["full_kv_bytes"] == 16 * per_token
    assert model.config.kv_bytes_per_token() == 23_040
