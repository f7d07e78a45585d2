"""Streaming to the client: Server-Sent Events framing (`data: {json}` events, then `data: [DONE]`), a streaming
response that always closes its stream, and waiting for a client's disconnect. The events' content comes from
responses.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
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


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
