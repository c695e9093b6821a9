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

p2pweights receivers also publish the memory they registered with the transport,
``"registered_memory": [[addr, nbytes], ...]``, and the address their registration came from as the
engine's server saw it, ``"registered_from": "ip"`` (sglang's publisher has neither). At connect a
sender refuses (:class:`~p2pweights.errors.LayoutMismatch`, naming engine, rank and parameters) a
table whose entries overlap or leave the registered memory, or registered memory that is not the
parameters' allocation (empty, wrapping, holding no parameter, or far larger than the parameters:
:meth:`EnginePublication.check_regions`),
and a session id that is not the rank's own (:func:`check_sessions`); docs/transports.md says what
"own" means. They also publish the rank's own build, ``"device_arch": "sm90"`` (``cpu`` for a GPU
rank's layout held in host memory) and ``"sglang_version"``, which connect checks against the
engine's ``/server_info`` and the sender's sglang (``replica/build_check.py``).

A publication that carries ``"p2pw_refused": "<why>"`` (:data:`REFUSED_KEY`) comes from an engine whose
p2pweights plugin cannot keep the session's guarantees there (an in-process ``sglang.Engine``:
``sglang_plugin/inprocess.py``); a sender refuses to connect to it (:meth:`EnginePublication.check_not_refused`).
"""
from __future__ import annotations

import base64
import bisect
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..errors import LayoutMismatch, UnknownParameter, UnsupportedLayout, WrongTransport

TRANSPORTS = ("mooncake", "nixl")
#: the key of a publication whose engine refuses p2pweights' one-sided writes, and why
REFUSED_KEY = "p2pw_refused"

# What a rank may register beside its parameters (check_regions): its allocation holds each parameter
# on a 256-byte boundary (receiver/region.py), so registered bytes stay far below this many times
# the parameters' bytes rounded up to pages, plus one huge page.
PAGE = 4096
REGISTERED_SLACK = 2
REGISTERED_PAD = 2 << 20

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


#: the published names of LoRA adapter slots (receiver/adapter_pool.py), not base-weight parameters
ADAPTER_SLOTS = "lora."


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
    # what the rank registered with its transport, (addr, nbytes); empty: not published (sglang)
    registered: list[tuple[int, int]] = field(default_factory=list)
    registered_from: str = ""      # the address the rank's registration came from (p2pweights receivers)
    # the rank's own build (p2pweights receivers; sglang publishes neither): what connect's
    # same-build check (replica/build_check.py) compares with the engine's and the sender's
    device_arch: str = ""          # "sm90", "gfx942", "cpu" (a GPU rank's layout in host memory)
    sglang_version: str = ""       # the sglang the rank's model classes and post-processing come from
    # the engine's registration epoch (p2pweights receivers; 0: none published): it moves on when the
    # engine revokes what an abandoned session could reach (docs/security.md, "Epochs"); a sender
    # re-fetches a publication whose epoch is older than the one begin_weight_update answered
    epoch: int = 0
    # where the rank takes encoded deltas, (addr, nbytes), registered with its weights (deltas/area.py); None: none
    delta_area: tuple[int, int] | None = None
    refused: str = ""              # why the engine's plugin refuses one-sided writes (REFUSED_KEY); "": it does not

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
    def check_not_refused(self, engine: str = "") -> None:
        """Raise UnsupportedLayout, naming the engine, the rank and why, when the engine's plugin refuses
        one-sided writes into this rank (:data:`REFUSED_KEY`: an in-process sglang.Engine)."""
        if self.refused:
            who = (f"engine {engine}" if engine else "the engine") + (f" rank {self.rank}" if self.rank is not None else "")
            raise UnsupportedLayout(f"{who} refuses p2pweights' one-sided writes, so this sender does not connect "
                                    f"to it: {self.refused}", engine=engine or None, rank=self.rank)

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
        replica) is published with that byte count, and every published parameter is expected (but
        LoRA adapter slots, ``lora.<buffer>@<slot>``: an adapter update checks them against the
        engine's pool, both ways, sender/adapter_update.py).
        Raises LayoutMismatch naming the engine and each parameter that differs."""
        problems = [f"{n}: published {self.params[n].nbytes} B, the sender's replica has {nbytes} B"
                    for n, nbytes in expected.items() if n in self.params and self.params[n].nbytes != int(nbytes)]
        problems += [f"{n}: not published" for n in expected if n not in self.params]
        problems += [f"{n}: published, but the sender's replica has no such parameter"
                     for n in self.params if n not in expected and not n.startswith(ADAPTER_SLOTS)]
        if problems:
            shown = "; ".join(problems[:8]) + (f"; (+{len(problems) - 8} more)" if len(problems) > 8 else "")
            who = f"engine '{engine}'" if engine else "the engine"
            raise LayoutMismatch(f"{who} published parameters that differ from the sender's replica of its layout "
                                 f"({len(problems)} difference(s)): {shown}; refusing to write"
                                 + (f". {hint}" if hint else ""))

    def check_regions(self, engine: str = "") -> None:
        """Refuse a table that would make one write land on another parameter or outside the
        engine's memory: entries that overlap (sorted by address, O(n log n)), and, when the rank
        published its registered memory, entries not wholly inside one registered range.
        Raises LayoutMismatch naming the engine, the rank and the parameter(s)."""
        who = who_of(engine, self.rank)
        rows = sorted((t.data_ptr, t.data_ptr + t.nbytes, name) for name, t in self.params.items() if t.nbytes > 0)
        overlaps: list[str] = []
        reach_end, reach_name = -1, ""   # the furthest end so far and whose it is
        for start, end, name in rows:
            if start < reach_end:
                overlaps.append(f"{name} [0x{start:x}, 0x{end:x}) overlaps {reach_name} (ends at 0x{reach_end:x})")
            if end > reach_end:
                reach_end, reach_name = end, name
        if overlaps:
            first = overlaps[0].split(" ", 1)[0]
            raise LayoutMismatch(f"{who} published {len(overlaps)} parameter(s) whose memory overlaps another's: "
                                 f"{_shown(overlaps)}; a write into one would overwrite the other, refusing to "
                                 f"connect", engine=engine or None, rank=self.rank, parameter=first,
                                 hint="the engine's weights table is corrupt or forged; restart the engine")
        if not self.registered:
            return
        self._check_registered(who, engine, rows)
        ranges = merge_regions(self.registered)
        starts = [a for a, _ in ranges]
        outside = []
        for start, end, name in rows:
            i = bisect.bisect_right(starts, start) - 1
            if i < 0 or end > ranges[i][0] + ranges[i][1]:
                outside.append(f"{name} [0x{start:x}, 0x{end:x})")
        if outside:
            regs = ", ".join(f"[0x{a:x}, 0x{a + n:x})" for a, n in ranges[:4])
            raise LayoutMismatch(f"{who} published {len(outside)} parameter(s) outside the memory it registered "
                                 f"({regs}): {_shown(outside)}; refusing to connect", engine=engine or None,
                                 rank=self.rank, parameter=outside[0].split(" ", 1)[0],
                                 hint="the engine's weights table is corrupt or forged; restart the engine")

    def _check_registered(self, who: str, engine: str, rows: Sequence[tuple[int, int, str]]) -> None:
        """The registered memory itself must be what a rank registers: its parameters' allocation(s).
        A range that is empty, negative or runs past 2^64, one that holds no parameter, or more
        registered memory in all than :data:`REGISTERED_SLACK` times the parameters' bytes (each
        rounded up to a page) plus :data:`REGISTERED_PAD` is forged (``[0, 2^63)`` would pass the
        "inside" check for any table) and refused."""
        weights = [r for r in self.registered if r != self.delta_area]  # the area: deltas/publication.py checks it
        bad = [f"[{a}, +{n})" for a, n in weights if a <= 0 or n <= 0 or a + n > 1 << 64]
        ranges = merge_regions(weights)
        starts = [a for a, _ in ranges]
        holding = {bisect.bisect_right(starts, start) - 1 for start, _, _ in rows}
        bad += [f"[0x{a:x}, 0x{a + n:x}) holds no published parameter" for i, (a, n) in enumerate(ranges)
                if i not in holding and 0 < a and a + n <= 1 << 64]
        registered = sum(n for _, n in ranges)
        limit = REGISTERED_SLACK * sum(-(-(end - start) // PAGE) * PAGE for start, end, _ in rows) + REGISTERED_PAD
        if registered > limit:
            bad.append(f"{registered} bytes registered in all for {sum(e - s for s, e, _ in rows)} bytes of "
                       f"parameters (at most {limit})")
        if bad:
            raise LayoutMismatch(f"{who} published registered memory that is not its parameters' allocation: "
                                 f"{_shown(bad)}; refusing to connect", engine=engine or None, rank=self.rank,
                                 hint="the engine's publication is corrupt or forged; restart the engine")

    @property
    def session_host(self) -> str:
        """The host of a Mooncake session id ``host:port`` (``[v6]:port`` too); "" for NIXL."""
        if self.transport != "mooncake":
            return ""
        host = self.peer.rsplit(":", 1)[0] if ":" in self.peer else self.peer
        return host.strip("[]")

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
        if self.registered:
            d["registered_memory"] = [[int(a), int(n)] for a, n in self.registered]
        if self.registered_from:
            d["registered_from"] = self.registered_from
        if self.device_arch:
            d["device_arch"] = self.device_arch
        if self.sglang_version:
            d["sglang_version"] = self.sglang_version
        if self.epoch:
            d["epoch"] = int(self.epoch)
        if self.delta_area:
            d["delta_area"] = [int(self.delta_area[0]), int(self.delta_area[1])]
        if self.refused:
            d[REFUSED_KEY] = self.refused
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
        registered: list[tuple[int, int]] = []
        registered_from = device_arch = sglang_version = refused = ""
        epoch, delta_area = 0, None
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
            rows = data.get("registered_memory") or []
            if not isinstance(rows, list) or not all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rows):
                raise ValueError("'registered_memory' must be [[addr, nbytes], ...]")
            registered = [(int(a), int(n)) for a, n in rows]
            registered_from = str(data.get("registered_from") or "")
            device_arch = str(data.get("device_arch") or "")
            sglang_version = str(data.get("sglang_version") or "")
            epoch = data.get("epoch") or 0
            if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 1 << 63:
                raise ValueError(f"'epoch' must be an integer >= 0, got {epoch!r}")
            area = data.get("delta_area")
            if area is not None:
                if not (isinstance(area, list) and len(area) == 2 and all(
                        isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 64 for v in area)):
                    raise ValueError(f"'delta_area' must be [addr, nbytes] with both > 0, got {area!r}")
                delta_area = (area[0], area[1])
            refused = str(data.get(REFUSED_KEY) or "")
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
                   agent_metadata=meta, location=location, registered=registered,
                   registered_from=registered_from, device_arch=device_arch, sglang_version=sglang_version,
                   epoch=epoch, delta_area=delta_area, refused=refused)


def who_of(engine: str, rank: int | None) -> str:
    who = f"engine '{engine}'" if engine else "the engine"
    return who + (f" rank {rank}" if rank is not None else "")


def _shown(items: Sequence[str], limit: int = 6) -> str:
    return "; ".join(items[:limit]) + (f"; (+{len(items) - limit} more)" if len(items) > limit else "")


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
