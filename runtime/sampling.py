"""Sampling: the request parameters (one dataclass, the one place for defaults) and one pure function per
logits transform, composed in a fixed order:

    suppress (min_tokens) -> penalties -> temperature -> top-k -> top-p -> min-p -> sample

Every transform takes float64 logits [V] and returns new logits [V] (excluded tokens at -inf); nothing keeps
state. Randomness comes only from the request's own `np.random.Generator`, one uniform draw per sampled
token, so a seeded request reproduces itself whatever else shares the batch. Names and semantics follow
vLLM and the OpenAI API.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from llmc.errors import RequestError

GREEDY_TEMPERATURE = 1e-5  # temperature below this samples greedily (argmax)
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs and OpenAI's top_logprobs limit
# Far past any useful value (OpenAI stops at 2); beyond it the distribution is uniform to float precision.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
# Its mirror below 1: dividing a logit by a penalty near 0 overflows it to inf, and the softmax of an inf is NaN.
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY
# numpy's SeedSequence takes non-negative integers only; 64 bits is every seed a client sends in practice.
MAX_SEED = 2**64 - 1


@dataclasses.dataclass
class SamplingParams:
    n: int = 1  # independent sequences per prompt
    temperature: float = 1.0  # < 1e-5: greedy
    top_k: int = 0  # 0 (or -1): off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; keep tokens with prob >= min_p * max prob
    repetition_penalty: float = 1.0  # > 1 discourages tokens in prompt or output (CTRL style)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)  # output text ends before the first match
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # stop after generating any of these
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0  # EOS, stop tokens and stop strings are held off until this many tokens
    logprobs: int | None = None  # return the sampled token's logprob and the top-n; None: none
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # detokenization

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, value, hint: str) -> RequestError:
            return RequestError(f"invalid sampling parameter: {param}={value!r}", hint, param=param)

        def real(name: str) -> float:
            """The float field `name`, refused when it is not a finite number (inf and nan pass every range check)."""
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, f"{name} must be a finite number")
            return value

        def integer(name: str, low: int, high: int | None = None, hint: str = "") -> None:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < low
                or (high is not None and value > high)
            ):
                raise bad(
                    name, value, hint or f"{name} must be an integer in [{low}, {high if high is not None else 'inf'}]"
                )

        integer("n", 1, hint="n must be an integer >= 1")
        if not 0.0 <= real("temperature") <= MAX_TEMPERATURE:
            raise bad("temperature", self.temperature, f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy)")
        integer("top_k", 0, hint="top_k must be an integer >= 1, or 0 / -1 to turn it off")
        if not 0.0 < real("top_p") <= 1.0:
            raise bad("top_p", self.top_p, "top_p must be in (0, 1]")
        if not 0.0 <= real("min_p") <= 1.0:
            raise bad("min_p", self.min_p, "min_p must be in [0, 1]")
        if not MIN_REPETITION_PENALTY <= real("repetition_penalty") <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", self.repetition_penalty,
                      f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                      "(1 is off)")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= real(name) <= 2.0:
                raise bad(name, getattr(self, name), f"{name} must be in [-2, 2]")
        if self.seed is not None:
            integer("seed", 0, MAX_SEED, "seed must be an integer in [0, 2**64 - 1], or null for a random one")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "stop must be a non-empty string or a list of them")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "stop_token_ids must be token ids >= 0")
        if self.max_tokens is not None:
            integer("max_tokens", 1, hint="max_tokens must be an integer >= 1, or None")
        integer("min_tokens", 0, hint="min_tokens must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"invalid sampling parameter: min_tokens={self.min_tokens} > max_tokens={self.max_tokens}",
                               "need min_tokens <= max_tokens", param="min_tokens")  # fmt: skip
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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
