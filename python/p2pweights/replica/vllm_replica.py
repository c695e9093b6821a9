"""The vLLM replica: vLLM's own model of one engine rank on meta, probed with vLLM's own loaders,
behind the same interface as sglang's (:class:`~.model_replica.ModelReplica`: ``hf_specs``,
``param_specs``, ``groups``, ``group_of``, ``load_group(s)``, ``largest_group_nbytes``).

    from p2pweights.replica.vllm_layout import VllmLayout
    from p2pweights.replica.vllm_replica import vllm_replicas
    replica = vllm_replicas().get("deepseek-v3-fp8-tiny", VllmLayout.parse("tp=2,ep=2,deep_gemm=0,moe_backend=triton"), 1)
    regions = replica.load_group(replica.group_of(hf_name), {hf_name: tensor, ...}, slot)

What a sender writes is what the engine's parameters hold after ``process_weights_after_loading``:
vLLM's loaders' bytes, except in the modules whose kernels rewrite them (DeepGEMM's E8M0
requantization of FP8 block linears, FlashInfer CUTLASS's w13 swap of FP8 block experts), whose
post-processing ``load_groups`` replays on the loaded bytes (:mod:`.vllm_replay`); other rewriting
layouts are refused (:func:`.vllm_layout.refusal`). Derived tensors (DeepSeek MLA's ``W_UV`` /
``W_UK_T`` from ``kv_b_proj``) are never written: the engine's post-processing recomputes them when
an update finishes.
``p2pweights check-layout --engine-kind vllm`` proves both against a real post-processed load
(:mod:`.vllm_check`).

An engine started with an MTP draft (``spec=mtp``) holds a second role per rank, ``"draft"``
(:mod:`.vllm_draft`): ``get(..., role="draft")`` is its replica, without the parameters it shares
with the target; :func:`vllm_rank_replica` joins the roles (:class:`~.roles.RankRoles`, draft
names prefixed ``draft.``) into what a sender prepares.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import UnsupportedLayout
from ..models import resolve_model
from ..models.checkpoint import TensorSpec, checkpoint_tensors
from . import vllm_env
from .model_replica import ModelReplica, ReplicaKey, config_hash
from .probe import LoaderMapping, probe_loaders
from .roles import RankRoles, join_roles
from .vllm_draft import build_draft_model, build_role_model, share_with_target, without_shared
from .vllm_layout import VllmLayout
from .vllm_replay import ModuleReplay

if TYPE_CHECKING:
    import torch

    from .groups import ParameterGroup, SlotRegion


def probe_vllm_loaders(model: "torch.nn.Module", hf_specs: Mapping[str, TensorSpec]) -> LoaderMapping:
    """The loader probe of :mod:`.probe` (tags following data through every aten op, overwrite
    coverage per parameter), with the rank's vLLM context active instead of sglang's."""
    return probe_loaders(model, hf_specs, context=vllm_env.activate, engine="vLLM")


class VllmModelReplica(ModelReplica):
    """vLLM's model of one engine rank on meta and what its loaders do with HF tensors."""

    engine_kind = "vllm"
    _loader_context = staticmethod(vllm_env.activate)  # load_groups runs vLLM's loaders in the rank's vLLM context

    def __init__(self, config: Any, engine: VllmLayout, rank: int, mapping: LoaderMapping,
                 model: "torch.nn.Module | None" = None, key: ReplicaKey | None = None):
        super().__init__(config, engine, rank, mapping, model=model, key=key)
        self._config = config
        self._replay: ModuleReplay | None = None

    @property
    def model(self) -> "torch.nn.Module":
        with self._model_lock:
            if self._model is None:
                self._model = build_role_model(self._config, self.engine, self.rank, self.role)
            return self._model

    @property
    def replay(self) -> ModuleReplay:
        """The modules whose post-processing this rank's engine applies and the sender replays."""
        if self._replay is None:
            self._replay = ModuleReplay(self.model)
        return self._replay

    @property
    def replayed(self) -> dict[str, str]:
        """Module name -> transform replayed on send (:data:`.vllm_replay.TRANSFORMS`); empty when
        post-processing keeps every loaded byte."""
        return dict(self.replay.transforms)

    def load_groups(self, placed: "Sequence[tuple[ParameterGroup, int]]", hf_tensors: "Mapping[str, torch.Tensor]",
                    slot: "torch.Tensor") -> "list[SlotRegion]":
        """vLLM's loaders into the slot, then the replayed modules' post-processing over their bytes."""
        regions = super().load_groups(placed, hf_tensors, slot)
        if self.replay:
            self.replay.apply(regions, slot, self.mapping.param_specs, vllm_env.activate)
        return regions

    def not_a_copy(self, group: "ParameterGroup") -> str | None:
        """Why ``group`` must stay on the loader path (copy plans, p2pweights.copyplans): its bytes are
        post-processed on send; None for a group of loaded bytes only."""
        return self.replay.why_not_a_copy(group.params)


class VllmReplicas:
    """The process's vLLM replicas, one per (model config, vLLM layout, engine rank); in memory
    only (no disk cache yet)."""

    def __init__(self) -> None:
        self._replicas: dict[ReplicaKey, VllmModelReplica] = {}
        self._lock = threading.Lock()
        self.builds = 0

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, config: Any, engine: VllmLayout, rank: int,
            hf_specs: Mapping[str, TensorSpec] | None = None, role: str = "target") -> VllmModelReplica:
        """The replica of engine rank ``rank`` (DP rank x tp + TP rank) of a vLLM engine (built once).
        ``role="draft"``: its MTP draft (``engine.spec == "mtp"``), less the parameters that are
        the target's (:func:`.vllm_draft.share_with_target`)."""
        if isinstance(config, str):
            config = resolve_model(config)
        if role not in engine.roles:
            raise UnsupportedLayout(f"vLLM engine {engine.describe()} has no {role!r} model; its roles are "
                                    f"{', '.join(engine.roles)}", parameter="spec")
        key = ReplicaKey(config_hash(config), engine, rank, role)
        with self._lock:
            replica = self._replicas.get(key)
            if replica is None:
                specs = hf_specs if hf_specs is not None else checkpoint_tensors(config)
                if role == "target":
                    model = vllm_env.build_model(config, engine, rank)
                    mapping = probe_vllm_loaders(model, specs)
                else:  # the draft's loaders need its own embedding and heads: probe, then share
                    model = build_draft_model(config, engine, rank)
                    mapping = without_shared(probe_vllm_loaders(model, specs), share_with_target(model))
                replica = VllmModelReplica(config, engine, rank, mapping, model=model, key=key)
                self._replicas[key] = replica
                self.builds += 1
            return replica


def vllm_rank_replica(replicas: VllmReplicas, config: Any, layout: VllmLayout, rank: int,
                      hf_specs: Mapping[str, TensorSpec] | None = None) -> "VllmModelReplica | RankRoles":
    """What a sender prepares for engine rank ``rank`` of a vLLM engine: the target replica alone,
    or, for an engine with an MTP draft, both roles joined (:class:`~.roles.RankRoles`: the draft's
    parameters named ``draft.<name>``, as vLLM's worker names them)."""
    if layout.roles == ("target",):
        return replicas.get(config, layout, rank, hf_specs=hf_specs)
    return join_roles({role: replicas.get(config, layout, rank, hf_specs=hf_specs, role=role)
                       for role in layout.roles})


_DEFAULT: VllmReplicas | None = None


def vllm_replicas() -> VllmReplicas:
    """The process-wide :class:`VllmReplicas`."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = VllmReplicas()
    return _DEFAULT
