"""The API key: a FastAPI dependency that refuses a /v1 request without `Authorization: Bearer <key>` (401),
compared in constant time. /health and /metrics take no key (app.py)."""

from __future__ import annotations

import hmac

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from llmc.runtime.server.errors import ApiError


def bearer_check(api_key: str):
    """A FastAPI dependency: 401 unless the request sends `Authorization: Bearer <api_key>`."""
    expected = api_key.encode()
    bearer = HTTPBearer(auto_error=False, description="the key given to `llmc serve --api-key`")

    async def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, expected):  # constant time: the answer's timing does not leak the key
            raise ApiError(
                "a missing or wrong API key: send `Authorization: Bearer <key>` with the server's key",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_api_key
