"""What the engines return: a step's increment per sequence (RequestOutput), the finished sequences of
`LLMEngine.generate` (GenerationResult of Completions), and the engine's load at one instant (EngineStats).

Plain dataclasses, shared by engine.py, async_engine.py, the server and metrics.py; nothing here runs a model.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one sequence: the increment, not the whole text."""

    req_id: str  # the caller's request id (the n sequences of a request share it)
    index: int  # which of the request's n sequences
    new_token_ids: list[int]
    new_text: str  # text delta; "" while an incomplete character or a possible stop string is held back
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS, stop token, stop string) | "length" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched; None for EOS
    logprobs: list[dict[int, float]] | None = None  # per new token: {token id: logprob}, sampled + top-n
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, this sequence
    error: Exception | None = None  # finish_reason "error": why the request was aborted


@dataclasses.dataclass
class Completion:
    """One finished sequence, as `generate` returns it."""

    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    def add(self, out: RequestOutput) -> None:
        """Append one step's increment of this sequence."""
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


@dataclasses.dataclass
class GenerationResult:
    req_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]  # n of them, by index


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's load at one instant: what /metrics and /health report."""

    num_running: int  # sequences that hold KV blocks
    num_waiting: int  # sequences queued for their first (or, once preempted, next) step
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int  # since the engine was created
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since the engine was created
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed)
    spec_num_draft_tokens: int = 0  # speculative guesses verified by the target model, since the engine was created
    spec_num_accepted_tokens: int = 0  # of those, guesses the target accepted
    structured_requests: int = 0  # requests with a grammar (structured output), since the engine was created
    grammar_compiles: int = 0  # constraints compiled (a cache miss each)
    grammar_compile_seconds: float = 0.0  # their time, summed
    grammar_mask_steps: int = 0  # steps that filled grammar masks
    grammar_mask_seconds: float = 0.0  # their time filling masks (beside the model step), summed

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens found in the prefix cache, 0..1 (0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Fraction of verified speculative guesses the target accepted, 0..1 (0 before any)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0
