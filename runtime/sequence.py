"""One sequence's engine-side state (the scheduler's `Request` holds its tokens), and the stop rules that each
token it emits goes through, in order: a stop token (EOS, stop_token_ids) once min_tokens are out, the end of
its grammar (structured output), max_tokens and the context, then stop strings in the detokenized text."""

from __future__ import annotations

import dataclasses

import numpy as np

from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.scheduler import Request
from llmc.runtime.spec_decode import Proposal
from llmc.runtime.structured import GrammarMatcher
from llmc.sampling_params import SamplingParams


@dataclasses.dataclass
class Emitted:
    """What a step's tokens became once the stop rules had their say."""

    token_ids: list[int]  # the tokens kept: up to and including the one that stopped the sequence
    text: str  # the new text (held back where it may still become a stop string)
    finish_reason: str | None
    stop_reason: str | int | None


@dataclasses.dataclass(eq=False)
class SequenceState:
    req_id: str
    index: int
    params: SamplingParams
    request: Request
    rng: np.random.Generator
    prompt_ids: np.ndarray  # int64 [P], for the repetition penalty
    detokenizer: IncrementalDetokenizer | None
    min_tokens_suppress: tuple[int, ...]  # EOS and stop token ids, banned until min_tokens are out
    speculate: bool = True  # the engine's speculative decoding (if on) guesses this sequence's tokens
    proposal: Proposal | None = None  # the guesses of its next step, while it runs
    matcher: GrammarMatcher | None = None  # structured output: where its output stands in its grammar

    def emit(self, tokens: list[int], eos_token_ids: tuple[int, ...], max_model_len: int) -> Emitted:
        """Take `tokens` (sampled, or a verified run of guesses) one by one, stopping at the first that a stop
        rule matches."""
        params, request = self.params, self.request
        num_out, num_tokens = request.num_output_tokens, request.num_tokens  # before these tokens
        kept: list[int] = []
        finish_reason = stop_reason = None
        for token in tokens:
            kept.append(token)
            num_out += 1
            num_tokens += 1
            finish_reason, stop_reason = self._stop_token(token, num_out, eos_token_ids)
            stopped_by_token = finish_reason == "stop"
            if finish_reason is None and self.matcher is not None:
                self.matcher.accept([token])
                if self.matcher.is_finished:  # only EOS could follow: end here, not one step later
                    finish_reason = "stop"
            if finish_reason is None and (
                (params.max_tokens is not None and num_out >= params.max_tokens) or num_tokens >= max_model_len
            ):
                finish_reason = "length"
            if self.detokenizer is not None:
                # NOTE: a stop token (EOS or stop_token_ids) is returned as an id but not as text (as vLLM).
                matched = self.detokenizer.update(
                    [] if stopped_by_token else [token],
                    check_stop=num_out > params.min_tokens,
                    flush=finish_reason is not None,
                )
                if matched is not None:
                    finish_reason, stop_reason = "stop", matched
            if finish_reason is not None:
                break
        text = "" if self.detokenizer is None else self.detokenizer.take_delta(finished=finish_reason is not None)
        return Emitted(kept, text, finish_reason, stop_reason)

    def _stop_token(self, token: int, num_out: int, eos_token_ids) -> tuple[str | None, int | None]:
        if num_out <= self.params.min_tokens:
            return None, None
        if token in eos_token_ids and not self.params.ignore_eos:
            return "stop", None
        if token in self.params.stop_token_ids:
            return "stop", token
        return None, None
