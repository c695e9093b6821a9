"""NVIDIA NIXL, driven through its Python bindings (``nixl_cu12`` / ``nixl_cu13`` / ``nixl._api``).

Sender side: :class:`NixlBackend` implements the backend protocol that the native ``PyTransport``
calls from the writer's per-engine threads (the Python path; where the wheel ships NIXL's C API the
sender takes the native path instead, without the GIL: nixl_native.py, P2PW_NIXL_API).
Receiver side: :class:`NixlReceiver` registers an engine
rank's memory and publishes its agent metadata (the JSON is defined in publication.py and
docs/transports.md).

One posted batch = one NIXL transfer request (``initialize_xfer("WRITE", ...)`` + ``transfer``),
polled with ``check_xfer_state``. A request that completed is kept, keyed by its engine and exact
(local, remote, length) list, and re-posted by the next identical batch — the same slot packing
recurs every update — which saves building descriptor lists, ``initialize_xfer`` and
``release_xfer_handle`` (Python under the GIL that the loaders need). Failed, timed-out or
cancelled requests are released (``release_xfer_handle`` cancels in flight), and so is every kept
one of an engine that disconnects or reconnects. A request whose handle NIXL refuses to release
(still busy) answers IN_PROGRESS to ``release``, and the native writer keeps its slot and asks
again. NIXL has no timeout of its own: the native writer's deadline, which starts before
``transfer()``, is the only one.

Environment set here before NIXL is imported (``os.environ.setdefault``, so your values win):
  UCX_MODULES=^efa      without it every NIXL process segfaults at exit where rdma-core is installed
  UCX_NET_DEVICES=lo    only on hosts without an RDMA device (the CPU development machines), so
                        UCX does not stripe loopback traffic over every interface. On a multi-host
                        TCP-only cluster set UCX_NET_DEVICES yourself (e.g. eth0).
NIXL's Python logger prints to stdout; it is moved to stderr (NIXL_LOG_LEVEL still applies).
NIXL's Python agent runs its progress thread with no delay (one core busy per process, idle or
not); ours sleep ``progress_delay`` µs (keyword, else P2PW_NIXL_PROGRESS_DELAY_US, default 1000)
between rounds, see new_agent.
Plugin: keyword ``backend``, else P2PW_NIXL_BACKEND, else SGLANG_REMOTE_INSTANCE_NIXL_BACKEND, else UCX.

With UCX's cma transport (same host, host memory) ``transfer()`` may copy before it returns (GIL
released); that time counts against the writer's deadline, which starts before the post. A post
that never returns is bounded too: ``finish()`` reports its engine failed after the transfer
timeout.
"""
from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import NotFound, RemoteDisconnected, TransportError, code_of
from ..settings import value
from .publication import EnginePublication, ParamTarget, check_descriptor_transport, parse_descriptor

NAME = "nixl"

# the native status codes poll returns (plain ints: PyTransport reads an int)
IN_PROGRESS, DONE = code_of("IN_PROGRESS"), code_of("OK")
REMOTE_DISCONNECTED, TRANSPORT_ERROR = code_of("REMOTE_DISCONNECTED"), code_of("TRANSPORT_ERROR")


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def set_ucx_defaults() -> None:
    os.environ.setdefault("UCX_MODULES", "^efa")
    if not _rdma_devices():
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


set_ucx_defaults()

_api: Any = None


def nixl_api():
    """The NIXL Python API module: nixl_cu12, else nixl_cu13, else the meta package's nixl._api."""
    global _api
    if _api is not None:
        return _api
    errors = []
    for mod in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            _api = __import__(mod, fromlist=["nixl_agent"])
        except ImportError as e:
            errors.append(f"{mod}: {e}")
            continue
        _logs_to_stderr()
        return _api
    raise TransportError("NIXL is not installed: pip install --no-deps nixl-cu12 (or nixl-cu13) plus numpy "
                         "(avoid the meta package 'nixl', it pulls a CUDA torch). Tried " + "; ".join(errors))


def _logs_to_stderr() -> None:
    """NIXL's Python logger writes to stdout, which would corrupt a command's JSON output."""
    import logging
    import sys

    for h in logging.getLogger("nixl").handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


def _bindings():
    api = nixl_api()
    return __import__(api.__name__.rsplit(".", 1)[0] + "._bindings", fromlist=["x"])


def mem_type(location: str) -> tuple[str, int]:
    """"cpu" -> ("DRAM", 0); "cuda:N" -> ("VRAM", N)."""
    if location in ("cpu", "", None):
        return "DRAM", 0
    if location.startswith("cuda"):
        _, _, idx = location.partition(":")
        return "VRAM", int(idx or 0)
    raise ValueError(f"unknown memory location {location!r}; expected cpu or cuda:N")


_agent_lock = threading.Lock()


def progress_delay_us() -> int:
    return int(value("P2PW_NIXL_PROGRESS_DELAY_US"))


def new_agent(name: str, backend: str | None = None, progress_delay: int | None = None):
    """A NIXL agent with one plugin and its progress thread sleeping ``progress_delay`` µs between
    rounds (P2PW_NIXL_PROGRESS_DELAY_US, default 1000; 0 = NIXL's own busy loop, a whole core per
    process even when idle)."""
    api = nixl_api()
    backend = backend or value("P2PW_NIXL_BACKEND")
    delay = progress_delay_us() if progress_delay is None else int(progress_delay)
    cfg = api.nixl_agent_config(enable_prog_thread=True, backends=[backend])
    try:
        with _agent_lock, _progress_delay(api, delay):
            agent = api.nixl_agent(name, cfg)
    except Exception as e:
        raise TransportError(f"NIXL agent {name!r} with the {backend} plugin failed to start: {e}") from None
    if backend not in getattr(agent, "backends", {backend: None}):
        raise TransportError(f"NIXL has no {backend} plugin here (available: {', '.join(agent.get_plugin_list())}); "
                             "set P2PW_NIXL_BACKEND")
    return agent, backend


class _progress_delay:
    """nixl_agent() hard-codes the progress thread's delay to 0 (busy polling). While an agent is
    built, the bindings' config class is swapped for a subclass that keeps ``delay`` instead."""

    def __init__(self, api: Any, delay: int):
        self.bind = getattr(api, "nixlBind", None)
        self.delay = delay
        self.base = None

    def __enter__(self):
        if self.bind is None or self.delay <= 0:
            return self
        base = self.bind.nixlAgentConfig
        delay = self.delay
        try:
            class _Config(base):  # type: ignore[misc, valid-type]
                @property
                def pthrDelay(self):  # noqa: N802  (the bindings' name)
                    return base.pthrDelay.__get__(self)

                @pthrDelay.setter
                def pthrDelay(self, value):  # noqa: N802
                    base.pthrDelay.__set__(self, max(int(value), delay))

            self.bind.nixlAgentConfig = _Config
            self.base = base
        except Exception:  # a future binding that cannot be subclassed: NIXL's default then
            self.base = None
        return self

    def __exit__(self, *exc):
        if self.base is not None:
            self.bind.nixlAgentConfig = self.base


def _status_of(exc: BaseException) -> int:
    try:
        if isinstance(exc, _bindings().nixlRemoteDisconnectError):
            return REMOTE_DISCONNECTED
    except Exception:
        pass
    return TRANSPORT_ERROR


def coalesce(local: list[int], remote: list[int], lengths: list[int]) -> list[tuple[int, int, int]]:
    out: list[list[int]] = []
    for lo, re, n in zip(local, remote, lengths):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == re:
            out[-1][2] += n
        else:
            out.append([lo, re, n])
    return [(a, b, c) for a, b, c in out]


@dataclass
class _Peer:
    agent: str
    mem: str
    dev: int


@dataclass
class _Request:
    engine: int
    handle: Any
    key: tuple = ()
    state: int = IN_PROGRESS
    error: tuple[int, str] | None = None


MAX_KEPT_REQUESTS = 1024  # completed transfer requests kept for re-posting (least recently used go)


class NixlBackend:
    """The sender's NIXL backend (the protocol ``_native.PyTransport`` calls)."""

    name = NAME

    def __init__(self, *, backend: str | None = None, agent_name: str | None = None,
                 progress_delay: int | None = None):
        self.agent_name = agent_name or f"p2pw-sender-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent, self.plugin = new_agent(self.agent_name, backend, progress_delay)
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._requests: dict[int, _Request] = {}
        self._draining: dict[int, Any] = {}  # request id -> handle NIXL refused to release
        self._registered: dict[int, tuple[int, str, int, Any]] = {}  # addr -> (length, mem, dev, reg descs)
        self._abandoned: list[Any] = []
        self._kept: OrderedDict[tuple, Any] = OrderedDict()  # (engine, writes) -> completed request
        self._next = 1
        self._closed = False

    # -- memory ----------------------------------------------------------------------------------
    def register_memory(self, addr: int, length: int, location: str = "cpu") -> None:
        mem, dev = mem_type(location)
        try:
            descs = self.agent.register_memory([(int(addr), int(length), dev, "")], mem)
        except Exception as e:
            raise TransportError(f"NIXL register_memory(0x{addr:x}, {length}, {location}) failed: {e}") from None
        with self._lock:
            self._registered[int(addr)] = (int(length), mem, dev, descs)

    def deregister_memory(self, addr: int) -> None:
        with self._lock:
            entry = self._registered.pop(int(addr), None)
        if entry is None:
            raise NotFound(f"0x{int(addr):x} is not registered with NIXL")
        self.agent.deregister_memory(entry[3])

    def _local(self, addr: int, length: int) -> tuple[str, int]:
        for base, (n, mem, dev, _) in self._registered.items():
            if base <= addr and addr + length <= base + n:
                return mem, dev
        raise TransportError(f"local memory [0x{addr:x}, +{length}) is not registered with NIXL")

    # -- peers -----------------------------------------------------------------------------------
    def connect(self, engine: int, descriptor: str) -> None:
        desc = parse_descriptor(descriptor)
        check_descriptor_transport(desc, NAME)
        try:
            name = self.agent.add_remote_agent(desc.agent_metadata)
        except Exception as e:
            raise TransportError(f"NIXL add_remote_agent({desc.peer}) failed: {e}") from None
        if isinstance(name, bytes):
            name = name.decode()
        mem, dev = mem_type(desc.location)
        self._drop_kept(int(engine))  # requests kept for an earlier connection target its old agent
        with self._lock:
            self._peers[int(engine)] = _Peer(str(name), mem, dev)

    def disconnect(self, engine: int) -> None:
        with self._lock:
            peer = self._peers.pop(int(engine), None)
            still_used = peer is not None and any(p.agent == peer.agent for p in self._peers.values())
        self._drop_kept(int(engine))
        if peer is not None and not still_used:
            try:
                self.agent.remove_remote_agent(peer.agent)
            except Exception:
                pass  # a peer that died may be half-removed already

    # -- writes ----------------------------------------------------------------------------------
    def post(self, engine: int, local: list[int], remote: list[int], lengths: list[int]) -> int:
        with self._lock:
            peer = self._peers.get(int(engine))
            rid = self._next
            self._next += 1
        if peer is None:
            raise NotFound(f"engine {engine} is not connected")
        self._reap()
        writes = coalesce(local, remote, lengths)
        key = (int(engine), tuple(writes))
        with self._lock:
            handle = self._kept.pop(key, None)  # taken: never posted twice at once
        if handle is None:
            mem, dev = self._local(writes[0][0], writes[0][2])
            try:
                src = self.agent.get_xfer_descs([(lo, n, dev) for lo, _, n in writes], mem)
                dst = self.agent.get_xfer_descs([(re, n, peer.dev) for _, re, n in writes], peer.mem)
                handle = self.agent.initialize_xfer("WRITE", src, dst, peer.agent)
            except Exception as e:
                err = RemoteDisconnected if _status_of(e) == REMOTE_DISCONNECTED else TransportError
                raise err(f"NIXL could not create a write to {peer.agent}: {e}") from None
        req = _Request(int(engine), handle, key)
        try:
            state = self.agent.transfer(handle)
        except Exception as e:
            self._release_handle(handle)
            err = RemoteDisconnected if _status_of(e) == REMOTE_DISCONNECTED else TransportError
            raise err(f"NIXL transfer to {peer.agent} failed: {e}") from None
        if state == "ERR":
            self._release_handle(handle)
            raise TransportError(f"NIXL transfer to {peer.agent} failed to post")
        req.state = DONE if state == "DONE" else IN_PROGRESS
        with self._lock:
            self._requests[rid] = req
        return rid

    def poll(self, request: int) -> int | tuple[int, str]:
        with self._lock:
            req = self._requests.get(int(request))
        if req is None:
            raise NotFound(f"unknown NIXL request {request}")
        if req.error:
            return req.error
        if req.state == DONE:
            return DONE
        try:
            state = self.agent.check_xfer_state(req.handle)
        except Exception as e:
            code = _status_of(e)
            what = "the engine's NIXL agent is gone" if code == REMOTE_DISCONNECTED else "NIXL write failed"
            req.error = (code, f"{what}: {e}")
            return req.error
        if state == "DONE":
            req.state = DONE
            return DONE
        if state == "PROC":
            return IN_PROGRESS
        req.error = (TRANSPORT_ERROR, f"NIXL write state {state}")
        return req.error

    def release(self, request: int) -> int | None:
        """None once NIXL let go of the request; IN_PROGRESS while it refuses to release a handle
        that may still read the sender's memory (the writer asks again and keeps the slot)."""
        with self._lock:
            req = self._requests.pop(int(request), None)
            refused = self._draining.pop(int(request), None) if req is None else None
        if req is None and refused is None:
            raise NotFound(f"unknown NIXL request {request}")
        if refused is not None:
            return self._release_or_keep(int(request), refused)
        evicted = None
        with self._lock:
            keep = req.state == DONE and req.error is None and not self._closed and req.engine in self._peers
            if keep:
                self._kept[req.key] = req.handle
                if len(self._kept) > MAX_KEPT_REQUESTS:
                    evicted = self._kept.popitem(last=False)[1]
        if evicted is not None:
            self._release_handle(evicted)
        return None if keep else self._release_or_keep(int(request), req.handle)

    def _release_or_keep(self, request: int, handle: Any) -> int | None:
        try:
            self.agent.release_xfer_handle(handle)  # cancels a write still in flight
        except Exception:
            with self._lock:
                self._draining[request] = handle
            return IN_PROGRESS
        return None

    def _drop_kept(self, engine: int | None = None) -> None:
        """Release the kept requests of one engine (every engine: None)."""
        with self._lock:
            keys = [k for k in self._kept if engine is None or k[0] == engine]
            handles = [self._kept.pop(k) for k in keys]
        for h in handles:
            self._release_handle(h)

    def _release_handle(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)  # cancels a write still in flight
        except Exception:
            with self._lock:
                self._abandoned.append(handle)  # refused while busy: retried on the next post

    def _reap(self) -> None:
        with self._lock:
            work, self._abandoned = self._abandoned, []
        for h in work:
            self._release_handle(h)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            reqs, self._requests = list(self._requests.values()), {}
            for h in self._draining.values():
                self._abandoned.append(h)
            self._draining = {}
            peers, self._peers = list(self._peers.values()), {}
            regs, self._registered = list(self._registered.values()), {}
        for r in reqs:
            self._release_handle(r.handle)
        self._drop_kept()
        self._reap()
        for p in {p.agent for p in peers}:
            try:
                self.agent.remove_remote_agent(p)
            except Exception:
                pass
        for _, _, _, descs in regs:
            try:
                self.agent.deregister_memory(descs)
            except Exception:
                pass


class NixlReceiver:
    """An engine rank's NIXL endpoint: register its memory, publish agent metadata + weights table."""

    name = NAME

    def __init__(self, *, backend: str | None = None, agent_name: str | None = None,
                 progress_delay: int | None = None):
        self.agent_name = agent_name or f"p2pw-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # UCX's cross-memory-attach path (cma: the sender's process_vm_writev into this process,
        # host memory on one host) writes with the engine's pid alone: closing this agent cannot
        # revoke it, so a lost owner's write would still land after a takeover (docs/security.md,
        # "Epochs"). An engine offers no cma unless UCX_TLS says otherwise; the senders then use
        # UCX's other paths (same-host host memory: 5.0 -> 2.0 GB/s measured on the CPU VM).
        os.environ.setdefault("UCX_TLS", "^cma")
        self.agent, self.plugin = new_agent(self.agent_name, backend, progress_delay)
        self._registered: dict[int, Any] = {}
        self._location = "cpu"
        self._closed = False

    @property
    def peer(self) -> str:
        return self.agent_name

    def register(self, addr: int, length: int, location: str = "cpu") -> None:
        mem, dev = mem_type(location)
        if self._registered and location != self._location:
            raise ValueError(f"one NIXL receiver publishes one memory location; already {self._location}, "
                             f"now {location}")
        try:
            self._registered[int(addr)] = self.agent.register_memory([(int(addr), int(length), dev, "")], mem)
        except Exception as e:
            raise TransportError(f"NIXL register_memory(0x{addr:x}, {length}, {location}) failed: {e}") from None
        self._location = location

    def deregister(self, addr: int) -> None:
        descs = self._registered.pop(int(addr))
        self.agent.deregister_memory(descs)

    def publication(self, params: dict[str, Any], rank: int | None = 0) -> EnginePublication:
        """params: ``{name: [data_ptr, numel, element_size]}``. Call after registering the memory
        (the agent metadata carries the registrations)."""
        table = {n: ParamTarget(*(int(x) for x in row)) for n, row in params.items()}
        return EnginePublication(transport=NAME, peer=self.agent_name, params=table, rank=rank,
                                 agent_metadata=self.agent.get_agent_metadata(), location=self._location)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for descs in self._registered.values():
            try:
                self.agent.deregister_memory(descs)
            except Exception:
                pass
        self._registered.clear()
        # Dropping the agent ends its UCX worker and the endpoints senders opened to it: what an
        # engine revoking an epoch relies on (receiver/revocation.py)
        self.agent = None

    def __enter__(self) -> "NixlReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
