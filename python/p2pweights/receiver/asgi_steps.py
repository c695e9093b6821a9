"""The few ASGI steps a session gate takes around an engine's own app, whatever the engine (the sglang
plugin's gate, the vLLM backend's gate): read a request's whole body, hand the app a body read
already, hold back the app's whole answer, send an answer, and the path a route is known by.
Host-neutral: it imports nothing of any engine (starlette or not)."""
from __future__ import annotations

import json
from typing import Any, Callable

from ..control import protocol as p

JSON_HEADERS = [(b"content-type", b"application/json")]


async def read_body(receive: Any, limit: int | None = None) -> bytes:
    """The request's whole body; ``limit``: ValueError past that many bytes (the rest is not read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise ValueError(f"the body is over this engine's limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(raw: bytes) -> Callable[[], Any]:
    """An ASGI ``receive`` that hands the app ``raw`` (a body the gate read, or rewrote) once."""
    sent = [False]

    async def receive() -> dict:
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return receive


async def answer_of(app: Any, scope: dict, receive: Any) -> tuple[int, list, bytes]:
    """``app``'s whole answer to one call (status, headers, body), held back from the caller (the
    engines' control routes answer small JSON)."""
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


async def respond_json(send: Any, status: int, payload: Any) -> None:
    await respond(send, status, JSON_HEADERS, encode(payload))


def route_path(scope: dict) -> str:
    """The path a route is known by: the request's path without the app's ``root_path``."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def header(scope: dict, name: str) -> str | None:
    """One request header's value (the first, decoded as latin-1), or None."""
    key = name.lower().encode("latin-1")
    for k, v in scope.get("headers") or ():
        if k.lower() == key:
            return v.decode("latin-1")
    return None


class Headers:
    """The request's headers as ``session_keeper`` reads them (``.get(name)``)."""

    def __init__(self, scope: dict):
        self._scope = scope

    def get(self, name: str, default: Any = None) -> Any:
        value = header(self._scope, name)
        return default if value is None else value


def encode(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def decode(body: bytes) -> Any:
    """A body as JSON, or None when it is empty or not JSON."""
    try:
        return json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):
        return None
