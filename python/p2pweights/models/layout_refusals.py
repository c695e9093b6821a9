"""Engine layouts a replica cannot reproduce yet, refused with what sglang does and why.

Two families, checked wherever a layout is made (:meth:`EngineLayout.check_supported`: at connect
from ``/server_info``, in ``check-layout``, ``plan`` and the receiver from ``--engine``):

- **parallelism** sglang 0.5.23 runs with resident weights that the replica does not build:
  engine pipeline parallelism, MoE data parallelism, attention context parallelism and decode
  context parallelism (:data:`PARALLELISM_REFUSED`).
- **speculative decoding**: an engine that runs a draft model holds a second set of weights (the
  draft role, replica/roles.py). EAGLE / NEXTN drafts of the target's own MTP layer are built and
  written; every other draft is refused, never treated as target-only (its draft would keep stale
  weights while the target moves on), each with its reason (:func:`check_speculative`).

docs/replica.md ("Layouts refused and why") lists the same reasons. This module imports neither
torch nor sglang.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import UnsupportedLayout

#: (server arg, what sglang 0.5.23 does with it, why the replica cannot reproduce it yet)
PARALLELISM_REFUSED: tuple[tuple[str, str, str], ...] = (
    ("pp_size",
     "engine pipeline parallelism: each PP stage builds only its own layers (the others are "
     "PPMissingLayer; the embedding lives on the first stage, the LM head on the last)",
     "the replica is built per TP rank with every layer, and sglang's engine-info bootstrap server "
     "keys each publication by tp_rank, so the stages' ranks overwrite each other's regions"),
    ("moe_dp_size",
     "MoE data parallelism: expert weights are sharded over tp / (ep x moe_dp) ranks and each "
     "moe_dp group holds a copy (moe_dp_rank = tp_rank // (tp / moe_dp))",
     "the replica derives a rank's MoE TP and EP ranks from tp and ep only, so it would give a "
     "moe_dp rank another rank's expert shard"),
    ("attn_cp_size",
     "attention context parallelism: attention TP becomes tp / (attn_dp x attn_cp) and the ranks "
     "of one CP group hold the same attention shard",
     "the replica derives attention TP from tp and attention DP only, so its attention shards "
     "would be the wrong size"),
    ("dcp_size",
     "decode context parallelism: the KV cache is split over dcp ranks and MLA attention builds "
     "an extra attention module over the heads gathered from the DCP group",
     "the replica's parallel stand-ins build no DCP group, so its construction of such a rank is "
     "unverified against sglang's loader"),
)

#: server args that describe an engine's draft model (sglang 0.5.23's ``spec`` namespace)
SPECULATIVE_KEYS = frozenset({
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_token_map",
    "speculative_moe_runner_backend", "speculative_moe_a2a_backend", "enable_multi_layer_eagle",
})

#: speculative algorithms with no draft weights: the engine holds only the target's
WEIGHTLESS_DRAFTS = frozenset({"NGRAM"})

DRAFT_ROLES_NOT_SUPPORTED = "draft roles are built for EAGLE and NEXTN (the target's own MTP layer) only"
#: speculative algorithms whose draft role the replica builds and the sender writes (replica/roles.py:
#: which architectures have one, and why others are refused); every other draft is refused.
DRAFT_ROLE_ALGORITHMS: frozenset[str] = frozenset({"EAGLE", "NEXTN"})

_NONE = (None, "", "none", "None", "null")


def _int(value: Any, default: int = 1) -> int:
    return default if value in _NONE else int(value)


def check_parallelism(args: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedLayout` (parameter: the server arg) for a refused parallel layout."""
    for name, what, why in PARALLELISM_REFUSED:
        value = _int(args.get(name, 1))
        if value != 1:
            raise UnsupportedLayout(
                f"engine flag {name}={value} is not supported yet: sglang runs it as {what}; {why}",
                parameter=name, hint=f"serve rollouts with {name}=1 (scale with tp, ep, dp_attention or more engines)")


def draft_algorithm(args: Mapping[str, Any]) -> str | None:
    """The engine's speculative algorithm when it runs a draft model with weights, else None."""
    algorithm = args.get("speculative_algorithm")
    if algorithm in _NONE:
        return None
    algorithm = str(algorithm).upper()
    return None if algorithm in WEIGHTLESS_DRAFTS else algorithm


def check_speculative(args: Mapping[str, Any]) -> None:
    """Refuse an engine that runs a draft: first the drafts that stay refused (each with its own
    reason), then every draft whose algorithm is not in :data:`DRAFT_ROLE_ALGORITHMS`. Which
    architectures have a draft role is replica/roles.py's (it needs the model config).
    ``args``: the engine's server args (``model_path`` when known, to tell a separate draft
    checkpoint from the target's own)."""
    algorithm = draft_algorithm(args)
    if algorithm is None:
        return
    hint = "serve rollouts without --speculative-algorithm, or update the draft by reloading the engine"
    token_map = args.get("speculative_token_map")
    if token_map not in _NONE:
        raise UnsupportedLayout(
            f"engine flag speculative_token_map={token_map!r} is not supported: the draft's LM head is then a "
            f"derived copy of the target's rows for a reduced vocabulary, which no HF tensor writes",
            parameter="speculative_token_map", hint=hint)
    if args.get("enable_multi_layer_eagle") not in (None, False, 0, "false", "False"):
        raise UnsupportedLayout(
            "engine flag enable_multi_layer_eagle=True is not supported: multi-layer EAGLE runs several "
            "draft layers as separate models, the replica maps one MTP layer (num_nextn_predict_layers=1)",
            parameter="enable_multi_layer_eagle", hint=hint)
    draft_path = args.get("speculative_draft_model_path")
    model_path = args.get("model_path")
    if draft_path not in _NONE and draft_path != model_path:
        raise UnsupportedLayout(
            f"engine flag speculative_draft_model_path={draft_path!r} is not supported: a separate draft "
            f"checkpoint (the target is {model_path or 'another checkpoint'!s}) is not fed by the trainer's tensors; "
            f"only the target's own MTP layer can be a draft role", parameter="speculative_draft_model_path",
            hint=hint)
    for draft_key, target_key, default in (("speculative_moe_runner_backend", "moe_runner_backend", "auto"),
                                           ("speculative_moe_a2a_backend", "moe_a2a_backend", "none")):
        draft, target = args.get(draft_key), args.get(target_key) or default  # unset draft: the target's
        if draft not in (None, "") and str(draft) != str(target):
            raise UnsupportedLayout(
                f"engine flag {draft_key}={draft!r} is not supported: the draft's MoE layout would differ from "
                f"the target's ({target_key}={target!r}), and a draft role shares the target's layout",
                parameter=draft_key, hint=f"drop --{draft_key.replace('_', '-')} (it defaults to the target's)")
    if algorithm in DRAFT_ROLE_ALGORITHMS:
        return
    raise UnsupportedLayout(
        f"engine flag speculative_algorithm={args.get('speculative_algorithm')!r}: the engine runs a {algorithm} "
        f"draft model, and {DRAFT_ROLES_NOT_SUPPORTED}: the sender would update the target only and leave the "
        f"draft's weights stale", parameter="speculative_algorithm", hint=hint)  # draft roles: docs/replica.md
