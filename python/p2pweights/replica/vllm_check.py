"""Prove the vLLM replica path produces the bytes vLLM's kernels read: ``check-layout --engine-kind vllm``.

Per engine rank, random HF tensors (seeded per name; for an FP8 config the BF16 tensors quantized
with the sender's formula, as for sglang) go (a) through the replica path — vLLM's model on meta,
the loader probe, parameter groups, one slot, vLLM's loaders — and (b) through vLLM's own
``load_weights`` into a fully materialized CPU model of the rank under the Hopper stand-in,
followed by vLLM's ``process_weights_after_loading``: what an engine rank holds once an update
finished. Every parameter the loaders write is compared byte for byte with (b). Tensors
post-processing adds (DeepSeek MLA's ``W_UV`` / ``W_UK_T``) are listed per rank as
``post_processed``: no sender writes them, the engine recomputes them.
"""
from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ..errors import P2PWeightsError
from ..models import load_config, resolve_model
from ..models.checkpoint import checkpoint_tensors, random_checkpoint
from ..models.quant import quant_scheme
from . import vllm_env
from .check import LayoutCheck, RankCheck, compare_with_reference, merged_dtypes
from .role_check import role_mismatches, roles_json
from .vllm_draft import share_with_target
from .vllm_layout import VllmLayout, check_refusal
from .vllm_replica import VllmReplicas

if TYPE_CHECKING:
    import torch


def reference_model(config: Any, layout: VllmLayout, rank: int, *, seed: int = 0,
                    post_process: bool = True, role: str = "target",
                    changed: tuple[float, int] | None = None) -> "torch.nn.Module":
    """vLLM's model of the rank, materialized on the CPU, loaded by vLLM's ``load_weights`` from
    ``random_checkpoint(checkpoint_tensors(config), seed, quant_scheme(config), changed=changed)`` and (by default)
    post-processed as the engine's update finish does. ``role="draft"``: the MTP draft, which then
    holds the target's embedding and LM head in place of its own, as the proposer leaves it."""
    # the draft as its loader needs it: its own embedding and heads, shared only after post-processing
    model = vllm_env.materialize(vllm_env.build_model(config, layout, rank, device="meta", role=role), "cpu")
    cfg = load_config(config)
    with vllm_env.activate(model):
        model.load_weights(random_checkpoint(checkpoint_tensors(cfg), int(seed), quant_scheme(cfg), changed=changed))
    if post_process:
        before = {name for name, _ in model.named_parameters()}
        if role == "target":  # the target's call as it always was (tests wrap post_process by it)
            vllm_env.post_process(model)
        else:
            vllm_env.post_process(model, role=role)
        model._p2pw_added_by_post_processing = sorted(  # type: ignore[attr-defined]
            name for name, _ in model.named_parameters() if name not in before)
    if role != "target":
        share_with_target(model)  # after post-processing, as the proposer's load_model does
    return model


class _LoadedParameters:
    """The reference's parameters the loaders wrote (post-processed bytes), without the ones
    post-processing added: what ``compare_with_reference`` compares slot regions against."""

    def __init__(self, model: "torch.nn.Module"):
        self.model = model
        self.added = set(getattr(model, "_p2pw_added_by_post_processing", ()))

    def named_parameters(self) -> Iterator[tuple[str, "torch.nn.Parameter"]]:
        return ((n, p) for n, p in self.model.named_parameters() if n not in self.added)


def check_rank(config: Any, layout: VllmLayout, rank: int, *, seed: int = 0,
               replicas: VllmReplicas | None = None, role: str = "target") -> RankCheck:
    """Compare the replica path with vLLM's load + post-processing for one engine rank (one role)."""
    t0 = time.perf_counter()
    replica = (replicas or VllmReplicas()).get(config, layout, rank, hf_specs=checkpoint_tensors(config), role=role)
    reference = reference_model(config, layout, rank, seed=seed, role=role)
    loaded = _LoadedParameters(reference)
    result = compare_with_reference(replica, loaded, seed=seed, config=config)  # type: ignore[arg-type]
    result.post_processed = sorted(set(result.post_processed) | loaded.added)
    result.seconds = time.perf_counter() - t0
    return result


def check_rank_roles(config: Any, layout: VllmLayout, rank: int, *, seed: int = 0,
                     replicas: VllmReplicas | None = None) -> dict[str, RankCheck]:
    """:func:`check_rank` of every role the engine rank holds: ``{"target": ..., "draft": ...}``."""
    replicas = replicas or VllmReplicas()
    return {role: check_rank(config, layout, rank, seed=seed, replicas=replicas, role=role) for role in layout.roles}


def check_byte_exact(config: Any, layout: VllmLayout, ranks: Iterable[int] | None = None, *, seed: int = 0,
                     replicas: VllmReplicas | None = None) -> LayoutCheck:
    """:func:`check_rank` for every rank of the engine (or the given ones)."""
    replicas = replicas or VllmReplicas()
    chosen = list(range(layout.world_size)) if ranks is None else list(ranks)
    return LayoutCheck(layout, [check_rank(config, layout, r, seed=seed, replicas=replicas)  # type: ignore[arg-type]
                                for r in chosen])


def run_check_layout(model: str, spec: str, *, rank: int | None = None, seed: int = 0, as_json: bool = False) -> int:
    """``p2pweights check-layout --engine-kind vllm``: exit 0 only when every rank is byte-exact;
    1 on a mismatch or a replica that cannot be built; 2 on an unknown model, a quantization
    p2pweights cannot write, a refused layout (the reason names the engine flag to change), or no vLLM."""
    def fail(message: str, code: int) -> int:
        print(f"p2pweights check-layout: error: {message}", file=sys.stderr)
        return code

    try:
        path = resolve_model(model)
        quant_scheme(load_config(path))
    except P2PWeightsError as e:
        return fail(f"--model: {e}", 2)
    try:
        layout = VllmLayout.parse(spec, command="check-layout")
        check_refusal(load_config(path), layout)
        vllm_env.prepare()
    except P2PWeightsError as e:
        return fail(str(e), 2)
    if rank is not None and not 0 <= rank < layout.world_size:
        return fail(f"--rank {rank} is not a rank of {layout.describe()} ({layout.world_size} ranks)", 2)
    replicas, results, checks = VllmReplicas(), [], []  # every role's RankCheck; per rank {role: RankCheck}
    roles = layout.roles
    for r in range(layout.world_size) if rank is None else [rank]:
        try:
            per_role = check_rank_roles(path, layout, r, seed=seed, replicas=replicas)
        except P2PWeightsError as e:
            if as_json:
                print(json.dumps({"equal": False, "params_checked": sum(x.params_checked for x in results),
                                  "ranks": [c["target"].to_json() for c in checks], "mismatches": [f"rank {r}: {e}"],
                                  "error": str(e), "engine": layout.describe()}))
            else:
                print(f"rank {r}: cannot build a replica: {e}", file=sys.stderr)
            return 1
        checks.append(per_role)
        for role, result in per_role.items():
            results.append(result)
            if not as_json:
                _print_rank(result, r, role if len(roles) > 1 else "")
    equal = all(x.equal for x in results)  # every role of every rank
    if as_json:
        check = LayoutCheck(layout, [c["target"] for c in checks])  # type: ignore[arg-type]
        print(json.dumps({**check.to_json(), "equal": equal, "params_checked": sum(x.params_checked for x in results),
                          "dtypes": merged_dtypes(results),
                          "mismatches": [m for c in checks for role, x in c.items() for m in role_mismatches(role, x)],
                          "roles": roles_json(checks), "engine_kind": "vllm"}))
    else:
        print(f"{layout.describe()}: {'OK, byte-exact' if equal else 'FAILED'} over {len(checks)} rank(s)"
              + (f" x {len(roles)} roles ({', '.join(roles)})" if len(roles) > 1 else "")
              + f" (vLLM {vllm_env.vllm_version()}, loaded and post-processed on the Hopper stand-in)")
    return 0 if equal else 1


def _print_rank(result: RankCheck, rank: int, role: str) -> None:
    dtypes = ", ".join(f"{n} {d}" for d, n in sorted(result.dtypes.items()))
    verdict = "equal" if result.equal else f"{len(result.mismatches)} MISMATCHES"
    print(f"rank {rank}{' ' + role if role else ''}: {result.params_checked} params ({dtypes}), "
          f"{result.bytes_checked / 1e6:.3f} MB, {result.groups} groups (largest {result.largest_group_bytes / 1e6:.3f} MB), "
          f"{len(result.post_processed)} post-processed: {verdict} [{result.seconds:.1f} s]")
    for m in result.mismatches:
        print(f"  {m}")
