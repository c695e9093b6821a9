"""What a receiver's HTTP servers check before a handler runs: the bearer key, and the request
body's size, arrival time and shape; and how they answer (:func:`send_json`). Shared by the
engine's server (:mod:`.request_handler`, sglang's routes) and its ranks' internal endpoint
(:mod:`.rank_server`).

- **Key**: with an API key set, a call without ``Authorization: Bearer KEY`` is refused (401)
  before anything else is read or run (health routes excepted, as in sglang).
- **Size**: a ``Content-Length`` over the limit is refused (413) without reading the body.
- **Time**: every socket read has a deadline (:data:`READ_TIMEOUT`); a client that sends half a
  request and stops is cut off (408) instead of holding a server thread forever.
- **Shape**: a body shorter than its ``Content-Length``, not JSON, too deeply nested, or not an
  object is a 400 and never reaches a handler.

A refused request's connection is closed afterwards: what is left of its body on the socket must
never be read as the next request.
"""
from __future__ import annotations

import json
import logging
import socket
from http.server import BaseHTTPRequestHandler
from typing import Any

from ..control import error_answers
from ..control import protocol as p
from ..control.http import key_matches

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20   # the largest legitimate body (a rank's parameter table) is far smaller
READ_TIMEOUT = 30.0         # seconds a client may stall while sending its request
_DISCARD_CHUNK = 64 << 10


class RequestRefused(Exception):
    """A request refused before any handler ran: ``status`` and the message of the answer."""

    def __init__(self, status: int, message: str, hint: str | None = None):
        super().__init__(message)
        self.status, self.hint = status, hint

    def payload(self) -> dict:
        return error_answers.error_payload(str(self), hint=self.hint)


def check_key(handler: BaseHTTPRequestHandler, api_key: str | None, *, limit: int = MAX_BODY_BYTES) -> None:
    """Refuse (401) a request that does not carry ``api_key``. Its body is read and dropped first
    (when small enough), so the client reads the 401 instead of a reset connection."""
    if key_matches(handler.headers.get("Authorization"), api_key):
        return
    handler.close_connection = True
    try:
        _discard(handler, limit)
    except RequestRefused:
        pass
    raise RequestRefused(p.UNAUTHORIZED, "Unauthorized: this engine requires an API key",
                         hint="send Authorization: Bearer KEY (api_key= / P2PW_API_KEY; the engine's --api-key)")


def read_body(handler: BaseHTTPRequestHandler, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, exactly ``Content-Length`` bytes (b"" without one). RequestRefused: 400
    (a bad or negative length, chunked encoding, a truncated body), 413 (over ``limit``), 408
    (the client stalled past the socket's read timeout)."""
    length = _content_length(handler, limit)
    if not length:
        return b""
    try:
        raw = handler.rfile.read(length)
    except (socket.timeout, TimeoutError):
        handler.close_connection = True
        raise RequestRefused(p.REQUEST_TIMEOUT, f"the request body did not arrive within {handler.timeout or READ_TIMEOUT:g}s "
                                                f"(Content-Length {length})") from None
    except OSError as e:
        handler.close_connection = True
        raise RequestRefused(p.BAD_REQUEST, f"the request body could not be read: {e}") from None
    if len(raw) < length:
        handler.close_connection = True
        raise RequestRefused(p.BAD_REQUEST, f"the request body is truncated: {len(raw)} of {length} bytes "
                                            f"(Content-Length) arrived; nothing was run")
    return raw


def read_json_object(handler: BaseHTTPRequestHandler, limit: int = MAX_BODY_BYTES) -> dict:
    """The body as a JSON object ({} for an empty body); RequestRefused as :func:`read_body`, and
    400 for a body that is not a JSON object."""
    raw = read_body(handler, limit)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested past Python's stack
        raise RequestRefused(p.BAD_REQUEST, f"the body is not JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise RequestRefused(p.BAD_REQUEST, "the body must be a JSON object")
    return body


def _content_length(handler: BaseHTTPRequestHandler, limit: int) -> int:
    if handler.headers.get("Transfer-Encoding"):
        handler.close_connection = True
        raise RequestRefused(p.BAD_REQUEST, "chunked request bodies are not accepted; send Content-Length")
    text = handler.headers.get("Content-Length")
    if text is None or not text.strip():
        return 0
    try:
        length = int(text)
    except ValueError:
        handler.close_connection = True
        raise RequestRefused(p.BAD_REQUEST, f"Content-Length {text[:40]!r} is not a number") from None
    if length < 0:
        handler.close_connection = True
        raise RequestRefused(p.BAD_REQUEST, f"Content-Length {length} is negative")
    if length > limit:
        handler.close_connection = True
        raise RequestRefused(p.PAYLOAD_TOO_LARGE, f"the body ({length} bytes) is over this engine's limit of "
                                                  f"{limit} bytes; nothing was read")
    return length


def _discard(handler: BaseHTTPRequestHandler, limit: int) -> None:
    left = _content_length(handler, limit)
    while left > 0:
        try:
            chunk = handler.rfile.read(min(left, _DISCARD_CHUNK))
        except OSError:
            return
        if not chunk:
            return
        left -= len(chunk)


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    """Answer an HTTP request with a JSON body (none for ``payload=None``); a client that already
    gave up (its timeout) is not our error."""
    data = b"" if payload is None else json.dumps(payload).encode()
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if handler.close_connection:  # a refused request's connection is closed: the client must not keep it
            handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(data)
    except OSError:  # broken pipe, reset, or a write past the socket's timeout
        logger.debug("client left before the answer to %s", handler.path)
        handler.close_connection = True
