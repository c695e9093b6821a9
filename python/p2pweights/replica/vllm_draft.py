"""The MTP draft of a vLLM 0.33 engine rank, built the way vLLM's speculative proposer builds it.

With ``--speculative-config '{"method": "mtp", ...}'`` a DeepSeek-V3 engine runs a second model on
every rank: the MTP layer of the target's own checkpoint. vLLM's proposer
(``v1/spec_decode/llm_base_proposer.py``) builds it with

- ``get_model(vllm_config, model_config=speculative_config.draft_model_config)``: the target's
  VllmConfig (same TP/DP/EP layout, same quantization; with no speculative ``moe_backend`` or
  ``attention_backend`` given, ``_create_draft_vllm_config`` changes nothing that decides a byte)
  and a ModelConfig whose architecture ``hf_config_override`` renamed to ``DeepSeekMTPModel``;
- ``DeepSeekMTP.load_weights`` over the same checkpoint: it reads ``model.layers.{N}.*``
  (N = ``num_hidden_layers``) and the top-level ``model.embed_tokens.weight``;
- ``process_weights_after_loading`` with the draft's ModelConfig;
- then, for MTP always, ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``: the draft's
  ``model.embed_tokens`` becomes the target's module, and its ``lm_head`` and every MTP layer's
  ``shared_head.head`` the target's ``lm_head``.

So those parameters ARE the target's: not the draft's to publish or write, and the HF tensors
only they read (``model.layers.N.embed_tokens.weight``, ``model.layers.N.shared_head.head.weight``)
reach nothing in the served engine. :func:`share_with_target` does vLLM's replacement here (with
parameter-less stand-ins for the target's modules) and names what it dropped; :func:`without_shared`
takes those parameters out of a loader mapping (their HF inputs become ignored).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import vllm_env
from .probe import LoaderMapping
from .vllm_layout import VllmLayout

if TYPE_CHECKING:
    import torch

ROLES = ("target", "draft")
_SHARED_ATTR = "_p2pw_shared_with_target"


def build_draft_model(config: Any, layout: VllmLayout, rank: int, device: str = "meta") -> "torch.nn.Module":
    """vLLM's draft model of engine rank ``rank`` as ``get_model`` builds it, before the proposer
    shares the target's embedding and LM head (its own copies still there, as its loader needs)."""
    return vllm_env.build_model(config, layout, rank, device=device, role="draft")


def _target_module(own: "torch.nn.Module") -> "torch.nn.Module":
    """What stands for the target's module the proposer puts in place of ``own``: a module with a
    plain ``weight`` tensor of the same shape (the target's parameter, not the draft's)."""
    import torch

    stand_in = torch.nn.Module()
    stand_in.weight = own.weight.detach()  # a plain tensor: not a parameter of the draft
    return stand_in


def share_with_target(draft: "torch.nn.Module") -> list[str]:
    """The proposer's ``_maybe_share_embeddings`` and ``_maybe_share_lm_head`` for an MTP draft
    (pipeline parallelism is 1): the draft's embedding, its ``lm_head`` and every MTP layer's
    ``shared_head.head`` replaced by (stand-ins for) the target's modules. Returns the draft
    parameter names that are now the target's (they drop out of ``named_parameters``)."""
    before = [n for n, _ in draft.named_parameters()]
    inner = draft.model
    embed = _target_module(inner.embed_tokens)
    del inner.embed_tokens
    inner.embed_tokens = embed
    layers = list(inner.layers.values())
    head = _target_module(layers[0].shared_head.head)
    if hasattr(draft, "lm_head"):
        del draft.lm_head
    draft.lm_head = head
    for layer in layers:
        del layer.shared_head.head
        layer.shared_head.head = head
    after = {n for n, _ in draft.named_parameters()}
    shared = [n for n in before if n not in after]
    setattr(draft, _SHARED_ATTR, shared)
    return shared


def shared_with_target(model: "torch.nn.Module") -> list[str]:
    """The draft parameters :func:`share_with_target` replaced by the target's."""
    return list(getattr(model, _SHARED_ATTR, ()))


def without_shared(mapping: LoaderMapping, shared: list[str]) -> LoaderMapping:
    """The probe's mapping of the whole draft, less the parameters that are the target's: HF
    tensors that reached only those are ignored by the draft (a sender may push them; nothing of
    the draft is written)."""
    drop = set(shared)
    sources = {p: s for p, s in mapping.sources.items() if p not in drop}
    reached = {hf for s in sources.values() for hf in s}
    return LoaderMapping(
        sources=sources,
        param_specs={n: s for n, s in mapping.param_specs.items() if n not in drop},
        hf_specs=dict(mapping.hf_specs),
        ignored=[n for n in mapping.hf_specs if n not in reached],
        partial=None if mapping.partial is None else [p for p in mapping.partial if p not in drop],
        derived=[p for p in mapping.derived if p not in drop],
    )


def build_role_model(config: Any, layout: VllmLayout, rank: int, role: str = "target",
                     device: str = "meta") -> "torch.nn.Module":
    """A role's model as the served engine holds it: the target's (``vllm_env.build_model``), or
    the draft's with the target's embedding and LM head in place of its own
    (:func:`share_with_target`; their names in :func:`shared_with_target`)."""
    if role == "target":
        return vllm_env.build_model(config, layout, rank, device=device)
    if role != "draft":
        raise ValueError(f"unknown replica role {role!r}; roles are {', '.join(ROLES)}")
    model = build_draft_model(config, layout, rank, device=device)
    share_with_target(model)
    return model
