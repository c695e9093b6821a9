"""LoRA adapter slots in a real sglang server (docs/lora.md, "Adapter updates"; docs/sglang.md, "LoRA
adapters"): what the engine core's adapter sessions need from sglang's own LoRA pool, the same as our
receiver's ranks give (``receiver/adapter_pool.py``, ``receiver/rank.py``).

- **The pool, registered and published.** sglang builds a runner's ``LoRAManager`` (and its
  ``LoRAMemoryPool``: one tensor per target module, layer and side, never reallocated) right after the
  rank published its weights. An AROUND hook on ``ModelRunner.init_lora_manager`` then registers the
  pool's memory with the rank's Mooncake endpoint (``rank_epochs.add_regions``: revoked and
  re-registered under a new epoch with the weights on a takeover), adds every adapter slot of every
  buffer to the rank's weights table as ``lora.{A|B}.{module}.L{layer}@{slot}`` (slots 1..S-1; slot 0
  is the base model's), and publishes the table again through sglang's own PUT.
- **An adapter's slot** (the core's ``steps.AdapterSlot``): sglang gives an adapter a slot lazily, when
  a batch first asks for it. :func:`slot` sends sglang's ``CheckWeightsReqInput`` with the action
  :data:`ACTION` through the weight checker's communicator (as the digest and the delta apply do); in
  every TP rank's scheduler the hook finds the adapter among the LoRA manager's loaded ones, refuses one
  that is not loaded, or loaded unpinned (sglang may evict it and give its slot to another adapter),
  places a pinned one as a batch would (``LoRAManager.fetch_new_loras``) and answers its slot; the ranks
  all-gather their answers and must agree.
- **Digests** of slot entries (``verify=True``): :func:`slot_digests`, called by ``digest.py``; and of
  the base weights under the names the rank published them by, which LoRA's wrapping of the target
  layers changed in the model (:class:`PublishedNames`).
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..control.error_answers import error_payload
from ..control.weights_digest import digest
from ..errors import EngineError, InvalidRequest, LayoutMismatch, UnknownParameter
from ..replica.lora_layout import base_name, buffer_name
from ..transport.publication import ADAPTER_SLOTS, merge_regions
from . import rank_deltas, rank_epochs
from .rank_gather import every_tp_rank, output_of

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

INIT_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager"
CHECK_TARGET = rank_deltas.CHECK_TARGET
ACTION = "p2pw_adapter_slot"  # the weight checker's action that places an adapter and answers its slot
ERROR_KEY = rank_deltas.ERROR_KEY
PREFIX = ADAPTER_SLOTS        # "lora.": a published adapter slot entry, not a base-weight parameter


def slot_entry(buffer: str, slot: int) -> str:
    """The weights-table name of one adapter slot of one pool buffer (as ``receiver/adapter_pool.py``)."""
    return f"{buffer}@{int(slot)}"


# -- the pool ------------------------------------------------------------------------------------
def pool_buffers(lora_manager: Any) -> dict[str, "torch.Tensor"]:
    """Every buffer of sglang's LoRA pool by its replica name (``lora.{A|B}.{module}.L{layer}``), by
    module name, layer, A before B (``replica.lora_pool``'s order); embedding and lm_head buffers are
    left out (the sender's replica refuses those adapters)."""
    pool = lora_manager.memory_pool
    out = {}
    for module in sorted(pool.A_buffer):
        for layer in range(len(pool.A_buffer[module])):
            for side, tensors in (("A", pool.A_buffer), ("B", pool.B_buffer)):
                t = tensors[module][layer]
                if not t.is_contiguous():
                    raise LayoutMismatch(f"sglang's LoRA pool buffer {side} {module} layer {layer} is not contiguous: "
                                         f"its slots cannot be published")
                out[buffer_name(side, module, layer)] = t
    return out


def slot_table(lora_manager: Any) -> dict[str, tuple[int, int, int]]:
    """sglang's weights-table rows ``{entry: (data_ptr, numel, element_size)}`` of every adapter slot."""
    slots = int(lora_manager.memory_pool.max_loras_per_batch)
    return {slot_entry(name, s): (int(t[s].data_ptr()), int(t[s].numel()), int(t.element_size()))
            for name, t in pool_buffers(lora_manager).items() for s in range(1, slots)}


def publish(runner: Any) -> int:
    """Register the runner's LoRA pool with the rank's endpoint and publish its slots; the entries
    published (0 where the rank publishes no weights: no seed flag, or no Mooncake engine)."""
    transporter = getattr(runner, "remote_instance_weight_transporter", None)
    if transporter is None or transporter.engine is None or not isinstance(transporter.weight_info, dict):
        logger.info("p2pweights sglang plugin: this rank publishes no weights, so no LoRA adapter slots either")
        return 0
    buffers = pool_buffers(runner.lora_manager)
    if not buffers:
        return 0
    regions = merge_regions((int(t.data_ptr()), t.numel() * t.element_size()) for t in buffers.values())
    rank_epochs.add_regions(regions, str(next(iter(buffers.values())).device), transporter.engine)
    table = slot_table(runner.lora_manager)
    transporter.weight_info.update(table)  # the dict the rank's registrations publish (rank_epochs.adopt)
    transporter._register_to_engine_info_bootstrap()  # sglang's own PUT; the key, area and epoch ride along
    logger.info("p2pweights sglang plugin: %d LoRA adapter slot entries published (%d region(s), %d bytes)",
                len(table), len(regions), sum(n for _, n in regions))
    return len(table)


def around_init_lora_manager(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ModelRunner.init_lora_manager``: sglang's manager, then its pool registered and published."""
    result = original(runner, *args, **kwargs)
    if getattr(runner, "is_draft_worker", False) or getattr(runner, "lora_manager", None) is None:
        return result
    try:
        publish(runner)
    except Exception:  # noqa: BLE001 - the server serves either way; an adapter update then finds no entries
        logger.exception("p2pweights sglang plugin: this rank's LoRA adapter slots are not published")
    return result


# -- in each rank's scheduler ------------------------------------------------------------------------
def lora_manager_of(manager: Any) -> Any:
    """The target runner's ``LoRAManager`` (None: started without ``--enable-lora``)."""
    runners = [r for role, r in manager.tp_worker.weight_update_runners() if role == "target"]
    return getattr(runners[0], "lora_manager", None) if runners else None


def place(lora_manager: Any, name: str, *, rank: int) -> int:
    """The slot pinned adapter ``name`` occupies in this rank's pool, placed as a batch asking for it
    would place it when it has none yet. Raises naming the fix: no pool, not loaded, not pinned."""
    if lora_manager is None:
        raise UnknownParameter(f"engine rank {rank} runs no LoRA pool", rank=rank, parameter=name,
                               hint="start the server with --enable-lora (and --max-lora-rank, --lora-target-modules)")
    refs = [r for r in lora_manager.lora_refs.values() if r.lora_name == name]
    if not refs:
        loaded = sorted(r.lora_name for r in lora_manager.lora_refs.values())
        raise UnknownParameter(f"LoRA adapter {name!r} is not loaded on engine rank {rank} (loaded: "
                               f"{', '.join(loaded) or 'none'})", rank=rank, parameter=name,
                               hint=f"load it with sglang's /load_lora_adapter (lora_name={name!r}, pinned=true)")
    ref = refs[0]
    if not ref.pinned:
        raise InvalidRequest(f"LoRA adapter {name!r} is loaded unpinned: sglang may evict it and give its slot to "
                             f"another adapter, so a one-sided write could land in that adapter's slot",
                             rank=rank, parameter=name,
                             hint=f"load it with pinned=True (unload_lora_adapter {name!r}, then /load_lora_adapter "
                                  f"with pinned=true)")
    pool = lora_manager.memory_pool
    if ref.lora_id not in pool.uid_to_buffer_id:
        lora_manager.fetch_new_loras({ref.lora_id})  # what ForwardBatch.init_new does for a batch asking for it
    slot = int(pool.uid_to_buffer_id[ref.lora_id])
    if not 1 <= slot < int(pool.max_loras_per_batch):
        raise LayoutMismatch(f"sglang put LoRA adapter {name!r} in slot {slot}, which is the base model's and not "
                             f"published", rank=rank, parameter=name,
                             hint="unload and load it again (pinned) while the base model holds slot 0")
    return slot


def rank_slot(manager: Any, rank: int, raw: Any) -> dict:
    """This rank's answer to :data:`ACTION` (``raw``: ``{"lora_name": name}`` as JSON); never raises."""
    try:
        name = (json.loads(raw) if isinstance(raw, str) else {}).get("lora_name")
        if not isinstance(name, str):
            raise InvalidRequest(f"the {ACTION} action takes {{'lora_name': str}}, got {raw!r}")
        return {"rank": rank, "slot": place(lora_manager_of(manager), name, rank=rank)}
    except Exception as e:  # noqa: BLE001 - reported to the launcher; this rank must still join the gather
        logger.info("p2pweights: no adapter slot on rank %d: %s", rank, e)
        return {"rank": rank, "error": error_payload(e, type_name=type(e).__name__)["error"]}


def around_check_weights(original: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``SchedulerWeightUpdaterManager.check_weights``: :data:`ACTION` is this plugin's."""
    if getattr(recv_req, "action", None) != ACTION:
        return original(manager, recv_req, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    (raw,) = recv_req.skip_tensor_list or [None]
    return output_of(every_tp_rank(manager, rank_slot(manager, int(get_parallel().tp_rank), raw)), ERROR_KEY)


def slot_digests(lora_manager: Any, names: Iterable[str], *, engine: str, rank: int) -> dict[str, str]:
    """The digest of each named adapter slot entry (``lora.A.qkv_proj.L0@1``) this rank holds."""
    buffers = pool_buffers(lora_manager) if lora_manager is not None else {}
    slots = int(lora_manager.memory_pool.max_loras_per_batch) if lora_manager is not None else 0
    out = {}
    for name in names:
        buffer, _, slot = name.rpartition("@")
        if buffer not in buffers or not slot.isdigit() or not 1 <= int(slot) < slots:
            raise UnknownParameter(f"engine {engine} rank {rank} has no adapter slot {name!r}", engine=engine,
                                   rank=rank, parameter=name)
        out[name] = digest(buffers[buffer][int(slot)])
    return out


class PublishedNames:
    """A rank's model with its parameters named as its weights table names them: sglang's
    ``--enable-lora`` wraps every target layer after the rank published its weights, so the layer's
    parameters become ``...qkv_proj.base_layer.weight``; the table (and every sender) keeps
    ``...qkv_proj.weight``, the same memory."""

    def __init__(self, model: Any):
        self._model = model

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, Any]]:
        return ((base_name(n), q) for n, q in self._model.named_parameters(*args, **kwargs))


def published_names(model: Any, lora_manager: Any) -> Any:
    """``model`` as its table names it (:class:`PublishedNames` where LoRA wrapped its layers)."""
    return PublishedNames(model) if lora_manager is not None else model


# -- in the HTTP process -----------------------------------------------------------------------------
def slot_request(name: str) -> Any:
    """sglang's ``CheckWeightsReqInput`` that has every rank place adapter ``name`` and answer its slot."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    return CheckWeightsReqInput(action=ACTION, skip_tensor_list=[json.dumps({"lora_name": name})])


async def slot(tokenizer: Any, name: str, engine: str) -> int:
    """The slot adapter ``name`` occupies on every rank (the core's ``steps.AdapterSlot``); raises the
    first rank's refusal (not loaded, not pinned, no pool), or when the ranks disagree."""
    if tokenizer is None or not hasattr(tokenizer, "check_weights_communicator"):
        raise EngineError(f"engine {engine}: the ranks cannot be asked for an adapter's slot (no tokenizer manager)",
                          engine=engine)
    tokenizer.auto_create_handle_loop()
    outputs = await tokenizer.check_weights_communicator(slot_request(name))
    slots: dict[int, int] = {}
    for out in outputs:
        try:
            message = json.loads(out.message)
        except (TypeError, ValueError):
            message = None
        if not out.success:
            detail = message.get(ERROR_KEY) if isinstance(message, dict) else None
            if not isinstance(detail, dict):
                raise EngineError(f"engine {engine}: the schedulers did not answer the adapter's slot: {out.message!r} "
                                  f"(is the p2pweights plugin attached in them?)", engine=engine, parameter=name)
            raise EngineError(str(detail.get("message")), engine=engine, rank=detail.get("rank"), parameter=name,
                              hint=detail.get("hint"))
        slots.update({int(a["rank"]): int(a["slot"]) for a in message["ranks"]})
    if len(set(slots.values())) != 1:
        raise EngineError(f"engine {engine}: the ranks put LoRA adapter {name!r} in different slots {slots}",
                          engine=engine, parameter=name)
    return next(iter(slots.values()))


def register(kind: str) -> None:
    """The scheduler's hooks (the launcher's part runs in the session gate: ``sessions.py``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if kind == "scheduler":
        HookRegistry.register(INIT_TARGET, around_init_lora_manager, HookType.AROUND)
        HookRegistry.register(CHECK_TARGET, around_check_weights, HookType.AROUND)
