"""OpenAIServing: the request handling behind the routes. It admits a request (model, queue, shutdown), turns
its body into a prompt and SamplingParams under the server's and the engine's limits, and answers it on the
one generation path that both endpoints share (`respond`: a whole response, or a stream); it also holds
graceful shutdown's state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from llmc.chat_template import (
    NO_TEMPLATE_NOTICE,
    compile_template,
    pick_template,
    render_chat,
    warm_render_processes,
)
from llmc.errors import LlmcError, RequestError
from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.chat_template import special_tokens
from llmc.runtime.metrics import ServerMetrics
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.server.errors import ApiError, error_body, shutting_down
from llmc.runtime.server.limits import ServerLimits
from llmc.runtime.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, parse_body
from llmc.runtime.server.responses import ChatFormat, Choice, CompletionFormat, Format
from llmc.runtime.server.streaming import SSE_DONE, SSEResponse, sse, wait_for_disconnect
from llmc.runtime.tool_calls import (
    call_grammar,
    check_tool_choice,
    check_tools,
    detect_tool_format,
    format_tool_calls,
    template_renders_tools,
    tools_system_prompt,
)
from llmc.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs

logger = logging.getLogger("llmc.server")


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        tokenizer,
        model_name: str,
        chat_template,
        bos_token,
        eos_token,
        limits: ServerLimits,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.chat_template = pick_template(chat_template)
        self.tool_format = detect_tool_format(self.chat_template)  # how this model writes a tool call
        if self.chat_template is not None:
            compile_template(self.chat_template, limits.chat_template)  # a broken template fails at start
            warm_render_processes()  # the first chat request does not wait for a render process to start
        else:
            logger.warning(NO_TEMPLATE_NOTICE)
        default_bos, default_eos = special_tokens(tokenizer, engine.bos_token_id, engine.eos_token_ids)
        self.bos_token = default_bos if bos_token is None else bos_token
        self.eos_token = default_eos if eos_token is None else eos_token
        self.created = int(time.time())
        self.draining = False  # shutdown began: new requests get 503
        self.cut = False  # shutdown's grace period is over: requests still running were aborted
        self.in_flight: dict[str, int] = {}  # request id -> its sequences (n)
        self.metrics = ServerMetrics(model_name, lambda: engine.stats)
        # A prompt text longer than this cannot fit the context, whatever its tokens: it is refused untokenized.
        self.max_prompt_chars = engine.max_model_len * max_chars_per_token(tokenizer)
        # Long prompts are tokenized here, never on the default pool that parsing and chat renders wait on.
        self._tokenizer_threads = concurrent.futures.ThreadPoolExecutor(
            limits.tokenizer_threads, thread_name_prefix="llmc-tokenize"
        )

    def close(self) -> None:
        self._tokenizer_threads.shutdown(wait=False, cancel_futures=True)

    # -- shutdown -------------------------------------------------------------------------------------------

    def begin_shutdown(self, timeout_s: float) -> None:
        """Refuse new requests from now on; in `timeout_s` seconds abort those still running."""
        if self.draining:
            return
        self.draining = True
        logger.info("shutting down: %d request(s) in flight get %g s to finish", len(self.in_flight), timeout_s)
        asyncio.get_running_loop().call_later(timeout_s, self.cut_in_flight)

    def cut_in_flight(self) -> None:
        self.cut = True
        if self.in_flight:
            logger.warning("shutdown: aborting %d request(s) still running", len(self.in_flight))
        for req_id in list(self.in_flight):
            self.engine.abort(req_id)  # its stream ends; respond() sees self.cut and says why

    # -- checks before a request starts ---------------------------------------------------------------------

    def admit(self, model: str | None, n: int | None) -> None:
        """Shutdown, the model, then room: the request's n sequences join those in flight (429 past the limit)."""
        if self.draining:
            raise shutting_down()
        if model not in (None, "", self.model_name):
            shown = model if len(model) <= 64 else f"{model[:64]}... ({len(model):,} characters)"
            raise ApiError(
                f"the model '{shown}' does not exist; this server serves '{self.model_name}'",
                status=404,
                param="model",
                code="model_not_found",
            )
        most = self.engine.max_num_seqs + self.limits.max_waiting_requests
        busy, n = sum(self.in_flight.values()), max(n or 1, 1)
        if busy and busy + n > most:  # alone, a request may take more than `most`: it waits for its place
            raise ApiError(
                f"the server is busy: {busy} sequences are in flight, and {n} more would pass its limit of {most}",
                status=429,
                code="queue_full",
                headers={"Retry-After": str(self.limits.retry_after_s)},
            )

    def check_body(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The server's limits on the lists and counts a body carries: before anything is built from them."""
        lim = self.limits
        if body.n is not None and body.n > lim.max_n:
            raise ApiError(f"n={body.n} is more than this server's limit of {lim.max_n}", param="n")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > lim.max_stop or any(len(s) > lim.max_stop_chars for s in stop):
            raise ApiError(
                f"stop: at most {lim.max_stop} strings of at most {lim.max_stop_chars} characters", param="stop"
            )
        if body.stop_token_ids is not None and len(body.stop_token_ids) > lim.max_stop_token_ids:
            raise ApiError(
                f"stop_token_ids: {len(body.stop_token_ids):,} ids, more than this server's limit of "
                f"{lim.max_stop_token_ids}",
                param="stop_token_ids",
            )

    async def check_limits(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        params: SamplingParams,
        prompt_ids: list[int],
        prompt_param: str,
        logprobs_param: str = "logprobs",
    ) -> None:
        """The engine's limits (prompt length, vocabulary), the context and the structured output's grammar
        (compiled off the event loop, once per constraint): all before the request starts."""
        try:
            if params.structured is None:
                self.engine.check_request(prompt_ids, params)
            else:
                await asyncio.to_thread(self.engine.check_request, prompt_ids, params)
        except RequestError as e:
            param = {"prompt": prompt_param, "logprobs": logprobs_param}.get(e.param, e.param)
            if params.structured is not None and e.param == params.structured.kind:
                param = body.structured_param(e.param)
            raise ApiError(str(e), param=param) from None
        room = self.engine.max_model_len - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ApiError(
                f"max_tokens={params.max_tokens} with a prompt of {len(prompt_ids)} tokens passes the "
                f"model's context of {self.engine.max_model_len} tokens; at most {room} can be generated",
                param="max_tokens",
            )

    # -- the one generation path ----------------------------------------------------------------------------

    async def respond(
        self,
        request: Request,
        arrival: float,
        fmt: Format,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
    ):
        """arrival: the request's time.perf_counter() when it came in, for the time-to-first-token metric."""
        req_id, created = f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        choices = [Choice(i) for i in range(params.n)]

        def envelope(choice_list: list[dict], obj: str, **extra) -> dict:
            return {
                "id": req_id,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choice_list,
                **extra,
            }

        def usage() -> dict:
            completion = sum(c.num_tokens for c in choices)
            return {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion,
            }

        def chunks_for(out: RequestOutput) -> list[dict]:
            tracker.output(out)
            choice = choices[out.index]
            lp = fmt.logprobs(choice, out)
            choice.update(out)
            if not out.new_text and not out.finished and lp is None:
                return []  # text held back (an incomplete character, a possible stop string)
            entry = fmt.delta(choice, out, lp)
            return [] if entry is None else [envelope([entry], fmt.chunk_object)]

        tracker = self.metrics.track_request(len(prompt_ids), params.n, arrival)
        engine_stream = self.engine.generate(prompt_ids, params, req_id)
        self.in_flight[req_id] = params.n
        first: list[RequestOutput | None] = []

        async def consume() -> None:
            """Non-streaming: the whole request; streaming: its first output, so that a failure is a status."""
            out = await anext(engine_stream, None)
            first.append(out)
            while not stream and out is not None:
                chunks_for(out)
                out = await anext(engine_stream, None)

        handed_to_stream = False
        try:
            # a client that leaves while its request waits in the queue or prefills aborts it too
            if not await self._until_disconnect(request, consume(), req_id):
                return Response(status_code=499)
            handed_to_stream = stream
        finally:
            if not handed_to_stream:
                self.in_flight.pop(req_id, None)
                tracker.close()
                await engine_stream.aclose()
        if not stream:
            if self.cut and any(c.finish_reason is None for c in choices):
                raise shutting_down()
            return envelope([fmt.choice(c) for c in choices], fmt.object, usage=usage())

        async def body() -> AsyncIterator[str]:
            try:
                for entry in fmt.opening(choices):
                    yield sse(envelope([entry], fmt.chunk_object))
                if first[0] is not None:
                    for chunk in chunks_for(first[0]):
                        yield sse(chunk)
                async for out in engine_stream:
                    for chunk in chunks_for(out):
                        yield sse(chunk)
                if self.cut and any(c.finish_reason is None for c in choices):
                    raise shutting_down()
                if include_usage:
                    yield sse(envelope([], fmt.chunk_object, usage=usage()))
            except ApiError as e:  # cannot become an HTTP status any more: the stream has started
                yield sse(error_body(e.message, e.status, e.param, e.code))
            except LlmcError as e:
                yield sse(error_body(str(e), 400, getattr(e, "param", None)))
            except Exception as e:
                logger.exception("generation failed")
                yield sse(error_body(f"internal error: {type(e).__name__}: {e}", 500))
            finally:
                self.in_flight.pop(req_id, None)
                tracker.close()
                await engine_stream.aclose()
            yield SSE_DONE

        return SSEResponse(body())

    @staticmethod
    async def _until_disconnect(request: Request, work, req_id: str) -> bool:
        """Run `work` to its end; False (and work cancelled, so its request aborted) if the client left first."""
        work = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()  # re-raises a request's failure
                return True
            logger.info("client disconnected; request %s aborted", req_id)
            return False
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)

    # -- /v1/completions -----------------------------------------------------------------------------------

    async def tokenize(self, text: str, param: str, *, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids. A text too long for the context is refused before it is tokenized (a few MB take
        seconds of CPU); a long one is tokenized on the server's tokenizer threads, off the event loop."""
        if len(text) > self.max_prompt_chars:
            raise ApiError(
                f"the prompt is {len(text):,} characters long: more than the model's context of "
                f"{self.engine.max_model_len} tokens can hold (at most {self.max_prompt_chars:,} characters "
                "with this tokenizer)",
                param=param,
            )
        if len(text) <= self.limits.tokenize_on_loop_chars:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizers' encode holds the GIL and encode_batch lets go of it: a long text leaves the loop free
        encode = functools.partial(self.tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens)
        (encoding,) = await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads, encode)
        return encoding.ids

    async def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.tokenize(prompt, "prompt")
        if all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ApiError(
            "this server takes one prompt per request; send the prompts as separate requests", param="prompt"
        )

    async def completions(self, request: Request):
        arrival = time.perf_counter()
        body = await parse_body(request, CompletionRequest, self.limits)
        self.check_body(body)
        self.admit(body.model, body.n)
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise ApiError("best_of other than n is not supported", param="best_of")
        params = body.sampling_params(max_tokens=body.max_tokens, logprobs=body.logprobs)
        prompt_ids = await self.completion_prompt(body.prompt)
        await self.check_limits(body, params, prompt_ids, "prompt")
        fmt = CompletionFormat(self.token_text, params.logprobs)
        return await self.respond(request, arrival, fmt, prompt_ids, params, body.stream, body.include_usage)

    # -- /v1/chat/completions ------------------------------------------------------------------------------

    def chat_messages(self, messages: list[ChatMessage]) -> list[dict]:
        out = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):  # content parts: only text
                if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                    raise ApiError("only text content parts are supported", param=f"messages.{i}.content")
                content = "\n".join(p["text"] for p in content)
            out.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        return out

    async def chat_completions(self, request: Request):
        arrival = time.perf_counter()
        body = await parse_body(request, ChatCompletionRequest, self.limits)
        self.check_body(body)
        self.admit(body.model, body.n)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(
                f"top_logprobs={body.top_logprobs}: it must be an integer in [0, {MAX_LOGPROBS}]", param="top_logprobs"
            )
        if body.tool_choice is not None and not body.tools:
            raise ApiError("tool_choice is only allowed when tools are given", param="tool_choice")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        messages = self.chat_messages(body.messages)
        functions, tool_format = None, None
        if body.tools is not None:
            try:
                functions = check_tools(body.tools)
                mode, name = check_tool_choice(body.tool_choice, functions)
            except RequestError as e:
                raise ApiError(str(e), param=e.param) from None
            if mode != "none":
                tool_format = self.tool_format
                messages = self.tool_messages(messages, functions)
                params = self.tool_constraint(body, params, functions, mode, name)
            else:
                functions = None
        # a thread waits for the render (in a render process, chat_template.py), which may take its whole budget;
        # the template placed the special tokens itself, so the tokenizer adds none
        text = await asyncio.to_thread(
            render_chat,
            self.chat_template,
            messages,
            self.bos_token,
            self.eos_token,
            add_generation_prompt=True,
            limits=self.limits.chat_template,
            tools=None if functions is None else [{"type": "function", "function": f} for f in functions],
            template_kwargs=body.chat_template_kwargs,
        )
        prompt_ids = await self.tokenize(text, "messages", add_special_tokens=False)
        await self.check_limits(body, params, prompt_ids, "messages", logprobs_param="top_logprobs")
        fmt = ChatFormat(self.token_text, params.logprobs, tool_format)
        return await self.respond(request, arrival, fmt, prompt_ids, params, body.stream, body.include_usage)

    def tool_messages(self, messages: list[dict], functions: list[dict]) -> list[dict]:
        """The conversation as the template needs it for tools: a template that does not render them gets them
        in a system message, and the calls of earlier assistant turns in their text (tool_calls.py's format)."""
        if not template_renders_tools(self.chat_template):
            prompt = tools_system_prompt(self.tool_format, functions)
            if messages and messages[0]["role"] == "system":
                messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": prompt}, *messages]
        if self.chat_template is None or "tool_calls" not in self.chat_template:
            messages = [
                {**m, "content": "\n".join(filter(None, [m["content"], format_tool_calls(self.tool_format, calls)]))}
                if m["role"] == "assistant" and isinstance(calls := m.get("tool_calls"), list) and calls
                else m
                for m in messages
            ]
        return messages

    def tool_constraint(self, body, params: SamplingParams, functions: list[dict], mode: str, name: str | None):
        """The sampling params of a tools request: tool_choice required or a named function constrains the
        output to calls, whose arguments validate against the function's parameters; auto with strict
        functions constrains the calls it makes (free text stays free)."""
        parallel = body.parallel_tool_calls is not False
        if mode == "required":
            grammar = call_grammar(self.tool_format, functions, parallel=parallel)
        elif mode == "named":  # called once
            grammar = call_grammar(self.tool_format, [f for f in functions if f["name"] == name], parallel=False)
        elif strict := [f for f in functions if f.get("strict")]:
            grammar = call_grammar(self.tool_format, strict, parallel=parallel, free_text=True)
        else:
            return params
        if params.structured is not None:
            raise ApiError("a forced tool call and response_format or structured_outputs cannot go together",
                           param="tool_choice")  # fmt: skip
        return dataclasses.replace(params, structured=StructuredOutputs(grammar=grammar))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- /v1/models ----------------------------------------------------------------------------------------

    def models(self) -> dict:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "llmc",
            "max_model_len": self.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}


def max_chars_per_token(tokenizer) -> int:
    """A bound on the characters of text one token stands for: the longest token's text (a byte-level BPE's
    token strings have a character per byte, and a character is at least a byte), four times that when a
    normalizer may shorten the text first (Unicode composition makes one character of up to three)."""
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, 1) * (4 if tokenizer.normalizer is not None else 1)
