"""check-layout and the receiver's equality check for every role of an engine rank.

The draft role's reference is sglang's draft class (:mod:`.draft_model`) fully materialized on
the CPU and loaded by its own ``load_weights`` from the same random checkpoint as the target's
(``random_checkpoint(checkpoint_tensors(config), seed)``: the draft's loader picks the MTP layer
out of it). Its embedding and LM head are the target's (:func:`~.draft_model.tie_to_target`), so
check-layout compares only the draft's own parameters; the receiver's check compares the whole
draft (its tied tensors are the target's, compared there too).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..models import load_config
from ..models.checkpoint import checkpoint_tensors, random_checkpoint
from ..models.engine_layout import EngineLayout
from ..models.quant import quant_scheme
from . import check, sglang_env
from .check import RankCheck, compare_with_reference
from .draft_model import build_role_model, target_embed_and_head, tie_to_target
from .model_replica import ModelReplicas
from .roles import roles_of

if TYPE_CHECKING:
    import torch


def _random_inputs(config: Any, seed: int, changed: "tuple[float, int] | None" = None) -> Any:
    """The seeded HF tensors the target's reference loads (an FP8 config's engine checkpoint too);
    ``changed``: that version of the seed's changed family."""
    cfg = load_config(config)
    return random_checkpoint(checkpoint_tensors(cfg), int(seed), quant_scheme(cfg), changed=changed)


def reference_draft(config: Any, engine: EngineLayout, rank: int, *, seed: int = 0, post_process: bool = False,
                    target: "torch.nn.Module | None" = None, model: "torch.nn.Module | None" = None,
                    changed: "tuple[float, int] | None" = None) -> "torch.nn.Module":
    """sglang's draft model of the rank, materialized on the CPU, loaded by its own loader from the
    seeded random checkpoint. ``target``: the target reference to tie its embedding and head to (as
    sglang's worker does); without it they stay untied (not the draft's parameters: check-layout).
    ``post_process``: also what an update session runs around a loader. ``model``: reload it.
    ``changed``: that version of the seed's changed family (``models.checkpoint``)."""
    import torch

    if model is None:
        model = sglang_env.materialize(build_role_model(config, engine, rank, "draft"), "cpu")
        if target is not None:
            tie_to_target(model, *target_embed_and_head(target))
    from sglang.srt.model_loader.loader import DefaultModelLoader

    cpu = torch.device("cpu")
    with sglang_env.activate(model):
        if post_process:
            DefaultModelLoader.restore_weights_before_loading(model, cpu)
        model.load_weights(_random_inputs(config, seed, changed))  # runs the draft's post_load_weights
        if post_process:
            DefaultModelLoader.postprocess_weights(model, cpu)
    return model


def check_rank_roles(config: Any, engine: EngineLayout, rank: int, *, seed: int = 0,
                     replicas: "ModelReplicas | None" = None) -> dict[str, "RankCheck"]:
    """check-layout of one engine rank, per role: the replica path against sglang's own loader of
    that role (``{"target": RankCheck, "draft": RankCheck}``; only the target without a draft)."""
    replicas = replicas or ModelReplicas(cache_dir="")
    out = {"target": check.check_rank(config, engine, rank, seed=seed, replicas=replicas)}  # patchable
    for role in roles_of(config, engine)[1:]:
        t0 = time.perf_counter()
        replica = replicas.get(config, engine, rank, hf_specs=checkpoint_tensors(config), role=role)
        result = compare_with_reference(replica, reference_draft(config, engine, rank, seed=seed), seed=seed,
                                        config=config)
        result.seconds = time.perf_counter() - t0
        out[role] = result
    return out


def roles_json(checks: "list[dict[str, RankCheck]]") -> dict[str, Any]:
    """check-layout's ``"roles"``: per role, whether every rank checked is equal, the parameters
    checked and each rank's result (``checks``: :func:`check_rank_roles` of each rank)."""
    out: dict[str, Any] = {}
    for per_rank in checks:
        for role, result in per_rank.items():
            entry = out.setdefault(role, {"equal": True, "params_checked": 0, "ranks": []})
            entry["equal"] = entry["equal"] and result.equal
            entry["params_checked"] += result.params_checked
            entry["ranks"].append(result.to_json())
    return out


def role_mismatches(role: str, result: "RankCheck") -> list[str]:
    """A role's mismatches as check-layout lists them: ``rank R: draft: ...`` (the target's unprefixed)."""
    prefix = "" if role == "target" else f"{role}: "
    return [f"rank {result.rank}: {prefix}{m}" for m in result.mismatches]
