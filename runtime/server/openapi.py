"""The OpenAPI schema (/openapi.json): the error body every error status carries, /health's body, the statuses
each endpoint documents, and the request bodies of the endpoints that read their own body (protocol.py)."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema


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


ERROR_RESPONSES = {
    400: _error_doc(
        "Bad JSON, a wrong type or value, or a request past a limit; `param` names the field. Also a "
        "Host header the server does not answer to (code `invalid_host`)."
    ),
    404: _error_doc("The model named is not served here."),
    408: _error_doc("The body did not arrive in time."),
    413: _error_doc("The body is larger than the server's limit."),
    415: _error_doc("The body was not sent as `Content-Type: application/json`."),
    429: {
        **_error_doc("Too many requests in flight; see Retry-After."),
        "headers": {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}},
    },
    500: _error_doc("The model or its chat template failed on this request; the server goes on."),
    503: _error_doc("The server is shutting down, or has too many open connections."),
}
ERROR_RESPONSES_AUTH = _error_doc("No API key, or a wrong one.")
GENERATION_OK = {
    "description": "The completion (JSON), or with stream=true Server-Sent Events ending in [DONE].",
    "content": {
        "application/json": {},
        "text/event-stream": {
            "schema": {  # one event
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"type": "string", "description": "a chunk's JSON, or [DONE]"}},
            }
        },
    },
}


def json_body(model: type[BaseModel]) -> dict:
    """openapi_extra for an endpoint that reads its body itself (for size limits and 400s instead of 422s)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def document_request_bodies(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add the JSON schemas of the request bodies that `json_body` refers to into the app's OpenAPI schema."""
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
