"""Each rank's side of delta updates in a real sglang server (docs/deltas.md, docs/sglang.md
"Deltas"): the rank's :class:`DeltaArea` (deltas/area.py, the receiver's own: one implementation,
two hosts), registered with sglang's Mooncake engine next to the weights, published at the
engine-info bootstrap server, and applied in the rank's scheduler when the launcher asks.

- **The area.** :func:`open_area` runs when the rank publishes its weights (the AROUND hook on
  ``_register_to_engine_info_bootstrap``, right after ``weight_registration.py`` registered them):
  ``area_bytes`` of them (``P2PW_DELTA_AREA``), registered with the same Mooncake engine, on the
  weights' device: a rank whose weights are on a GPU keeps its area there when ``P2PW_DELTA_AREA``
  sizes it (it takes memory sglang would give its KV cache), index records only, applied through
  each parameter's own storage (``deltas/weight_views.py``).
- **The publication.** sglang's PUT of the rank's weights table carries only ``tp_rank`` and
  ``transfer_engine_info``: while ``_register_to_engine_info_bootstrap`` runs (an AROUND hook),
  the plugin's one AROUND hook on ``requests.Session.request`` (``bootstrap_requests.py``) adds
  ``delta_area: [addr, nbytes]`` to that PUT's JSON. The bootstrap server's handler ignores it; the
  launcher's middleware there keeps it and adds it to the GET's answer (``delta_updates.AreaBook``),
  the key a receiver's rank publishes it under.
- **The apply.** The launcher sends sglang's ``CheckWeightsReqInput`` with the action
  :data:`ACTION` (the manifests, as JSON, in ``skip_tensor_list``) through the weight checker's
  communicator, as ``digest.py`` does; an AROUND hook on ``check_weights`` answers it: each TP rank
  applies its own manifest, the ranks all-gather their outcomes, rank 0 answers. No rank raises
  out of the hook (the others wait for it in the gather).
"""
from __future__ import annotations

import contextvars
import json
import logging
from typing import Any, Callable

from ..control.error_answers import error_payload
from ..deltas.area import DeltaArea, open_rank_area
from ..deltas.weight_views import weights_device
from ..engine.rank_area import RankDeltas
from ..errors import LayoutMismatch
from ..transport.publication import merge_regions
from . import bootstrap_requests
from .rank_gather import every_tp_rank, output_of

logger = logging.getLogger(__name__)

RANK_TARGET = ("sglang.srt.model_executor.model_runner_components.remote_instance_weight_transporter."
               "RemoteInstanceWeightTransporter._register_to_engine_info_bootstrap")
CHECK_TARGET = ("sglang.srt.managers.scheduler_components.weight_updater."
                "SchedulerWeightUpdaterManager.check_weights")
REGISTER_PATH = bootstrap_requests.REGISTER_PATH
ACTION = "p2pw_apply_deltas"  # the weight checker's action that applies the session's deltas
AREA_KEY = "delta_area"       # the publication's key (transport/publication.py)
EPOCH_KEY = "epoch"           # the publication's key of the rank's registration epoch (rank_epochs.py)
ERROR_KEY = "p2pw_error"

# This scheduler's area and the weight regions its records may write (one rank per scheduler).
AREA: DeltaArea | None = None
DELTAS: RankDeltas | None = None  # the area and where its records may write (engine/rank_area.py)

_PUBLISHING: contextvars.ContextVar[list | None] = contextvars.ContextVar("p2pw_delta_area", default=None)


def open_area(regions: list[tuple[int, int]], transfer_engine: Any, rank: int = 0, *, device: str = "cpu",
              named: list | None = None) -> DeltaArea | None:
    """Allocate and register this rank's area beside its weight ``regions``, on their ``device`` (a
    GPU area takes index records; ``named``: the parameters of those regions, which a GPU area's
    records are applied through). A refused registration leaves the rank without one (full writes),
    loudly."""
    global AREA, DELTAS
    area = open_rank_area(sum(n for _, n in regions), device, rank, "sglang")
    if area is None:
        return None
    ret = transfer_engine.register_memory(area.address, area.nbytes)
    if ret != 0:
        logger.error("p2pweights sglang plugin: Mooncake refused the delta area (error %s): full writes only", ret)
        area.close()
        return None
    AREA, DELTAS = area, RankDeltas(area, rank, "sglang", device)
    DELTAS.cover(regions, named=named)
    return area


def merged_regions(table: dict) -> list[tuple[int, int]]:
    """sglang's weights table ``{name: (ptr, numel, size)}`` -> the byte ranges registered."""
    return list(merge_regions((ptr, numel * size) for ptr, numel, size in table.values()))


def cover(table: dict, named: list | None = None) -> None:
    """The area's records may write every region of ``table`` from now on (a drafting rank's table
    gained the draft's parameters: ``draft_roles.py``; ``named``: those parameters, for a GPU area);
    nothing where the rank keeps no area."""
    if DELTAS is not None:
        DELTAS.cover(merged_regions(table), named=named)


def _open_beside(transporter: Any) -> None:
    params = list(transporter.model.named_parameters())
    table = transporter.weight_info
    try:
        device = weights_device(q for _, q in params)
    except LayoutMismatch:
        return  # no weights, or spread over devices: full writes
    if not isinstance(table, dict):
        return
    named = [(n, q) for n, q in params if n in table]  # what sglang registered and published
    open_area(merged_regions(table), transporter.engine, int(getattr(transporter, "tp_rank", 0) or 0),
              device=device, named=named)


# -- the publication ----------------------------------------------------------------------------
def around_rank_registration(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_register_to_engine_info_bootstrap``: the rank's weights are registered by now
    (``weight_registration.py``); a rank whose weights are all in host memory opens its area beside
    them, and the PUT publishing them carries it."""
    transporter = args[0] if args else None
    if AREA is None and transporter is not None:
        try:
            _open_beside(transporter)
        except Exception:  # noqa: BLE001 - the rank publishes its weights either way (full writes)
            logger.exception("p2pweights sglang plugin: no delta area on this rank")
    if AREA is None:
        return original(*args, **kwargs)
    token = _PUBLISHING.set(AREA.published())
    try:
        return original(*args, **kwargs)
    finally:
        _PUBLISHING.reset(token)


bootstrap_requests.add_registration_fields(_PUBLISHING, lambda area: {AREA_KEY: list(area)})


# -- the apply, in each rank's scheduler --------------------------------------------------------
def apply_request(manifests: dict) -> Any:
    """sglang's ``CheckWeightsReqInput`` that has every rank apply its manifest (``{rank: manifest}``)."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    return CheckWeightsReqInput(action=ACTION, skip_tensor_list=[json.dumps({"manifests": manifests})])


def rank_apply(rank: int, raw: Any) -> dict:
    """This rank's apply of its manifest in ``raw`` (the action's JSON); never raises."""
    try:
        manifests = (json.loads(raw) if isinstance(raw, str) else {}).get("manifests")
        return (DELTAS or RankDeltas(None, rank, "sglang")).apply(manifests)
    except Exception as e:  # noqa: BLE001 - reported to the launcher; this rank must still join the gather
        logger.error("p2pweights: delta apply refused on rank %d: %s", rank, e)
        return {"rank": rank, "error": error_payload(e, type_name=type(e).__name__)["error"]}


def around_check_weights(original: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``SchedulerWeightUpdaterManager.check_weights``: :data:`ACTION` is this plugin's."""
    if getattr(recv_req, "action", None) != ACTION:
        return original(manager, recv_req, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    (raw,) = recv_req.skip_tensor_list or [None]
    return output_of(every_tp_rank(manager, rank_apply(int(get_parallel().tp_rank), raw)), ERROR_KEY)


def register() -> None:
    """The hooks of a scheduler process (the area itself opens in ``weight_registration``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RANK_TARGET, around_rank_registration, HookType.AROUND)
    bootstrap_requests.register()
    HookRegistry.register(CHECK_TARGET, around_check_weights, HookType.AROUND)
