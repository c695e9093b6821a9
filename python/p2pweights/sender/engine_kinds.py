"""What connect asks of an engine that depends on its kind: its shard layout, the identity its ranks'
publications are checked against, and the replica of one of its ranks. sglang engines (and
receivers) answer with sglang's layout, build check and replicas; vLLM engines
(``control.vllm.VllmEngine``) with a :class:`~p2pweights.replica.vllm_layout.VllmLayout`, vLLM's
version and refusals (:class:`VllmIdentity`) and :class:`~p2pweights.replica.vllm_replica.VllmReplicas`
(an engine running vLLM's MTP drafter: target and draft joined, the draft's names ``draft.<name>``).

A vLLM engine's layout is read from vLLM's ``/server_info?config_format=json`` (the parallel config,
``kernel_config.moe_backend``, the dtype, ``VLLM_USE_DEEP_GEMM``, ``speculative_config.method``) or
given (``VllmEngine(layout=)``), and either way checked against the engine's ``/get_world_size``. Nothing here imports vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import EngineError, EngineMismatch, LayoutMismatch, LayoutSpecError, UnsupportedLayout
from ..models.engine_layout import EngineLayout
from ..replica import roles
from ..replica.build_check import engine_identity
from ..replica.vllm_env import vllm_version
from ..replica.vllm_layout import VllmLayout, check_refusal
from ..replica.vllm_replica import vllm_rank_replica, vllm_replicas

_LAYOUT_HINT = "pass the engine's layout: VllmEngine(url, layout='tp=...,dp=...')"


def is_vllm(engine: Any) -> bool:
    return getattr(engine, "engine_kind", "sglang") == "vllm"


def layout_and_identity(client: Any, info: Mapping[str, Any], config: Mapping[str, Any]) -> tuple[Any, Any]:
    """(layout, identity) of one engine from what its ``server_info()`` answered; raises before any
    replica is built when the sender cannot serve it."""
    if is_vllm(client):
        layout = vllm_layout(client, info)
        return layout, VllmIdentity.judge(client.name, info, config, layout)
    identity = engine_identity(client.name, info, config, gpu_arch=getattr(client, "gpu_arch", None))
    # the layout names the architecture the identity judged, never one /server_info states by itself: an
    # FP8 engine on sm100 gets a Blackwell layout (its replica replays sglang's UE8M0 post-processing,
    # replica/sglang_ue8m0.py), every other engine the Hopper default
    return EngineLayout.from_server_info({**info, "gpu_arch": identity.layout_arch()}), identity


def rank_replica_of(replicas: Any, model: Any, layout: Any, rank: int) -> Any:
    """The replica a sender prepares for engine rank ``rank`` of an engine of ``layout``."""
    if isinstance(layout, VllmLayout):
        return vllm_rank_replica(vllm_replicas(), model, layout, rank)  # with an MTP draft: both roles joined
    return roles.rank_replica(replicas, model, layout, rank)  # looked up here: tests stand a target-only one in


def vllm_layout(client: Any, info: Mapping[str, Any]) -> VllmLayout:
    """The engine's VllmLayout: the one given to its client, else read from ``info`` (``VllmEngine.
    server_info``); its world size must be what the engine reports (LayoutMismatch otherwise)."""
    given = client.given_layout
    if isinstance(given, str):
        given = VllmLayout.parse(given, command="VllmEngine(layout=...)")
    layout = given if given is not None else layout_of(info.get("vllm_server_info"), client.name)
    world = info.get("world_size")
    if world != layout.world_size:
        raise LayoutMismatch(f"engine {client.name} runs {world} rank(s) (/get_world_size), the layout "
                             f"{layout.describe()} has {layout.world_size}", engine=client.name, hint=_LAYOUT_HINT)
    return layout


def layout_of(server_info: Any, engine: str) -> VllmLayout:
    """A VllmLayout from vLLM's ``/server_info?config_format=json`` (``vllm_config``, ``vllm_env``).
    FlashInfer's presence is not reported there: assumed (vLLM's CUDA wheel depends on it)."""
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("parallel_config"), dict):
        raise EngineError(f"engine {engine}: vLLM's /server_info has no vllm_config (is VLLM_SERVER_DEV_MODE=1 set?)",
                          engine=engine, hint=_LAYOUT_HINT)
    par = config["parallel_config"]
    model, kernel = config.get("model_config") or {}, config.get("kernel_config") or {}
    env = server_info.get("vllm_env") or {}
    if not all(isinstance(x, dict) for x in (model, kernel, env)):
        raise EngineError(f"engine {engine}: vLLM's /server_info is not vLLM's config", engine=engine)
    if par.get("pipeline_parallel_size") not in (None, 1):
        raise LayoutMismatch(f"engine {engine}: pipeline parallelism is not supported for vLLM engines", engine=engine)
    dtype = str(model.get("dtype") or "auto").replace("torch.", "")
    spec = config.get("speculative_config") or {}
    if not isinstance(spec, dict):
        raise EngineError(f"engine {engine}: vLLM's /server_info is not vLLM's config", engine=engine)
    _check_draft_settings(spec, par, engine)
    try:
        return VllmLayout(tp=int(par.get("tensor_parallel_size") or 1), dp=int(par.get("data_parallel_size") or 1),
                          expert_parallel=bool(par.get("enable_expert_parallel")),
                          moe_backend=str(kernel.get("moe_backend") or "auto").lower(), dtype=dtype,
                          deep_gemm=str(env.get("VLLM_USE_DEEP_GEMM", "1")).lower() not in ("0", "false"),
                          spec=str(spec.get("method") or ""))
    except LayoutSpecError as e:  # vLLM's config, a layout the replica refuses (a separate draft checkpoint, ...)
        raise UnsupportedLayout(f"engine {engine}: {e}", engine=engine) from None
    except (TypeError, ValueError) as e:  # an answer that is not vLLM's config
        raise EngineError(f"engine {engine}: vLLM's /server_info reports no usable layout ({e})", engine=engine,
                          hint=_LAYOUT_HINT) from None


#: speculative_config keys that would build the draft otherwise than the target (the replica's draft
#: role shares the target's layout, quantization and kernels: replica/vllm_draft.py)
_DRAFT_OWN_SETTINGS = ("quantization", "moe_backend", "attention_backend", "draft_lm_head_quantization")


def _check_draft_settings(spec: Mapping[str, Any], par: Mapping[str, Any], engine: str) -> None:
    """UnsupportedLayout where the engine's draft is laid out otherwise than its target."""
    if not spec.get("method"):
        return
    draft_tp, tp = spec.get("draft_tensor_parallel_size"), par.get("tensor_parallel_size") or 1
    if draft_tp not in (None, tp):
        raise UnsupportedLayout(f"engine {engine}: its draft runs at tensor parallel size {draft_tp}, its target at "
                                f"{tp}; the replica's draft role shares the target's layout", engine=engine,
                                parameter="speculative_config.draft_tensor_parallel_size",
                                hint="start the engine without draft_tensor_parallel_size")
    own = [k for k in _DRAFT_OWN_SETTINGS if spec.get(k) not in (None, "", "auto")]
    if own:
        raise UnsupportedLayout(f"engine {engine}: its draft sets {own[0]}={spec[own[0]]!r} of its own; the replica's "
                                f"draft role shares the target's", engine=engine,
                                parameter=f"speculative_config.{own[0]}",
                                hint=f"start the engine without speculative_config.{own[0]}")


@dataclass(frozen=True)
class VllmIdentity:
    """A vLLM engine as connect judged it: the vLLM version its ranks publish (the sender's replicas
    are built with the local vLLM: the same release, or refused) and its GPU architecture."""

    engine: str
    version: str
    arch: str | None

    @classmethod
    def judge(cls, engine: str, info: Mapping[str, Any], config: Mapping[str, Any], layout: VllmLayout
              ) -> "VllmIdentity":
        check_refusal(config, layout)  # UnsupportedLayout: post-processing would rewrite the written bytes
        local, theirs = vllm_version(), info.get("vllm_version")
        if local is None or theirs is None or str(theirs) != local:
            raise EngineMismatch(f"engine {engine} runs vLLM {theirs}, the sender's replicas are built with vLLM "
                                 f"{local}: the layouts and post-processing may differ; refusing to connect",
                                 engine=engine, parameter="vllm_version",
                                 hint=f"install vllm=={theirs} where the sender runs (or serve with vllm=={local})")
        arch = info.get("device_arch")
        return cls(engine, local, str(arch) if arch else None)

    def check_rank(self, rank: int, published_arch: Any = None, published_version: Any = None) -> None:
        """Every rank runs on the architecture rank 0 published (the replica models one)."""
        if published_arch and self.arch and str(published_arch) != self.arch:
            raise EngineMismatch(f"engine {self.engine} rank {rank} runs on {published_arch}, rank 0 on {self.arch}: "
                                 f"refusing to connect", engine=self.engine, rank=rank, parameter="device_arch")
