"""OpenAI-compatible HTTP server (`llmc serve`): FastAPI + uvicorn over AsyncLLMEngine.

    app = create_app(AsyncLLMEngine(LLMEngine(model, tokenizer)), tokenizer, "my-model", chat_template)
    serve(app, "127.0.0.1", 8000)

Endpoints:
- POST /v1/completions        prompt: a string or a list of token ids (or a list holding one of them)
- POST /v1/chat/completions   messages rendered with the checkpoint's chat template (chat_template.py)
- GET  /v1/models, GET /health
Both generation endpoints take OpenAI's and vLLM's parameter names (model, max_tokens, temperature, top_p,
top_k, min_p, n, stop, seed, presence/frequency/repetition_penalty, logprobs / top_logprobs, stream,
stream_options, stop_token_ids, min_tokens, ignore_eos) and stream with Server-Sent Events: `data: {json}`
chunks, then `data: [DONE]`. Other OpenAI fields are ignored, except the few that would change the output
and are not implemented (echo, suffix, logit_bias, tools, ...): those are refused.

Errors: anything wrong with a request (bad JSON, wrong types, invalid values, a prompt longer than the
context: the engine's RequestError) is an HTTP 400 with OpenAI's error body
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`; the server never answers a bad
request with a 500 and keeps serving. A request is validated before the stream starts, so a streaming
request that cannot run gets the 400 too, not a stream.

Cancellation: a client that disconnects (mid-stream or while waiting for a non-streaming answer) aborts its
request, so its KV cache blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.errors import LlmcError, RequestError
from llmc.runtime.chat_template import NO_TEMPLATE_NOTICE, chat_prompt_ids, compile_template, pick_template
from llmc.runtime.chat_template import special_tokens
from llmc.runtime.engine import AsyncLLMEngine, RequestOutput
from llmc.runtime.sampling import SamplingParams

logger = logging.getLogger("llmc.server")

# ----------------------------------------------------------------------------------------------------------
# Request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


# Request fields that map one to one onto SamplingParams; unset (or null) ones keep SamplingParams' defaults.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos",
                    "skip_special_tokens")  # fmt: skip


class _GenerationRequest(_Body):
    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted so that they can be refused when set: silently ignoring them would change the answer.
    logit_bias: dict[str, float] | None = None

    _unsupported: ClassVar[tuple[str, ...]] = ("logit_bias",)

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        for name in self._unsupported:
            if getattr(self, name) not in (None, False, [], {}):
                raise _ApiError(f"'{name}' is not supported by this server", param=name)
        kwargs = {k: getattr(self, k) for k in _SAMPLING_FIELDS if getattr(self, k) is not None}
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; null: until the context is full
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    _unsupported: ClassVar[tuple[str, ...]] = ("logit_bias", "echo", "suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed on to the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # chat default: until EOS or the context is full
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    _unsupported: ClassVar[tuple[str, ...]] = ("logit_bias", "tools")


# ----------------------------------------------------------------------------------------------------------
# Errors


class _ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def _error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _error_param(error: LlmcError) -> str | None:
    """The request field a RequestError is about, where its message names one (SamplingParams' do)."""
    m = re.match(r"invalid sampling parameter: (\w+)", error.what)
    if m:
        return m.group(1)
    return "prompt" if "prompt" in error.what else None


def _validation_message(errors) -> tuple[str, str | None]:
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


# ----------------------------------------------------------------------------------------------------------
# Per-choice state while generating


@dataclasses.dataclass
class _Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list = dataclasses.field(default_factory=list)  # formatted entries
    text_offset: int = 0  # completions logprobs: characters of token text so far
    started: bool = False  # chat streaming: the role chunk went out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its stream, also when the client went away mid-stream.

    Closing the body generator closes the engine's stream inside it, which aborts the request.
    """

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------------------------------------------------------
# The app


class _Server:
    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, chat_template, bos_token, eos_token):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_template = pick_template(chat_template)
        if self.chat_template is not None:
            compile_template(self.chat_template)  # a broken template fails at start, not per request
        else:
            logger.warning(NO_TEMPLATE_NOTICE)
        config = engine.engine.model.config
        default_bos, default_eos = special_tokens(tokenizer, config)
        self.bos_token = default_bos if bos_token is None else bos_token
        self.eos_token = default_eos if eos_token is None else eos_token
        self.created = int(time.time())

    # -- shared --------------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise _ApiError(f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                            status=404, param="model", code="model_not_found")  # fmt: skip

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def start(self, prompt_ids: list[int], params: SamplingParams, req_id: str):
        """Start the request and wait for its first output, so that an invalid request raises here (-> 400)."""
        stream = self.engine.generate(prompt_ids, params, req_id)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None  # aborted before it produced anything
        except BaseException:
            await stream.aclose()
            raise
        return stream, first

    async def run_to_end(self, request: Request, prompt_ids, params, req_id, on_output) -> bool:
        """Feed every output to on_output until all sequences finish; False if the client left first."""

        async def consume():
            stream, first = await self.start(prompt_ids, params, req_id)
            async with contextlib.aclosing(stream):
                if first is not None:
                    on_output(first)
                async for out in stream:
                    on_output(out)

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()  # re-raises a RequestError
                return True
            logger.info("client disconnected; request %s aborted", req_id)
            return False
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # closes the engine stream: the request is aborted
                await asyncio.gather(work, return_exceptions=True)

    def usage(self, num_prompt: int, choices: list[_Choice]) -> dict:
        completion = sum(c.num_tokens for c in choices)
        return {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion}

    @staticmethod
    def update_choice(choice: _Choice, out: RequestOutput) -> None:
        choice.text += out.new_text
        choice.num_tokens = out.num_output_tokens
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason

    async def stream_chunks(self, stream, first, choices, params, make_chunks, usage_chunk) -> AsyncIterator[str]:
        """The SSE body: make_chunks(out) -> chunk dicts per output, then the usage chunk (if any), then [DONE]."""
        try:
            for chunk in make_chunks(None):  # opening chunks (chat: the assistant role)
                yield _sse(chunk)
            if first is not None:
                for chunk in make_chunks(first):
                    yield _sse(chunk)
            async for out in stream:
                for chunk in make_chunks(out):
                    yield _sse(chunk)
            if usage_chunk is not None:
                yield _sse(usage_chunk())
        except LlmcError as e:  # cannot become a 400 any more: the stream has started
            yield _sse({"error": {"message": str(e), "type": "invalid_request_error", "param": None, "code": None}})
        except Exception as e:
            logger.exception("generation failed")
            yield _sse({"error": {"message": f"internal error: {e}", "type": "server_error", "param": None,
                                  "code": None}})  # fmt: skip
        finally:
            await stream.aclose()
        yield _SSE_DONE

    # -- /v1/completions -----------------------------------------------------------------------------------

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids
        if all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if len(prompt) == 1:
            return self.completion_prompt(prompt[0])
        raise _ApiError("this server takes one prompt per request; send the prompts as separate requests",
                        param="prompt")  # fmt: skip

    def completion_logprobs(self, choice: _Choice, out: RequestOutput, k: int) -> dict:
        """OpenAI's legacy logprobs object for the new tokens of `out`."""
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, dist in zip(out.new_token_ids, out.logprobs or []):
            text = self.token_text(token)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(dist[token])
            lp["top_logprobs"].append({self.token_text(t): v for t, v in list(dist.items())[:k]})
            lp["text_offset"].append(choice.text_offset)
            choice.text_offset += len(text)
        return lp

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise _ApiError("best_of other than n is not supported", param="best_of")
        params = body.sampling_params(max_tokens=body.max_tokens, logprobs=body.logprobs)
        prompt_ids = self.completion_prompt(body.prompt)
        req_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choices = [_Choice(i) for i in range(params.n)]
        want_logprobs = params.logprobs is not None

        def choice_json(choice: _Choice, text: str, logprobs) -> dict:
            return {"index": choice.index, "text": text, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}  # fmt: skip

        def envelope(choice_list, **extra) -> dict:
            return {"id": req_id, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choice_list, **extra}  # fmt: skip

        if not body.stream:
            full_logprobs: list[dict] = [{} for _ in choices]

            def on_output(out: RequestOutput) -> None:
                choice = choices[out.index]
                if want_logprobs:
                    lp = self.completion_logprobs(choice, out, params.logprobs)
                    acc = full_logprobs[out.index]
                    for key, values in lp.items():
                        acc.setdefault(key, []).extend(values)
                self.update_choice(choice, out)

            if not await self.run_to_end(request, prompt_ids, params, req_id, on_output):
                return Response(status_code=499)
            return envelope(
                [choice_json(c, c.text, full_logprobs[c.index] if want_logprobs else None) for c in choices],
                usage=self.usage(len(prompt_ids), choices),
            )

        stream, first = await self.start(prompt_ids, params, req_id)

        def make_chunks(out: RequestOutput | None) -> list[dict]:
            if out is None:
                return []
            choice = choices[out.index]
            lp = self.completion_logprobs(choice, out, params.logprobs) if want_logprobs else None
            self.update_choice(choice, out)
            if not out.new_text and not out.finished and lp is None:
                return []  # text held back (an incomplete character, a possible stop string)
            return [envelope([choice_json(choice, out.new_text, lp)])]

        usage_chunk = None
        if body.stream_options is not None and body.stream_options.include_usage:
            usage_chunk = lambda: envelope([], usage=self.usage(len(prompt_ids), choices))  # noqa: E731
        return _SSEResponse(self.stream_chunks(stream, first, choices, params, make_chunks, usage_chunk))

    # -- /v1/chat/completions ------------------------------------------------------------------------------

    def chat_messages(self, messages: list[ChatMessage]) -> list[dict]:
        out = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):  # content parts: only text
                if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                    raise _ApiError("only text content parts are supported", param=f"messages.{i}.content")
                content = "\n".join(p["text"] for p in content)
            out.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        return out

    def chat_logprobs(self, out: RequestOutput, k: int) -> list[dict]:
        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [
            {**entry(token, dist[token]), "top_logprobs": [entry(t, v) for t, v in list(dist.items())[:k]]}
            for token, dist in zip(out.new_token_ids, out.logprobs or [])
        ]

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise _ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        if body.response_format not in (None, {"type": "text"}):
            raise _ApiError("response_format other than text is not supported", param="response_format")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        messages = self.chat_messages(body.messages)
        prompt_ids = chat_prompt_ids(self.tokenizer, self.chat_template, messages, self.bos_token, self.eos_token)
        req_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = [_Choice(i) for i in range(params.n)]
        want_logprobs = params.logprobs is not None

        def envelope(choice_list, obj="chat.completion.chunk", **extra) -> dict:
            return {"id": req_id, "object": obj, "created": created, "model": self.model_name,
                    "choices": choice_list, **extra}  # fmt: skip

        if not body.stream:
            full_logprobs: list[list] = [[] for _ in choices]

            def on_output(out: RequestOutput) -> None:
                if want_logprobs:
                    full_logprobs[out.index].extend(self.chat_logprobs(out, params.logprobs))
                self.update_choice(choices[out.index], out)

            if not await self.run_to_end(request, prompt_ids, params, req_id, on_output):
                return Response(status_code=499)
            return envelope(
                [
                    {"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": {"content": full_logprobs[c.index]} if want_logprobs else None,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
                    for c in choices
                ],
                obj="chat.completion",
                usage=self.usage(len(prompt_ids), choices),
            )

        stream, first = await self.start(prompt_ids, params, req_id)

        def make_chunks(out: RequestOutput | None) -> list[dict]:
            if out is None:  # every choice opens with the role
                return [envelope([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]) for c in choices]  # fmt: skip
            choice = choices[out.index]
            lp = {"content": self.chat_logprobs(out, params.logprobs)} if want_logprobs else None
            self.update_choice(choice, out)
            if not out.new_text and not out.finished and lp is None:
                return []
            delta = {"content": out.new_text} if out.new_text or not out.finished else {}
            return [envelope([{"index": choice.index, "delta": delta, "logprobs": lp,
                               "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}])]  # fmt: skip

        usage_chunk = None
        if body.stream_options is not None and body.stream_options.include_usage:
            usage_chunk = lambda: envelope([], usage=self.usage(len(prompt_ids), choices))  # noqa: E731
        return _SSEResponse(self.stream_chunks(stream, first, choices, params, make_chunks, usage_chunk))

    # -- /v1/models ----------------------------------------------------------------------------------------

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "llmc",
                "max_model_len": self.engine.engine.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}


def create_app(
    engine: AsyncLLMEngine,
    tokenizer,
    model_name: str,
    chat_template: str | None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `engine` (whose LLMEngine must hold the same tokenizer, for text).

    tokenizer: a `tokenizers.Tokenizer`; chat_template: the checkpoint's Jinja2 template, or None for a plain
    transcript. bos_token / eos_token: the strings the template sees; by default the tokens of the model
    config's bos_token_id and first eos_token_id. The engine is shut down when the app stops.
    """
    server = _Server(engine, tokenizer, model_name, chat_template, bos_token, eos_token)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown()

    app = FastAPI(title="llmc", lifespan=lifespan)
    app.state.llmc = server

    @app.exception_handler(_ApiError)
    async def api_error(request: Request, e: _ApiError):
        return _error_response(e.message, e.status, e.param, e.code)

    @app.exception_handler(LlmcError)
    async def llmc_error(request: Request, e: LlmcError):  # RequestError: the request cannot be served
        param = _error_param(e) if isinstance(e, RequestError) else None
        if param == "prompt" and request.url.path.endswith("/chat/completions"):
            param = "messages"
        return _error_response(str(e), 400, param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        message, param = _validation_message(e.errors())
        return _error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error_response(str(e.detail), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("internal error")
        return _error_response(f"internal error: {type(e).__name__}: {e}", 500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat_completions(body, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "error", "detail": "the engine loop failed; restart the server"}, 503)
        return {"status": "ok"}

    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Run the app until Ctrl-C (blocking). Open streams get 5 s to finish on shutdown."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

