"""An ASGI app served by uvicorn on a background thread with its own event loop
(:class:`BackgroundServer`): how our receiver and its ranks serve their apps behind the
:class:`.guard.Guard`. (sglang and vLLM run uvicorn themselves; only the middleware is shared.)

``start()`` binds and listens in the caller's thread (a port taken raises there; ``port=0``
picks a free one) and returns once uvicorn serves it; ``close()`` stops serving, closes every
connection (kept-alive ones too) and joins the thread; it is idempotent.

What the server adds to uvicorn's HTTP/1.1 (h11) protocol, which waits for a request's head for
as long as its client likes:

- **a head deadline**: a connection must deliver each request's head (request line and
  headers) within ``request_deadline`` seconds of opening, or of its previous answer; one that
  drips its headers is closed then. One that sends nothing, or stops mid-head, for
  ``read_timeout`` is closed then (as uvicorn closes an idle kept-alive connection).
- **whether the client left**: the scope's :data:`.asgi.CLIENT_LEFT` says, from the socket itself,
  whether the client has closed its connection (a leader that gave a rank's call up).
"""
from __future__ import annotations

import asyncio
import logging
import select
import socket
import threading
from typing import Any

from . import asgi
from .guard import READ_TIMEOUT, REQUEST_DEADLINE

logger = logging.getLogger(__name__)

START_TIMEOUT = 30.0   # seconds start() waits for the server to serve
STOP_GRACE = 1.0       # seconds close() lets running requests finish before their connections are cut
BACKLOG = 2048         # connections the kernel accepts before the loop does (capped by somaxconn)


def _protocol_class(head_deadline: float) -> type:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11(H11Protocol):
        """uvicorn's h11 protocol, with a deadline for each request's head and CLIENT_LEFT in the scope."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.access_log = False  # no line per request (uvicorn's access logger is left as it is)
            self._head_timer: asyncio.TimerHandle | None = None
            app = self.app

            async def with_client_left(scope: dict, receive: Any, send: Any) -> None:
                scope[asgi.CLIENT_LEFT] = self.client_left
                await app(scope, receive, send)

            self.app = with_client_left

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # no Nagle delay between an answer's head and body (asyncio's own rule may not)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            # nothing sent yet: closed after the keep-alive timeout, as an idle kept connection is
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
            self._arm_head_deadline()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_head():
                self._disarm_head_deadline()
            elif not self.transport.is_closing():  # part of a head: the rest may stall read_timeout at most
                self._unset_keepalive_if_required()
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._waiting_for_head():
                self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_timer = self.loop.call_later(head_deadline, self._head_too_late)

        def _disarm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_late(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                logger.debug("closed a connection from %s: no request head within %gs", self.client, head_deadline)
                self.transport.close()

        def client_left(self) -> bool:
            """Whether the peer has closed the connection: the socket has nothing left but its end
            (or was reset); exact as soon as the kernel has the peer's FIN, read or not."""
            if self.transport is None or self.transport.is_closing() or (self.cycle is not None
                                                                         and self.cycle.disconnected):
                return True
            sock = self.transport.get_extra_info("socket")
            if sock is None:
                return False
            try:
                fd = sock.fileno()
                if fd < 0:
                    return True
                readable, _, _ = select.select([fd], [], [], 0)
                if not readable:
                    return False
                with socket.fromfd(fd, sock.family, sock.type) as peek:
                    return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except (OSError, ValueError):
                return True

    return DeadlineH11


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port); OSError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP, and
    # an answer's head and body are two writes (with Nagle on, the body waits out the client's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, never a live listener
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.set_inheritable(False)
    except BaseException:
        sock.close()
        raise
    return sock


class BackgroundServer:
    """``BackgroundServer(app, host, port, read_timeout=..., request_deadline=..., name=...)``:
    ``.start()``, ``.port``, ``.open_connections()``, ``.close()``. ``name`` is the thread's and the
    answers' ``Server`` header."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, read_timeout: float = READ_TIMEOUT,
                 request_deadline: float = REQUEST_DEADLINE, name: str = "p2pweights"):
        self.app, self.host, self.name = app, host, name
        self._requested_port = int(port)
        self.read_timeout, self.request_deadline = float(read_timeout), float(request_deadline)
        self._port: int | None = None
        self._state: Any = None                       # uvicorn's ServerState: its connections and tasks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()
        self._failed: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()

    def start(self) -> "BackgroundServer":
        import uvicorn

        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the server was closed; create a new one")
            if self._thread is not None:
                return self
            sock = bind(self.host, self._requested_port)
            self._port = sock.getsockname()[1]
            config = uvicorn.Config(self.app, http=_protocol_class(self.request_deadline), ws="none", lifespan="off",
                                    loop="asyncio", log_config=None, proxy_headers=False, server_header=False,
                                    headers=[("server", self.name)], timeout_keep_alive=self.read_timeout)
            self._thread = threading.Thread(target=self._serve, args=(config, sock), daemon=True,
                                            name=f"{self.name}-{self._port}")
            self._thread.start()
        if not self._serving.wait(START_TIMEOUT) or self._failed is not None:
            failed = self._failed
            self.close()
            raise RuntimeError(f"{self.name}: the HTTP server did not start: {failed!r}") from failed
        return self

    def _serve(self, config: Any, sock: socket.socket) -> None:
        try:
            asyncio.run(self._serve_until_stopped(config, sock))
        except BaseException as e:  # noqa: BLE001 - recorded for start()
            self._failed = e
            logger.error("%s: the HTTP server stopped: %r", self.name, e)
        finally:
            sock.close()
            self._serving.set()

    async def _serve_until_stopped(self, config: Any, sock: socket.socket) -> None:
        from uvicorn.server import ServerState

        config.load()
        state = self._state = ServerState()
        state.default_headers = list(config.encoded_headers)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: config.http_protocol_class(config=config, server_state=state, app_state={}, _loop=loop),
            sock=sock, backlog=BACKLOG)
        self._loop, self._stop = loop, asyncio.Event()
        self._serving.set()
        await self._stop.wait()
        server.close()  # no new connections
        for connection in list(state.connections):
            connection.shutdown()  # an idle one is closed now, a busy one after its answer
        end = loop.time() + STOP_GRACE
        while state.connections and loop.time() < end:
            await asyncio.sleep(0.01)
        for connection in list(state.connections):  # a request still running (a hook that does not return)
            connection.transport.abort()
        for task in list(state.tasks):
            task.cancel()
        await asyncio.sleep(0)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self.name} is not started; call start()")
        return self._port

    def open_connections(self) -> list:
        """The client address of each connection open now (idle, reading, or being answered)."""
        state = self._state
        return [] if state is None else [c.client for c in list(state.connections)]

    def close(self) -> None:
        """Stop serving, close every connection and join the thread. Idempotent."""
        with self._lock:
            self._closed = True
            thread, loop, stop = self._thread, self._loop, self._stop
            self._thread = None
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop is closed already
                pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=STOP_GRACE + 5)
            if thread.is_alive():
                logger.warning("%s: the HTTP server thread did not stop", self.name)
