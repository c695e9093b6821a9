"""``POST /p2pw_weights_digest`` (``update(verify=True)``) in a real sglang server: each engine rank's
digest of the bytes it holds for the parameters named, computed in that rank's scheduler process
(the HTTP launcher holds no weights) by the receiver's own function
(``control.weights_digest.parameter_digests``: one implementation, two hosts). docs/sglang.md, "Digests".

How a call reaches the ranks: sglang's own path for its weight checker (``/weights_checker``), which
already visits every rank and gathers their answers. The route sends sglang's ``CheckWeightsReqInput``
with the action :data:`ACTION` through the tokenizer manager's ``check_weights_communicator``; the
scheduler of TP rank 0 receives it and sglang broadcasts it to the other TP ranks; every rank's
scheduler dispatches it to ``SchedulerWeightUpdaterManager.check_weights``. An AROUND hook there
(:func:`around_check_weights`) answers this action and passes every other one to sglang unchanged:
each rank digests what it holds, the TP ranks all-gather their answers (as sglang's checksum does),
and rank 0 returns sglang's ``CheckWeightsReqOutput``, one ``ChecksumInfo`` per rank whose
``checksums`` are the digests. No request type, dispatcher entry or IPC decoder of sglang's is added
or changed; a scheduler without the hook answers sglang's own "Unsupported action" (the route then
answers 501, as a receiver whose hooks lack the digest).

The action's arguments ride in the request's ``skip_tensor_list``: one element, the JSON of
``{"names": {"<rank>": [param, ...]}, "engine": name}`` (:func:`check_request`). No rank raises out of
the hook: a rank that cannot answer (a name it does not hold) sends its error to the gather, so no
other rank waits in it forever.

The route (added by a BEFORE hook on ``_setup_and_run_http_server``, like ``sessions.py``'s) takes
the receiver's body and gives its answers: 200 ``{"success", "algorithm", "ranks"}``, 400 for a bad
body or ``UnknownParameter`` naming the rank and the parameter, 501 when the schedulers do not
digest. It reads, so it is nobody's session's (not gated) but sglang's key middleware guards it as
its own ``/weights_checker`` (``ADMIN_OPTIONAL``).

Not covered (the route is not added, ``p2pw_plugin.error`` says why): several HTTP workers, data
parallelism and pipeline parallelism (the answer is keyed by TP rank, as sglang's weights tables are).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Iterable

from starlette.requests import Request  # at module level: FastAPI resolves the endpoint's annotations here
from starlette.responses import JSONResponse

from ..control import bodies, routes
from ..control import protocol as p
from ..control.error_answers import error_payload
from ..control.weights_digest import ALGORITHM, parameter_digests
from ..errors import InvalidRequest, UnknownParameter
from . import lora_slots, version_guard
from .rank_gather import every_tp_rank, output_of

logger = logging.getLogger(__name__)

SCHEDULER_TARGET = ("sglang.srt.managers.scheduler_components.weight_updater."
                    "SchedulerWeightUpdaterManager.check_weights")
HTTP_SERVER_TARGET = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
ACTION = "p2pw_digest"   # the weight checker's action this plugin answers
OFFER = p.PLUGIN_DIGEST
PATH = routes.route("p2pw_weights_digest").path
DRAFT_PREFIX = "draft."  # a draft role's parameter, as publications and the receiver name it
_ERROR = "p2pw_error"    # the key of a rank's error in sglang's failure message

# The HTTP process's state once the hook ran: the route is served; why it is not.
INSTALLED = False
REFUSED: str | None = None


# -- the request, as it rides sglang's weight checker ----------------------------------------------
def check_request(names: dict[int, list[str]], engine: str) -> Any:
    """sglang's ``CheckWeightsReqInput`` that asks every rank for its digests of ``names`` (by rank)."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    args = {"names": {str(r): list(ns) for r, ns in names.items()}, "engine": engine}
    return CheckWeightsReqInput(action=ACTION, skip_tensor_list=[json.dumps(args)])


def read_names(raw: bytes) -> dict[int, list[str]]:
    """The receiver's body (``bodies.WeightsDigestReq``) -> names by engine rank; InvalidRequest
    naming the field, as a receiver answers (``receiver/server.py``)."""
    try:
        obj = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise InvalidRequest("the body must be a JSON object") from None
    req = bodies.decode(bodies.WeightsDigestReq, obj)
    try:
        return {int(r): [str(n) for n in ns] for r, ns in req.names.items()}
    except (TypeError, ValueError):
        raise InvalidRequest("field 'names' must map an engine rank to a list of parameter names") from None


# -- in each rank's scheduler ----------------------------------------------------------------------
def rank_digests(model: Any, draft: Any, names: Iterable[str], *, engine: str, rank: int) -> dict[str, str]:
    """``{name: digest}`` of what this rank holds, by the receiver's rules (``receiver/rank.py``):
    ``draft.<name>`` is the draft model's ``<name>``; with no draft model, UnknownParameter names it."""
    names = list(names)
    target = [n for n in names if not n.startswith(DRAFT_PREFIX)]
    drafted = [n for n in names if n.startswith(DRAFT_PREFIX)]
    digests = parameter_digests(model, target, engine=engine, rank=rank)
    if drafted and draft is not None:
        got = parameter_digests(draft, [n[len(DRAFT_PREFIX):] for n in drafted], engine=engine, rank=rank)
        digests.update({DRAFT_PREFIX + n: d for n, d in got.items()})
    elif drafted:
        digests.update(parameter_digests(model, drafted, engine=engine, rank=rank))  # names them
    return digests


def _models(manager: Any) -> tuple[Any, Any]:
    """The rank's target model and its draft model (None without one), from sglang's runners."""
    (_, target), = [(role, r) for role, r in manager.tp_worker.weight_update_runners() if role == "target"]
    drafts = manager.draft_worker.weight_update_runners() if manager.draft_worker is not None else []
    draft = next((r.model for role, r in drafts if role == "draft"), None)
    return target.model, draft


def rank_answer(manager: Any, recv_req: Any) -> dict[str, Any]:
    """This rank's part of the answer; never raises (the other ranks wait for it in the gather)."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    rank = int(parallel.tp_rank)
    where = {"role": "target", "tp_rank": rank, "tp_size": int(parallel.tp_size),
             "dp_rank": int(parallel.dp_rank or 0), "dp_size": int(parallel.attn_dp_size),
             "pp_rank": int(parallel.pp_rank), "pp_size": int(parallel.pp_size),
             "rank": dist.get_rank() if dist.is_initialized() else 0,
             "size": dist.get_world_size() if dist.is_initialized() else 1}
    try:
        (raw,) = recv_req.skip_tensor_list or [None]
        args = json.loads(raw) if isinstance(raw, str) else None
        if not isinstance(args, dict) or not isinstance(args.get("names"), dict):
            raise InvalidRequest(f"the {ACTION} action takes its names as one JSON element of skip_tensor_list")
        model, draft = _models(manager)
        lora = lora_slots.lora_manager_of(manager)  # its wrapping renamed the target layers' parameters
        names, engine = args["names"].get(str(rank), []), str(args.get("engine", ""))
        slots = [n for n in names if n.startswith(lora_slots.PREFIX)]  # "lora.<buffer>@<slot>": adapter slots
        digests = rank_digests(lora_slots.published_names(model, lora), draft,
                               [n for n in names if not n.startswith(lora_slots.PREFIX)], engine=engine, rank=rank)
        if slots:
            digests.update(lora_slots.slot_digests(lora, slots, engine=engine, rank=rank))
        return {"where": where, "digests": digests}
    except Exception as e:  # noqa: BLE001 - reported to the caller; this rank must still join the gather
        if not isinstance(e, (InvalidRequest, UnknownParameter)):
            logger.exception("p2pweights digest failed on rank %d", rank)
        return {"where": where, "error": error_payload(e, type_name=type(e).__name__)["error"]}


def around_check_weights(original: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on ``SchedulerWeightUpdaterManager.check_weights``: :data:`ACTION` is this
    plugin's; every other action is sglang's."""
    if getattr(recv_req, "action", None) != ACTION:
        return original(manager, recv_req, *args, **kwargs)
    import msgspec
    from sglang.srt.managers.io_struct import ChecksumInfo, CheckWeightsReqOutput

    answers = every_tp_rank(manager, rank_answer(manager, recv_req))  # as in sglang's checksum
    if any("error" in a for a in answers):
        return output_of(answers, _ERROR)
    payload = [msgspec.convert({"checksums": a["digests"], "per_gpu_checksum": "", "parallelism_info": [a["where"]]},
                               ChecksumInfo) for a in answers]
    return CheckWeightsReqOutput(success=True, message="Success.", payload=payload)


# -- in the HTTP process ---------------------------------------------------------------------------
def answer_of(outputs: Iterable[Any]) -> tuple[int, dict[str, Any]]:
    """The receiver's answer (status, body) from sglang's ``CheckWeightsReqOutput`` of each DP rank."""
    outputs = list(outputs)
    for out in outputs:
        if out.success:
            continue
        try:
            detail = json.loads(out.message)[_ERROR]
        except (ValueError, TypeError, KeyError):  # sglang's own failure: no rank answered the action
            return p.NOT_IMPLEMENTED, error_payload(
                f"this engine does not digest its weights ({PATH}): its schedulers answered {out.message!r} "
                f"(is the p2pweights plugin attached in them? see their log)")
        if detail.get("type") in (UnknownParameter.__name__, InvalidRequest.__name__):  # the caller's input
            return p.BAD_REQUEST, {"success": False, "message": detail.get("message", ""), "error": detail}
        message = f"{PATH} failed in the engine: {detail.get('type')}: {detail.get('message')}"
        return p.ENGINE_FAILED, {"success": False, "message": message, "error": {**detail, "message": message}}
    ranks = {str(info.parallelism_info[0].tp_rank): dict(info.checksums) for out in outputs for info in out.payload or ()}
    return p.OK, {"success": True, "algorithm": ALGORITHM, "ranks": ranks}


def endpoint(tokenizer_manager: Any, engine: str) -> Any:
    """``POST /p2pw_weights_digest``: the receiver's body and answers, the ranks asked through sglang's
    weight-checker communicator."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def p2pw_weights_digest(request: Request) -> JSONResponse:
        try:
            names = read_names(await request.body())
        except InvalidRequest as e:
            return JSONResponse(error_payload(e), status_code=p.BAD_REQUEST)
        tokenizer_manager.auto_create_handle_loop()
        outputs = await tokenizer_manager.check_weights_communicator(check_request(names, engine))
        status, answer = answer_of(outputs)
        return JSONResponse(answer, status_code=status)

    return p2pw_weights_digest


def install(app: Any, tokenizer_manager: Any, *, engine: str, workers: int = 1, dp_size: int = 1,
            pp_size: int = 1) -> bool:
    """Add the route to sglang's FastAPI ``app`` (before it serves). Refuses (False, logged,
    :data:`REFUSED`) where the answer could not be keyed by TP rank or reach every rank."""
    global INSTALLED
    if workers != 1:
        return refuse(f"digests not served: this server runs {workers} HTTP workers (--tokenizer-worker-num); "
                      f"the route is added to the launcher's app only")
    if dp_size != 1 or pp_size != 1:
        return refuse(f"digests not served: dp_size={dp_size}, pp_size={pp_size}; the answer is keyed by TP rank "
                      f"(data and pipeline parallelism are not covered)")
    if not hasattr(tokenizer_manager, "check_weights_communicator"):
        return refuse("digests not served: sglang's tokenizer manager has no check_weights_communicator")
    if PATH in {getattr(r, "path", None) for r in app.router.routes}:
        return refuse(f"digests not served: {PATH} is served already (by another plugin?)")
    app.add_api_route(PATH, endpoint(tokenizer_manager, engine), methods=["POST"])
    INSTALLED = True
    return True


def refuse(why: str) -> bool:
    global REFUSED
    REFUSED = why
    logger.error("p2pweights sglang plugin: %s", why)  # ERROR reaches the server's log
    return False


def before_http_server(*args: Any, **kwargs: Any) -> None:
    """The BEFORE hook on ``_setup_and_run_http_server``: the route on sglang's ``app``. Never raises
    (a failure is logged and reported in ``p2pw_plugin.error``); leaves sglang's arguments as they are."""
    try:
        from sglang.srt.entrypoints import http_server
        from sglang.srt.runtime_context import get_serving

        bound = {**dict(zip(version_guard.HOOKED[HTTP_SERVER_TARGET], args)), **kwargs}
        server_args, serving = bound["server_args"], get_serving()
        install(http_server.app, bound["tokenizer_manager"], engine=f"http://{serving.host}:{serving.port}",
                workers=int(serving.tokenizer_worker_num), dp_size=int(server_args.dp_size),
                pp_size=int(server_args.pp_size))
    except Exception as e:  # noqa: BLE001 - sglang must start either way; the refusal is loud
        refuse(f"digests not served: {type(e).__name__}: {e}")
    return None


def live() -> dict[str, Any]:
    """What ``/server_info`` says of digests now (``server_info.after_build``): ``offers``
    (``["digest"]`` while the route is served), ``error`` (why it is not)."""
    return {"offers": [OFFER] if INSTALLED else [], "error": REFUSED}


def register(kind: str) -> None:
    """Register the hook of a process of ``kind`` (``sglang_plugin.process_kind``): the route in the
    launcher (``main``), the action in each rank's scheduler; none elsewhere."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if kind == "main":
        HookRegistry.register(HTTP_SERVER_TARGET, before_http_server, HookType.BEFORE)
    elif kind == "scheduler":
        HookRegistry.register(SCHEDULER_TARGET, around_check_weights, HookType.AROUND)
