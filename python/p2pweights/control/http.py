"""The one HTTP client of the control plane: JSON over the standard library, with a connect
timeout and a read timeout.

Every control-plane call p2pweights makes (a trainer to an engine, a receiver's leader to its
ranks, a rank to its bootstrap server) goes through :func:`request`. Each call opens a fresh
connection: calls are rare (a handful per update) and a fresh connection never meets a socket
the peer closed meanwhile.

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
import socket
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
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=connect_s)
    try:
        try:
            conn.connect()
        except ConnectionRefusedError as e:
            raise EngineUnreachable(f"{what}: connection refused",
                                    hint=f"is the engine running and listening at {url}?") from e
        except socket.timeout as e:
            raise EngineUnreachable(f"{what}: no connection within {connect_s:g}s",
                                    hint="is the host reachable? (P2PW_ENGINE_CONNECT_TIMEOUT)") from e
        except OSError as e:
            raise EngineUnreachable(f"{what}: cannot connect: {e}",
                                    hint=f"is the engine running and listening at {url}?") from e
        conn.sock.settimeout(read_s)
        try:
            conn.request(method, target, body=data, headers=send_headers)
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        except socket.timeout as e:
            raise EngineUnreachable(
                f"{what}: no answer within {read_s:g}s",
                hint="the engine may be stuck or still post-processing; raise timeout= (P2PW_ENGINE_TIMEOUT)") from e
        except (http.client.HTTPException, OSError) as e:
            raise EngineUnreachable(f"{what}: connection lost: {e!r}", hint="did the engine process exit?") from e
    finally:
        conn.close()
    return status, decode(raw)


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
