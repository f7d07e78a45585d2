"""Iteration-level (continuous) batching over the paged KV cache.

The algorithm (vLLM v1's model). There is no prefill phase and no decode phase. Each request has
`num_tokens` (prompt + generated so far) and `num_computed_tokens` (tokens whose k/v are in the cache).
Between steps every request misses num_tokens - num_computed_tokens >= 1 tokens. A step computes some
of them; when it reaches num_tokens, the logits of the last token sample one more (num_tokens += 1). So a
new request misses its whole prompt ("prefill"), a decoding one misses 1 token (its last sampled one), and
a preempted one simply has num_computed_tokens = 0 again.

Each `schedule()` hands out a budget of `max_num_batched_tokens` tokens:
  1. Running requests, oldest first, each get min(missing tokens, budget left). A long prompt that does
     not fit takes what is left (chunked prefill) and continues next step, mixed with others' decodes.
     Cache slots come from `KVCacheManager.allocate_slots`. When it fails, the newest running request is
     preempted (recompute): its blocks are freed, num_computed_tokens = 0, and it goes to the FRONT of the
     waiting queue, keeping its generated tokens, which are recomputed like prompt next time. Repeat until
     the allocation succeeds or the request preempted is the one being scheduled.
  2. Then, if nothing was preempted this step, waiting requests in FIFO order are admitted while budget,
     `max_num_seqs` and cache blocks allow. Admission stops at the first that does not fit (no skipping
     ahead, so a long request is not starved by short ones). With prefix caching, an admitted request
     first takes the longest cached run of full blocks that starts its tokens (`get_computed_blocks`):
     those tokens count as computed, and only the rest is scheduled (and budgeted).
  3. num_computed_tokens of every scheduled request advances now; the step runs; once it succeeded the
     engine calls `cache_computed_blocks`, so the full blocks it wrote become findable, then appends the
     sampled tokens (`append_token`) and finishes requests (`finish_request`), which frees their blocks.

Speculative decoding: the engine puts guesses of a decoding request's next tokens in `spec_token_ids` before
`schedule()`; its step then computes the last token and the guesses (budget permitting), and `append_tokens`
records the accepted ones and rolls the computed tokens (and cache slots) back past the rejected ones.

LongRoPE (Phi-3, `long_rope` = its original length): a sequence of more tokens rotates q and k by the long
frequencies, all of its tokens, as transformers recomputes the whole cache the step a sequence passes that length.
So the step a running request passes it, its short-rotated k/v are dropped and it is computed again from its first
token (`_recompute`), and the prefix cache keeps the two kinds apart (`_salt`).

Admission, budget, preemption and output building are separate helpers (`_admit_waiting`,
`_num_new_tokens`, `_preempt_newest`, `_schedule_request`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Sequence

from llmc.runtime.kv_cache import KVCacheManager


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted (then num_preemptions > 0)
    RUNNING = "running"  # holds cache blocks
    FINISHED = "finished"


class Request:
    """The scheduler's view of one sequence: its tokens and how many of them are in the cache."""

    __slots__ = (
        "req_id",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "status",
        "num_preemptions",
        "spec_token_ids",
        "long_rope_kv",
    )

    def __init__(self, req_id: str, prompt_token_ids: Sequence[int]):
        assert len(prompt_token_ids) > 0, "a request needs at least one prompt token"
        self.req_id = req_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # guesses of the tokens after its last one (speculative decoding), to verify in its next decode step
        self.spec_token_ids: list[int] = []
        self.long_rope_kv = False  # its cached k/v were rotated by LongRoPE's long set (Scheduler.long_rope)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return f"Request({self.req_id!r}, {self.status.value}, computed={self.num_computed_tokens}/{self.num_tokens})"


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One sequence of the step: its new tokens, where they start, and its block table."""

    req_id: str
    token_ids: list[int]  # [n]: the tokens computed this step
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[int]  # the request's block table (covers num_computed_tokens + n)
    samples: bool  # the step reaches the request's last token, so its logits give a new token
    num_spec_tokens: int = 0  # the last ones of token_ids are guesses to verify (each then gives logits too)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # batch order
    num_scheduled_tokens: int
    preempted_req_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int, long_rope: int = 0):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}, max_num_seqs={max_num_seqs}: need >= 1")
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_rope = long_rope  # LongRoPE's original length (0: the model has none)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first, newest (first to preempt) last
        self.num_preemptions = 0  # since creation, for stats and tests
        # prefix cache, in tokens, over admissions (a preempted request is looked up again when readmitted)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # -- the request set ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} already exists")
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_request(self, req_id: str) -> Request:
        """Remove a request (finished or aborted) and free its blocks at once."""
        request = self.requests.pop(req_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv_cache.free(req_id)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        return request

    def abort(self, req_id: str) -> bool:
        """Cancel a request if it is still here; True if it was."""
        if req_id not in self.requests:
            return False
        self.finish_request(req_id)
        return True

    def append_token(self, req_id: str, token_id: int) -> None:
        """Record a token sampled from the last step's logits."""
        self.append_tokens(req_id, [token_id])

    def append_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Record the tokens a step gave: one sampled token, or a verify step's accepted guesses and the token after.

        The verify step computed k/v for the last token and every guess; those of rejected guesses are stale, so
        the computed tokens roll back to all but the new last token, and slots past them go back to the cache.
        """
        request = self.requests[req_id]
        assert request.num_computed_tokens >= request.num_tokens, f"{request}: sampled before caught up"
        request.all_token_ids.extend(int(t) for t in token_ids)
        if request.num_computed_tokens >= request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1
            self.kv_cache.trim_slots(req_id, request.num_computed_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[], num_scheduled_tokens=0, preempted_req_ids=[])
        budget = self._schedule_running(self.max_num_batched_tokens, out)
        if not out.preempted_req_ids:
            self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_computed_tokens and self._long(request) != request.long_rope_kv:
                self._recompute(request)
            num_new = self._num_new_tokens(request, budget)
            while not self.kv_cache.allocate_slots(request.req_id, num_new):
                victim = self._preempt_newest()
                out.preempted_req_ids.append(victim.req_id)
                if victim is request:
                    break
            else:
                self._schedule_request(request, num_new, out)
                budget -= num_new
                i += 1
                continue
            break  # the request being scheduled was itself preempted, so all later ones were too
        return budget

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_blocks = self.kv_cache.get_computed_blocks(request.all_token_ids, self._salt(self._long(request)))
            request.num_computed_tokens = len(computed_blocks) * self.kv_cache.block_size
            num_new = self._num_new_tokens(request, budget)
            if not self.kv_cache.allocate_slots(request.req_id, num_new, computed_blocks):
                request.num_computed_tokens = 0
                break  # FIFO: wait for blocks rather than let a later request jump ahead
            if self.kv_cache.enable_prefix_caching:  # with caching off, nothing was looked up
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += request.num_computed_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule_request(request, num_new, out)
            budget -= num_new
        return budget

    @staticmethod
    def _num_new_tokens(request: Request, budget: int) -> int:
        """Budget: the request's missing tokens, cut to what is left of the step's budget (chunked prefill).

        A decoding request (one token missing) also computes its guesses, as many as the budget leaves room for.
        """
        missing = request.num_tokens - request.num_computed_tokens
        assert missing >= 1, f"{request}: nothing to compute"
        if missing == 1:
            missing += len(request.spec_token_ids)
        return min(missing, budget)

    def _preempt_newest(self) -> Request:
        """Preemption by recompute: the newest running request loses its blocks and waits at the front.

        Its cached blocks stay cached while free, so when readmitted it may find its own prefix again.
        """
        victim = self.running.pop()
        self.kv_cache.free(victim.req_id)
        victim.num_computed_tokens = 0  # its generated tokens stay in all_token_ids and are recomputed
        victim.spec_token_ids = []
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _long(self, request: Request) -> bool:
        """Whether the request's tokens rotate by LongRoPE's long set: it holds more than the original length."""
        return 0 < self.long_rope < request.num_tokens

    @staticmethod
    def _salt(long_rope_kv: bool) -> bytes:
        """The prefix cache's salt for k/v rotated by LongRoPE's long set: they never meet the short ones."""
        return b"longrope" if long_rope_kv else b""

    def _recompute(self, request: Request) -> None:
        """A running request that passed LongRoPE's original length: its k/v, rotated by the short set, go, and its
        tokens are computed again (prefix-cached long ones reused)."""
        self.kv_cache.free(request.req_id)
        computed = self.kv_cache.get_computed_blocks(request.all_token_ids, self._salt(True))
        request.num_computed_tokens = len(computed) * self.kv_cache.block_size
        if not self.kv_cache.allocate_slots(request.req_id, 0, computed):
            request.num_computed_tokens = 0
        request.spec_token_ids = []

    def cache_computed_blocks(self, out: SchedulerOutput) -> None:
        """The step of `out` has run: make the full blocks it computed findable by later requests."""
        for scheduled in out.scheduled:
            request = self.requests.get(scheduled.req_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                # never past num_tokens: guesses under verification are not final, so their blocks are not either
                num_final = min(request.num_computed_tokens, request.num_tokens)
                salt = self._salt(request.long_rope_kv)
                self.kv_cache.cache_blocks(request.req_id, request.all_token_ids, num_final, salt)

    def _schedule_request(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        """Output building: record the request's chunk and advance its computed tokens."""
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start : start + num_new]
        num_spec = num_new - len(token_ids)  # the budget may cut the guesses short
        token_ids += request.spec_token_ids[:num_spec]
        request.spec_token_ids = []
        request.num_computed_tokens = start + num_new
        request.long_rope_kv = self._long(request)
        out.scheduled.append(
            ScheduledRequest(
                req_id=request.req_id,
                token_ids=token_ids,
                num_computed_tokens=start,
                block_ids=self.kv_cache.block_ids(request.req_id),
                samples=request.num_computed_tokens >= request.num_tokens,
                num_spec_tokens=num_spec,
            )
        )
        out.num_scheduled_tokens += num_new
