"""The few ASGI steps the HTTP front and every host's gate take around an app, whatever the engine
(our receiver, the sglang plugin's gate, the vLLM backend's gate): read a request's whole body,
hand the app a body read already, hold back the app's whole answer, send an answer, the path a
route is known by, a request's headers, and whether its client has left. Host-neutral: it imports
nothing of any engine, nor starlette."""
from __future__ import annotations

import json
from typing import Any, Callable

from ..control import protocol as p

JSON_HEADERS = [(b"content-type", b"application/json")]
#: the headers of an answer after which the connection is closed (a refusal: what is left of the
#: request's body on the socket must never be read as the next request)
CLOSE_HEADERS = JSON_HEADERS + [(b"Connection", b"close")]
#: scope key of a no-argument callable saying whether the request's client has closed its
#: connection (set by :mod:`.background_server`'s server; absent under another server)
CLIENT_LEFT = "p2pw.client_left"


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


def replay(raw: bytes, then: Callable[[], Any] | None = None) -> Callable[[], Any]:
    """An ASGI ``receive`` that hands the app ``raw`` (a body read already, or rewritten) once;
    after it, ``then`` (the connection's own ``receive``: the client's disconnect, when it comes),
    or at once a disconnect without ``then``."""
    sent = [False]

    async def receive() -> dict:
        if sent[0]:
            if then is not None:
                return await then()
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


def client_host(scope: dict) -> str:
    """The address of the request's client ("" when the server does not say)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def client_left(scope: dict) -> bool:
    """Whether the request's client has closed its connection (False where the server cannot say)."""
    check = scope.get(CLIENT_LEFT)
    return bool(check()) if check is not None else False


class Headers:
    """The request's headers as the session rules read them (``.get(name)``)."""

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
