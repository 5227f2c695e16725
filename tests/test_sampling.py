"""Sampler: parameter validation, each filter on hand-made logits, determinism, frequencies."""

import math

import numpy as np
import pytest

from cfr_atlas.errors import ConfigError, DimensionError, NumericError
from cfr_atlas.sampling import Sampler, SamplingParams, apply_repeat_penalty, candidate_probs


def f32(*values):
    return np.array(values, dtype=np.float32)


def log_probs(*probs):
    return np.log(np.array(probs)).astype(np.float32)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", math.inf),
        ("repeat_last_n", -2),
        ("seed", -1),
        ("seed", "42"),
    ],
)
def test_params_validation_names_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and field in str(info.value)


def test_defaults_are_greedy_and_frozen():
    params = SamplingParams()
    assert params.greedy
    with pytest.raises(AttributeError):
        params.temperature = 1.0


def test_greedy_is_argmax_with_lowest_id_on_ties():
    sampler = Sampler()
    assert sampler.sample(f32(0.0, 3.0, -1.0, 3.0)) == 1
    assert sampler.sample(f32(-5.0, -5.0)) == 0


def test_candidates_at_temperature_zero_are_the_argmax():
    ids, probs = candidate_probs(f32(1.0, 5.0, 5.0), SamplingParams())
    assert ids.tolist() == [1] and probs.tolist() == [1.0]


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    params = SamplingParams(repeat_penalty=2.0)
    out = apply_repeat_penalty(f32(4.0, -1.0, 3.0, 0.5, 0.0), [0, 1, 0, 4], params)
    assert np.array_equal(out, f32(2.0, -2.0, 3.0, 0.5, 0.0))  # token 0 penalized once
    assert Sampler(params).sample(f32(4.0, -1.0, 3.0), [0]) == 2


def test_repeat_last_n_window():
    logits = f32(2.0, 2.0, 2.0)
    window = apply_repeat_penalty(
        logits, [0, 1, 2, 2], SamplingParams(repeat_penalty=2.0, repeat_last_n=2)
    )
    assert np.array_equal(window, f32(2.0, 2.0, 1.0))
    whole = apply_repeat_penalty(
        logits, [0, 1], SamplingParams(repeat_penalty=2.0, repeat_last_n=-1)
    )
    assert np.array_equal(whole, f32(1.0, 1.0, 2.0))
    off = apply_repeat_penalty(logits, [0], SamplingParams(repeat_penalty=2.0, repeat_last_n=0))
    assert off is logits


def test_temperature_rescales_softmax():
    logits = f32(1.0, 2.0, 4.0)
    ids, probs = candidate_probs(logits, SamplingParams(temperature=2.0))
    z = np.array([1.0, 2.0, 4.0]) / 2.0
    assert ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(probs, np.exp(z) / np.exp(z).sum(), rtol=1e-12)


def test_top_k_keeps_k_largest_lowest_ids_on_ties():
    ids, probs = candidate_probs(f32(1.0, 3.0, 2.0, 0.0), SamplingParams(temperature=1.0, top_k=2))
    assert ids.tolist() == [1, 2]
    np.testing.assert_allclose(probs, [math.e / (1 + math.e), 1 / (1 + math.e)], rtol=1e-12)
    ids, _ = candidate_probs(f32(1.0, 1.0, 1.0, 0.0), SamplingParams(temperature=1.0, top_k=2))
    assert ids.tolist() == [0, 1]


@pytest.mark.parametrize(("top_p", "kept"), [(0.1, [0]), (0.75, [0, 1]), (0.81, [0, 1, 2])])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    ids, probs = candidate_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert ids.tolist() == kept
    expected = np.array([0.5, 0.3, 0.15, 0.05])[kept]
    np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-6)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_on_large_vocab_matches_full_sort(top_p):
    logits = (np.random.default_rng(5).standard_normal(49152) * 2).astype(np.float32)
    logits[100:110] = logits[3]  # ties
    ids, _ = candidate_probs(logits, SamplingParams(temperature=0.7, top_p=top_p))
    z = (logits.astype(np.float64) - logits.max()) / 0.7
    probs = np.exp(z) / np.exp(z).sum()
    order = np.argsort(-probs, kind="stable")
    n_keep = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
    assert ids.tolist() == sorted(order[:n_keep].tolist())


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = log_probs(0.05, 0.5, 0.3, 0.15)
    ids, _ = candidate_probs(logits, SamplingParams(temperature=1.0, min_p=0.5))
    assert ids.tolist() == [1, 2]  # threshold 0.25


def test_temperature_is_applied_before_top_p():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    # T=0.5 sharpens to p0 = 0.685 >= 0.6; T=2 flattens to 0.379, 0.294, ...: two are needed.
    cold, _ = candidate_probs(logits, SamplingParams(temperature=0.5, top_p=0.6))
    hot, _ = candidate_probs(logits, SamplingParams(temperature=2.0, top_p=0.6))
    assert cold.tolist() == [0] and hot.tolist() == [0, 1]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=3))
    assert {sampler.sample(logits) for _ in range(20)} == {int(np.argmax(logits))}


def test_same_seed_same_tokens():
    logits = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    draw = lambda s: [s.sample(logits, [1, 2, 3]) for _ in range(50)]  # noqa: E731
    assert draw(Sampler(params)) == draw(Sampler(params))
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1235)
    assert draw(Sampler(params)) != draw(Sampler(other))


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_frequencies_follow_tempered_softmax(temperature):
    # n = 20000 draws: the standard deviation of a frequency is <= 0.0036, so 0.015 is > 4 sigma.
    p = np.array([0.6, 0.3, 0.1])
    sampler = Sampler(SamplingParams(temperature=temperature, seed=7))
    draws = [sampler.sample(log_probs(*p)) for _ in range(20000)]
    expected = p ** (1 / temperature) / (p ** (1 / temperature)).sum()
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 20000, expected, atol=0.015)


def test_zero_probability_tokens_never_drawn():
    logits = f32(0.0, -1e4, 0.0)  # exp(-1e4) underflows to 0 in float64
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert 1 not in {sampler.sample(logits) for _ in range(500)}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_raise_numeric_error(bad):
    with pytest.raises(NumericError, match="index 2"):
        Sampler().sample(f32(0.0, 1.0, bad))


def test_bad_shapes_and_history():
    with pytest.raises(DimensionError, match="float32"):
        Sampler().sample(np.zeros(3))
    with pytest.raises(DimensionError, match="1-D"):
        Sampler().sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(DimensionError, match="history token 5 is outside the vocabulary of 3"):
        Sampler(SamplingParams(repeat_penalty=1.1)).sample(f32(0, 1, 2), [0, 5])
    assert Sampler(SamplingParams(repeat_penalty=3.0)).sample(f32(0, 1, 2), np.array([2])) == 1


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=3),
                                    SamplingParams(temperature=1.3, top_k=20, top_p=0.8,
                                                   min_p=0.02, repeat_penalty=1.2, seed=8)])
def test_grammar_mask_only_restricts_the_draw(params):
    """allowed=all-True draws exactly as unconstrained; a mask keeps draws inside it and never
    changes the logits passed in; an empty mask is a typed error."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=500).astype(np.float32)
    before = logits.copy()
    free, masked = Sampler(params), Sampler(params)
    everything = np.ones(500, dtype=bool)
    history = [1, 2, 3]
    assert [free.sample(logits, history) for _ in range(30)] == \
        [masked.sample(logits, history, everything) for _ in range(30)]
    allowed = np.zeros(500, dtype=bool)
    allowed[[7, 99, 400]] = True
    s = Sampler(params)
    assert {s.sample(logits, history, allowed) for _ in range(50)} <= {7, 99, 400}
    assert np.array_equal(logits, before)
    with pytest.raises(NumericError, match="no token"):
        s.sample(logits, history, np.zeros(500, dtype=bool))
    with pytest.raises(DimensionError):
        s.sample(logits, history, np.ones(3, dtype=bool))
