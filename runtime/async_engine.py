"""AsyncLLMEngine: an LLMEngine (engine.py) for asyncio code, which the HTTP server is a thin layer over.

The engine runs on one worker thread; the event loop only queues adds and aborts and routes each step's
outputs to per-request queues (the class docstring has the threading contract).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
from collections.abc import AsyncIterator, Sequence

from llmc.errors import RequestError
from llmc.runtime.engine import LLMEngine
from llmc.runtime.outputs import EngineStats, RequestOutput
from llmc.sampling_params import SamplingParams


class _Aborted:
    pass


_ABORTED = _Aborted()


class AsyncLLMEngine:
    """An LLMEngine for asyncio code (the HTTP server is a thin layer over `generate`).

    Threads: the engine runs on one worker thread and is touched by nothing else. The event loop thread
    only queues adds and aborts (`_pending`, drained by the worker before each step), and a background
    task awaits steps and routes their outputs to per-request asyncio queues. So a step never blocks the
    event loop, and no lock guards the engine. Call the methods from the event loop's thread.

        async for out in engine.generate(prompt_ids, SamplingParams(max_tokens=64)):
            send(out.new_text)          # leaving the loop early (client gone) aborts the request
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmc-engine")
        self._pending: collections.deque[tuple[str, tuple]] = collections.deque()
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._busy = False  # the engine had unfinished requests after the last step
        self._error: BaseException | None = None
        self._closed = False
        self._ids = itertools.count()
        self._stats = engine.stats()

    @property
    def stats(self) -> EngineStats:
        """The engine's load after its last step (or its last add or abort, if later), taken on the worker thread."""
        return self._stats

    @property
    def healthy(self) -> bool:
        """False once the engine loop itself has failed (not a request: those fail alone): it serves nothing more."""
        return self._error is None

    # What a front end may know about the engine; it reaches no further in.

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    @property
    def bos_token_id(self) -> int | None:
        return self.engine.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @property
    def num_requests(self) -> int:
        """Requests streaming now: running or waiting for a place in a step."""
        return len(self._queues)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """LLMEngine.check_request: raise RequestError if the request can never be served."""
        self.engine.check_request(prompt_token_ids, params)  # immutable engine state: safe from this thread

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, req_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs until all n sequences finish. Raises RequestError at once if invalid."""
        params = params or SamplingParams()
        self.check_request(prompt_token_ids, params)
        if self._error is not None:
            raise RuntimeError("the engine loop failed earlier") from self._error
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if req_id is None:
            req_id = f"async-{next(self._ids)}"
        if req_id in self._queues:
            raise RequestError(f"request id {req_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req_id] = queue
        self._submit(("add", (list(prompt_token_ids), params, req_id)))
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if item is _ABORTED:
                    remaining = 0
                    return
                if isinstance(item, BaseException):
                    remaining = 0
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            self._queues.pop(req_id, None)
            if remaining:  # the consumer left early (client disconnected, task cancelled)
                self._submit(("abort", (req_id,)))

    def abort(self, req_id: str) -> None:
        """Cancel a request; its stream ends without a final output; blocks are freed before the next step."""
        queue = self._queues.pop(req_id, None)
        if queue is not None:
            queue.put_nowait(_ABORTED)
        self._submit(("abort", (req_id,)))

    async def shutdown(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._executor.shutdown(wait=True)

    # -- loop thread side -----------------------------------------------------------------------------

    def _submit(self, item: tuple[str, tuple]) -> None:
        if self._closed:
            return
        self._pending.append(item)
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="llmc-engine-loop")
        self._wakeup.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending and not self._busy:
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                outputs, errors, self._busy = await loop.run_in_executor(self._executor, self._work)
            except Exception as e:  # a bug in the loop itself (requests' failures are theirs): accept no more work
                self._error = e
                for queue in self._queues.values():
                    queue.put_nowait(e)
                self._queues.clear()
                return
            for req_id, error in errors:
                if (queue := self._queues.get(req_id)) is not None:
                    queue.put_nowait(error)
            for out in outputs:
                if (queue := self._queues.get(out.req_id)) is not None:
                    queue.put_nowait(out if out.error is None else out.error)

    # -- worker thread side ---------------------------------------------------------------------------

    def _work(self) -> tuple[list[RequestOutput], list[tuple[str, BaseException]], bool]:
        errors = []
        while self._pending:
            kind, args = self._pending.popleft()
            if kind == "add":
                try:
                    self.engine.add_request(*args)
                except Exception as e:  # this request's fault or bug; never the other requests'
                    errors.append((args[2], e))
            else:
                self.engine.abort(*args)
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        self._stats = self.engine.stats()  # one reference swap: the loop thread reads it whole, never half-written
        return outputs, errors, self.engine.has_unfinished()
