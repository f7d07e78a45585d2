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
from collections.abc import Callable, Sequence

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.batch import StepBatch
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.sampling import process_logits, sample_from_probs, softmax
from llmc.sampling_params import SamplingParams

_NO_TOKENS = np.zeros(0, dtype=np.int64)


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
            raise LlmcError(
                f"num_speculative_tokens={self.num_speculative_tokens} is out of range", "use 1..64 (2 to 8 is typical)"
            )
        if (self.method == "draft") != (self.draft_model is not None):
            raise LlmcError(
                "a draft model goes with --speculative draft, and only with it",
                "pass --speculative draft --draft ARTIFACT, or --speculative ngram alone",
            )
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


def accept_greedy(target_at: Callable[[int], int], draft_token_ids: Sequence[int]) -> list[int]:
    """The emitted tokens: the target's own choices (target_at(i), its argmax of row i) up to and including its
    first disagreement with the guesses, or all K+1 if it agrees with all K. Rows after a disagreement are never
    asked for: processing a row is O(vocab)."""
    out = []
    for i, draft in enumerate(draft_token_ids):
        out.append(int(target_at(i)))
        if out[-1] != draft:
            return out
    out.append(int(target_at(len(draft_token_ids))))
    return out


def rejection_sample(
    target_row: Callable[[int], np.ndarray],
    draft_token_ids: Sequence[int],
    draft_probs: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """(emitted tokens, number of guesses accepted), each token distributed as the target's row it comes from.

    target_row(i) is p [V] after guesses 1..i (i = 0..K), asked for only when the loop reaches row i;
    draft_probs [K, V] (None: each guess had q = 1). One uniform per guess checked, and one more for the
    replacement or the bonus token.
    """
    k = len(draft_token_ids)
    assert draft_probs is None or draft_probs.shape[0] == k
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = target_row(i)
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
    out.append(sample_from_probs(target_row(k), rng))
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


class DraftProposer:
    """A smaller compiled model with the same tokenizer guesses each sequence's next tokens.

    It keeps its own paged KV cache (a `KVCacheManager` over the draft model's blocks) and, per sequence, the
    tokens whose k/v it holds. To propose, it first rolls a sequence back to where that record and the
    sequence's tokens part (the guesses the target rejected), then catches up on the tokens it has not seen
    (the prompt, accepted tokens, the target's own tokens) in steps batched across sequences and cut to its
    token budget, and draws K guesses with K-1 more single-token steps, batched too. Greedy requests take the
    draft's argmax; sampled ones draw from the draft's processed distribution q, which the verifier needs.
    A sequence the draft cannot hold (its cache or context is too small) gets no guesses this step.
    """

    def __init__(self, draft_model, target_config):
        draft_config = draft_model.config
        if int(draft_config.vocab_size) != int(target_config.vocab_size):
            raise LlmcError(
                f"the draft model's vocabulary ({draft_config.vocab_size} tokens) is not the target's "
                f"({target_config.vocab_size})",
                "use a draft model trained with the target's tokenizer",
            )
        self.model = draft_model
        self.kv_cache = KVCacheManager(
            draft_model.num_blocks, draft_model.block_size, sliding_window=int(draft_config.kv_window)
        )
        self.max_context = int(draft_config.max_context)
        self.max_num_tokens = int(draft_model.max_num_tokens)
        self.max_num_seqs = int(draft_model.max_num_seqs)
        self._computed: dict[str, list[int]] = {}  # seq id -> the tokens whose k/v the draft cache holds, in order

    def free(self, seq_id: str) -> None:
        if self._computed.pop(seq_id, None) is not None:
            self.kv_cache.free(seq_id)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        live = [i for i, r in enumerate(requests[: self.max_num_seqs]) if self._prepare(r)]
        pending = {i: list(requests[i].token_ids[len(self._computed[requests[i].seq_id]) :]) for i in live}
        probs: dict[int, list[np.ndarray]] = {i: [] for i in live}
        last_rows: dict[int, np.ndarray] = {}
        while pending:  # catch up, a budget of tokens at a time; a sequence's last chunk gives its first row
            budget, chunk = self.max_num_tokens, {}
            for i in list(pending)[: self.max_num_seqs]:
                if budget == 0:
                    break
                chunk[i] = pending[i][:budget]
                budget -= len(chunk[i])
            rows = self._step(requests, chunk)
            for i, row in zip(chunk, rows, strict=True):
                del pending[i][: len(chunk[i])]
                if not pending[i]:
                    del pending[i]
                    last_rows[i] = row
        for round_ in range(max((requests[i].num_tokens for i in live), default=0)):
            for i, row in last_rows.items():
                proposals[i].token_ids.append(self._draw(requests[i], row, probs[i]))
            feeding = {i: [proposals[i].token_ids[-1]] for i in last_rows if requests[i].num_tokens > round_ + 1}
            if not feeding:
                break
            last_rows = dict(zip(feeding, self._step(requests, feeding), strict=True))
        for i in live:
            if not requests[i].params.greedy:
                proposals[i].probs = np.stack(probs[i])
        return proposals

    def _prepare(self, request: ProposalRequest) -> bool:
        """Roll the sequence's draft cache back to its tokens, and hold slots for the rest and the guesses."""
        tokens, seq_id = request.token_ids, request.seq_id
        if len(tokens) + request.num_tokens > self.max_context:
            self.free(seq_id)
            return False
        computed = self._computed.get(seq_id, [])
        keep = 0
        for have, want in zip(computed, tokens[:-1], strict=False):  # the last token is always fed (its row)
            if have != want:
                break
            keep += 1
        if seq_id in self._computed:
            self.kv_cache.trim_slots(seq_id, keep)
        # the guesses but the last are fed back in, so their k/v need slots too
        if not self.kv_cache.allocate_slots(seq_id, len(tokens) - keep + request.num_tokens - 1):
            self.free(seq_id)
            return False
        self._computed[seq_id] = computed[:keep]
        return True

    def _step(self, requests: Sequence[ProposalRequest], chunk: dict[int, list[int]]) -> np.ndarray:
        """Run the draft on each sequence's next tokens; returns the logits of each one's last token [len(chunk), V]."""
        seq_ids = [requests[i].seq_id for i in chunk]
        batch = StepBatch.build(
            list(chunk.values()),
            [len(self._computed[s]) for s in seq_ids],
            [self.kv_cache.block_ids(s) for s in seq_ids],
            self.kv_cache.block_size,
        )
        logits = self.model.step(batch)
        for s, tokens in zip(seq_ids, chunk.values(), strict=True):
            self._computed[s].extend(tokens)
        return logits

    @staticmethod
    def _draw(request: ProposalRequest, row: np.ndarray, probs: list[np.ndarray]) -> int:
        if request.params.greedy:
            return int(np.argmax(row))
        q = softmax(process_logits(row, request.params, _NO_TOKENS, _NO_TOKENS))
        probs.append(q)
        return sample_from_probs(q, request.rng)
