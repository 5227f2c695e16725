"""`forward_batch` against `forward_chunk` (the llama and gemma3 families, one concatenated
pass each): the logits of every item of a mixed batch are bitwise those of the item run
alone, whatever the batch holds (prefill chunks and decode tokens, unbounded and budgeted
sessions, spill and recompute, float16 and float32 K/V), a failing item leaves the others
exactly as they would be without it, and the weights stream once a step."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.atlas import AtlasConfig
from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError, RegeneratorError
from cfr_atlas.models.batch import BatchItem
from cfr_atlas.models.session import fixed_kv_bytes
from cfr_atlas.testing.tiny_gemma3 import write_tiny_gemma3

PAGE = 16  # small pages: a few hundred tokens span many, so budgets force regeneration


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_llama, tmp_path_factory):
    """The tiny llama, and a tiny Gemma 3 (sliding windows of 24 tokens: local layers' pages
    leave the window while the batch runs; a final softcap on the head)."""
    if request.param == "llama":
        return load_model(tiny_llama)
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    return load_model(write_tiny_gemma3(path, sliding_window=24, final_softcap=30.0))


def _budget(model, regenerator: str, context: int, pages: int = 3) -> int:
    """The fixed bytes plus `pages` hot pages: far below the full K/V of `context` tokens."""
    c = model.config
    fixed = fixed_kv_bytes(c, regenerator=regenerator, page_tokens=PAGE, context_limit=context)
    page = AtlasConfig(page_tokens=PAGE, head_dim=c.head_dim).page_bytes
    return sum(fixed.values()) + pages * page


def _sessions(model, tmp_path, context: int):
    """Four differently configured sequences (the same options twice: solo and batched)."""
    kws = [{},
           {"kv_budget": _budget(model, "spill", context), "cache_dir": tmp_path},
           {"kv_budget": _budget(model, "recompute", context), "regenerator": "recompute"},
           {"storage_dtype": "float32"}]
    return [model.session(page_tokens=PAGE, context_limit=context, **kw) for kw in kws]


def _schedule(rng, vocab: int):
    """Per round: (sequence, ids, all_logits, output, hidden) feeds; sequences join and leave,
    chunks of every size mix with single decode tokens, and the order changes."""
    def ids(n):
        return rng.integers(0, vocab, n).astype(np.int64)
    return [
        [(0, ids(37), False, False, False), (1, ids(64), True, True, False),
         (2, ids(120), False, True, False)],
        [(1, ids(150), False, True, False), (0, ids(33), False, True, False),
         (3, ids(20), True, True, True), (2, ids(1), False, True, False)],
        [(2, ids(1), False, True, False), (0, ids(1), False, True, False),
         (1, ids(1), False, True, False), (3, ids(5), False, True, False)],
        *[[(s, ids(1), False, True, False) for s in order]
          for order in ([3, 2, 1, 0], [0, 1, 2, 3], [1, 3], [2, 0, 3, 1])],
    ]


def _solo(model, session, ids, all_logits, output, hidden):
    return model.net.forward_chunk(session, ids, all_logits=all_logits, output=output,
                                   hidden=hidden)


def test_mixed_batches_are_bitwise_the_solo_passes(model, tmp_path):
    solo = _sessions(model, tmp_path / "solo", 400)
    batch = _sessions(model, tmp_path / "batch", 400)
    try:
        for feeds in _schedule(np.random.default_rng(0), model.config.vocab_size):
            items = [BatchItem(batch[s], ids, all_logits=a, output=o, hidden=h)
                     for s, ids, a, o, h in feeds]
            got = model.net.forward_batch(items)
            for (s, ids, a, o, h), out in zip(feeds, got, strict=True):
                want = _solo(model, solo[s], ids, a, o, h)
                assert (out is None) == (want is None), s
                if want is not None:
                    assert out.shape == want.shape and np.array_equal(out, want), s
        for a, b in zip(solo, batch, strict=True):
            assert a.n_tokens == b.n_tokens and a.token_ids == b.token_ids
        # the budgets really regenerated pages, in both worlds alike
        regen = [s.telemetry_summary()["pages_regenerated"] for s in batch]
        assert regen[1] > 0 and regen[2] > 0
        assert regen == [s.telemetry_summary()["pages_regenerated"] for s in solo]
    finally:
        for s in solo + batch:
            s.close()


def test_a_failing_item_leaves_the_others_exact(model, tmp_path):
    solo = _sessions(model, tmp_path / "solo", 400)
    batch = _sessions(model, tmp_path / "batch", 400)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, n).astype(np.int64)
               for n in (30, 90, 45, 12)]
    try:
        for s in range(4):  # everyone prefilled alike
            model.net.forward_batch([BatchItem(batch[s], prompts[s])])
            _solo(model, solo[s], prompts[s], False, True, False)
        real = batch[1].backend.record

        def failing_record(layer, pos0, x, k, v):
            if layer == 1:
                raise RegeneratorError("L1/H0/p0", "page file vanished")
            return real(layer, pos0, x, k, v)

        # the spill sequence fails in layer 1: its regenerator's copy, which both the pieces'
        # store_attend and the decode step's decode_attend make first
        batch[1].backend.record = failing_record
        bad = np.array([model.config.vocab_size], dtype=np.int64)
        for _ in range(3):
            tokens = rng.integers(0, model.config.vocab_size, 4)
            items = [BatchItem(batch[s], np.array([t], dtype=np.int64))
                     for s, t in zip((0, 1, 2), tokens[:3], strict=True)]
            items.append(BatchItem(batch[3], bad))  # refused before the pass
            got = model.net.forward_batch(items)
            assert isinstance(got[1], RegeneratorError) and "vanished" in str(got[1])
            assert isinstance(got[3], ConfigError) and "token ids" in str(got[3])
            for s in (0, 2):
                want = _solo(model, solo[s], np.array([tokens[s]], dtype=np.int64),
                             False, True, False)
                assert np.array_equal(got[s], want), s
        assert batch[3].n_tokens == 12  # the refused item never touched its session
        assert batch[1].n_tokens == 90  # the failed one did not advance
    finally:
        for s in solo + batch:
            s.close()


def test_a_batch_of_one_is_forward_chunk(model, tmp_path):
    ids = np.arange(3, 60, dtype=np.int64)
    a, b = model.session(), model.session()
    try:
        (got,) = model.net.forward_batch([BatchItem(a, ids, all_logits=True)])
        assert np.array_equal(got, _solo(model, b, ids, True, True, False))
        assert model.net.forward_batch([BatchItem(a, ids[:3], output=False)]) == [None]
        twice = model.net.forward_batch([BatchItem(b, ids[:2]), BatchItem(b, ids[2:4])])
        assert twice[0].shape == (1, model.config.vocab_size)
        assert isinstance(twice[1], ConfigError) and "twice" in str(twice[1])
    finally:
        a.close()
        b.close()


def test_the_weights_stream_once_per_step(model, tmp_path, monkeypatch):
    """A step of three sequences calls each weight's matmul once, as one sequence alone does
    (the rows are concatenated), not once per sequence. (No recompute sequence here: its page
    regeneration runs K/V weights of its own, per sequence by design.)"""
    from cfr_atlas.quant.weight import QuantWeight

    every = _sessions(model, tmp_path, 200)
    sessions = [every[0], every[1], every[3]]  # unbounded, spill, float32
    every[2].close()
    try:
        for s in sessions:
            model.net.forward_chunk(s, np.arange(1, 30, dtype=np.int64), output=False)
        calls, real, product = [], QuantWeight.matmul, QuantWeight.product
        monkeypatch.setattr(QuantWeight, "matmul",
                            lambda self, x, out=None: calls.append(self.name) or real(self, x, out))
        monkeypatch.setattr(QuantWeight, "product",  # the decode step's products (one token)
                            lambda self, x, out: calls.append(self.name) or product(self, x, out))
        model.net.forward_chunk(sessions[0], np.array([5], dtype=np.int64), all_logits=False)
        one = sorted(calls)
        calls.clear()
        got = model.net.forward_batch([BatchItem(s, np.array([7], dtype=np.int64))
                                       for s in sessions])
        assert all(isinstance(g, np.ndarray) for g in got)
        assert sorted(calls) == one and len(one) > 2 * model.config.n_layers
    finally:
        for s in sessions:
            s.close()
