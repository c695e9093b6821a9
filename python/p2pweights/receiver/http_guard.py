"""What a receiver's HTTP servers check before a handler runs: the connection, the bearer key,
and the request body's size, arrival time and shape; and how they answer (:func:`send_json`).
Shared by the engine's server (:mod:`.request_handler`, sglang's routes) and its ranks' internal
endpoint (:mod:`.rank_server`): both are a :class:`GuardedHTTPServer` of :class:`GuardedHandler`.

- **Connections**: at most :data:`MAX_CONNECTIONS` open at once, :data:`MAX_CONNECTIONS_PER_CLIENT`
  from one client address; one more is answered 503 at once, from the accepting thread (no thread
  is started for it), and closed.
- **Key**: with an API key set, a call without ``Authorization: Bearer KEY`` is refused (401)
  before anything else is read or run (health routes excepted, as in sglang).
- **Size**: ``Content-Length`` must be plain ASCII digits, given once (``+2``, ``0_2``, `` 2``,
  ``-1``, two headers: 400); over the limit it is refused (413) without reading the body. A route
  that takes no body (the health routes among them) reads none: up to :data:`UNREAD_BODY_LIMIT`
  is read and dropped unparsed, more is a 413 unread.
- **Time**: every socket read has a timeout (:data:`READ_TIMEOUT`: an idle kept-alive connection,
  a client that stops), and a whole request, headers and body, a deadline from its first byte
  (:data:`REQUEST_DEADLINE`): a client that drips a byte now and then is cut off (408 in the body,
  the connection closed in the headers) instead of holding a server thread for as long as it likes.
- **Shape**: a body shorter than its ``Content-Length``, not JSON, too deeply nested, or not an
  object is a 400 and never reaches a handler.

A refused request's connection is closed afterwards: what is left of its body on the socket must
never be read as the next request.
"""
from __future__ import annotations

import io
import json
import logging
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..control import error_answers
from ..control import protocol as p
from ..control.http import key_matches

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20   # the largest legitimate body (a rank's parameter table) is far smaller
READ_TIMEOUT = 30.0         # seconds a client may stall while sending its request (or idle between requests)
REQUEST_DEADLINE = 60.0     # seconds from a request's first byte to the end of its body, however it trickles
UNREAD_BODY_LIMIT = 64 << 10  # what a route that takes no body (health, a 401) reads and drops, unparsed
MAX_CONNECTIONS = 256       # open connections (one thread each) a server keeps at once
MAX_CONNECTIONS_PER_CLIENT = 64  # of which from one client address (a trainer opens a few per process)
LISTEN_BACKLOG = 128        # connections the kernel accepts while the server is busy (capped by somaxconn)
_DISCARD_CHUNK = 64 << 10
_DIGITS = re.compile(r"[0-9]{1,19}")  # 19 digits: anything longer is over every limit (and past int64)


class RequestRefused(Exception):
    """A request refused before any handler ran: ``status`` and the message of the answer."""

    def __init__(self, status: int, message: str, hint: str | None = None):
        super().__init__(message)
        self.status, self.hint = status, hint

    def payload(self) -> dict:
        return error_answers.error_payload(str(self), hint=self.hint)


def check_key(handler: BaseHTTPRequestHandler, api_key: str | None, *, limit: int = UNREAD_BODY_LIMIT) -> None:
    """Refuse (401) a request that does not carry ``api_key``. Its body is read and dropped first
    (when at most ``limit``), so the client reads the 401 instead of a reset connection."""
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
        deadline = getattr(handler, "request_deadline", REQUEST_DEADLINE)
        raise RequestRefused(p.REQUEST_TIMEOUT, f"the request body did not arrive in time (Content-Length {length}; "
                                                f"{handler.timeout or READ_TIMEOUT:g}s per read, {deadline:g}s for the "
                                                f"whole request)") from None
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


def skip_body(handler: BaseHTTPRequestHandler, limit: int = UNREAD_BODY_LIMIT) -> None:
    """For a route that takes no body: read and drop up to ``limit`` bytes of it, unparsed;
    RequestRefused 413 (unread, connection closed) over it, and as :func:`read_body` otherwise."""
    _discard(handler, limit, strict=True)


def _content_length(handler: BaseHTTPRequestHandler, limit: int) -> int:
    """The body's length: ``Content-Length`` given at most once, as plain ASCII digits (a smuggling
    proxy and this server must never read two different lengths), at most ``limit``."""
    if handler.headers.get("Transfer-Encoding"):
        handler.close_connection = True
        raise RequestRefused(p.BAD_REQUEST, "chunked request bodies are not accepted; send Content-Length")
    given = handler.headers.get_all("Content-Length") or []
    if not given:
        return 0
    if len(given) > 1:
        handler.close_connection = True
        raise RequestRefused(p.BAD_REQUEST, f"Content-Length is given {len(given)} times; send it once")
    text = given[0]
    if not _DIGITS.fullmatch(text):
        handler.close_connection = True
        if text.isascii() and text.isdigit():  # more than 19 digits: over every limit
            raise RequestRefused(p.PAYLOAD_TOO_LARGE, f"the body ({text[:40]}... bytes) is over this engine's limit of "
                                                      f"{limit} bytes; nothing was read")
        raise RequestRefused(p.BAD_REQUEST, f"Content-Length {text[:40]!r} is not a plain number of bytes "
                                            f"(ASCII digits only)")
    length = int(text)
    if length > limit:
        handler.close_connection = True
        raise RequestRefused(p.PAYLOAD_TOO_LARGE, f"the body ({length} bytes) is over this engine's limit of "
                                                  f"{limit} bytes; nothing was read")
    return length


def _discard(handler: BaseHTTPRequestHandler, limit: int, strict: bool = False) -> None:
    """Read and drop the body (at most ``limit`` bytes). ``strict``: a stalled or truncated body is
    refused as :func:`read_body` refuses it (else the caller answers anyway, the connection closed)."""
    length = left = _content_length(handler, limit)
    while left > 0:
        try:
            chunk = handler.rfile.read(min(left, _DISCARD_CHUNK))
        except OSError:
            handler.close_connection = True
            if strict:
                raise RequestRefused(p.REQUEST_TIMEOUT, f"the request body did not arrive in time "
                                                        f"(Content-Length {length})") from None
            return
        if not chunk:
            handler.close_connection = True
            if strict:
                raise RequestRefused(p.BAD_REQUEST, f"the request body is truncated: {length - left} of {length} "
                                                    f"bytes (Content-Length) arrived; nothing was run")
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
        # the headers and the body in one write: one segment, one wake-up of the client (end_headers()
        # then a write of the body would be two)
        handler._headers_buffer.extend((b"\r\n", data))  # type: ignore[attr-defined]  # BaseHTTPRequestHandler's
        handler.flush_headers()
    except OSError:  # broken pipe, reset, or a write past the socket's timeout
        logger.debug("client left before the answer to %s", handler.path)
        handler.close_connection = True


# ---- connections: a deadline per request, a cap on how many ---------------------------------------

class _DeadlineReader(io.RawIOBase):
    """A connection's reads: each waits at most ``idle`` seconds, and none past the deadline of
    the request under way (``total`` seconds from its first byte; :meth:`next_request` starts the
    next one). The socket's own timeout (its writes') is restored after every read."""

    def __init__(self, sock: socket.socket, idle: float, total: float):
        super().__init__()
        self._sock, self._idle, self._total = sock, idle, total
        self._deadline: float | None = None

    def next_request(self) -> None:
        self._deadline = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        wait = self._idle
        if self._deadline is not None:
            wait = min(wait, self._deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"the request did not arrive within its {self._total:g}s deadline")
        self._sock.settimeout(wait)
        try:
            n = self._sock.recv_into(buf)
        finally:
            self._sock.settimeout(self._idle)
        if n and self._deadline is None:
            self._deadline = time.monotonic() + self._total
        return n


class GuardedHandler(BaseHTTPRequestHandler):
    """The request reading both servers share: every read under :class:`_DeadlineReader` (``timeout``
    per read, ``request_deadline`` for a whole request), keep-alive HTTP/1.1, no Nagle delay."""

    protocol_version = "HTTP/1.1"  # keep-alive: a client's next verb reuses the connection (control.http)
    disable_nagle_algorithm = True  # an answer's headers and body are two writes: no 40 ms delayed-ACK stall
    timeout = READ_TIMEOUT          # every read of a request: a stalled client cannot hold a thread
    request_deadline = REQUEST_DEADLINE  # a whole request, however it trickles in

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain reader setup() made: its reference would keep the socket open after close()
        self._reader = _DeadlineReader(self.connection, float(self.timeout or READ_TIMEOUT),
                                       float(self.request_deadline))
        self.rfile = io.BufferedReader(self._reader, self.rbufsize if self.rbufsize > 0 else io.DEFAULT_BUFFER_SIZE)

    def handle_one_request(self) -> None:
        self._reader.next_request()
        super().handle_one_request()

    def parse_request(self) -> bool:
        """The standard parse, then refuse (400) headers the parser only half understood: a line
        that is no header (``Content-Length : 2`` hides every header after it) or a folded value."""
        if not super().parse_request():
            return False
        if self.headers.defects or any("\r" in v or "\n" in v for v in self.headers.values()):
            self.close_connection = True
            send_json(self, p.BAD_REQUEST, error_answers.error_payload(
                "malformed request headers (a line that is not 'Name: value', or a folded value); nothing was run"))
            return False
        return True


class GuardedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them and ``max_per_client`` from one
    client address; a connection over either is answered 503 and closed by the accepting thread."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple, handler: type, *, max_connections: int = MAX_CONNECTIONS,
                 max_per_client: int = MAX_CONNECTIONS_PER_CLIENT):
        self.max_connections, self.max_per_client = int(max_connections), int(max_per_client)
        self._open: Counter = Counter()  # client address -> its open connections
        self._open_lock = threading.Lock()
        self.refused = 0                  # connections answered 503 (over a cap)
        super().__init__(address, handler)

    def open_connections(self) -> int:
        with self._open_lock:
            return sum(self._open.values())

    def process_request(self, request: Any, client_address: Any) -> None:
        client = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        with self._open_lock:
            total, mine = sum(self._open.values()), self._open[client]
            over = total >= self.max_connections or mine >= self.max_per_client
            if over:
                self.refused += 1
            else:
                self._open[client] += 1
        if over:
            which = (f"{mine} from {client} (at most {self.max_per_client})" if mine >= self.max_per_client
                     else f"{total} (at most {self.max_connections})")
            _refuse_connection(request, f"too many open connections to this engine: {which}; close idle ones")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed(client)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed(client_address[0] if isinstance(client_address, tuple) else str(client_address))

    def _closed(self, client: str) -> None:
        with self._open_lock:
            self._open[client] -= 1
            if self._open[client] <= 0:
                del self._open[client]


def _refuse_connection(sock: socket.socket, message: str) -> None:
    """Answer 503 on a connection without a thread and without waiting: one non-blocking send (a
    fresh socket's buffer holds it), what already arrived drained (closing over unread bytes
    would reset the connection before the client reads the answer)."""
    body = json.dumps(error_answers.error_payload(message, hint="retry later")).encode()
    head = (f"HTTP/1.1 {p.SERVICE_UNAVAILABLE} Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.setblocking(False)
        sock.send(head + body)
        for _ in range(16):
            if not sock.recv(_DISCARD_CHUNK):
                break
    except OSError:  # BlockingIOError: nothing (more) arrived; or the client already left
        pass
    logger.debug("refused a connection: %s", message)
