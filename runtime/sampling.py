"""Sampling: one pure function per logits transform, composed in a fixed order (the parameters are
llmc/sampling_params.py's):

    suppress (min_tokens) -> penalties -> temperature -> top-k -> top-p -> min-p -> sample

Every transform takes float64 logits [V] and returns new logits [V] (excluded tokens at -inf); nothing keeps
state. Randomness comes only from the request's own `np.random.Generator`, one uniform draw per sampled
token, so a seeded request reproduces itself whatever else shares the batch. Names and semantics follow
vLLM and the OpenAI API.
"""

from __future__ import annotations

import numpy as np

from llmc.sampling_params import SamplingParams

# ----------------------------------------------------------------------------------------------------------
# Transforms: float64 logits [V] -> logits [V]. Each returns its input unchanged when it is off.


def suppress_tokens(logits: np.ndarray, token_ids) -> np.ndarray:
    """Set the logits of `token_ids` to -inf (EOS and stop tokens while min_tokens is not reached)."""
    if len(token_ids) == 0:
        return logits
    out = logits.copy()
    out[np.asarray(token_ids, dtype=np.int64)] = -np.inf
    return out


def apply_repetition_penalty(logits: np.ndarray, seen_token_ids: np.ndarray, penalty: float) -> np.ndarray:
    """For tokens in prompt or output: positive logits / penalty, negative logits * penalty (vLLM, CTRL)."""
    if penalty == 1.0 or len(seen_token_ids) == 0:
        return logits
    out = logits.copy()
    idx = np.unique(seen_token_ids)
    seen = out[idx]
    out[idx] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


def apply_frequency_presence_penalties(
    logits: np.ndarray, output_token_ids: np.ndarray, frequency_penalty: float, presence_penalty: float
) -> np.ndarray:
    """logit -= frequency * count + presence * (count > 0), counting generated tokens only (OpenAI, vLLM)."""
    if (frequency_penalty == 0.0 and presence_penalty == 0.0) or len(output_token_ids) == 0:
        return logits
    counts = np.bincount(output_token_ids, minlength=logits.shape[0])[: logits.shape[0]]
    return logits - frequency_penalty * counts - presence_penalty * (counts > 0)


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    if temperature == 1.0:
        return logits
    return logits / temperature


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (ties with the k-th are kept too)."""
    vocab = logits.shape[0]
    if k <= 0 or k >= vocab:
        return logits
    kth = np.partition(logits, vocab - k)[vocab - k]
    return np.where(logits >= kth, logits, -np.inf)


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability sums to >= p (always at least one)."""
    if p >= 1.0:
        return logits
    probs = softmax(logits)
    order = np.argsort(-logits, kind="stable")  # most likely first
    sorted_probs = probs[order]
    mass_before = np.cumsum(sorted_probs) - sorted_probs
    out = logits.copy()
    out[order[mass_before >= p]] = -np.inf  # the first token has mass_before 0 < p: always kept
    return out


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens with prob >= min_p * max prob, i.e. logit >= max logit + log(min_p)."""
    if min_p <= 0.0:
        return logits
    threshold = logits.max() + np.log(min_p)
    return np.where(logits >= threshold, logits, -np.inf)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64) - logits.max()
    return x - np.log(np.exp(x).sum())


def sample_from_logits(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from softmax(logits) with exactly one uniform from `rng`; never a -inf token."""
    return sample_from_probs(softmax(logits), rng)


def sample_from_probs(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from probs [V] (non-negative, any positive total) with exactly one uniform from `rng`;
    never a token of probability 0."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    idx = int(np.searchsorted(cdf, u, side="right"))  # first i with cdf[i] > u, so probs[i] > 0
    if idx >= cdf.shape[0]:  # u rounded up to the total: take the last token with mass
        idx = int(np.flatnonzero(probs > 0)[-1])
    return idx


# ----------------------------------------------------------------------------------------------------------
# Composition


def process_logits(
    logits: np.ndarray,
    params: SamplingParams,
    prompt_token_ids: np.ndarray,
    output_token_ids: np.ndarray,
    suppress_token_ids=(),
) -> np.ndarray:
    """float logits [V] -> float64 logits [V] ready to sample, every transform in the fixed order.

    With greedy params, the result is only suppressed and penalized (temperature and the filters keep the
    argmax anyway).
    """
    x = logits.astype(np.float64)
    x = suppress_tokens(x, suppress_token_ids)
    if params.repetition_penalty != 1.0:
        x = apply_repetition_penalty(x, np.concatenate([prompt_token_ids, output_token_ids]), params.repetition_penalty)
    x = apply_frequency_presence_penalties(x, output_token_ids, params.frequency_penalty, params.presence_penalty)
    if params.greedy:
        return x
    x = apply_temperature(x, params.temperature)
    x = apply_top_k(x, params.top_k)
    x = apply_top_p(x, params.top_p)
    x = apply_min_p(x, params.min_p)
    return x


def sample_next_token(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    prompt_token_ids: np.ndarray,
    output_token_ids: np.ndarray,
    suppress_token_ids=(),
) -> int:
    """One request's next token from its logits row [V]. Greedy draws nothing from `rng`."""
    if params.greedy and not params.has_penalties and len(suppress_token_ids) == 0:
        return int(np.argmax(logits))  # fast path: no copy
    x = process_logits(logits, params, prompt_token_ids, output_token_ids, suppress_token_ids)
    if params.greedy:
        return int(np.argmax(x))
    return sample_from_logits(x, rng)


def top_logprobs(logits: np.ndarray, token_id: int, n: int) -> dict[int, float]:
    """{token: logprob} for the sampled token and the n most likely, from the model's raw logits [V].

    NOTE (raw logprobs): as vLLM v1's default (logprobs_mode="raw_logprobs"), these are the model's own
    log-probabilities, before penalties, temperature and filtering, so they do not depend on the sampler.
    """
    lp = log_softmax(logits)
    out: dict[int, float] = {}
    if n > 0:
        top = np.argpartition(-lp, n - 1)[:n] if n < lp.shape[0] else np.arange(lp.shape[0])
        top = top[np.argsort(-lp[top], kind="stable")]
        out = {int(t): float(lp[t]) for t in top}
    out.setdefault(int(token_id), float(lp[token_id]))
    return out


def make_rng(seed: int | None, fallback: np.random.Generator | None = None) -> np.random.Generator:
    """A request's own generator: from its seed, else from `fallback` (the engine's) or OS entropy."""
    if seed is not None:
        return np.random.default_rng(seed)
    if fallback is not None:
        return np.random.default_rng(fallback.integers(2**63))
    return np.random.default_rng()
