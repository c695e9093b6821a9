"""Transports: Mooncake Transfer Engine and NVIDIA NIXL behind the native pipelined writer.

Sender side::

    transport = make_sender_transport("mooncake")          # a _native.Transport
    transport.register_memory(buffers.address, buffers.total_bytes, buffers.location)  # once per process
    pub = EnginePublication.from_json(http_get(".../remote_instance_transfer_engine_info?rank=0"))
    attach_engine(transport, writer, engine=0, name="engine0/rank0", publication=pub)
    rows = param_writes(pub, 0, "engine0/rank0", [("model.norm.weight", slot_offset, nbytes), ...])
    writer.submit(slot, rows)

Receiver side (an engine rank)::

    ep = make_receiver_endpoint("mooncake")
    ep.register(region_addr, region_bytes, "cuda:0")
    publish(ep.publication(params_table(model.named_parameters()), rank=tp_rank).to_json())
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol

from .. import _native
from ..errors import LayoutMismatch, TransportError, WrongTransport
from ..settings import TRANSPORTS, value
from .publication import (
    EnginePublication,
    ParamTarget,
    merge_regions,
    params_table,
)

__all__ = [
    "EnginePublication",
    "ParamTarget",
    "ReceiverEndpoint",
    "attach_engine",
    "detach_engine",
    "engine_transport",
    "resolve_transport",
    "transport_for_engines",
    "make_backend",
    "make_receiver_endpoint",
    "make_sender_transport",
    "merge_regions",
    "param_writes",
    "params_table",
]


class ReceiverEndpoint(Protocol):
    """What an engine rank uses: register its weight memory, then publish."""

    name: str

    @property
    def peer(self) -> str: ...  # Mooncake session id "ip:rpc_port" / NIXL agent name

    def register(self, addr: int, length: int, location: str = "cpu") -> None: ...

    def deregister(self, addr: int) -> None: ...

    def publication(self, params: dict[str, Any], rank: int | None = 0) -> EnginePublication: ...

    def close(self) -> None: ...


def resolve_transport(name: str | None = None) -> tuple[str, str]:
    """(transport, why) for a transport name, None meaning ``P2PW_TRANSPORT`` (default ``auto``).

    ``auto`` is nixl where NIXL's native C-API sender path loads here (the library opens and NIXL's
    Python package, which the receivers use, imports), else mooncake: NIXL/UCX listeners bind the
    configured devices' addresses, Mooncake's the wildcard (docs/security.md), and NIXL's native
    path has no GIL on the write path. ``why`` says which rule decided ("auto: ..."), "" for an
    explicit name. The one rule of WeightSender (when no engine says), ``serve``, the receiver's
    launcher and ``demo``."""
    if name is None:
        name = value("P2PW_TRANSPORT")
    if name != "auto":
        return _check_name(name), ""
    import ctypes

    from . import nixl, nixl_native

    path = nixl_native.data_path()
    if path["path"] != "native":
        return "mooncake", f"auto: NIXL's native path is not available: {path['reason']}"
    try:
        ctypes.CDLL(path["library"])
        nixl.nixl_api()  # the receivers' side
    except (OSError, TransportError) as e:
        return "mooncake", f"auto: NIXL's C API does not load here: {e}"
    return "nixl", "auto: NIXL's native C-API path loads here"


def engine_transport(server_info: dict) -> str:
    """The transport an engine publishes its weights for, from its ``/server_info``: a p2pweights
    receiver says (``p2pw_transport``); sglang's remote-instance publication is Mooncake's."""
    named = server_info.get("p2pw_transport")
    return named if named in TRANSPORTS else "mooncake"


def transport_for_engines(name: str | None, engines: Iterable[tuple[str, dict]]) -> tuple[str, str]:
    """(transport, why) for a sender about to connect ``engines`` ((name, server_info) pairs).

    An explicit ``mooncake``/``nixl`` is kept (a publication for the other one is then refused,
    WrongTransport, naming the fix). ``auto`` takes the transport the engines publish for, so that
    an auto sender never refuses an engine it could talk to; engines that publish for different
    transports are refused here (one sender has one transport agent); no engine: the local rule
    (:func:`resolve_transport`)."""
    if name is None:
        name = value("P2PW_TRANSPORT")
    if name != "auto":
        return resolve_transport(name)
    by_engine = {engine: engine_transport(info) for engine, info in engines}
    published = sorted(set(by_engine.values()))
    if len(published) > 1:
        shown = ", ".join(f"'{e}': {t}" for e, t in by_engine.items())
        raise WrongTransport(f"the engines publish their weights for different transports ({shown}); one sender "
                             f"writes over one transport: restart them all for one, or connect a sender per transport")
    if published:
        return published[0], f"auto: the engines publish for {published[0]}"
    return resolve_transport("auto")


def _check_name(name: str) -> str:
    if name not in TRANSPORTS and name != "loopback":
        raise ValueError(f"unknown transport {name!r}; expected one of {', '.join(TRANSPORTS)} (or loopback for tests)")
    return name


# The options each transport's backend takes (Settings.transport_options() gives the chosen one's).
OPTIONS = {
    "mooncake": ("hostname", "protocol", "device", "metadata_server"),
    "nixl": ("backend", "progress_delay", "agent_name"),
    "loopback": (),
}


def _options(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The set options (None = unset: the setting, else the default, applies), each checked to be
    one this transport takes, so a typo or another transport's option is an error, not ignored."""
    opts = {k: v for k, v in opts.items() if v is not None}
    unknown = sorted(set(opts) - set(OPTIONS[name]))
    if unknown:
        takes = ", ".join(OPTIONS[name]) or "no options"
        raise TypeError(f"the {name} transport takes no option {', '.join(unknown)} (it takes {takes})")
    return opts


def make_backend(name: str, **opts: Any):
    """The Python backend object (the protocol PyTransport calls) for mooncake or nixl."""
    if _check_name(name) == "mooncake":
        from .mooncake import MooncakeBackend

        return MooncakeBackend(**_options(name, opts))
    if name == "nixl":
        from .nixl import NixlBackend

        return NixlBackend(**_options(name, opts))
    raise ValueError(f"{name} has no Python backend")


def make_sender_transport(name: str | None = None, nixl_api: str | None = None, **opts: Any) -> "_native.Transport":
    """A native Transport for the sender: loopback (in-process, tests), mooncake or nixl.

    name defaults to P2PW_TRANSPORT (``auto``: :func:`resolve_transport`). nixl is ``nixl_native.NativeNixlTransport`` (NIXL's C
    API, no GIL) when the wheel ships it, else the Python backend (``nixl_api``, default P2PW_NIXL_API;
    ignored by the other transports).
    Options go to the backend, None meaning unset —
    so ``make_sender_transport(name, **s.transport_options(name))`` works for a Settings ``s`` and
    ``name = resolve_transport(s.transport)[0]``:
    mooncake: hostname, protocol, device, metadata_server; nixl: backend (the NIXL plugin),
    progress_delay (µs), agent_name. An option the transport does not take is a TypeError.
    """
    name = resolve_transport(name)[0]
    if name == "loopback":
        _options(name, opts)
        return _native.LoopbackTransport()
    if name == "nixl":  # native (NIXL's C API, no GIL) or Python, by P2PW_NIXL_API
        from .nixl_native import make_nixl_transport

        return make_nixl_transport(api=nixl_api, **_options(name, opts))
    return _native.PyTransport(make_backend(name, **opts))


def make_receiver_endpoint(name: str | None = None, **opts: Any) -> ReceiverEndpoint:
    """The engine rank's endpoint for mooncake or nixl (same options as the sender's backend); name
    defaults to P2PW_TRANSPORT, ``auto`` resolved by :func:`resolve_transport`."""
    name = resolve_transport(name)[0]
    if name == "mooncake":
        from .mooncake import MooncakeReceiver

        return MooncakeReceiver(**_options(name, opts))
    if name == "nixl":
        from .nixl import NixlReceiver

        return NixlReceiver(**_options(name, opts))
    raise ValueError("the loopback transport has no receiver endpoint")


def attach_engine(transport: "_native.Transport", writer: Any, engine: int, name: str,
                  publication: EnginePublication) -> None:
    """Connect an engine rank from its publication and add it to the writer with its regions.

    Rejects a publication for another transport (WrongTransport) before connecting.
    """
    publication.check_transport(transport.name, engine=name)
    transport.connect(int(engine), publication.descriptor)
    try:
        writer.add_engine(int(engine), name, writable_regions(publication, name))
    except BaseException:
        transport.disconnect(int(engine))
        raise


def writable_regions(publication: EnginePublication, name: str = "") -> list[tuple[int, int]]:
    """Where the writer may write on an engine rank: its parameters, and its delta area (deltas/area.py)
    once checked to be a range it registered, apart from every parameter (LayoutMismatch otherwise)."""
    regions = list(publication.regions)
    area = publication.delta_area
    if area is None:
        return regions
    a, n = area
    why = ("it is not a range the rank registered" if publication.registered and area not in publication.registered
           else "it overlaps the rank's weights" if any(s < a + n and a < s + m for s, m in regions) else "")
    if why:
        raise LayoutMismatch(f"engine rank {name or publication.rank} published a delta area [{a:#x}, +{n}) that "
                             f"cannot be written: {why}; refusing to connect", engine=name or None,
                             hint="the engine's publication is corrupt or forged; restart the engine")
    return regions + [area]


def detach_engine(transport: "_native.Transport", writer: Any, engine: int) -> None:
    """Remove the engine from the writer (refused while writes are in flight) and disconnect it."""
    writer.remove_engine(int(engine))
    transport.disconnect(int(engine))


def param_writes(publication: EnginePublication, engine: int, engine_name: str,
                 entries: Iterable[tuple[str, int, int]]) -> list[tuple[int, int, int, int]]:
    """Writer rows (slot offset, length, engine, remote address) for (param name, slot offset, source
    bytes) entries, each checked first: the source byte count must equal the engine's numel x
    element size (LayoutMismatch naming the engine and parameter otherwise)."""
    rows = []
    for param, offset, nbytes in entries:
        t = publication.target(param, nbytes, engine=engine_name)
        rows.append((int(offset), int(nbytes), int(engine), t.data_ptr))
    return rows
