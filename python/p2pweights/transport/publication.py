"""What an engine rank publishes so that a sender can write into its parameters.

Mooncake (exactly sglang's format, what ``GET /remote_instance_transfer_engine_info?rank=N``
returns from an engine started with ``--remote-instance-weight-loader-start-seed-via-transfer-engine``)::

    {"rank": 0,
     "remote_instance_transfer_engine_info": ["10.0.0.5:15432",
                                              {"model.embed_tokens.weight": [data_ptr, numel, element_size], ...}]}

NIXL (defined by p2pweights; sglang 0.5.23 has no NIXL publisher; see docs/transports.md)::

    {"rank": 0, "transport": "nixl",
     "remote_instance_transfer_engine_info": ["<agent name>", {param: [data_ptr, numel, element_size], ...}],
     "agent_metadata": "<base64 of nixl_agent.get_agent_metadata()>",
     "location": "cuda:0"}

A publication without ``"transport"`` is a Mooncake one. The writer's region check uses the
parameters' byte ranges merged where they touch (:func:`merge_regions`), never anything wider.
A sender checks a publication against its replica both ways (:meth:`EnginePublication.check_params`).
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..errors import LayoutMismatch, UnknownParameter, WrongTransport

TRANSPORTS = ("mooncake", "nixl")

# The flag (sender side and engine side) that selects each transport.
_FIX = {
    "mooncake": ("transport='mooncake' (P2PW_TRANSPORT=mooncake)",
                 "sglang: --remote-instance-weight-loader-start-seed-via-transfer-engine; "
                 "p2pweights receiver: transport='mooncake'"),
    "nixl": ("transport='nixl' (P2PW_TRANSPORT=nixl)", "p2pweights receiver: transport='nixl'"),
}


@dataclass(frozen=True)
class ParamTarget:
    """Where one parameter lives in the engine rank: ``numel * element_size`` bytes at ``data_ptr``."""

    data_ptr: int
    numel: int
    element_size: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def merge_regions(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(addr, length) ranges -> sorted, merged where they overlap or touch; empty ranges dropped."""
    out: list[list[int]] = []
    for addr, length in sorted((int(a), int(n)) for a, n in ranges if int(n) > 0):
        if out and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + length - out[-1][0])
        else:
            out.append([addr, length])
    return [(a, n) for a, n in out]


def params_table(named_tensors: Iterable[tuple[str, Any]]) -> dict[str, list[int]]:
    """sglang's weights table ``{name: [data_ptr, numel, element_size]}`` from (name, tensor) pairs."""
    return {name: [int(t.data_ptr()), int(t.numel()), int(t.element_size())] for name, t in named_tensors}


@dataclass
class EnginePublication:
    """One engine rank's published weights: how to connect, where each parameter lives.

    ``descriptor`` is what the sender's transport ``connect(engine, descriptor)`` takes (a JSON
    string); ``regions`` is what the writer's ``add_engine`` takes.
    """

    transport: str
    peer: str                      # Mooncake session id "ip:rpc_port", or the NIXL agent name
    params: dict[str, ParamTarget]
    rank: int | None = None
    agent_metadata: bytes = b""    # NIXL only
    location: str = ""             # NIXL only: "cpu" or "cuda:N" (memory type of the peer's regions)
    regions: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r} in an engine publication; "
                             f"expected one of {', '.join(TRANSPORTS)}")
        if not self.regions:
            self.regions = merge_regions((p.data_ptr, p.nbytes) for p in self.params.values())

    # -- connecting ------------------------------------------------------------------------------
    @property
    def descriptor(self) -> str:
        d: dict[str, Any] = {"transport": self.transport, "peer": self.peer}
        if self.transport == "nixl":
            d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
            d["location"] = self.location or "cpu"
        return json.dumps(d)

    def check_transport(self, expected: str, engine: str = "") -> None:
        """Raise WrongTransport unless this engine published for ``expected``."""
        if self.transport == expected:
            return
        who = f"engine '{engine}'" if engine else "the engine"
        if self.rank is not None:
            who += f" rank {self.rank}"
        sender_fix, engine_fix = _FIX[self.transport]
        raise WrongTransport(
            f"{who} published its weights for {self.transport}, but this sender uses {expected}: "
            f"start the sender with {sender_fix}, or restart the engine for {expected} "
            f"({_FIX[expected][1]})")

    # -- safety ----------------------------------------------------------------------------------
    def target(self, param: str, source_bytes: int, engine: str = "") -> ParamTarget:
        """The parameter's target after checking the source byte count equals numel x element size."""
        try:
            t = self.params[param]
        except KeyError:
            raise UnknownParameter(f"engine '{engine}' published no parameter named {param!r}") from None
        if int(source_bytes) != t.nbytes:
            raise LayoutMismatch(
                f"engine '{engine}' parameter {param!r}: the sender has {int(source_bytes)} bytes, the engine holds "
                f"{t.nbytes} ({t.numel} elements x {t.element_size} bytes); refusing to write")
        return t

    def check_params(self, expected: Mapping[str, int], engine: str = "", hint: str = "") -> None:
        """Both ways: every parameter in ``expected`` ({name: numel x element size}, the sender's
        replica) is published with that byte count, and every published parameter is expected.
        Raises LayoutMismatch naming the engine and each parameter that differs."""
        problems = [f"{n}: published {self.params[n].nbytes} B, the sender's replica has {nbytes} B"
                    for n, nbytes in expected.items() if n in self.params and self.params[n].nbytes != int(nbytes)]
        problems += [f"{n}: not published" for n in expected if n not in self.params]
        problems += [f"{n}: published, but the sender's replica has no such parameter"
                     for n in self.params if n not in expected]
        if problems:
            shown = "; ".join(problems[:8]) + (f"; (+{len(problems) - 8} more)" if len(problems) > 8 else "")
            who = f"engine '{engine}'" if engine else "the engine"
            raise LayoutMismatch(f"{who} published parameters that differ from the sender's replica of its layout "
                                 f"({len(problems)} difference(s)): {shown}; refusing to write"
                                 + (f". {hint}" if hint else ""))

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    # -- (de)serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        table = {name: [p.data_ptr, p.numel, p.element_size] for name, p in self.params.items()}
        d: dict[str, Any] = {}
        if self.rank is not None:
            d["rank"] = self.rank
        if self.transport != "mooncake":
            d["transport"] = self.transport
        d["remote_instance_transfer_engine_info"] = [self.peer, table]
        if self.transport == "nixl":
            d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
            d["location"] = self.location or "cpu"
        return d

    def extra(self) -> dict[str, Any]:
        """The keys served next to ``rank`` and ``remote_instance_transfer_engine_info`` (none for
        Mooncake; ``transport``, ``agent_metadata``, ``location`` for NIXL): the ``extra`` of
        ``ReceiverServer.register_transfer_engine_info``."""
        return {k: v for k, v in self.to_dict().items() if k not in ("rank", "remote_instance_transfer_engine_info")}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any] | list) -> "EnginePublication":
        """Parse what an engine published: the HTTP answer (dict or JSON text), or sglang's bare
        ``[session_id, weights]`` pair."""
        if isinstance(data, (str, bytes, bytearray)):
            data = json.loads(data)
        rank = None
        transport = "mooncake"
        meta = b""
        location = ""
        if isinstance(data, Mapping):
            if "error" in data and "remote_instance_transfer_engine_info" not in data:
                raise ValueError(f"the engine answered with an error: {data['error']}")
            rank = data.get("rank")
            transport = str(data.get("transport", "mooncake"))
            try:
                info = data["remote_instance_transfer_engine_info"]
            except KeyError:
                raise ValueError("not an engine publication: no 'remote_instance_transfer_engine_info' "
                                 f"(keys: {', '.join(map(str, data))})") from None
            if transport == "nixl":
                meta = base64.b64decode(data.get("agent_metadata", ""))
                if not meta:
                    raise ValueError("a NIXL publication without 'agent_metadata'")
                location = str(data.get("location", "cpu"))
        else:
            info = data
        if not isinstance(info, (list, tuple)) or len(info) != 2 or not isinstance(info[1], Mapping):
            raise ValueError("'remote_instance_transfer_engine_info' must be [session id, {param: [data_ptr, numel, "
                             "element_size]}]")
        peer, table = info
        if not peer:
            raise ValueError("the engine published no session id / agent name (did it register its weights?)")
        params = {}
        for name, row in table.items():
            if len(row) != 3:
                raise ValueError(f"parameter {name!r}: expected [data_ptr, numel, element_size], got {row!r}")
            params[str(name)] = ParamTarget(int(row[0]), int(row[1]), int(row[2]))
        return cls(transport=transport, peer=str(peer), params=params, rank=None if rank is None else int(rank),
                   agent_metadata=meta, location=location)


@dataclass(frozen=True)
class PeerDescriptor:
    """What a sender backend's connect() needs; parsed from a descriptor or a whole publication."""

    transport: str
    peer: str
    agent_metadata: bytes = b""
    location: str = "cpu"


def parse_descriptor(text: str) -> PeerDescriptor:
    d = json.loads(text)
    if isinstance(d, Mapping) and "peer" in d and "remote_instance_transfer_engine_info" not in d:
        meta = base64.b64decode(d["agent_metadata"]) if d.get("agent_metadata") else b""
        return PeerDescriptor(str(d.get("transport", "mooncake")), str(d["peer"]), meta, str(d.get("location", "cpu")))
    p = EnginePublication.from_json(d)
    return PeerDescriptor(p.transport, p.peer, p.agent_metadata, p.location or "cpu")


def check_descriptor_transport(desc: PeerDescriptor, expected: str) -> None:
    if desc.transport != expected:
        sender_fix, _ = _FIX.get(desc.transport, (f"transport='{desc.transport}'", ""))
        raise WrongTransport(f"the engine published for {desc.transport}, but this transport is {expected}: "
                             f"use {sender_fix}")
