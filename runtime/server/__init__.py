"""OpenAI-compatible HTTP server (`llmc serve`): FastAPI + uvicorn over AsyncLLMEngine.

    app = create_app(AsyncLLMEngine(LLMEngine(model, tokenizer)), tokenizer, "my-model", chat_template,
                     sites=hosts_for("127.0.0.1"))       # the Host names answered (sites.py)
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
generation path (`OpenAIServing.respond`); what differs (object names, choice and logprobs layout) is a
`Format`.

A bad request fails alone, with OpenAI's error body `{"error": {"message", "type", "param", "code"}}`; the
server never answers a bad request with a 500 and keeps serving:
- 400: bad JSON (a lone UTF-16 surrogate included), wrong types, invalid values (non-finite floats, a
  negative seed), a prompt longer than the context (a text too long to fit is refused before it is
  tokenized), prompt + max_tokens past it, n / stop / stop_token_ids / logprobs past the `ServerLimits`;
  a Host header the server does not answer to (code invalid_host, before anything else). A request is
  validated before its stream starts, so a streaming request that cannot run gets the 400 too, not a stream.
- 401: an API key is set and the request did not send it (checked before the body is read).
- 404: a model other than the one served.
- 408: the body did not arrive within `ServerLimits.body_timeout_s` (the headers: `header_timeout_s`, serve).
- 413: a body larger than `ServerLimits.max_body_bytes`, told by Content-Length or counted while it arrives.
- 415: a POST body not sent as `Content-Type: application/json` (never parsed; sites.py says why).
- 429 with Retry-After: the request's n sequences would pass `max_num_seqs + max_waiting_requests` in flight.
- 503: the server is shutting down; or (serve) more than `ServerLimits.max_connections` connections are open.
Large bodies are parsed off the event loop, and so are chat templates (bounded by chat_template.py); long
prompts are tokenized on the server's own tokenizer threads.

Cancellation: a client that disconnects (while its request waits, prefills or streams) aborts its request,
so its KV cache blocks are freed before the next step.

Shutdown (`serve`): SIGTERM or Ctrl-C stops new requests (503; uvicorn closes the listening socket too) and
lets those in flight finish for `ServerLimits.shutdown_timeout_s`; then the rest are cut: a non-streaming
client gets a 503 error body, a stream an SSE error event and `[DONE]`. The process then exits with 0.

The modules, by responsibility (a new request feature touches them in this order):
- protocol.py   the request bodies (pydantic models: a new request field goes on its model; fields not
                implemented yet are refused there, `_unsupported`) and reading a body (size limit, parse, validate)
- errors.py     ApiError and OpenAI's error body; every exception's status (`install_error_handlers`). A request
                that fails validation raises ApiError(message, param=...) and gets a 400
- serving.py    OpenAIServing, the handling behind the routes: admission and limits, each endpoint's prompt and
                parameters (the checks across fields live there), the one generation path, shutdown's state
- responses.py  what each endpoint answers: whole choices and stream deltas (`Format`): a new kind of delta
                (tool calls, say) is a Format's
- streaming.py  Server-Sent Events framing, the streaming response, a client's disconnect
- auth.py, openapi.py, limits.py   the API key check; the OpenAPI schema's bodies and errors; ServerLimits
- sites.py      which web sites may drive the server: the Host check (DNS rebinding) and CORS (SitePolicy)
- connections.py  uvicorn's h11 protocol with a header timeout and a connection limit (serve's)
- app.py        create_app (routes, handlers, lifespan) and serve (uvicorn, graceful shutdown)
"""

from llmc.runtime.server.app import create_app, serve
from llmc.runtime.server.errors import ApiError, error_body, error_response
from llmc.runtime.server.limits import ServerLimits
from llmc.runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    read_body,
)
from llmc.runtime.server.sites import SitePolicy, hosts_for

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ServerLimits",
    "SitePolicy",
    "StreamOptions",
    "create_app",
    "error_body",
    "error_response",
    "hosts_for",
    "read_body",
    "serve",
]
