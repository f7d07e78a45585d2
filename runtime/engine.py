"""LLMEngine: requests in, incremental outputs out, one model step at a time. async_engine.py wraps it for
asyncio servers; outputs.py holds the types it returns, admission.py the checks a request must pass.

The step loop (`LLMEngine.step`):
  0. With speculative decoding (spec_decode.py), a proposer first guesses the next K tokens of each decoding
     sequence; the scheduler puts them after its last token, and the step asks for logits at all K+1 rows.
  1. `Scheduler.schedule()` picks this step's sequences and token counts under the token budget,
     allocating cache slots (preempting by recompute when the cache is full).
  2. `StepBatch.build` flattens them into the C ABI arrays; `model.step(batch)` returns logits [N, vocab]
     (one row per sequence, K+1 for a sequence with K guesses).
     Once the step succeeded, the full blocks it wrote enter the prefix cache (`cache_computed_blocks`), so
     later requests that start with the same tokens share them instead of computing them again.
  3. Every sequence whose step reached its last token samples one token (sampling.py), or keeps its accepted
     guesses and one token after them (each checked in turn as if sampled alone), appends it, checks
     stop tokens / length, detokenizes it and checks stop strings (detokenizer.py); a finished sequence is
     removed and its blocks are freed at once.
  4. One `RequestOutput` per sequence that got tokens is returned: the new token ids (several after a verify
     step), the new text, finished and why.

Failures stay with the request that caused them: a sequence whose sampling raises, or every sequence of a
step whose model call raised, is aborted and gets one final `RequestOutput` with finish_reason "error" and
the exception in `error`; the engine goes on with the rest.

The model is anything with `config` (ModelConfig: vocab_size, max_context, eos_token_ids, kv_window), `block_size`,
`num_blocks`, `max_num_tokens`, `max_num_seqs`, `max_num_logits` and `step(StepBatch) -> float32 [N, vocab]`
(docs/contracts.md, "Runtime model interface"), so tests use a fake model.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from llmc.errors import LlmcError, RequestError
from llmc.runtime.admission import RequestLimits
from llmc.runtime.batch import StepBatch
from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.outputs import Completion, EngineStats, GenerationResult, RequestOutput
from llmc.runtime.sampling import make_rng, process_logits, sample_next_token, softmax, top_logprobs
from llmc.runtime.scheduler import Request, Scheduler
from llmc.runtime.sequence import SequenceState
from llmc.runtime.spec_decode import (
    DraftProposer,
    NgramProposer,
    ProposalRequest,
    SpeculativeConfig,
    accept_greedy,
    rejection_sample,
)
from llmc.runtime.structured import StructuredOutput, add_mask_biases
from llmc.sampling_params import SamplingParams

_NO_TOKENS = np.zeros(0, dtype=np.int64)


class LLMEngine:
    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        seed: int | None = None,
        enable_prefix_caching: bool = True,
        speculative: SpeculativeConfig | None = None,
    ):
        """model: the CompiledModel interface; tokenizer: a `tokenizers.Tokenizer`, or None for token ids only.

        max_num_batched_tokens / max_num_seqs default to (and are capped by) what the model was created for;
        max_model_len defaults to the model's context (max_context). enable_prefix_caching: a request reuses
        the k/v of the longest cached run of full blocks its tokens start with (kv_cache.py), and computes
        only the rest. speculative: guess K tokens per decoding sequence and verify them in one step
        (spec_decode.py); the model needs logits rows for them (load it with max_num_logits >= max_num_seqs * (K+1)).
        """
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in config.eos_token_ids)
        bos = getattr(config, "bos_token_id", None)
        self.bos_token_id = None if bos is None else int(bos)
        self.context_len = int(config.max_context)
        self.kv_cache = KVCacheManager(
            model.num_blocks,
            model.block_size,
            sliding_window=int(config.kv_window),
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_batched_tokens=min(max_num_batched_tokens or model.max_num_tokens, model.max_num_tokens),
            max_num_seqs=min(max_num_seqs or model.max_num_seqs, model.max_num_seqs),
            long_rope=int(getattr(config, "long_rope", 0)),
        )
        # A sequence holds at most its window plus one step's chunk (and a partial block at each end) when
        # the cache releases out-of-window blocks; else all of its tokens, so the cache caps its length.
        window = self.kv_cache.sliding_window
        bounded = (
            window
            and window + self.scheduler.max_num_batched_tokens + 2 * model.block_size <= self.kv_cache.max_num_tokens
        )
        cache_cap = self.context_len if bounded else self.kv_cache.max_num_tokens
        self.max_model_len = min(self.context_len, max_model_len or self.context_len, cache_cap)
        self.limits = RequestLimits(
            vocab_size=self.vocab_size,
            context_len=self.context_len,
            max_model_len=self.max_model_len,
            cache_tokens=self.kv_cache.max_num_tokens,
            cache_blocks=self.kv_cache.num_blocks,
            block_size=self.kv_cache.block_size,
        )
        self._rng = np.random.default_rng(seed)
        self.speculative = speculative
        self._proposer = None if speculative is None else self._make_proposer(speculative, model)
        # logits rows a step has beyond one per sequence: the guesses of a step may use no more
        self._spec_rows = 0 if speculative is None else int(model.max_num_logits) - self.scheduler.max_num_seqs
        if speculative is not None and self._spec_rows < speculative.num_speculative_tokens:
            k = speculative.num_speculative_tokens
            raise LlmcError(
                f"speculative decoding of {k} tokens needs logits rows for them, but the model was loaded for "
                f"{model.max_num_logits} rows per step and {self.scheduler.max_num_seqs} sequences",
                f"load it with max_num_logits >= max_num_seqs * {k + 1} (CompiledModel.load(max_num_logits=...))",
            )
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.structured = StructuredOutput(tokenizer, self.vocab_size, self.eos_token_ids, int(model.max_num_logits))
        self._seqs: dict[str, SequenceState] = {}  # by sequence id (== req_id when n == 1)
        self._seq_ids: dict[str, list[str]] = {}  # req_id -> its live sequence ids
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError if the request can never be served (admission.py). Reads only immutable state."""
        self.limits.check(prompt_token_ids, params)
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need a tokenizer",
                "load the engine with the model's tokenizer, or use stop_token_ids",
                param="stop",
            )
        if params.structured is not None:
            self.structured.compiler().check(params.structured)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        speculate: bool = True,
    ) -> str:
        """Queue a request (n sequences for params.n > 1); returns its id. Invalid requests raise RequestError.

        speculate=False: the engine's speculative decoding leaves this request alone (it decodes one token a step).
        """
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        self.check_request(prompt, params)
        if req_id is None:
            req_id = self._new_id()
        elif req_id in self._seq_ids:
            raise RequestError(f"request id {req_id!r} is already in use")
        seq_ids = [req_id] if params.n == 1 else [f"{i}_{req_id}" for i in range(params.n)]
        if any(s in self._seqs for s in seq_ids):
            raise RequestError(f"request id {req_id!r} clashes with a running request's sequence ids")
        self._seq_ids[req_id] = seq_ids
        if params.structured is not None:
            self.structured.num_requests += 1
        try:
            for index, seq_id in enumerate(seq_ids):
                # n > 1: n independent sequences; seeded ones get seed + index (as vLLM), or they would be equal
                seq_params = (
                    params
                    if params.n == 1
                    else dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index)
                )
                self._add_sequence(req_id, index, seq_id, prompt, seq_params, speculate)
        except Exception:
            self.abort(req_id)  # all or nothing: no sequence of a failed add stays behind
            raise
        return req_id

    def _add_sequence(
        self, req_id: str, index: int, seq_id: str, prompt: list[int], params: SamplingParams, speculate: bool
    ) -> None:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt, stop=params.stop, skip_special_tokens=params.skip_special_tokens
            )
        request = Request(seq_id, prompt)
        self._seqs[seq_id] = SequenceState(
            req_id=req_id,
            index=index,
            params=params,
            request=request,
            rng=make_rng(params.seed, self._rng),
            prompt_ids=np.asarray(prompt, dtype=np.int64),
            detokenizer=detokenizer,
            min_tokens_suppress=tuple(sorted(set(self.eos_token_ids) | set(params.stop_token_ids))),
            speculate=speculate,
            matcher=None if params.structured is None else self.structured.compiler().matcher(params.structured),
        )
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> bool:
        """Cancel a request (all its sequences); their cache blocks are freed at once. False if unknown."""
        seq_ids = self._seq_ids.pop(req_id, None)
        if seq_ids is None:
            return False
        for seq_id in seq_ids:
            self.scheduler.abort(seq_id)
            self._seqs.pop(seq_id, None)  # absent when add_request failed before this sequence
            if self._proposer is not None:
                self._proposer.free(seq_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        sched, cache = self.scheduler, self.kv_cache
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_blocks=cache.num_blocks,
            num_free_blocks=cache.num_free_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            **self.structured.stats(),
        )

    def _new_id(self) -> str:
        while (req_id := f"req-{next(self._ids)}") in self._seq_ids:
            pass
        return req_id

    # -- the step -------------------------------------------------------------------------------------

    def _total(self, req_id: str) -> int:
        """The tokens a scheduled request holds in all, its guesses under verification included (StepBatch)."""
        request = self.scheduler.requests[req_id]
        return max(request.num_tokens, request.num_computed_tokens)

    def step(self) -> list[RequestOutput]:
        if self._proposer is not None:
            try:
                self._propose()
            except Exception as e:  # a failed draft model step: its sequences cannot go on, as for the target's
                return self._fail_requests(self._seqs.values(), e)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # Cannot happen while requests wait: every admitted prompt fits the empty cache. Fail, never spin.
            assert not self.scheduler.has_unfinished(), "the scheduler made no progress"
            return []
        num_rows = [1 + s.num_spec_tokens for s in sched.scheduled]  # a verify step's guesses each need a row
        batch = StepBatch.build(
            [s.token_ids for s in sched.scheduled],
            [s.num_computed_tokens for s in sched.scheduled],
            [s.block_ids for s in sched.scheduled],
            self.kv_cache.block_size,
            num_logits=num_rows,
            seq_totals=[self._total(s.req_id) for s in sched.scheduled],
        )
        row_end = np.cumsum(num_rows)
        masking = self._start_masks(sched.scheduled, row_end)  # beside the model step, which lets go of the GIL
        try:
            logits = self.model.step(batch)  # float32 [N, vocab]: each sequence's last num_rows[b] token rows
            if logits.shape != (batch.num_logits, self.vocab_size):
                raise RuntimeError(
                    f"the model returned logits of shape {logits.shape}, not {(batch.num_logits, self.vocab_size)}"
                )
        except Exception as e:  # the step's requests cannot go on; the others (waiting) can
            if masking is not None:
                masking.result()
            return self._fail_requests([self._seqs[s.req_id] for s in sched.scheduled], e)
        if masking is not None:
            add_mask_biases(logits, *masking.result())
        self.scheduler.cache_computed_blocks(sched)  # before sampling finishes (and frees) any of them
        outputs = []
        for scheduled, end in zip(sched.scheduled, row_end, strict=True):
            seq = self._seqs.get(scheduled.req_id)  # None: a sibling sequence failed earlier in this loop
            if seq is None or not scheduled.samples:  # partial prefill chunks produce no token
                continue
            try:
                first = end - 1 - scheduled.num_spec_tokens
                if scheduled.num_spec_tokens:
                    guesses = scheduled.token_ids[-scheduled.num_spec_tokens :]
                    if seq.matcher is not None:  # rows past the first guess the grammar refuses hold stale masks
                        guesses = guesses[: seq.matcher.num_valid(guesses) + 1]
                    outputs.append(self._verify_and_finish(seq, logits[first : first + len(guesses) + 1], guesses))
                else:
                    outputs.append(self._sample_and_finish(seq, logits[end - 1]))
            except Exception as e:
                outputs.append(self._fail(seq, e))
        return outputs

    def _start_masks(self, scheduled, row_end):
        """Start computing the grammar masks of the step's constrained rows (structured.py); None when it has none."""
        rows = []
        for s, end in zip(scheduled, row_end, strict=True):
            seq = self._seqs[s.req_id]
            if seq.matcher is not None and s.samples:
                guesses = s.token_ids[len(s.token_ids) - s.num_spec_tokens :] if s.num_spec_tokens else []
                rows.append((seq.matcher, int(end) - 1 - s.num_spec_tokens, guesses))
        return self.structured.start_masks(rows) if rows else None

    @staticmethod
    def _make_proposer(config: SpeculativeConfig, model) -> NgramProposer | DraftProposer:
        if config.method == "draft":
            return DraftProposer(config.draft_model, model.config)
        return NgramProposer(config.ngram_min, config.ngram_max)

    def _propose(self) -> None:
        """Guess the next tokens of each running sequence that decodes this step (one token missing), as many as
        the step's spare logits rows, its max_tokens (one token comes after the guesses) and its length allow."""
        spare_rows = self._spec_rows
        wanted: list[SequenceState] = []
        asks: list[ProposalRequest] = []
        for request in self.scheduler.running:
            seq = self._seqs[request.req_id]
            seq.proposal, request.spec_token_ids = None, []
            if not seq.speculate or request.num_tokens - request.num_computed_tokens != 1:
                continue
            max_tokens = seq.params.max_tokens
            left = self.max_model_len if max_tokens is None else max_tokens - request.num_output_tokens - 1
            k = min(self.speculative.num_speculative_tokens, spare_rows, left, self.max_model_len - request.num_tokens)
            if k < 1:
                continue
            spare_rows -= k
            wanted.append(seq)
            asks.append(ProposalRequest(request.req_id, request.all_token_ids, k, seq.params, seq.rng))
        for seq, proposal in zip(wanted, self._proposer.propose(asks) if asks else [], strict=True):
            seq.proposal = proposal
            seq.request.spec_token_ids = list(proposal.token_ids)

    def _fail_requests(self, seqs, error: Exception) -> list[RequestOutput]:
        """`_fail` once per request among `seqs` (its n sequences go together)."""
        by_request = {seq.req_id: seq for seq in seqs}
        return [self._fail(seq, error) for seq in by_request.values()]

    def _fail(self, seq: SequenceState, error: Exception) -> RequestOutput:
        """Abort the whole request of `seq` (all n sequences) because of `error`, and say so in one output."""
        self.abort(seq.req_id)
        return RequestOutput(
            req_id=seq.req_id,
            index=seq.index,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            error=error,
            num_prompt_tokens=seq.request.num_prompt_tokens,
            num_output_tokens=seq.request.num_output_tokens,
        )

    def _sample_and_finish(self, seq: SequenceState, logits: np.ndarray) -> RequestOutput:
        """Sample one token for the sequence, apply every stop rule, and build its output."""
        params, request = seq.params, seq.request
        num_out = request.num_output_tokens  # before this token
        suppress = seq.min_tokens_suppress if num_out < params.min_tokens else ()
        if seq.matcher is not None and seq.matcher.is_finished:  # the grammar allows only EOS now
            suppress = ()
        output_ids = np.asarray(request.output_token_ids, dtype=np.int64) if params.has_penalties else _NO_TOKENS
        token = sample_next_token(logits, params, seq.rng, seq.prompt_ids, output_ids, suppress)
        logprobs = [top_logprobs(logits, token, params.logprobs)] if params.logprobs is not None else None
        return self._append_and_finish(seq, [token], logprobs)

    def _verify_and_finish(self, seq: SequenceState, rows: np.ndarray, guesses: list[int]) -> RequestOutput:
        """Check the sequence's guesses against the target's rows [K+1, vocab] (spec_decode.py), then emit the
        accepted ones and the token after them as `_sample_and_finish` would, one by one.

        Row i follows guesses 1..i, so it is processed with them as output so far (penalties, min_tokens): every
        emitted token sees exactly the history it would see without speculation.
        """
        params, request = seq.params, seq.request
        output = request.output_token_ids
        k = len(guesses)

        def history(i: int) -> tuple[np.ndarray, tuple[int, ...]]:
            """(output ids for the penalties, ids to suppress) for row i."""
            output_ids = np.asarray(output + guesses[:i], dtype=np.int64) if params.has_penalties else _NO_TOKENS
            return output_ids, seq.min_tokens_suppress if len(output) + i < params.min_tokens else ()

        # Rows are processed only as far as acceptance reads them: each costs O(vocab), more with top_p.
        def target_at(i: int) -> int:
            return sample_next_token(rows[i], params, seq.rng, seq.prompt_ids, *history(i))

        def target_row(i: int) -> np.ndarray:
            return softmax(process_logits(rows[i], params, seq.prompt_ids, *history(i)))

        if params.greedy:
            tokens = accept_greedy(target_at, guesses)
            num_accepted = len(tokens) - 1
        else:
            draft_probs = None if seq.proposal is None or seq.proposal.probs is None else seq.proposal.probs[:k]
            tokens, num_accepted = rejection_sample(target_row, guesses, draft_probs, seq.rng)
        self.spec_num_draft_tokens += k
        self.spec_num_accepted_tokens += num_accepted
        logprobs = None
        if params.logprobs is not None:
            logprobs = [top_logprobs(rows[i], t, params.logprobs) for i, t in enumerate(tokens)]
        return self._append_and_finish(seq, tokens, logprobs)

    def _append_and_finish(self, seq: SequenceState, tokens: list[int], logprobs: list | None) -> RequestOutput:
        """Emit `tokens` under every stop rule (sequence.py) and build the output."""
        emitted = seq.emit(tokens, self.eos_token_ids, self.max_model_len)
        self.scheduler.append_tokens(seq.request.req_id, emitted.token_ids)
        if emitted.finish_reason is not None:
            self._finish_sequence(seq)
        return RequestOutput(
            req_id=seq.req_id,
            index=seq.index,
            new_token_ids=emitted.token_ids,
            new_text=emitted.text,
            finished=emitted.finish_reason is not None,
            finish_reason=emitted.finish_reason,
            stop_reason=emitted.stop_reason,
            logprobs=None if logprobs is None else logprobs[: len(emitted.token_ids)],
            num_prompt_tokens=seq.request.num_prompt_tokens,
            num_output_tokens=seq.request.num_output_tokens,
        )

    def _finish_sequence(self, seq: SequenceState) -> None:
        self.scheduler.finish_request(seq.request.req_id)
        if self._proposer is not None:
            self._proposer.free(seq.request.req_id)
        del self._seqs[seq.request.req_id]
        live = self._seq_ids[seq.req_id]
        live.remove(seq.request.req_id)
        if not live:
            del self._seq_ids[seq.req_id]

    # -- convenience ----------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run the given prompts (token ids, or text to encode with the tokenizer) to completion.

        Other requests already in the engine run along; their outputs are not returned.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        results: dict[str, GenerationResult] = {}
        for prompt, p in zip(prompts, params, strict=True):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestError("a text prompt needs a tokenizer", "pass token ids or give the engine one")
                prompt = self.tokenizer.encode(prompt).ids
            req_id = self.add_request(prompt, p)
            results[req_id] = GenerationResult(req_id, list(prompt), [Completion(i) for i in range(p.n)])
        while any(r in self._seq_ids for r in results):
            for out in self.step():
                if out.error is not None and out.req_id in results:
                    for req_id in results:
                        self.abort(req_id)
                    raise out.error
                if (result := results.get(out.req_id)) is not None:
                    result.outputs[out.index].add(out)
        return list(results.values())
