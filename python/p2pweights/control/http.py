"""The one HTTP client of the control plane: JSON over the standard library, with a connect
timeout and a read timeout.

Every control-plane call p2pweights makes (a trainer to an engine, a receiver's leader to its
ranks, a rank to its bootstrap server) goes through :func:`request`, or :func:`send` (the request now,
its answer later: :class:`PendingAnswer`, for a caller that sends one verb to several servers before
it waits for any). Connections are kept alive
and reused (:class:`ConnectionPool`): a verb on an open connection costs one round trip, where a
fresh one also pays the connect and, on the server, a new thread. A kept connection is reused only
while it is younger than ``IDLE_REUSE_S`` (below the keep-alive timeouts of sglang's server,
uvicorn: 5 s, and the receiver's: 30 s) and the peer has not closed it; should the peer close it
anyway just as it is reused, a GET is sent again on a fresh connection and any other call fails as
"connection lost" (its verb may have run: the caller's failure policy decides, never a silent repeat).

The two timeouts are separate because they fail for different reasons: a connect that does not
complete within seconds means the engine is down or unreachable; an answer may legitimately take
minutes (``end_weight_update`` runs the engine's post-processing).

Authentication is sglang's ``--api-key`` convention: ``Authorization: Bearer KEY`` on every call
(:func:`bearer`); servers compare it with :func:`key_matches`. docs/security.md has the threat model.
"""
from __future__ import annotations

import hmac
import http.client
import json
import os
import select
import socket
import threading
import time
from typing import Any, Mapping
from urllib.parse import urlencode, urlsplit

from ..errors import EngineUnreachable
from ..settings import value


def request(method: str, url: str, path: str, *, body: dict | None = None,
            params: Mapping[str, Any] | None = None, timeout: float | None = None,
            connect_timeout: float | None = None, headers: Mapping[str, str] | None = None,
            api_key: str | None = None) -> tuple[int, Any]:
    """(HTTP status, decoded JSON body — or text when not JSON; None when empty). Raises
    EngineUnreachable (an EngineError) when it cannot connect or the read times out, naming url and path.

    ``url`` is the server (``http://host:port``, optionally with a path prefix), ``path`` the route
    (``/pause_generation``), ``params`` the query string. ``timeout`` bounds the wait for each read
    of the answer (``P2PW_ENGINE_TIMEOUT``), ``connect_timeout`` the connect
    (``P2PW_ENGINE_CONNECT_TIMEOUT``). ``api_key`` (when set) is sent as ``Authorization: Bearer``.
    Any HTTP status is returned, not raised: what a status means is the caller's protocol (see
    :mod:`p2pweights.control.protocol`).
    """
    try:  # on a kept connection; a GET that meets one the server closed is sent again on a fresh one
        return send(method, url, path, body=body, params=params, timeout=timeout, connect_timeout=connect_timeout,
                    headers=headers, api_key=api_key, _fresh=False, _retry=method == "GET").answer()
    except _StaleReuse:
        pass
    return send(method, url, path, body=body, params=params, timeout=timeout, connect_timeout=connect_timeout,
                headers=headers, api_key=api_key, _fresh=True).answer()


def send(method: str, url: str, path: str, *, body: dict | None = None, params: Mapping[str, Any] | None = None,
         timeout: float | None = None, connect_timeout: float | None = None,
         headers: Mapping[str, str] | None = None, api_key: str | None = None,
         _fresh: bool = False, _retry: bool = False) -> "PendingAnswer":
    """Send a request now and read its answer later (:meth:`PendingAnswer.answer`), as
    :func:`request` does in one step: a caller that fans one verb out to several servers sends to
    all of them before it waits for any. A kept-alive connection the server closed just then fails
    the answer as "connection lost" (never sent again: the call may have run)."""
    read_s = float(value("P2PW_ENGINE_TIMEOUT", timeout))
    connect_s = float(value("P2PW_ENGINE_CONNECT_TIMEOUT", connect_timeout))
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"control-plane URL must look like http://host:port, got {url!r}")
    target = parts.path.rstrip("/") + path + ("?" + urlencode(params) if params else "")
    what = f"{method} {url.rstrip('/')}{path}" + ("?" + urlencode(params) if params else "")
    send_headers = {"Accept": "application/json", **bearer(api_key), **(headers or {})}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        send_headers["Content-Type"] = "application/json"
    key = (parts.scheme, parts.hostname, parts.port)
    conn = None if _fresh else POOL.take(key)
    kept = conn is not None
    if conn is None:
        conn = _connect(parts, connect_s, url, what)
    pending = PendingAnswer(conn, key, what, read_s, kept=kept, retry=_retry)
    try:
        conn.sock.settimeout(read_s)
        conn.request(method, target, body=data, headers=send_headers)
    except socket.timeout as e:
        conn.close()
        raise EngineUnreachable(f"{what}: the request could not be sent within {read_s:g}s",
                                hint="the engine may be stuck; raise timeout= (P2PW_ENGINE_TIMEOUT)") from e
    except (http.client.HTTPException, OSError) as e:
        pending.lost(e)
    return pending


def _connect(parts: Any, connect_s: float, url: str, what: str) -> http.client.HTTPConnection:
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=connect_s)
    try:
        conn.connect()
    except ConnectionRefusedError as e:
        conn.close()
        raise EngineUnreachable(f"{what}: connection refused",
                                hint=f"is the engine running and listening at {url}?") from e
    except socket.timeout as e:
        conn.close()
        raise EngineUnreachable(f"{what}: no connection within {connect_s:g}s",
                                hint="is the host reachable? (P2PW_ENGINE_CONNECT_TIMEOUT)") from e
    except OSError as e:
        conn.close()
        raise EngineUnreachable(f"{what}: cannot connect: {e}",
                                hint=f"is the engine running and listening at {url}?") from e
    POOL.connects += 1
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once
    return conn


class _StaleReuse(Exception):
    """A kept-alive connection the peer had closed: nothing of the answer came (``what``: the call)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class PendingAnswer:
    """A request sent on ``conn``; its answer is read by :meth:`answer` (the connection then goes
    back to the pool when the server keeps it open)."""

    def __init__(self, conn: http.client.HTTPConnection, key: tuple, what: str, read_s: float, *, kept: bool,
                 retry: bool = False):
        self._conn, self._key, self.what, self._read_s = conn, key, what, read_s
        self._kept, self._retry = kept, retry  # a reused connection; request() sends a GET again on a fresh one
        self._failure: BaseException | None = None

    def lost(self, error: BaseException) -> None:
        """The request could not be sent: :meth:`answer` raises (a reused connection: as stale)."""
        self._conn.close()
        self._failure = error

    def acknowledged(self, within: float) -> bool:
        """Whether the server said anything within ``within`` seconds: an interim ``100 Continue``
        (sent by a server that runs the request, when asked with ``Expect: 100-continue``), the
        answer, or a close. False: nothing yet (the server is stopped, wedged, or never read it)."""
        sock = self._conn.sock
        if sock is None or self._failure is not None:
            return True  # failed already: answer() says how
        try:
            readable, _, _ = select.select([sock], [], [], max(0.0, within))
        except (OSError, ValueError):
            return True
        return bool(readable)

    def abandon(self) -> None:
        """Give the answer up: the connection is closed (the server sees its caller leave)."""
        self._conn.close()

    def answer(self, timeout: float | None = None) -> tuple[int, Any]:
        """(status, decoded body); EngineUnreachable when no answer comes within the read timeout
        (``timeout``, default the request's) or the connection is lost."""
        if self._failure is not None:
            return self._lost(self._failure)
        conn, what = self._conn, self.what
        read_s = self._read_s if timeout is None else max(float(timeout), 1e-3)
        try:
            conn.sock.settimeout(read_s)
            resp = conn.getresponse()  # skips interim 100 Continue answers
            status, raw = resp.status, resp.read()
        except socket.timeout as e:
            conn.close()
            raise EngineUnreachable(
                f"{what}: no answer within {read_s:g}s",
                hint="the engine may be stuck or still post-processing; raise timeout= (P2PW_ENGINE_TIMEOUT)") from e
        except (http.client.HTTPException, OSError) as e:
            return self._lost(e)
        if resp.will_close:
            conn.close()
        else:
            POOL.give(self._key, conn)
        return status, decode(raw)

    def _lost(self, error: BaseException) -> tuple[int, Any]:
        self._conn.close()
        stale = isinstance(error, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError))
        if stale and self._kept and self._retry:
            raise _StaleReuse(self.what) from error
        if stale and self._kept:
            raise EngineUnreachable(f"{self.what}: connection lost (the server closed a kept-alive connection as "
                                    f"it was reused); the call may have run",
                                    hint="did the engine restart? check its state before repeating") from error
        raise EngineUnreachable(f"{self.what}: connection lost: {error!r}",
                                hint="did the engine process exit?") from error


class ConnectionPool:
    """Idle kept-alive connections by (scheme, host, port), most recent first; per process (a forked
    child starts with none: its parent's sockets are the parent's)."""

    def __init__(self, idle_reuse_s: float = 2.0, per_server: int = 16):
        self.idle_reuse_s = idle_reuse_s
        self.per_server = per_server
        self.connects = 0  # fresh connections opened by request() (tests count reuse by it)
        self._idle: dict[tuple, list[tuple[http.client.HTTPConnection, float]]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self, key: tuple) -> http.client.HTTPConnection | None:
        """A kept connection to ``key`` that is fresh and still open, or None."""
        now = time.monotonic()
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = {}, os.getpid()
            idle = self._idle.get(key, [])
            while idle:
                conn, since = idle.pop()
                if now - since <= self.idle_reuse_s and _still_open(conn):
                    return conn
                conn.close()
        return None

    def give(self, key: tuple, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if self._pid != os.getpid() or len(idle) >= self.per_server:
                conn.close()
                return
            idle.append((conn, time.monotonic()))

    def clear(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                conn.close()


def _still_open(conn: http.client.HTTPConnection) -> bool:
    """An idle connection the server has not closed: nothing to read on it (a close reads as EOF)."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


#: this process's kept-alive connections (control.http.request's)
POOL = ConnectionPool()


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that carries ``api_key`` (sglang's convention); none when there is no key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def key_matches(authorization: str | None, api_key: str | None) -> bool:
    """Whether an ``Authorization`` header value carries ``api_key`` (True when no key is required).
    Constant-time, so the answer's timing does not reveal how much of a guess was right."""
    if not api_key:
        return True
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def decode(raw: bytes) -> Any:
    """A body as JSON when it is JSON, else as text; None when empty."""
    text = raw.decode("utf-8", "replace")
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text
