import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.runtime.sampling import (
    apply_frequency_presence_penalties,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    process_logits,
    sample_from_logits,
    sample_next_token,
    suppress_tokens,
    top_logprobs,
)
from llmc.sampling_params import SamplingParams

EMPTY = np.zeros(0, dtype=np.int64)


def _logits(vocab=50, seed=0):
    return np.random.default_rng(seed).standard_normal(vocab) * 2.0


def _softmax(x):
    z = np.exp(x - x.max())
    return z / z.sum()


# -- parameters -----------------------------------------------------------------------------------------


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens, p.logprobs) == (1, 1.0, 0, 1.0, 0.0, 16, None)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n=0"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": -3}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # logits / it overflowed to inf (the fuzzer's find)
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": -1}, "seed"),  # numpy refuses it deep inside the engine: it must not get that far
        ({"seed": 2**64}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e30}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"n": True}, "n"),
    ],
)
def test_validation_raises_request_error(kwargs, match):
    with pytest.raises(RequestError, match=match) as exc_info:
        SamplingParams(**kwargs)
    assert exc_info.value.param == next(iter(kwargs))  # the server names it in its 400


# -- transforms against numpy references -----------------------------------------------------------------


def test_penalties_match_reference():
    logits = _logits(20, seed=1)
    prompt = np.array([3, 4, 4, 7])
    output = np.array([7, 9, 9, 9, 12])
    rep, freq, pres = 1.3, 0.4, 0.25
    ref = logits.copy()
    for t in set(prompt.tolist()) | set(output.tolist()):  # repetition: prompt and output, once per token
        ref[t] = ref[t] / rep if ref[t] > 0 else ref[t] * rep
    for t in set(output.tolist()):  # frequency and presence: output only
        count = int((output == t).sum())
        ref[t] -= freq * count + pres
    got = apply_repetition_penalty(logits, np.concatenate([prompt, output]), rep)
    got = apply_frequency_presence_penalties(got, output, freq, pres)
    np.testing.assert_allclose(got, ref)
    params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, temperature=0)
    np.testing.assert_allclose(process_logits(logits, params, prompt, output), ref)
    assert apply_repetition_penalty(logits, prompt, 1.0) is logits


def test_temperature_top_k_top_p_min_p_match_reference():
    logits = _logits(40, seed=2)
    np.testing.assert_allclose(apply_temperature(logits, 0.5), logits * 2)

    k = 7
    kept = np.isfinite(apply_top_k(logits, k))
    assert set(np.flatnonzero(kept)) == set(np.argsort(-logits)[:k])

    for p in (0.05, 0.3, 0.9, 0.999):
        probs = _softmax(logits)
        order = np.argsort(-probs)
        ref_keep, mass = [], 0.0
        for t in order:  # smallest most-likely prefix with mass >= p
            ref_keep.append(t)
            mass += probs[t]
            if mass >= p:
                break
        assert set(np.flatnonzero(np.isfinite(apply_top_p(logits, p)))) == set(ref_keep), p

    for m in (0.01, 0.2, 0.8):
        probs = _softmax(logits)
        ref = set(np.flatnonzero(probs >= m * probs.max()))
        assert set(np.flatnonzero(np.isfinite(apply_min_p(logits, m)))) == ref

    np.testing.assert_array_equal(np.isfinite(suppress_tokens(logits, [3, 5])), ~np.isin(np.arange(40), [3, 5]))


def test_filters_compose_in_order_on_renormalized_probs():
    # top-p sees the distribution after top-k: with k=2, p=0.6 keeps only the best of the two
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    x = apply_top_p(apply_top_k(logits, 2), 0.55)  # renormalized: 0.571, 0.429
    assert list(np.flatnonzero(np.isfinite(x))) == [0]
    x = apply_top_p(logits, 0.55)  # without top-k: 0.4 + 0.3 needed
    assert list(np.flatnonzero(np.isfinite(x))) == [0, 1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=5, temperature=1.5),
        SamplingParams(top_p=0.5, temperature=2.0),
        SamplingParams(min_p=0.3, temperature=3.0),
        SamplingParams(top_k=10, top_p=0.8, min_p=0.05, temperature=1.2),
    ],
)
def test_filters_never_emit_an_excluded_token(params):
    logits = _logits(60, seed=3)
    allowed = np.isfinite(process_logits(logits, params, EMPTY, EMPTY))
    assert 0 < allowed.sum() < 60
    rng = np.random.default_rng(0)
    drawn = {sample_next_token(logits, params, rng, EMPTY, EMPTY) for _ in range(3000)}
    assert drawn <= set(np.flatnonzero(allowed))
    assert len(drawn) == allowed.sum()  # and every allowed one does appear


def test_near_zero_temperature_is_greedy_and_draws_nothing():
    logits = _logits(30, seed=4)
    for t in (0.0, 1e-6, 9.9e-6):
        rng = np.random.default_rng(7)
        before = rng.bit_generator.state
        assert sample_next_token(logits, SamplingParams(temperature=t), rng, EMPTY, EMPTY) == int(np.argmax(logits))
        assert rng.bit_generator.state == before
    # greedy still applies penalties: the argmax, repeated, is pushed below the runner-up
    best, second = np.argsort(-logits)[:2]
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    out = np.array([best] * 10)
    assert sample_next_token(logits, params, np.random.default_rng(), EMPTY, out) == second


# Chi-square goodness of fit with a fixed seed (deterministic, so never flaky). Critical values of the
# chi-square distribution at significance 0.001: df=7 -> 24.32, df=4 -> 18.47.
@pytest.mark.parametrize("temperature, top_k, df, critical", [(0.7, 0, 7, 24.32), (1.8, 5, 4, 18.47)])
def test_empirical_distribution_matches_softmax_chi_square(temperature, top_k, df, critical):
    logits = np.array([1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.2, 0.3])
    expected_p = _softmax(logits / temperature)
    if top_k:
        keep = np.argsort(-logits)[:top_k]
        mask = np.zeros(8, bool)
        mask[keep] = True
        expected_p = np.where(mask, expected_p, 0.0)
        expected_p /= expected_p.sum()
    params = SamplingParams(temperature=temperature, top_k=top_k)
    rng = np.random.default_rng(1234)
    draws = 40_000
    counts = np.bincount([sample_next_token(logits, params, rng, EMPTY, EMPTY) for _ in range(draws)], minlength=8)
    support = expected_p > 0
    assert counts[~support].sum() == 0
    expected = draws * expected_p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert support.sum() - 1 == df
    assert chi2 < critical, f"chi2={chi2:.2f} >= {critical} (df={df})"


def test_sample_from_logits_never_picks_minus_inf_even_at_the_edge():
    class EdgeRng:
        def random(self):
            return np.nextafter(1.0, 0.0)

    logits = np.array([0.0, 1.0, -np.inf, 2.0, -np.inf])
    assert sample_from_logits(logits, EdgeRng()) == 3
    logits = np.array([-np.inf, 0.0, -np.inf])
    assert sample_from_logits(logits, np.random.default_rng()) == 1


def test_seeded_generator_reproduces():
    logits = _logits(100, seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)

    def run():
        rng = np.random.default_rng(params.seed)
        return [sample_next_token(logits, params, rng, EMPTY, EMPTY) for _ in range(50)]

    assert run() == run()


def test_top_logprobs_are_raw_log_softmax():
    logits = _logits(30, seed=6).astype(np.float32)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    out = top_logprobs(logits, token_id=int(np.argmin(logits)), n=3)
    top3 = np.argsort(-logits)[:3]
    assert list(out)[:3] == list(top3)  # most likely first, then the sampled token
    assert len(out) == 4 and int(np.argmin(logits)) in out
    for t, lp in out.items():
        assert lp == pytest.approx(ref[t], abs=1e-6)
    assert list(top_logprobs(logits, int(top3[0]), 0)) == [int(top3[0])]  # logprobs=0: the sampled token only
