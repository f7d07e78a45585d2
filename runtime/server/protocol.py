"""The request bodies of /v1/completions and /v1/chat/completions (OpenAI's and vLLM's field names), and how a
body is read: with a size limit, parsed (off the event loop when large) and validated into its model.

A new request field goes on its model here; one that would change the output but is not implemented yet is
listed in `_unsupported` and refused (400), never ignored. Checks across fields live in serving.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmc.errors import RequestError
from llmc.runtime.server.errors import ApiError, validation_error
from llmc.runtime.server.limits import ServerLimits
from llmc.sampling_params import SamplingParams, StructuredOutputs


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # no coercion: `"temperature": false` is a wrong type


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = Field(None, max_length=64)  # OpenAI requires it; it names the schema and changes nothing
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # llmc constrains every schema: strict or not, the output matches it


class ResponseFormat(_Body):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's structured_outputs: one of them."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # Accepted so that they can be refused when set: silently ignoring them would change the answer.
    logit_bias: dict[str, float] | None = None

    _unsupported: ClassVar[tuple[str, ...]] = ("logit_bias",)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        for name in self._unsupported:
            if getattr(self, name) not in (None, False, [], {}):
                raise ApiError(f"'{name}' is not supported by this server", param=name)
        kwargs = {k: getattr(self, k) for k in _SAMPLING_FIELDS if getattr(self, k) is not None}
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs, structured=self.structured())

    def structured(self) -> StructuredOutputs | None:
        """The constraint response_format or structured_outputs asks for (not both), or None for free text."""
        fmt, so = self.response_format, self.structured_outputs
        asked = fmt is not None and fmt.type != "text"
        if asked and so is not None:
            raise ApiError("give response_format or structured_outputs, not both", param="structured_outputs")
        try:
            if fmt is not None and fmt.type == "json_schema":
                if fmt.json_schema is None:
                    raise ApiError("response_format json_schema needs its json_schema", param="response_format")
                schema = fmt.json_schema.schema_
                return StructuredOutputs(json_object=True) if schema in (None, True) else StructuredOutputs(json=schema)
            if fmt is not None and fmt.type == "json_object":
                return StructuredOutputs(json_object=True)
            if so is not None:
                return StructuredOutputs(
                    json=so.json_,
                    json_object=bool(so.json_object),
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                )
        except RequestError as e:
            raise ApiError(str(e), param=self.structured_param(e.param)) from None
        return None

    def structured_param(self, kind: str | None) -> str:
        """The request field a constraint of `kind` came from, for an error message."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs" if kind in (None, "structured_outputs") else f"structured_outputs.{kind}"


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
    tools: list[dict[str, Any]] | None = None  # checked by runtime/tool_calls.py
    tool_choice: str | dict[str, Any] | None = None  # refused without tools (serving.py), as OpenAI does
    parallel_tool_calls: bool | None = None  # None: as OpenAI, true
    # vLLM's and SGLang's extension: more variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    _unsupported: ClassVar[tuple[str, ...]] = ("logit_bias",)


# ----------------------------------------------------------------------------------------------------------
# Request bodies: read with a size limit, parsed (off the event loop when large) and validated


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON: a form POST or a `text/plain` fetch from any web page needs no CORS
    preflight, so a body sent as anything else is never parsed (sites.py)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        shown = media_type[:100] or "none"
        raise ApiError(
            f"the request body must be sent as Content-Type: application/json, not {shown}",
            status=415,
            code="unsupported_media_type",
        )


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, refused with a 413 as soon as it is known to pass `limit`: by Content-Length, else by count;
    and with a 408 when it has not all arrived within timeout_s (a client that trickles it holds a connection)."""

    def too_large() -> ApiError:
        return ApiError(
            f"the request body is larger than {limit:,} bytes",
            status=413,
            code="request_too_large",
            headers={"Connection": "close"},
        )

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large()
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            f"the request body did not arrive within {timeout_s:g} s",
            status=408,
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BaseModel], limits: ServerLimits) -> BaseModel:
    require_json(request)
    body = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)

    def parse() -> BaseModel:
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None

    return await asyncio.to_thread(parse) if len(body) > limits.parse_off_loop_bytes else parse()
