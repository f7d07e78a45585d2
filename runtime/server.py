"""OpenAI-compatible HTTP server (`llmc serve`): FastAPI + uvicorn over AsyncLLMEngine.

    app = create_app(AsyncLLMEngine(LLMEngine(model, tokenizer)), tokenizer, "my-model", chat_template)
    serve(app, "127.0.0.1", 8000)

Endpoints:
- POST /v1/completions        prompt: a string or a list of token ids (or a list holding one of them)
- POST /v1/chat/completions   messages rendered with the checkpoint's chat template (chat_template.py)
- GET  /v1/models, GET /health
- GET  /metrics                Prometheus text (metrics.py: vLLM's metric names with `llmc:` for `vllm:`)
With an API key (`create_app(api_key=...)`, `llmc serve --api-key` or $LLMC_API_KEY) every /v1 request must
send `Authorization: Bearer <key>`, compared in constant time; /health and /metrics stay open, as in vLLM, for
load balancers' probes and Prometheus. The OpenAPI schema (/openapi.json) documents the request bodies and
every error status below, with its body.
Both generation endpoints take OpenAI's and vLLM's parameter names (model, max_tokens, temperature, top_p,
top_k, min_p, n, stop, seed, presence/frequency/repetition_penalty, logprobs / top_logprobs, stream,
stream_options, stop_token_ids, min_tokens, ignore_eos) and stream with Server-Sent Events: `data: {json}`
chunks, then `data: [DONE]`. Other OpenAI fields are ignored, except the few that would change the output
and are not implemented (echo, suffix, logit_bias, tools, ...): those are refused. Both share one
generation path (`_Server.respond`); what differs (object names, choice and logprobs layout) is a
`_Format`.

A bad request fails alone, with OpenAI's error body `{"error": {"message", "type", "param", "code"}}`; the
server never answers a bad request with a 500 and keeps serving:
- 400: bad JSON (a lone UTF-16 surrogate included), wrong types, invalid values (non-finite floats, a
  negative seed), a prompt longer than the context, prompt + max_tokens past it, n / stop / logprobs past
  the `ServerLimits`. A request is validated before its stream starts, so a streaming request that cannot
  run gets the 400 too, not a stream.
- 401: an API key is set and the request did not send it (checked before the body is read).
- 404: a model other than the one served.
- 413: a body larger than `ServerLimits.max_body_bytes`, told by Content-Length or counted while it arrives.
- 429 with Retry-After: more than `max_num_seqs + max_waiting_requests` requests already in flight.
- 503: the server is shutting down.
Large bodies are parsed off the event loop, and so are chat templates (bounded by chat_template.py).

Cancellation: a client that disconnects (while its request waits, prefills or streams) aborts its request,
so its KV cache blocks are freed before the next step.

Shutdown (`serve`): SIGTERM or Ctrl-C stops new requests (503; uvicorn closes the listening socket too) and
lets those in flight finish for `ServerLimits.shutdown_timeout_s`; then the rest are cut: a non-streaming
client gets a 503 error body, a stream an SSE error event and `[DONE]`. The process then exits with 0.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.errors import LlmcError, RequestError
from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.chat_template import (
    DEFAULT_LIMITS,
    NO_TEMPLATE_NOTICE,
    TemplateLimits,
    chat_prompt_ids,
    compile_template,
    pick_template,
    special_tokens,
)
from llmc.runtime.metrics import CONTENT_TYPE, ServerMetrics
from llmc.runtime.outputs import RequestOutput
from llmc.sampling_params import SamplingParams

logger = logging.getLogger("llmc.server")


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for; past a limit it gets a 4xx naming it. The defaults suit a public endpoint."""

    max_body_bytes: int = 4 << 20  # 413 past it; a context of 128K token ids is about 1 MB of JSON
    max_n: int = 16  # choices per request: each is a sequence in the engine
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_waiting_requests: int = 256  # in flight beyond max_num_seqs; 429 past it
    retry_after_s: int = 1  # the Retry-After a 429 sends
    parse_off_loop_bytes: int = 64 << 10  # bodies larger than this are parsed in a worker thread
    chat_template: TemplateLimits = DEFAULT_LIMITS  # time and size bounds of the checkpoint's chat template
    shutdown_timeout_s: float = 30.0  # after SIGTERM, requests in flight get this long to finish (`serve`)


# ----------------------------------------------------------------------------------------------------------
# Request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # no coercion: `"temperature": false` is a wrong type


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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

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
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_calls, ...: passed on to the template
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
    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers


def _error_body(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    return JSONResponse(_error_body(message, status, param, code), status_code=status, headers=headers)


def _shutting_down() -> _ApiError:
    return _ApiError("the server is shutting down; send the request again to another instance", status=503,
                     code="shutting_down")  # fmt: skip


def _validation_error(e: ValidationError) -> _ApiError:
    parts, param = [], None
    for err in e.errors(include_url=False):
        loc = [str(x) for x in err.get("loc", ())]
        if err.get("type") == "json_invalid":
            return _ApiError(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return _ApiError("invalid request: " + "; ".join(parts), param=param)


# ----------------------------------------------------------------------------------------------------------
# Request bodies: read with a size limit, parsed (off the event loop when large) and validated


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to pass `limit`: by Content-Length, else by count."""

    def too_large() -> _ApiError:
        return _ApiError(f"the request body is larger than {limit:,} bytes", status=413, code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse_body(request: Request, model: type[BaseModel], limits: ServerLimits) -> BaseModel:
    body = await _read_body(request, limits.max_body_bytes)

    def parse() -> BaseModel:
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None

    return await asyncio.to_thread(parse) if len(body) > limits.parse_off_loop_bytes else parse()


# ----------------------------------------------------------------------------------------------------------
# Per-choice state while generating, and the two response formats


@dataclasses.dataclass
class _Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Any = None  # the format's accumulated logprobs of the whole choice
    text_offset: int = 0  # completions logprobs: characters of token text so far

    def update(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.num_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


class _Format(abc.ABC):
    """What differs between /v1/completions and /v1/chat/completions; the generation path is shared."""

    id_prefix: ClassVar[str]
    object: ClassVar[str]  # of a whole response
    chunk_object: ClassVar[str]  # of a stream chunk

    def __init__(self, token_text: Callable[[int], str], num_logprobs: int | None):
        self.token_text, self.num_logprobs = token_text, num_logprobs

    @abc.abstractmethod
    def logprobs(self, choice: _Choice, out: RequestOutput):
        """The logprobs of out's new tokens (None when not asked for), also added to choice.logprobs."""

    def opening(self, choices: list[_Choice]) -> list[dict]:
        """Choice entries of the stream's first chunks, before any token."""
        return []

    @abc.abstractmethod
    def choice(self, choice: _Choice) -> dict:
        """A whole choice of a non-streaming response."""

    @abc.abstractmethod
    def delta(self, choice: _Choice, out: RequestOutput, logprobs) -> dict:
        """The choice entry of one stream chunk."""


class _CompletionFormat(_Format):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def logprobs(self, choice: _Choice, out: RequestOutput):
        """OpenAI's legacy logprobs object for the new tokens of `out`."""
        if self.num_logprobs is None:
            return None
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, dist in zip(out.new_token_ids, out.logprobs or [], strict=True):
            text = self.token_text(token)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(dist[token])
            lp["top_logprobs"].append({self.token_text(t): v for t, v in list(dist.items())[: self.num_logprobs]})
            lp["text_offset"].append(choice.text_offset)
            choice.text_offset += len(text)
        choice.logprobs = choice.logprobs or {key: [] for key in lp}
        for key, values in lp.items():
            choice.logprobs[key].extend(values)
        return lp

    def choice(self, choice: _Choice) -> dict:
        return self._entry(choice, choice.text, choice.logprobs)

    def delta(self, choice: _Choice, out: RequestOutput, logprobs) -> dict:
        return self._entry(choice, out.new_text, logprobs)

    @staticmethod
    def _entry(choice: _Choice, text: str, logprobs) -> dict:
        return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}  # fmt: skip


class _ChatFormat(_Format):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def logprobs(self, choice: _Choice, out: RequestOutput):
        if self.num_logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, dist in zip(out.new_token_ids, out.logprobs or [], strict=True):
            top = [entry(t, v) for t, v in list(dist.items())[: self.num_logprobs]]
            content.append({**entry(token, dist[token]), "top_logprobs": top})
        choice.logprobs = choice.logprobs or {"content": []}
        choice.logprobs["content"].extend(content)
        return {"content": content}

    def opening(self, choices: list[_Choice]) -> list[dict]:  # every choice opens with the role
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in choices]  # fmt: skip

    def choice(self, choice: _Choice) -> dict:
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": choice.logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}  # fmt: skip

    def delta(self, choice: _Choice, out: RequestOutput, logprobs) -> dict:
        delta = {"content": out.new_text} if out.new_text or not out.finished else {}
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}  # fmt: skip


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
# Authentication and the OpenAPI schema


def _bearer_check(api_key: str):
    """A FastAPI dependency: 401 unless the request sends `Authorization: Bearer <api_key>`."""
    expected = api_key.encode()
    bearer = HTTPBearer(auto_error=False, description="the key given to `llmc serve --api-key`")

    async def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, expected):  # constant time: the answer's timing does not leak the key
            raise _ApiError("a missing or wrong API key: send `Authorization: Bearer <key>` with the server's key",
                            status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    return require_api_key


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every error status carries."""

    error: ErrorDetail


class HealthStatus(BaseModel):
    status: str  # "ok", "shutting down" or "error"
    detail: str | None = None


def _error_doc(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


_ERROR_RESPONSES = {
    400: _error_doc("Bad JSON, a wrong type or value, or a request past a limit; `param` names the field."),
    404: _error_doc("The model named is not served here."),
    413: _error_doc("The body is larger than the server's limit."),
    429: {**_error_doc("Too many requests in flight; see Retry-After."),
          "headers": {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}}},
    500: _error_doc("The model or its chat template failed on this request; the server goes on."),
    503: _error_doc("The server is shutting down."),
}  # fmt: skip
_ERROR_RESPONSES_AUTH = _error_doc("No API key, or a wrong one.")
_GENERATION_OK = {"description": "The completion (JSON), or with stream=true Server-Sent Events ending in [DONE].",
                  "content": {"application/json": {}, "text/event-stream": {"schema": {  # one event
                      "type": "object", "required": ["data"],
                      "properties": {"data": {"type": "string", "description": "a chunk's JSON, or [DONE]"}}}}}}  # fmt: skip


def _json_body(model: type[BaseModel]) -> dict:
    """openapi_extra for an endpoint that reads its body itself (for size limits and 400s instead of 422s)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}  # fmt: skip


def _document_request_bodies(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add the JSON schemas of the request bodies that `_json_body` refers to into the app's OpenAPI schema."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            _, defs = models_json_schema(
                [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        return app.openapi_schema

    app.openapi = openapi


# ----------------------------------------------------------------------------------------------------------
# The app


class _Server:
    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, chat_template, bos_token, eos_token,
                 limits: ServerLimits):  # fmt: skip
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.chat_template = pick_template(chat_template)
        if self.chat_template is not None:
            compile_template(self.chat_template, limits.chat_template)  # a broken template fails at start
        else:
            logger.warning(NO_TEMPLATE_NOTICE)
        default_bos, default_eos = special_tokens(tokenizer, engine.bos_token_id, engine.eos_token_ids)
        self.bos_token = default_bos if bos_token is None else bos_token
        self.eos_token = default_eos if eos_token is None else eos_token
        self.created = int(time.time())
        self.draining = False  # shutdown began: new requests get 503
        self.cut = False  # shutdown's grace period is over: requests still running were aborted
        self.in_flight: set[str] = set()
        self.metrics = ServerMetrics(model_name, lambda: engine.stats)

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

    def admit(self, model: str | None) -> None:
        if self.draining:
            raise _shutting_down()
        if model not in (None, "", self.model_name):
            raise _ApiError(f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                            status=404, param="model", code="model_not_found")  # fmt: skip
        most = self.engine.max_num_seqs + self.limits.max_waiting_requests
        if self.engine.num_requests >= most:
            raise _ApiError(f"the server is busy: {self.engine.num_requests} requests are in flight (at most {most})",
                            status=429, code="queue_full",
                            headers={"Retry-After": str(self.limits.retry_after_s)})  # fmt: skip

    def check_limits(self, params: SamplingParams, prompt_ids: list[int], prompt_param: str) -> None:
        """The server's own limits, then the engine's (prompt length, vocabulary): all before the request starts."""
        lim = self.limits
        if params.n > lim.max_n:
            raise _ApiError(f"n={params.n} is more than this server's limit of {lim.max_n}", param="n")
        if len(params.stop) > lim.max_stop or any(len(s) > lim.max_stop_chars for s in params.stop):
            raise _ApiError(f"stop: at most {lim.max_stop} strings of at most {lim.max_stop_chars} characters",
                            param="stop")  # fmt: skip
        try:
            self.engine.check_request(prompt_ids, params)
        except RequestError as e:
            raise _ApiError(str(e), param=prompt_param if e.param == "prompt" else e.param) from None
        room = self.engine.max_model_len - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise _ApiError(f"max_tokens={params.max_tokens} with a prompt of {len(prompt_ids)} tokens passes the "
                            f"model's context of {self.engine.max_model_len} tokens; at most {room} can be generated",
                            param="max_tokens")  # fmt: skip

    # -- the one generation path ----------------------------------------------------------------------------

    async def respond(self, request: Request, arrival: float, fmt: _Format, prompt_ids: list[int],
                      params: SamplingParams, stream: bool, include_usage: bool):  # fmt: skip
        """arrival: the request's time.perf_counter() when it came in, for the time-to-first-token metric."""
        req_id, created = f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        choices = [_Choice(i) for i in range(params.n)]

        def envelope(choice_list: list[dict], obj: str, **extra) -> dict:
            return {"id": req_id, "object": obj, "created": created, "model": self.model_name,
                    "choices": choice_list, **extra}  # fmt: skip

        def usage() -> dict:
            completion = sum(c.num_tokens for c in choices)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                    "total_tokens": len(prompt_ids) + completion}  # fmt: skip

        def chunks_for(out: RequestOutput) -> list[dict]:
            tracker.output(out)
            choice = choices[out.index]
            lp = fmt.logprobs(choice, out)
            choice.update(out)
            if not out.new_text and not out.finished and lp is None:
                return []  # text held back (an incomplete character, a possible stop string)
            return [envelope([fmt.delta(choice, out, lp)], fmt.chunk_object)]

        tracker = self.metrics.track_request(len(prompt_ids), params.n, arrival)
        engine_stream = self.engine.generate(prompt_ids, params, req_id)
        self.in_flight.add(req_id)
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
                self.in_flight.discard(req_id)
                tracker.close()
                await engine_stream.aclose()
        if not stream:
            if self.cut and any(c.finish_reason is None for c in choices):
                raise _shutting_down()
            return envelope([fmt.choice(c) for c in choices], fmt.object, usage=usage())

        async def body() -> AsyncIterator[str]:
            try:
                for entry in fmt.opening(choices):
                    yield _sse(envelope([entry], fmt.chunk_object))
                if first[0] is not None:
                    for chunk in chunks_for(first[0]):
                        yield _sse(chunk)
                async for out in engine_stream:
                    for chunk in chunks_for(out):
                        yield _sse(chunk)
                if self.cut and any(c.finish_reason is None for c in choices):
                    raise _shutting_down()
                if include_usage:
                    yield _sse(envelope([], fmt.chunk_object, usage=usage()))
            except _ApiError as e:  # cannot become an HTTP status any more: the stream has started
                yield _sse(_error_body(e.message, e.status, e.param, e.code))
            except LlmcError as e:
                yield _sse(_error_body(str(e), 400, getattr(e, "param", None)))
            except Exception as e:
                logger.exception("generation failed")
                yield _sse(_error_body(f"internal error: {type(e).__name__}: {e}", 500))
            finally:
                self.in_flight.discard(req_id)
                tracker.close()
                await engine_stream.aclose()
            yield _SSE_DONE

        return _SSEResponse(body())

    @staticmethod
    async def _until_disconnect(request: Request, work, req_id: str) -> bool:
        """Run `work` to its end; False (and work cancelled, so its request aborted) if the client left first."""
        work = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
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

    async def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if len(prompt) <= self.limits.parse_off_loop_bytes:
                return self.tokenizer.encode(prompt).ids
            # tokenizers' encode holds the GIL and encode_batch lets go of it: a long text leaves the loop free
            (encoding,) = await asyncio.to_thread(self.tokenizer.encode_batch, [prompt])
            return encoding.ids
        if all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise _ApiError("this server takes one prompt per request; send the prompts as separate requests",
                        param="prompt")  # fmt: skip

    async def completions(self, request: Request):
        arrival = time.perf_counter()
        body = await _parse_body(request, CompletionRequest, self.limits)
        self.admit(body.model)
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise _ApiError("best_of other than n is not supported", param="best_of")
        params = body.sampling_params(max_tokens=body.max_tokens, logprobs=body.logprobs)
        prompt_ids = await self.completion_prompt(body.prompt)
        self.check_limits(params, prompt_ids, "prompt")
        fmt = _CompletionFormat(self.token_text, params.logprobs)
        return await self.respond(request, arrival, fmt, prompt_ids, params, body.stream, body.include_usage)

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

    async def chat_completions(self, request: Request):
        arrival = time.perf_counter()
        body = await _parse_body(request, ChatCompletionRequest, self.limits)
        self.admit(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise _ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        if body.response_format not in (None, {"type": "text"}):
            raise _ApiError("response_format other than text is not supported", param="response_format")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        messages = self.chat_messages(body.messages)
        # the template runs in a thread: even bounded (chat_template.py), a render may take its whole budget
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, self.chat_template, messages,
                                             self.bos_token, self.eos_token, self.limits.chat_template)  # fmt: skip
        self.check_limits(params, prompt_ids, "messages")
        fmt = _ChatFormat(self.token_text, params.logprobs)
        return await self.respond(request, arrival, fmt, prompt_ids, params, body.stream, body.include_usage)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- /v1/models ----------------------------------------------------------------------------------------

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "llmc",
                "max_model_len": self.engine.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}


def create_app(
    engine: AsyncLLMEngine,
    tokenizer,
    model_name: str,
    chat_template: str | None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `engine` (whose LLMEngine must hold the same tokenizer, for text).

    tokenizer: a `tokenizers.Tokenizer`; chat_template: the checkpoint's Jinja2 template, or None for a plain
    transcript. bos_token / eos_token: the strings the template sees; by default the tokens of the model
    config's bos_token_id and first eos_token_id. api_key: if given, every /v1 request must send
    `Authorization: Bearer <api_key>` (401 otherwise); /health and /metrics stay open, as in vLLM, for
    probes and scrapers. The engine is shut down when the app stops.
    """
    server = _Server(engine, tokenizer, model_name, chat_template, bos_token, eos_token, limits or ServerLimits())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown()

    app = FastAPI(title="llmc", lifespan=lifespan)
    app.state.llmc = server

    @app.exception_handler(_ApiError)
    async def api_error(request: Request, e: _ApiError):
        return _error_response(e.message, e.status, e.param, e.code, e.headers)

    @app.exception_handler(LlmcError)
    async def llmc_error(request: Request, e: LlmcError):
        if isinstance(e, RequestError):  # the request cannot be served
            return _error_response(str(e), 400, e.param)
        logger.error("request failed: %s", e)  # the model's or the checkpoint's fault (a chat template out of bounds)
        return _error_response(str(e), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error_response(str(e.detail), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("internal error")
        return _error_response(f"internal error: {type(e).__name__}: {e}", 500)

    auth = [Depends(_bearer_check(api_key))] if api_key else []
    errors = {**_ERROR_RESPONSES, 401: _ERROR_RESPONSES_AUTH} if api_key else _ERROR_RESPONSES

    @app.post("/v1/completions", dependencies=auth, responses={200: _GENERATION_OK, **errors},
              openapi_extra=_json_body(CompletionRequest))  # fmt: skip
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions", dependencies=auth, responses={200: _GENERATION_OK, **errors},
              openapi_extra=_json_body(ChatCompletionRequest))  # fmt: skip
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    @app.get("/v1/models", dependencies=auth, responses={401: _ERROR_RESPONSES_AUTH} if api_key else {})
    async def models():
        return server.models()

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/health", responses={200: {"model": HealthStatus}, 503: {"model": HealthStatus, "description":
             "Shutting down, or the engine loop failed (`detail` says which to do)."}})  # fmt: skip
    async def health():
        if server.draining:
            return JSONResponse({"status": "shutting down"}, 503)
        if not engine.healthy:
            return JSONResponse({"status": "error", "detail": "the engine loop failed; restart the server"}, 503)
        return {"status": "ok"}

    _document_request_bodies(app, CompletionRequest, ChatCompletionRequest)
    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn, with the app's own graceful shutdown: drain on the first signal, exit 0 after it."""

    def __init__(self, config: uvicorn.Config, server: _Server):
        super().__init__(config)
        self.llmc = server

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own re-raises the signal after shutting down, which ends the process with -SIGTERM
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only; whoever runs the server there stops it
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if not self.llmc.draining and self.started:
            timeout = self.llmc.limits.shutdown_timeout_s
            asyncio.get_running_loop().call_soon_threadsafe(self.llmc.begin_shutdown, timeout)
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Run the app until SIGTERM or Ctrl-C (blocking); requests in flight get the app's
    `ServerLimits.shutdown_timeout_s` to finish."""
    server: _Server = app.state.llmc
    # uvicorn's own deadline comes after ours: by then every request has answered, so none gets its plain 500
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=server.limits.shutdown_timeout_s + 5)  # fmt: skip
    _Uvicorn(config, server).run()
