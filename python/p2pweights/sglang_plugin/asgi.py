"""The plugin's few ASGI steps around sglang's own app (the session gate, the bootstrap server's
area book): read a request's whole body, hold back an app's whole answer, send an answer."""
from __future__ import annotations

from typing import Any

from ..control import protocol as p


async def read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def answer_of(app: Any, scope: dict, receive: Any) -> tuple[int, list, bytes]:
    """``app``'s whole answer to one call (status, headers, body), held back from the caller (sglang's
    control routes answer small JSON)."""
    start: dict = {}
    chunks: list[bytes] = []

    async def hold(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, hold)
    return int(start.get("status", p.ENGINE_FAILED)), list(start.get("headers", [])), b"".join(chunks)


async def respond(send: Any, status: int, headers: list, body: bytes) -> None:
    """Send an answer whole, its content-length set to ``body``'s."""
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
