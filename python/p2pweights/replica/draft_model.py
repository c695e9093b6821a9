"""The speculative draft model of one engine rank, built the way sglang 0.5.23's EAGLE worker builds it.

With ``--speculative-algorithm NEXTN`` (sglang resolves it to ``EAGLE``) an engine serving one of
the four families below runs a second model on every rank: the MTP / NextN layer of the target's
own checkpoint. sglang builds it (``EAGLEWorkerV2.__init__``) with

- ``ModelConfig.from_server_args(server_args, model_path=<draft path>, is_draft_model=True)``,
  whose ``_config_draft_model`` renames the architecture (:data:`DRAFT_ARCHITECTURES`);
- the target's TP/EP layout (``DraftTPExecution.TARGET_LAYOUT``) and a single-member PP group;
- the speculative MoE runner and a2a backends (``speculative_moe_backend_context``, ...) around
  construction AND loading, and ``draft_model_build_scope`` around construction;
- the target's quantization unless ``--speculative-draft-model-quantization`` says otherwise.

Its loader (``load_weights(..., is_nextn=True)`` / ``is_mtp=True``) reads only the MTP layer
(``model.layers.{num_hidden_layers}.*``; Qwen3-MoE: ``mtp.*``) and skips ``embed_tokens`` and
``shared_head.head``; then ``init_lm_head`` calls ``set_embed_and_head(target embed, target head)``:
the draft's embedding and LM head ARE the target's tensors. :func:`tie_to_target` does that here,
and :func:`shared_parameters` names the draft parameters it replaces: they are not the draft's to
publish or write (the target's regions hold them).
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import UnsupportedLayout
from ..models import load_config
from ..models.engine_layout import EngineLayout
from ..models.layout_refusals import DRAFT_ROLE_ALGORITHMS
from . import sglang_env

if TYPE_CHECKING:
    import torch

#: target architecture -> the draft class sglang 0.5.23 builds for a same-checkpoint NEXTN/EAGLE draft
DRAFT_ARCHITECTURES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "DeepseekV3ForCausalLMNextN",
    "Glm4MoeForCausalLM": "Glm4MoeForCausalLMNextN",
    "Glm4MoeLiteForCausalLM": "Glm4MoeLiteForCausalLMNextN",
    "Qwen3MoeForCausalLM": "Qwen3MoeForCausalLMMTP",
}

def mtp_layers(config: Mapping[str, Any]) -> int:
    """MTP / NextN layers the checkpoint holds (DeepSeek/GLM ``num_nextn_predict_layers``,
    Qwen3-Next style ``mtp_num_hidden_layers``)."""
    return int(config.get("num_nextn_predict_layers") or config.get("mtp_num_hidden_layers") or 0)


def draft_architecture(config: Any, engine: EngineLayout) -> str:
    """The draft class sglang builds for this model and engine, or :class:`UnsupportedLayout` saying
    why the replica cannot build it."""
    cfg = load_config(config)
    algorithm = str(engine.get("speculative_algorithm") or "").upper()
    where = f"engine {engine.describe()}"
    if algorithm not in DRAFT_ROLE_ALGORITHMS:  # NEXTN is EAGLE's alias
        raise UnsupportedLayout(
            f"{where}: speculative_algorithm={algorithm or None!r} has no draft role the replica can build; "
            f"supported: NEXTN / EAGLE with the target's own MTP layer", parameter="speculative_algorithm")
    arch = (cfg.get("architectures") or ["?"])[0]
    draft = DRAFT_ARCHITECTURES.get(arch)
    if draft is None:
        raise UnsupportedLayout(
            f"{where}: a {algorithm} draft of {arch} is not supported: the replica builds same-checkpoint MTP "
            f"drafts of {', '.join(DRAFT_ARCHITECTURES)} only", parameter="speculative_algorithm",
            hint="serve without speculative decoding, or a model of a supported family")
    layers = mtp_layers(cfg)
    if layers != 1:
        raise UnsupportedLayout(
            f"{where}: the {arch} checkpoint has {layers} MTP layer(s); sglang's {draft} loads exactly one "
            f"(num_nextn_predict_layers must be 1)", parameter="num_nextn_predict_layers")
    return draft


#: target architectures whose same-checkpoint draft sglang does not find by itself (the engine was
#: started with ``--speculative-draft-model-path`` = its model path)
_EXPLICIT_DRAFT_PATH = ("Qwen3MoeForCausalLM",)


def draft_server_args(config: Any, engine: EngineLayout) -> Any:
    """sglang ``ServerArgs`` of the engine; the draft path is the replica's own config (the
    same-checkpoint draft, the only kind a replica builds), given where sglang needs it given."""
    args = sglang_env.make_server_args(config, engine)
    if (load_config(config).get("architectures") or ["?"])[0] in _EXPLICIT_DRAFT_PATH:
        args.speculative_draft_model_path = args.model_path
    return args


def build_draft_model(config: Any, engine: EngineLayout, rank: int, device: str = "meta") -> "torch.nn.Module":
    """The draft model of engine rank ``rank``, on ``device`` (default meta), not yet tied to the
    target (see :func:`tie_to_target`). It carries a runtime context of its own whose MoE flags are
    the speculative ones, so its loaders (run inside ``sglang_env.activate``) see what sglang's
    draft worker sees."""
    import torch

    expected = draft_architecture(config, engine)
    sglang_env.prepare()
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import patch_pipeline_parallel_group
    from sglang.srt.layers.moe.utils import (
        draft_model_build_scope,
        get_speculative_moe_a2a_backend,
        get_speculative_moe_runner_backend,
    )
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    server_args = draft_server_args(config, engine)
    with sglang_env._lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            context = sglang_env.rank_context(server_args, rank)
            with rc.use_context(context):
                model_config = ModelConfig.from_server_args(server_args, model_path=server_args.model_path,
                                                            is_draft_model=True)
                arch = (model_config.hf_config.architectures or ["?"])[0]
                if arch != expected:
                    raise UnsupportedLayout(f"sglang builds {arch} as the draft of this model, the replica expects "
                                            f"{expected}; a different sglang build?")
                sglang_env._register_architecture([arch])
                # what speculative_moe_backend_context / speculative_moe_a2a_backend_context set around the
                # draft worker's whole life (build, load, forward): kept in the draft's own context
                moe = rc.get_flags().moe
                moe.runner_backend = get_speculative_moe_runner_backend()
                moe.a2a_backend = get_speculative_moe_a2a_backend()
                moe.disable_fp4_allgather = True
                moe.speculative_context = True
                load_config = LoadConfig()
                quant_config = _get_quantization_config(model_config, load_config)
                target = torch.device("meta") if device == "meta" else torch.device(device)
                # draft_pp_context: a one-member PP group; pp_size > 1 is refused, so the rank's own is that
                with draft_model_build_scope(), patch_pipeline_parallel_group(rc.get_parallel().pp_group), \
                        set_default_torch_dtype(model_config.dtype), target:
                    model = _initialize_model(model_config, load_config, quant_config)
        except UnsupportedLayout:
            raise
        except Exception as e:  # sglang refuses the flags, or cannot build them on this host
            raise UnsupportedLayout(
                f"sglang cannot build the {expected} draft of engine layout {engine.describe()} rank {rank} here: "
                f"{type(e).__name__}: {e}", parameter="speculative_algorithm") from e
    setattr(model, sglang_env._CONTEXT_ATTR, context)
    setattr(model, sglang_env._SERVER_ARGS_ATTR, server_args)
    return model.eval()


def tie_to_target(draft: "torch.nn.Module", embed: Any, head: Any) -> None:
    """sglang's ``init_lm_head``: ``draft.set_embed_and_head(target embed, target head)``. The models'
    own method (it also empties the CUDA cache, a no-op without CUDA here)."""
    import torch

    empty_cache, synchronize = torch.cuda.empty_cache, torch.cuda.synchronize
    if not torch.cuda.is_available():
        torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    try:
        with sglang_env.activate(draft):
            draft.set_embed_and_head(embed, head)
    finally:
        torch.cuda.empty_cache, torch.cuda.synchronize = empty_cache, synchronize


def target_embed_and_head(target: "torch.nn.Module") -> tuple[Any, Any]:
    """What sglang's worker hands the draft: ``target.get_embed_and_head()``."""
    return target.get_embed_and_head()


def untie_shared(draft: "torch.nn.Module") -> list[str]:
    """Do what ``set_embed_and_head`` does, with the draft's own embedding and head as plain tensors
    (no longer parameters): the draft parameters it replaces by the target's, returned by name,
    drop out of ``named_parameters``. A meta replica then probes and publishes only what is the
    draft's own; the loaders skip those names anyway."""
    before = [n for n, _ in draft.named_parameters()]
    embed, head = target_embed_and_head(draft)
    tie_to_target(draft, embed.detach(), head.detach())
    after = {n for n, _ in draft.named_parameters()}
    return [n for n in before if n not in after]


ROLES = ("target", "draft")
_SHARED_ATTR = "_p2pw_shared_with_target"


def build_role_model(config: Any, engine: EngineLayout, rank: int, role: str = "target",
                     device: str = "meta") -> "torch.nn.Module":
    """The model a replica of ``role`` is built from: the target's (``sglang_env.build_model``), or
    the draft's with its shared embedding and head untied (:func:`untie_shared`; their names in
    :func:`shared_with_target`)."""
    if role == "target":
        return sglang_env.build_model(config, engine, rank, device=device)
    if role != "draft":
        raise ValueError(f"unknown replica role {role!r}; roles are {', '.join(ROLES)}")
    model = build_draft_model(config, engine, rank, device=device)
    setattr(model, _SHARED_ATTR, untie_shared(model))
    return model


def shared_with_target(model: "torch.nn.Module") -> list[str]:
    """The draft parameters that are the target's tensors (set by :func:`build_role_model`)."""
    return list(getattr(model, _SHARED_ATTR, ()))
