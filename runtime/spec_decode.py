"""Speculative decoding: cheap guesses of a sequence's next K tokens, verified by the target model in one step.

A proposer guesses; the engine (engine.py) puts the guesses after the sequence's last token in its next decode
step and asks for logits at all K+1 rows. Row i is the target's distribution after the last token and guesses
1..i, so the step checks every guess at once and, after j accepted guesses, row j gives one more token: each
verify step yields 1..K+1 tokens. The scheduler then rolls the sequence's cache back past the rejected guesses.

Acceptance (pure functions here, on the target's rows already processed by sampling.py):
  - greedy: the longest run of guesses equal to the target's argmax, then the argmax after it;
  - sampled: rejection sampling (Leviathan et al. 2023, Chen et al. 2023): guess x with draft probability q(x)
    is kept with probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw from
    norm(max(p - q, 0)). Every emitted token is then distributed exactly as the target's p.

Proposers:
  - `NgramProposer` (prompt lookup): the guesses follow the longest earlier match of the sequence's last tokens.
  - `DraftProposer`: a smaller compiled model with the same tokenizer, with its own paged KV cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.sampling import SamplingParams, sample_from_probs


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram" (prompt lookup) or "draft" (draft_model: a loaded CompiledModel); K guesses per step."""

    method: str
    num_speculative_tokens: int
    draft_model: object | None = None
    ngram_min: int = 1  # the shortest run of last tokens that may be looked up
    ngram_max: int = 8  # the longest; a longer match wins

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise LlmcError(f"unknown speculative method {self.method!r}", "use 'ngram' or 'draft'")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise LlmcError(f"num_speculative_tokens={self.num_speculative_tokens} is out of range",
                            "use 1..64 (2 to 8 is typical)")  # fmt: skip
        if (self.method == "draft") != (self.draft_model is not None):
            raise LlmcError("a draft model goes with --speculative draft, and only with it",
                            "pass --speculative draft --draft ARTIFACT, or --speculative ngram alone")  # fmt: skip
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise LlmcError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}", "need 1 <= min <= max")


@dataclasses.dataclass
class Proposal:
    """Guesses for one sequence; probs [len(token_ids), vocab]: the draft distribution each was drawn from, or
    None when the guesses are deterministic (each one's q is 1)."""

    token_ids: list[int]
    probs: np.ndarray | None = None


# ----------------------------------------------------------------------------------------------------------
# Acceptance


def accept_greedy(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """The emitted tokens: the target's own choices (argmax of rows 0..K) up to and including its first
    disagreement with the guesses, or all K+1 if it agrees with all K."""
    assert len(target_token_ids) == len(draft_token_ids) + 1
    out = []
    for target, draft in zip(target_token_ids, draft_token_ids, strict=False):
        out.append(int(target))
        if target != draft:
            return out
    out.append(int(target_token_ids[-1]))
    return out


def rejection_sample(
    target_probs: np.ndarray, draft_token_ids: Sequence[int], draft_probs: np.ndarray | None, rng: np.random.Generator
) -> tuple[list[int], int]:
    """(emitted tokens, number of guesses accepted), each token distributed as the target's row it comes from.

    target_probs [K+1, V]: row i is p after guesses 1..i; draft_probs [K, V] (None: each guess had q = 1).
    One uniform per guess checked, and one more for the replacement or the bonus token.
    """
    k = len(draft_token_ids)
    assert target_probs.shape[0] == k + 1 and (draft_probs is None or draft_probs.shape[0] == k)
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if rng.random() * q_x < p[x]:  # u < p(x) / q(x) without dividing; q(x) > 0 since x was drawn from q
            out.append(int(x))
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        if residual.sum() <= 0.0:  # p <= q everywhere only by rounding (a rejection means p(x) < q(x))
            residual = p
        out.append(sample_from_probs(residual, rng))
        return out, i
    out.append(sample_from_probs(target_probs[k], rng))
    return out, k


# ----------------------------------------------------------------------------------------------------------
# Proposers


@dataclasses.dataclass(frozen=True)
class ProposalRequest:
    """What a proposer may know of a sequence: its tokens (prompt and output), how many guesses are wanted, and,
    for a draft model's draws, its sampling parameters and generator."""

    seq_id: str
    token_ids: list[int]
    num_tokens: int  # guesses wanted, >= 1
    params: SamplingParams
    rng: np.random.Generator


class NgramProposer:
    """Prompt lookup (`ngram_lookup`) for each sequence; it keeps no state."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 8):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [Proposal(ngram_lookup(r.token_ids, r.num_tokens, self.ngram_min, self.ngram_max)) for r in requests]

    def free(self, seq_id: str) -> None:
        pass


def ngram_lookup(token_ids: Sequence[int], k: int, ngram_min: int = 1, ngram_max: int = 8) -> list[int]:
    """Up to k guesses: find the longest run of the last tokens (ngram_min..ngram_max of them) that also occurs
    earlier in the prompt or output, and guess that the tokens after that occurrence come again. Of equally
    long matches, the latest wins (the text the model is nearest to repeating)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    n = tokens.shape[0]
    if n < ngram_min + 1 or k < 1:
        return []
    # ends[e] is the last token of a candidate occurrence; it needs a token after it, so e <= n - 2
    ends = np.arange(n - 1)
    match_len = np.zeros(n - 1, dtype=np.int64)
    alive = np.ones(n - 1, dtype=bool)  # still matching at every distance so far
    for d in range(min(ngram_max, n - 1)):
        alive &= ends - d >= 0
        alive[alive] = tokens[ends[alive] - d] == tokens[n - 1 - d]
        match_len += alive
        if not alive.any():
            break
    best = int(match_len.max())
    if best < ngram_min:
        return []
    end = int(np.flatnonzero(match_len == best)[-1])
    return [int(t) for t in tokens[end + 1 : end + 1 + k]]
