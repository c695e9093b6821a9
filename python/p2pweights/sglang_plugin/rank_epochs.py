"""Each rank's side of epoch fencing in a real sglang server (docs/security.md, "Epochs"; docs/sglang.md,
"Fencing"): the rank's weight memory (and its delta area) held by the receiver's own
:class:`~p2pweights.transport.revocation.RevocableRegions` (one implementation, two hosts), moved to a
fresh Mooncake endpoint when the launcher asks, the old one closed, the new one published under the
next epoch.

- **The first epoch is sglang's.** sglang registers the rank's weights with its own Mooncake engine
  (``RemoteInstanceWeightTransporter.engine``; ``weight_registration.py`` for host memory). An AROUND
  hook on ``register_memory_region`` hands sglang's registration a :class:`Registrations` that
  records every region it registers; once the rank published (an AROUND hook on
  ``_register_to_engine_info_bootstrap``, the delta area open by then), :class:`SglangEndpoint`
  wraps sglang's engine with those regions and the area, and ``RevocableRegions`` adopts it as
  epoch 1. The rank's PUT carries ``epoch`` (the plugin's one AROUND hook on
  ``requests.Session.request``, ``bootstrap_requests.py``: only inside that registration, only for
  that path), which the bootstrap server's book keeps (``delta_updates.AreaBook``).
- **The revocation** (:data:`ACTION`, sglang's ``CheckWeightsReqInput`` through the weight checker's
  communicator, as ``digest.py``'s action; an AROUND hook on ``check_weights``): every TP rank opens a
  new ``MooncakeReceiver`` with sglang's own settings (its host, ``MOONCAKE_PROTOCOL``,
  ``MOONCAKE_DEVICE``) and a session id no earlier epoch used, registers the same regions, hands it to
  sglang's transporter (``engine``, ``session_id``), re-publishes through sglang's own PUT (its key
  and the area ride along) under the new epoch, once the old endpoint is fenced (waited for, at most
  ``P2PW_REVOKE_TIMEOUT``). Fencing sglang's own engine (:class:`SglangEndpoint`) unregisters every
  region from it, so a later request's header is refused, and cuts the connections senders opened to
  it, so a request already accepted stops mid-write (unregistering alone let its remaining bytes land:
  measured, docs/security.md). sglang keeps a reference to that engine (its load config), so its
  listener stays open, holding no memory and no connection of the old epoch.
  The TP ranks all-gather their outcomes; no rank raises out of the hook: a fence that fails or
  overruns is this rank's answer (``error``, type ``RevocationFailed``), and the launcher fails the begin.
"""
from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Any, Callable

from ..control.error_answers import error_payload
from ..errors import TransportError
from ..settings import value
from ..transport import mooncake_fence
from ..transport.mooncake import NAME as MOONCAKE
from ..transport.mooncake import MooncakeReceiver
from ..transport.publication import EnginePublication, ParamTarget
from ..transport.revocation import RevocableRegions
from . import bootstrap_requests, rank_deltas
from .rank_gather import every_tp_rank, output_of

logger = logging.getLogger(__name__)

REGISTER_TARGET = "sglang.srt.model_loader.remote_instance_weight_loader_utils.register_memory_region"
ACTION = "p2pw_revoke"  # the weight checker's action that moves every rank to the next epoch
EPOCH_KEY = rank_deltas.EPOCH_KEY
ERROR_KEY = rank_deltas.ERROR_KEY

# This scheduler's regions sglang registered, its revocable registrations, and sglang's transporter.
REGISTERED: list[tuple[int, int]] = []
REGIONS: RevocableRegions | None = None
TRANSPORTER: Any = None

_PUBLISHING: contextvars.ContextVar[int | None] = contextvars.ContextVar("p2pw_epoch", default=None)


class Registrations:
    """sglang's transfer engine as its ``register_memory_region`` sees it: every region registered
    (sglang answered 0) is recorded; everything else is the engine's own."""

    def __init__(self, engine: Any):
        self._engine = engine

    def register_memory(self, address: int, nbytes: int, *args: Any, **kwargs: Any) -> int:
        ret = self._engine.register_memory(address, nbytes, *args, **kwargs)
        if ret == 0:
            REGISTERED.append((int(address), int(nbytes)))
        return ret

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def around_register_memory_region(original: Callable[..., Any], model: Any, transfer_engine: Any) -> Any:
    """AROUND ``register_memory_region``: sglang's (or ``weight_registration.py``'s) registration, recorded."""
    return original(model, Registrations(transfer_engine))


class SglangEndpoint:
    """sglang's own Mooncake engine as epoch 1's endpoint (``RevocableRegions(endpoint=)``): the regions
    sglang registered there. :meth:`fence` unregisters them and cuts the connections senders opened to
    the engine; sglang keeps the engine itself, so :meth:`close` is the same fence."""

    name = MOONCAKE

    def __init__(self, engine: Any, session_id: str, regions: list[tuple[int, int]], protocol: str = "tcp"):
        self.engine, self.session_id, self.protocol = engine, str(session_id), protocol
        self.regions = list(regions)
        self._registered = {int(a): int(n) for a, n in regions}
        # the engine's TCP data port, asked now (its handshake listener serves one connection at a time,
        # and before the rank publishes no sender can be holding it); fence() asks again if this failed
        self.data_port: int | None = None
        try:
            self.data_port = mooncake_fence.tcp_data_port(self.session_id)
        except (OSError, ValueError, TransportError) as e:
            logger.warning("p2pweights sglang plugin: sglang's Mooncake engine %s did not name its TCP data port (%s)",
                           self.session_id, e)

    @property
    def peer(self) -> str:
        return self.session_id

    def add(self, address: int, nbytes: int) -> None:
        """More memory registered with sglang's engine, fenced with the rest (a LoRA pool: lora_slots.py)."""
        ret = self.engine.register_memory(int(address), int(nbytes))
        if ret != 0:
            raise TransportError(f"Mooncake refused to register {nbytes} bytes at {address:#x} (error {ret})")
        self.regions.append((int(address), int(nbytes)))
        self._registered[int(address)] = int(nbytes)

    def publication(self, params: dict[str, Any], rank: int | None = 0) -> EnginePublication:
        table = {n: ParamTarget(*(int(x) for x in row)) for n, row in params.items()}
        return EnginePublication(transport=MOONCAKE, peer=self.session_id, params=table, rank=rank)

    def fence(self, deadline: float) -> int:
        """Nothing lands through sglang's engine in these regions once this returns (transport/mooncake.py
        ``fence``); the connections cut. TransportError names what failed; a later call finishes it."""
        return mooncake_fence.fence(self.engine, self._registered, self.data_port, self.session_id, deadline,
                              self.protocol)

    def close(self) -> None:
        self.fence(time.monotonic() + float(value("P2PW_REVOKE_TIMEOUT")))


def endpoint_maker(session_id: str) -> Callable[[str], MooncakeReceiver]:
    """Each later epoch's endpoint, made as sglang makes its own (its host, protocol and device)."""
    from sglang.srt.environ import envs

    host = session_id.rsplit(":", 1)[0].strip("[]")
    protocol, device = envs.MOONCAKE_PROTOCOL.get(), envs.MOONCAKE_DEVICE.get()
    return lambda transport: MooncakeReceiver(hostname=host, protocol=protocol, device=device or "")


def adopt(transporter: Any) -> RevocableRegions | None:
    """This rank's registrations as epoch 1 (sglang's engine and what it registered, with the delta
    area); None where sglang registered nothing here (no seed flag, or ModelExpress's own)."""
    global REGIONS, TRANSPORTER
    table = getattr(transporter, "weight_info", None)
    if not REGISTERED or transporter.engine is None or not isinstance(table, dict):
        return None
    area = rank_deltas.AREA
    regions = list(REGISTERED) + ([(area.address, area.nbytes)] if area is not None else [])
    device = str(next(transporter.model.parameters()).device)
    from sglang.srt.environ import envs

    REGIONS = RevocableRegions(MOONCAKE, [(a, n, device) for a, n in regions], table,
                               int(getattr(transporter, "tp_rank", 0) or 0),
                               make_endpoint=endpoint_maker(transporter.session_id),
                               endpoint=SglangEndpoint(transporter.engine, transporter.session_id, regions,
                                                       protocol=envs.MOONCAKE_PROTOCOL.get() or "tcp"))
    TRANSPORTER = transporter
    return REGIONS


def add_regions(regions: list[tuple[int, int]], device: str, engine: Any) -> None:
    """Memory this rank allocated after it published its weights (sglang's LoRA pool: ``lora_slots.py``)
    joins its registrations: registered with the current epoch's endpoint and with every later one
    (a takeover revokes it with the weights). Before epoch 1 is adopted: with sglang's ``engine``,
    recorded as its own registrations are. Raises when Mooncake refuses one."""
    if REGIONS is None:
        for address, nbytes in regions:
            ret = Registrations(engine).register_memory(address, nbytes)
            if ret != 0:
                raise TransportError(f"Mooncake refused to register {nbytes} bytes at {address:#x} (error {ret})")
        return
    endpoint = REGIONS.endpoint
    for address, nbytes in regions:
        if isinstance(endpoint, SglangEndpoint):
            endpoint.add(address, nbytes)
        else:  # a later epoch's endpoint, opened by this plugin
            endpoint.register(address, nbytes, device)
        REGIONS.regions.append((int(address), int(nbytes), device))


# -- the publication ----------------------------------------------------------------------------
def around_rank_registration(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_register_to_engine_info_bootstrap``: the first time, sglang's registrations become
    epoch 1's (:func:`adopt`); every PUT publishing them carries the rank's epoch."""
    transporter = args[0] if args else None
    if REGIONS is None and transporter is not None:
        try:
            adopt(transporter)
        except Exception:  # noqa: BLE001 - the rank publishes either way; a takeover then cannot fence it
            logger.exception("p2pweights sglang plugin: this rank's registrations cannot be revoked")
    if REGIONS is None:
        return original(*args, **kwargs)
    token = _PUBLISHING.set(REGIONS.epoch)
    try:
        return original(*args, **kwargs)
    finally:
        _PUBLISHING.reset(token)


bootstrap_requests.add_registration_fields(_PUBLISHING, lambda epoch: {EPOCH_KEY: int(epoch)})


# -- the revocation, in each rank's scheduler ---------------------------------------------------
def revoke_request(epoch: int) -> Any:
    """sglang's ``CheckWeightsReqInput`` that moves every rank to ``epoch``."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    return CheckWeightsReqInput(action=ACTION, skip_tensor_list=[json.dumps({EPOCH_KEY: int(epoch)})])


def rank_revoke(rank: int, raw: Any) -> dict:
    """This rank moves to the epoch in ``raw`` (the action's JSON) and re-publishes; never raises."""
    try:
        epoch = (json.loads(raw) if isinstance(raw, str) else {}).get(EPOCH_KEY)
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ValueError(f"the {ACTION} action takes {{{EPOCH_KEY!r}: int}}, got {raw!r}")
        if REGIONS is None:
            raise RuntimeError(f"engine rank {rank} holds no revocable registrations (did it publish its weights "
                               f"over Mooncake?)")
        if REGIONS.epoch < epoch:  # else moved already by an earlier attempt whose other ranks failed
            REGIONS.revoke(epoch)
            TRANSPORTER.engine, TRANSPORTER.session_id = REGIONS.endpoint.engine, REGIONS.endpoint.peer
        TRANSPORTER._register_to_engine_info_bootstrap()  # sglang's own PUT: the new session, the same table
        return {"rank": rank, EPOCH_KEY: REGIONS.epoch, "peer": REGIONS.endpoint.peer,
                "seconds": REGIONS.revoke_seconds, "fence_seconds": REGIONS.fence_seconds}
    except Exception as e:  # noqa: BLE001 - reported to the launcher; this rank must still join the gather
        logger.error("p2pweights: revocation refused on rank %d: %s", rank, e)
        return {"rank": rank, "error": error_payload(e, type_name=type(e).__name__)["error"]}


def around_check_weights(original: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``SchedulerWeightUpdaterManager.check_weights``: :data:`ACTION` is this plugin's."""
    if getattr(recv_req, "action", None) != ACTION:
        return original(manager, recv_req, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    (raw,) = recv_req.skip_tensor_list or [None]
    answers = every_tp_rank(manager, rank_revoke(int(get_parallel().tp_rank), raw))
    return output_of(answers, ERROR_KEY, ranks_with_error=True)


def register() -> None:
    """The publication's and the revocation's hooks of a scheduler process. Registered before
    ``rank_deltas``'s (the last AROUND registered is the outermost), so that the area is open when
    :func:`around_rank_registration` adopts the registrations."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(rank_deltas.RANK_TARGET, around_rank_registration, HookType.AROUND)
    bootstrap_requests.register()
    HookRegistry.register(rank_deltas.CHECK_TARGET, around_check_weights, HookType.AROUND)


def register_recorder() -> None:
    """The recorder of a scheduler process, registered after ``weight_registration``'s so that it wraps it."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(REGISTER_TARGET, around_register_memory_region, HookType.AROUND)
