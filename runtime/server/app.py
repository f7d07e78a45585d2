"""The app: create_app builds the FastAPI app (routes, error handlers, the API key, the Host check and CORS, the
OpenAPI schema, the engine's shutdown with the app) over OpenAIServing, and serve runs it under uvicorn (with
connections.py's timeouts and connection limit) until SIGTERM or Ctrl-C, draining the requests in flight first.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.metrics import CONTENT_TYPE
from llmc.runtime.server.auth import bearer_check
from llmc.runtime.server.connections import protocol_class
from llmc.runtime.server.errors import install_error_handlers
from llmc.runtime.server.limits import ServerLimits
from llmc.runtime.server.openapi import (
    ERROR_RESPONSES,
    ERROR_RESPONSES_AUTH,
    GENERATION_OK,
    HealthStatus,
    document_request_bodies,
    json_body,
)
from llmc.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from llmc.runtime.server.serving import OpenAIServing
from llmc.runtime.server.sites import SitePolicy, install_site_policy


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
    sites: SitePolicy | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `engine` (whose LLMEngine must hold the same tokenizer, for text).

    tokenizer: a `tokenizers.Tokenizer`; chat_template: the checkpoint's Jinja2 template, or None for a plain
    transcript. bos_token / eos_token: the strings the template sees; by default the tokens of the model
    config's bos_token_id and first eos_token_id. api_key: if given, every /v1 request must send
    `Authorization: Bearer <api_key>` (401 otherwise); /health and /metrics stay open, as in vLLM, for
    probes and scrapers. sites: the Host names answered and the CORS origins (sites.py); `llmc serve` passes
    `hosts_for(--host, --allowed-hosts)`; by default any Host and no CORS. The engine is shut down when the
    app stops.
    """
    server = OpenAIServing(engine, tokenizer, model_name, chat_template, bos_token, eos_token, limits or ServerLimits())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown()
        server.close()

    app = FastAPI(title="llmc", lifespan=lifespan)
    app.state.llmc = server
    install_error_handlers(app)
    install_site_policy(app, sites or SitePolicy())

    auth = [Depends(bearer_check(api_key))] if api_key else []
    errors = {**ERROR_RESPONSES, 401: ERROR_RESPONSES_AUTH} if api_key else ERROR_RESPONSES

    @app.post(
        "/v1/completions",
        dependencies=auth,
        responses={200: GENERATION_OK, **errors},
        openapi_extra=json_body(CompletionRequest),
    )
    async def completions(request: Request):
        return await server.completions(request)

    @app.post(
        "/v1/chat/completions",
        dependencies=auth,
        responses={200: GENERATION_OK, **errors},
        openapi_extra=json_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    @app.get("/v1/models", dependencies=auth, responses={401: ERROR_RESPONSES_AUTH} if api_key else {})
    async def models():
        return server.models()

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get(
        "/health",
        responses={
            200: {"model": HealthStatus},
            503: {
                "model": HealthStatus,
                "description": "Shutting down, or the engine loop failed (`detail` says which to do).",
            },
        },
    )
    async def health():
        if server.draining:
            return JSONResponse({"status": "shutting down"}, 503)
        if not engine.healthy:
            return JSONResponse({"status": "error", "detail": "the engine loop failed; restart the server"}, 503)
        return {"status": "ok"}

    document_request_bodies(app, CompletionRequest, ChatCompletionRequest)
    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn, with the app's own graceful shutdown: drain on the first signal, exit 0 after it."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServing):
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


def uvicorn_config(app: FastAPI, host: str, port: int, *, log_level: str = "info", **kw) -> uvicorn.Config:
    """uvicorn's Config for the app: the h11 protocol with the app's header timeout and connection limit
    (connections.py), and a shutdown deadline after the app's own. kw: more of uvicorn.Config's."""
    limits: ServerLimits = app.state.llmc.limits
    # uvicorn's own deadline comes after ours: by then every request has answered, so none gets its plain 500
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol_class(limits.header_timeout_s, limits.max_connections),
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=limits.shutdown_timeout_s + 5,
        **kw,
    )


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Run the app until SIGTERM or Ctrl-C (blocking); requests in flight get the app's
    `ServerLimits.shutdown_timeout_s` to finish."""
    _Uvicorn(uvicorn_config(app, host, port, log_level=log_level), app.state.llmc).run()
