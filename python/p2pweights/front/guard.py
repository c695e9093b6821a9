"""The HTTP front's middleware (:class:`Guard`): what every host checks before its app runs, and
how any failure is answered. One pure ASGI class, so it wraps our receiver's app, its ranks'
endpoint, and (``app.add_middleware(Guard, ...)``) the FastAPI apps of sglang and vLLM alike.

- **Key**: with an API key set, a call without ``Authorization: Bearer KEY`` (compared in constant
  time, ``control.http.key_matches``) is refused 401 before its body is read or anything runs; the
  ``open_paths`` (the health routes) answer without it, as in sglang. What is left of a refused
  small body is read and dropped first (up to :data:`UNREAD_BODY_LIMIT`), so that the client
  reads the 401 rather than a reset connection.
- **Size**: a ``Content-Length`` over the route's limit is refused 413 before a byte of the body
  is read; a body without one (chunked) is counted while it is read and refused 413 once over.
- **Time**: the whole body must arrive within ``body_deadline`` seconds of the request's head, and
  no read may wait longer than ``read_timeout``: a client that stops, or drips a byte now and
  then, is answered 408. Waiting costs no thread: an idle or dripping connection is a socket in
  the event loop, never a worker (our server's own head deadline, :mod:`.background_server`, cuts
  one that drips its headers).
- **Errors**: any exception the app raises becomes a JSON error answer with a 4xx/5xx status
  (:func:`.error_status.answer_for`); none escapes to the server. Added to a Starlette or FastAPI
  app with ``add_middleware``, the Guard sits inside Starlette's own error middleware, so it sees
  a route's exception before that would answer it in plain text.

The body is read whole before the app runs, then handed to it (:func:`.asgi.replay`), so a handler
never waits on a client. A refused request's connection is closed after the answer. The scope
the app sees says whether its request carried the key (:data:`KEYED`: :mod:`.workers` runs keyed
requests on their own threads, so a flood of calls without the key never delays a keyed one).
"""
from __future__ import annotations

import asyncio
import json
import logging
import traceback
from typing import Any, Callable, Iterable

from ..control import protocol as p
from ..control.http import key_matches
from . import asgi
from .error_status import StatusError, answer_for

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20     # the largest legitimate body (a rank's parameter table) is far smaller
READ_TIMEOUT = 30.0           # seconds one read of a body (or an idle kept-alive connection) may wait
REQUEST_DEADLINE = 60.0       # seconds a request's head, and then its whole body, may take to arrive
UNREAD_BODY_LIMIT = 64 << 10  # what a route that takes no body (health, a 401) reads and drops, unparsed
#: scope key: whether the request carried the engine's key (True where no key is set)
KEYED = "p2pw.keyed"
_KEY_HINT = "send Authorization: Bearer KEY (api_key= / P2PW_API_KEY; the engine's --api-key)"


class _ClientGone(Exception):
    """The client closed its connection before its body arrived: nobody is left to answer."""


class Guard:
    """``Guard(app, api_key=..., open_paths=..., body_limit=..., read_timeout=..., body_deadline=...)``.

    ``api_key``: the key (None: no key is required), or a no-argument callable returning it (read on
    every request). ``open_paths``: paths answered without the key (the health routes).
    ``body_limit``: bytes a body may have, or a callable ``path -> bytes``. ``read_timeout`` and
    ``body_deadline``: seconds, as the module says."""

    def __init__(self, app: Any, *, api_key: str | None | Callable[[], str | None] = None,
                 open_paths: Iterable[str] = (), body_limit: int | Callable[[str], int] = MAX_BODY_BYTES,
                 read_timeout: float = READ_TIMEOUT, body_deadline: float = REQUEST_DEADLINE):
        self.app = app
        self._api_key = api_key
        self.open_paths = frozenset(open_paths)
        self._body_limit = body_limit
        self.read_timeout, self.body_deadline = float(read_timeout), float(body_deadline)

    def api_key(self) -> str | None:
        return self._api_key() if callable(self._api_key) else self._api_key

    def body_limit(self, path: str) -> int:
        return int(self._body_limit(path) if callable(self._body_limit) else self._body_limit)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan (and websockets, which no host of ours serves)
            await self.app(scope, receive, send)
            return
        path = asgi.route_path(scope)
        started = [False]

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            keyed = key_matches(asgi.header(scope, "authorization"), self.api_key())
            if not keyed and path not in self.open_paths:
                await self._drop_body(scope, receive)
                raise StatusError("Unauthorized: this engine requires an API key", p.UNAUTHORIZED, hint=_KEY_HINT)
            body = await self._read_body(scope, receive, self.body_limit(path))
            await self.app({**scope, KEYED: keyed}, asgi.replay(body, then=receive), tracked)
        except _ClientGone:
            return
        except StatusError as e:  # refused before the app ran, or by the app: closed after the answer
            if not started[0]:
                await asgi.respond(send, e.status, asgi.CLOSE_HEADERS, asgi.encode(e.payload()))
        except Exception as e:  # noqa: BLE001 - an app's failure is a JSON answer, never an escaped exception
            if started[0]:  # too late to answer: the server closes the half-sent answer's connection
                logger.error("%s failed after its answer began:\n%s", path, traceback.format_exc())
                return
            status, payload = answer_for(e, path)
            log = logger.error if status >= p.ENGINE_FAILED else logger.debug  # a 4xx is the caller's
            log("%s failed (answered %d):\n%s", path, status, traceback.format_exc())
            await asgi.respond(send, status, asgi.CLOSE_HEADERS, asgi.encode(payload))

    async def _read_body(self, scope: dict, receive: Any, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes, within the deadline. StatusError: 413 (over the
        limit, unread when its Content-Length says so), 408 (too slow); _ClientGone."""
        length = content_length(scope)
        if length is not None and length > limit:
            raise StatusError(f"the body ({length} bytes) is over this engine's limit of {limit} bytes; nothing "
                              f"was read", p.PAYLOAD_TOO_LARGE)
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_deadline
        while True:
            wait = min(self.read_timeout, deadline - loop.time())
            try:
                if wait <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                raise StatusError(f"the request body did not arrive in time ({size} of "
                                  f"{length if length is not None else 'its'} bytes; {self.read_timeout:g}s per read, "
                                  f"{self.body_deadline:g}s for the whole body)", p.REQUEST_TIMEOUT) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise StatusError(f"the body is over this engine's limit of {limit} bytes; the rest was not read",
                                  p.PAYLOAD_TOO_LARGE)
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _drop_body(self, scope: dict, receive: Any) -> None:
        """Read and drop a refused request's small body (the rest, if any, is closed on)."""
        try:
            await self._read_body(scope, receive, UNREAD_BODY_LIMIT)
        except (StatusError, _ClientGone):
            pass


def content_length(scope: dict) -> int | None:
    """The request's ``Content-Length`` (None without one). The server's parser (h11) has refused
    (400) a value that is not plain ASCII digits and two different values; under another server
    such a value is refused here (400)."""
    values = {v.decode("latin-1").strip() for k, v in scope.get("headers") or () if k.lower() == b"content-length"}
    if not values:
        return None
    text = values.pop()
    if values or not text.isdigit() or not text.isascii():
        raise StatusError(f"Content-Length {text[:40]!r} is not one plain number of bytes (ASCII digits, given once)")
    return int(text)


def json_object(raw: bytes) -> dict:
    """A body as a JSON object ({} for an empty body); StatusError 400 for one that is not JSON, is
    nested past Python's stack, or is not an object."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested past Python's stack
        raise StatusError(f"the body is not JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise StatusError("the body must be a JSON object")
    return body
