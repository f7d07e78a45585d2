"""Errors: ApiError (a request's failure, with its status), OpenAI's error body, and the status every other
exception maps to (`install_error_handlers`). A bad request fails alone: never a 500, and the server goes on.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.errors import LlmcError, RequestError

logger = logging.getLogger("llmc.server")


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers


def error_body(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def shutting_down() -> ApiError:
    return ApiError(
        "the server is shutting down; send the request again to another instance", status=503, code="shutting_down"
    )


def validation_error(e: ValidationError) -> ApiError:
    parts, param = [], None
    for err in e.errors(include_url=False):
        loc = [str(x) for x in err.get("loc", ())]
        if err.get("type") == "json_invalid":
            return ApiError(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return ApiError("invalid request: " + "; ".join(parts), param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception with OpenAI's error body: ApiError with its own status, a RequestError with 400,
    another LlmcError (the model's or the checkpoint's fault) and anything else with 500."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e.message, e.status, e.param, e.code, e.headers)

    @app.exception_handler(LlmcError)
    async def llmc_error(request: Request, e: LlmcError):
        if isinstance(e, RequestError):  # the request cannot be served
            return error_response(str(e), 400, e.param)
        logger.error("request failed: %s", e)  # the model's or the checkpoint's fault (a chat template out of bounds)
        return error_response(str(e), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(str(e.detail), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("internal error")
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)
