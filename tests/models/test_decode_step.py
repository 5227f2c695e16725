"""The decode step (models/decode.py) is forward_layers' arithmetic for one token, bit for bit:
token-by-token logits with the step equal those with it switched off, and those of one prefill,
for llama, qwen2 (biases) and Gemma 3 (QK-norm, post-norms, GeGLU, sliding windows), Q8_0, Q4_1
and mixed formats, both arithmetics, every storage dtype, budgets and both exact regenerators
across page boundaries; errors are the general path's; threads share a model safely."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import NumericError
from cfr_atlas.models.decode import DecodeStep

IDS = np.random.default_rng(3).integers(0, 256, size=40).astype(np.int64)


def _decode(model, ids, step_on: bool, telemetry: list | None = None, **kv) -> np.ndarray:
    """Logits of every position, one token per forward_chunk call (decode_step on or off);
    the session's Atlas telemetry appended to `telemetry` (timings left out)."""
    net = model.net
    saved = net.decode_step
    net.decode_step = saved if step_on else None
    try:
        s = model.session(context_limit=len(ids), **kv)
        try:
            out = np.concatenate([net.forward_chunk(s, ids[i:i + 1]) for i in range(len(ids))])
            if telemetry is not None:
                t = s.atlas.telemetry()
                telemetry.append({**{k: v for k, v in vars(t.total).items()
                                     if not k.endswith("seconds")},
                                  "resident": t.resident_bytes, "held": t.held_bytes,
                                  "allocated": t.allocated_bytes, "pages": t.resident_pages})
            return out
        finally:
            s.close()
    finally:
        net.decode_step = saved


@pytest.fixture(scope="module", params=[("llama", "Q8_0"), ("qwen2", "Q4_1"),
                                        ("qwen2", "mixed"), ("gemma3", "Q4_1")])
def path(request, tiny_gguf):
    arch, qtype = request.param
    if arch == "gemma3":  # 7 layers: 6 local (window 24 < the 40 tokens) and one global
        from cfr_atlas.testing.tiny_gemma3 import write_tiny_gemma3

        folder = tiny_gguf(arch="llama", qtype="Q8_0").parent
        return write_tiny_gemma3(folder / f"gemma3_step_{qtype}.gguf", qtype=qtype)
    return tiny_gguf(arch=arch, qtype=qtype, n_layers=2)


@pytest.mark.parametrize("matmul", ["float", "int8"])
@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32"])
def test_step_equals_the_general_path_and_prefill(path, matmul, storage, monkeypatch):
    from cfr_atlas.atlas.batch_walk import HotWalks
    from cfr_atlas.atlas.runtime import Atlas

    model = load_model(path, matmul=matmul)
    assert model.net.decode_step is not None
    walks, real = [], Atlas.decode_attend

    def spy(self, *a, **k):  # which calls the compiled walk served
        out = real(self, *a, **k)
        walks.append(out is not None)
        return out

    def spy_walks(self, *a, **k):  # a step's walks through HotWalks (one sequence: the default)
        ok = real_run(self, *a, **k)
        walks.extend([True] * int(ok.sum()))
        return ok

    real_run = HotWalks.run
    monkeypatch.setattr(Atlas, "decode_attend", spy)
    monkeypatch.setattr(HotWalks, "run", spy_walks)
    tel: list = []
    on = _decode(model, IDS, True, tel, storage_dtype=storage, page_tokens=8)
    off = _decode(model, IDS, False, tel, storage_dtype=storage, page_tokens=8)
    assert np.array_equal(on, off)
    assert np.array_equal(on, model.logits(IDS, storage_dtype=storage, page_tokens=8))
    assert tel[0] == tel[1]  # counters, residency and allocations alike
    n = model.config.n_layers
    # the compiled walk (HotWalks' or the per-sequence call's) served every token but a
    # page's first (5 of 40 with 8-token pages), which took the general call
    assert walks.count(True) == 35 * n and walks.count(False) == 5 * n


@pytest.mark.parametrize("regen", ["spill", "recompute"])
def test_step_under_a_budget_equals_unbounded(path, tmp_path, regen):
    model = load_model(path, matmul="int8")
    base = _decode(model, IDS, False, page_tokens=4)
    c = model.config
    kept = 0 if regen == "spill" else len(IDS) * c.n_layers * c.dim * 4  # recompute's inputs
    page = 4 * c.head_dim * 2 * 2  # K + V of a page, float16
    kv = dict(kv_budget=4 * page + 768 + kept, page_tokens=4, regenerator=regen,
              cache_dir=tmp_path)
    s = model.session(context_limit=len(IDS), **kv)
    try:
        got = np.concatenate([model.net.forward_chunk(s, IDS[i:i + 1])
                              for i in range(len(IDS))])
        assert s.telemetry_summary()["pages_regenerated"] > 0  # the budget really bit
    finally:
        s.close()
    assert np.array_equal(got, base)


def test_which_models_take_the_step(tiny_gguf):
    from cfr_atlas.testing.tiny_moe import write_tiny_moe

    assert load_model(tiny_gguf(arch="llama", qtype="Q4_0")).net.decode_step is not None
    folder = tiny_gguf(arch="llama", qtype="Q8_0").parent
    for arch in ("qwen2moe", "qwen3moe"):
        moe = load_model(write_tiny_moe(folder / f"{arch}_step.gguf", arch=arch))
        assert moe.net.decode_step is None and moe.net.decode_layers() is None


@pytest.mark.parametrize("column, value, says", [
    (-1, np.inf, "not finite"),  # V's last column of layer 1: not storable
    (-1, 7e4, "overflow float16"),  # finite, but past float16's largest
    (0, np.nan, "query is not finite"),  # the query: its rows are written, then the error
])
def test_rows_the_checks_refuse_raise_as_the_general_path_does(tiny_qwen2, column, value,
                                                               says):
    errors = []
    for step_on in (True, False):
        model = load_model(tiny_qwen2)
        lay = model.net.weights.layers[1]
        lay.bqkv = lay.bqkv.copy()
        lay.bqkv[column] = value
        model.net.decode_step = DecodeStep(model.config, model.net.decode_layers())
        with pytest.raises(NumericError) as e:
            _decode(model, IDS[:3], step_on)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and says in errors[0]


def test_threads_share_a_model(tiny_qwen2):
    model = load_model(tiny_qwen2, matmul="int8")
    want = _decode(model, IDS, True)
    got: list = [None] * 4

    def run(i):
        got[i] = _decode(model, IDS, True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(g, want) for g in got)


def test_a_decode_batch_takes_the_step_and_equals_each_sequence_alone(path, tmp_path,
                                                                       monkeypatch):
    """forward_batch of single tokens (the server's decode step) runs DecodeStep.run over
    every sequence at once: each row equals its sequence run alone through the pieces, for
    unbounded, spill and recompute sequences of one storage dtype."""
    from cfr_atlas.models.batch import BatchItem

    model = load_model(path, matmul="int8")
    c = model.config
    page = 4 * c.head_dim * 2 * 2
    kws = [{}, {"kv_budget": 4 * page + 768, "cache_dir": tmp_path / "b"},
           {"kv_budget": 4 * page + 768 + 60 * c.n_layers * c.dim * 4,
            "regenerator": "recompute"}]
    solo_kws = [{**kw, "cache_dir": tmp_path / "s"} if "cache_dir" in kw else kw for kw in kws]
    batch = [model.session(page_tokens=4, context_limit=60, **kw) for kw in kws]
    solo = [model.session(page_tokens=4, context_limit=60, **kw) for kw in solo_kws]
    runs = []
    real = DecodeStep.run
    monkeypatch.setattr(DecodeStep, "run",
                        lambda self, s, *a: runs.append(len(s)) or real(self, s, *a))
    try:
        for i, n in enumerate((9, 21, 14)):  # prefills of different lengths
            model.net.forward_chunk(batch[i], IDS[:n], output=False)
            model.net.forward_chunk(solo[i], IDS[:n], output=False)
        for step in range(8):
            toks = [IDS[(9 * i + step) % len(IDS)] for i in range(3)]
            got = model.net.forward_batch([BatchItem(s, np.array([t], dtype=np.int64))
                                           for s, t in zip(batch, toks, strict=True)])
            model.net.decode_step, step_fn = None, model.net.decode_step  # the pieces alone
            try:
                want = [model.net.forward_chunk(s, np.array([t], dtype=np.int64),
                                                all_logits=False)
                        for s, t in zip(solo, toks, strict=True)]
            finally:
                model.net.decode_step = step_fn
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), step
        assert runs == [3] * 8  # every decode batch went through the step, whole
        assert batch[1].telemetry_summary()["pages_regenerated"] > 0
    finally:
        for s in batch + solo:
            s.close()
