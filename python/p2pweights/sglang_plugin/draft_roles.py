"""A drafting sglang server (``--speculative-algorithm NEXTN``/``EAGLE``) publishes both roles of a
rank in ONE weights table, as p2pweights' receivers do (docs/protocol.md, "Roles in the weights
table"; docs/sglang.md, "Drafting servers").

sglang 0.5.23 runs two model runners per TP rank in one scheduler process, the target's and the
draft's, each with its own ``RemoteInstanceWeightTransporter`` and Mooncake engine, and each PUTs
``{tp_rank, transfer_engine_info}`` to the engine-info bootstrap server keyed by ``tp_rank`` alone:
the draft's table replaced the target's, and a sender refused the engine. With the plugin:

- **Which runner is which.** An AROUND hook on ``ModelRunner.init_remote_instance_weight_transporter``
  keeps every runner of this process (:data:`RUNNERS`); a runner's role is sglang's own
  ``is_draft_worker``. The target's runner loads (and publishes) first.
- **The draft's memory goes to the target's engine.** The AROUND hook on ``register_memory_region``
  (outermost: after the epochs' recorder, so the draft's regions are recorded too) hands the draft
  model's registration the target transporter's engine instead of the draft's own, and only the
  draft's own parameters: its embedding and LM head become the target's tensors at sglang's
  ``init_lm_head`` (``get_embed_and_head``), so they are published once, as the target's.
- **One table.** The AROUND hook on ``_register_to_engine_info_bootstrap`` (outermost) turns the draft
  transporter's PUT into the target's: the target's table gains ``"draft." + name`` for each draft
  parameter, the rank's delta area covers the draft's regions too, epoch 1 is adopted again over
  both roles' regions, and the target transporter publishes (its key, area and epoch ride along).
  The draft's own engine holds nothing and is never published.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from . import rank_deltas, rank_epochs

logger = logging.getLogger(__name__)

RUNNER_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_remote_instance_weight_transporter"
REGISTER_TARGET = rank_epochs.REGISTER_TARGET
RANK_TARGET = rank_deltas.RANK_TARGET
DRAFT_PREFIX = "draft."  # digest.DRAFT_PREFIX (not imported: digest imports starlette)

# This scheduler's model runners (sglang's ModelRunner), in the order they were built.
RUNNERS: list[Any] = []
# id() of each draft transporter whose table went into the target's
MERGED: set[int] = set()


def around_runner_transporter(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ModelRunner.init_remote_instance_weight_transporter``: keep the runner."""
    result = original(runner, *args, **kwargs)
    RUNNERS.append(runner)
    return result


def _target_runner() -> Any:
    return next((r for r in RUNNERS if not getattr(r, "is_draft_worker", False)), None)


def _draft_runner_of(model: Any = None, transporter: Any = None) -> Any:
    for runner in RUNNERS:
        if not getattr(runner, "is_draft_worker", False):
            continue
        if (model is not None and getattr(runner, "model", None) is model) or (
                transporter is not None and getattr(runner, "remote_instance_weight_transporter", None) is transporter):
            return runner
    return None


def _target_transporter() -> Any:
    runner = _target_runner()
    transporter = getattr(runner, "remote_instance_weight_transporter", None) if runner is not None else None
    if transporter is None or transporter.engine is None or not isinstance(transporter.weight_info, dict):
        return None
    return transporter


def shared_names(draft: Any) -> set[str]:
    """The draft parameters that sglang's ``init_lm_head`` replaces by the target's embedding and LM
    head (``set_embed_and_head(target.get_embed_and_head())``): the ones ``get_embed_and_head``
    returns on the draft itself."""
    get = getattr(draft, "get_embed_and_head", None)
    if get is None:
        return set()
    try:
        shared = {id(t) for t in get() if t is not None}
    except Exception:  # noqa: BLE001 - a draft without them shares nothing
        return set()
    return {n for n, p in draft.named_parameters() if id(p) in shared}


class OwnParameters:
    """A draft model as a registration sees it: its parameters but the shared ones."""

    def __init__(self, model: Any, skip: set[str]):
        self._model, self._skip = model, skip

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return ((n, p) for n, p in self._model.named_parameters(*args, **kwargs) if n not in self._skip)

    def parameters(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return (p for _, p in self.named_parameters())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def around_register_memory_region(original: Callable[..., Any], model: Any, transfer_engine: Any) -> Any:
    """AROUND ``register_memory_region``: a draft model's own parameters go to the target's engine."""
    target = _target_transporter()
    if target is None or _draft_runner_of(model=model) is None:
        return original(model, transfer_engine)
    skip = shared_names(model)
    logger.info("p2pweights sglang plugin: the draft's weights join the target's Mooncake engine %s "
                "(%d shared with the target left out)", target.session_id, len(skip))
    return original(OwnParameters(model, skip), target.engine)


def around_rank_registration(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_register_to_engine_info_bootstrap``: a draft transporter's PUT becomes the target's,
    of both roles' table; every other PUT is sglang's."""
    transporter = args[0] if args else None
    if transporter is None or _draft_runner_of(transporter=transporter) is None:
        return original(*args, **kwargs)
    target = _target_transporter()
    if target is None:
        logger.error("p2pweights sglang plugin: a draft runner published before the target's; its table "
                     "replaces the target's and a sender will refuse this engine")
        return original(*args, **kwargs)
    if MERGED and id(transporter) not in MERGED:
        logger.error("p2pweights sglang plugin: a second draft runner on this rank is not published "
                     "(one draft role per rank)")
        return None
    merge(target, transporter.weight_info or {}, getattr(transporter, "model", None))
    MERGED.add(id(transporter))
    return target._register_to_engine_info_bootstrap()


def merge(target: Any, draft_table: dict, draft_model: Any = None) -> None:
    """The target transporter's table gains the draft's as ``draft.<name>``; the rank's delta area and
    epoch 1's registrations cover the draft's regions from now on (``draft_model``: the draft's
    parameters, which a GPU area's records are applied through)."""
    table = {n: v for n, v in target.weight_info.items() if not n.startswith(DRAFT_PREFIX)}
    table.update({DRAFT_PREFIX + n: v for n, v in draft_table.items()})
    target.weight_info = table
    named = None
    if draft_model is not None and getattr(target, "model", None) is not None:
        both = [*target.model.named_parameters(), *((DRAFT_PREFIX + n, q) for n, q in draft_model.named_parameters())]
        named = [(n, q) for n, q in both if n in table]
    rank_deltas.cover(table, named)
    if rank_epochs.REGIONS is not None and rank_epochs.REGIONS.epoch == 1 and rank_epochs.TRANSPORTER is target:
        rank_epochs.REGIONS = None  # adopted again, over both roles' regions, at the PUT that follows
    elif rank_epochs.REGIONS is not None:
        raise RuntimeError("a draft's weights arrived after this rank's registrations were revoked")


def register() -> None:
    """The scheduler's hooks; after every other plugin hook on the same targets (outermost)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RUNNER_TARGET, around_runner_transporter, HookType.AROUND)
    HookRegistry.register(REGISTER_TARGET, around_register_memory_region, HookType.AROUND)
    HookRegistry.register(RANK_TARGET, around_rank_registration, HookType.AROUND)
