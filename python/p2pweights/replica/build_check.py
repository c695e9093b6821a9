"""Same build, same architecture: does the sender's replica environment reproduce the engine?

The replica is built by the sglang the sender imports; the engine runs its own sglang on its own
GPUs, and at ``end_weight_update`` its post-processing (``process_weights_after_loading``) picks
parameter layouts by sglang version and GPU architecture. A sender writes the checkpoint's bytes
into the engine's published parameters, so they must still be the checkpoint's layout after that
post-processing. At connect (:func:`engine_identity`, then :meth:`EngineIdentity.check_rank` for
each rank's publication):

- **sglang version**: the engine's (``/server_info`` ``version``; a rank's publication
  ``sglang_version``) must equal the sender's (``models/sglang_version.py``). An engine that reports none
  is refused for FP8 layouts and warned about otherwise.
- **GPU architecture**: any for BF16 layouts (post-processing keeps them). FP8 block-quantized
  layouts only where post-processing keeps the checkpoint's bytes: Hopper (``sm90``), and a
  p2pweights receiver holding a GPU rank's layout in host memory (arch ``cpu``, ``device`` cuda:
  sglang's CUDA path without DeepGEMM); and Blackwell ``sm100`` for 128x128 blocks with float32
  scales, whose UE8M0 post-processing the replica replays (:meth:`EngineIdentity.layout_arch`: connect
  then builds the layout with ``gpu_arch=sm100``, ``sender/engine_kinds.py``). Refused, with the
  reason: other Blackwell checkpoints (other blocks, ``scale_fmt: ue8m0``) and SM12x (DeepGEMM
  requantizes the block scales to UE8M0 and repacks them), Ampere/Ada
  (no Hopper FP8 path: Marlin repacks), ROCm (weights and scales converted to e4m3fnuz), sglang's
  CPU engine (AMX repack) and other devices. The architecture comes from, in order: the engine
  client's ``gpu_arch`` (an explicit override, for sglang servers without the p2pweights plugin,
  which do not report it), ``/server_info`` ``p2pw_device_archs`` (a p2pweights receiver's ranks)
  or ``p2pw_plugin.gpu_arch`` (the sglang plugin, protocol 3), each rank's publication
  ``device_arch``; reports that disagree are refused (an override that contradicts the engine's
  report too), and an FP8 engine whose architecture is unknown is refused with how to give it.
- **resolved flags** of an FP8 engine (shared-expert fusion, MoE runner and A2A backends, the FP8
  GEMM runner that decides DeepGEMM use) must be in ``/server_info``: sglang resolves them per
  architecture, so a default taken in their place may be the wrong layout.

This module imports neither torch nor sglang.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping

from ..control.protocol import plugin_gpu_arch
from ..errors import EngineMismatch
from ..models.quant import quant_scheme
from ..models.sglang_version import sglang_version

#: architectures whose post-processing keeps an FP8 block-quantized checkpoint's bytes
FP8_ARCHS = ("sm90", "cpu")
#: architectures whose FP8 post-processing the replica replays on send (sglang's Blackwell UE8M0
#: requantization and DeepGEMM scale packing: replica/sglang_ue8m0.py), for 128x128 blocks with
#: float32 scales; the layout connect builds then names ``gpu_arch`` (:func:`layout_arch`)
REPLAYED_ARCHS = ("sm100",)
#: server args an FP8 engine must report (resolved per architecture by sglang, never assumed)
FP8_RESOLVED_FLAGS = ("disable_shared_experts_fusion", "enforce_shared_experts_fusion", "moe_runner_backend",
                      "moe_a2a_backend", "fp8_gemm_runner_backend")
#: MoE runners / A2A backends whose FP8 post-processing keeps the checkpoint's expert bytes on Hopper
FP8_MOE_RUNNERS = ("auto", "triton", "deep_gemm")
FP8_MOE_A2A_REPACKING = ("megamoe", "flashinfer_megamoe")

ARCH_HINT = ("give the engine's GPU architecture: SglangEngine(url, gpu_arch='sm90') (an sglang server does "
             "not report it; a p2pweights receiver does, and so does sglang with the p2pweights plugin)")
PLUGIN_ARCH = "/server_info p2pw_plugin.gpu_arch"  # where the sglang plugin reports it


def normalize_arch(value: Any) -> str | None:
    """``sm90`` from ``sm90``, ``sm_90a``, ``9.0``, ``90``, ``(9, 0)``; ``gfx942`` from ROCm's
    ``gfx942:sramecc+:xnack-``; ``cpu``. None for None/empty; ValueError for anything else."""
    if value in (None, ""):
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"sm{int(value[0])}{int(value[1])}"
    text = str(value).strip().lower()
    if text == "cpu":
        return "cpu"
    if text.startswith("gfx"):
        return text.split(":", 1)[0]
    m = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?[af]?", text)
    if m:
        major, minor = m.group(1), m.group(2)
        return f"sm{major}{minor}" if minor is not None else f"sm{major}"
    raise ValueError(f"{value!r} is not a GPU architecture (sm90, 9.0, gfx942, cpu)")


def _arch_major(arch: str) -> int | None:
    m = re.fullmatch(r"sm(\d+)", arch)
    return int(m.group(1)) // 10 if m else None


@dataclass(frozen=True)
class ReplicaEnvironment:
    """What the sender's replica reproduces: its sglang version and the architectures whose FP8
    post-processing keeps the checkpoint's bytes."""

    sglang_version: str | None
    fp8_archs: tuple[str, ...] = FP8_ARCHS


@lru_cache(maxsize=1)
def replica_environment() -> ReplicaEnvironment:
    """The sglang this process's replicas are built with."""
    return ReplicaEnvironment(sglang_version())


def _version(value: Any) -> str | None:
    text = "" if value is None else str(value).strip().removeprefix("v")
    return text or None


def fp8_refusal(arch: str, device: str | None = None, scale_fmt: str | None = None,
                block: Any = (128, 128)) -> str | None:
    """Why an FP8 block-quantized layout cannot be written into an engine rank of ``arch`` (None: it
    can). ``block``: the checkpoint's ``weight_block_size``."""
    if device not in (None, "", "cuda"):
        if device == "cpu":
            return "sglang's CPU engine repacks FP8 weights for AMX (_amx_process_weight_after_loading)"
        return f"sglang on device {device!r} post-processes FP8 weights its own way, which is not reproduced"
    if arch in FP8_ARCHS:
        return None
    if arch.startswith("gfx"):
        return ("on ROCm sglang converts FP8 weights and their scales to float8_e4m3fnuz "
                "(normalize_e4m3fn_to_e4m3fnuz), so they are no longer the checkpoint's bytes")
    major = _arch_major(arch)
    if arch in REPLAYED_ARCHS and scale_fmt != "ue8m0" and tuple(block or ()) == (128, 128):
        return None  # the replica replays sglang's UE8M0 post-processing (gpu_arch=sm100 layouts)
    if major is not None and major >= 10:
        fmt = " (the checkpoint's scale_fmt is ue8m0)" if scale_fmt == "ue8m0" else ""
        why = ("on Blackwell/SM12x DeepGEMM's post-processing requantizes the block scales to UE8M0 and "
               f"repacks them{fmt} (requant_block_scale_ue8m0_for_deepgemm), a layout the checkpoint does not have")
        if arch in REPLAYED_ARCHS:
            why += ("; the replica replays it for sm100 only for 128x128 blocks with float32 scales (the layouts "
                    f"proven byte-exact), not weight_block_size {list(block or ())} with scale_fmt {scale_fmt!r}")
        return why
    if major is not None and major < 9:
        return ("below Hopper sglang has no block-FP8 tensor-core path and repacks the FP8 weights for Marlin, "
                "another layout than the checkpoint's")
    return f"FP8 post-processing on {arch} is not reproduced (only {', '.join(FP8_ARCHS)})"


@dataclass(frozen=True)
class EngineIdentity:
    """One engine as connect judged it: its sglang version, device and GPU architecture."""

    engine: str
    version: str | None
    device: str | None
    arch: str | None
    arch_source: str = ""
    fp8: bool = False
    scale_fmt: str | None = None
    env: ReplicaEnvironment = field(default_factory=replica_environment)
    block: tuple[int, ...] = (128, 128)

    def layout_arch(self) -> str | None:
        """The ``gpu_arch`` the engine's layout names (``models/engine_layout.py``): ``sm100`` for an FP8
        engine on an architecture whose post-processing the replica replays, else None (the replica's
        Hopper default; BF16 layouts are written the same on every architecture)."""
        return self.arch if self.fp8 and self.arch in REPLAYED_ARCHS else None

    def check_rank(self, rank: int, published_arch: Any = None, published_version: Any = None) -> None:
        """A rank's publication (``device_arch``, ``sglang_version``) against the engine's identity."""
        version = _version(published_version)
        if version is not None and version != self.version:
            raise EngineMismatch(
                f"engine {self.engine} rank {rank} runs sglang {version}, the engine reports {self.version} and "
                f"the sender's replicas are built with sglang {self.env.sglang_version}: refusing to connect",
                engine=self.engine, rank=rank, parameter="sglang_version",
                hint="run every rank of the engine and the sender with the same sglang build")
        try:
            arch = normalize_arch(published_arch)
        except ValueError as e:
            raise EngineMismatch(f"engine {self.engine} rank {rank} published device_arch {published_arch!r}: {e}",
                                 engine=self.engine, rank=rank, parameter="device_arch") from None
        if arch is None:
            return
        if self.arch is not None and arch != self.arch:
            raise EngineMismatch(
                f"engine {self.engine} rank {rank} runs on {arch}, but {self.arch_source} says {self.arch}: "
                f"refusing to connect", engine=self.engine, rank=rank, parameter="device_arch",
                hint="correct the gpu_arch given for this engine" if "gpu_arch" in self.arch_source else None)
        if self.fp8:
            why = fp8_refusal(arch, self.device, self.scale_fmt, self.block)
            if why:
                raise EngineMismatch(_fp8_message(self.engine, arch, f"rank {rank}'s publication", why),
                                     engine=self.engine, rank=rank, parameter="device_arch",
                                     hint=_fp8_hint(arch))


def _fp8_hint(arch: str) -> str:
    if arch in REPLAYED_ARCHS:
        return (f"on {arch} serve an FP8 checkpoint of weight_block_size [128, 128] with float32 scales (no "
                "scale_fmt), or serve this one on Hopper (sm90)")
    return "serve FP8 rollouts on Hopper (sm90), or a BF16 checkpoint elsewhere"


def _fp8_message(engine: str, arch: str, source: str, why: str) -> str:
    return (f"engine {engine} runs on {arch} ({source}) and serves an FP8 block-quantized checkpoint: {why}; "
            f"the sender's replica reproduces FP8 layouts only on {', '.join(FP8_ARCHS)} (and "
            f"{', '.join(REPLAYED_ARCHS)} by replaying its post-processing, 128x128 blocks with float32 scales)")


def engine_identity(engine: str, server_info: Mapping[str, Any], config: Mapping[str, Any], *,
                    gpu_arch: Any = None, env: ReplicaEnvironment | None = None) -> EngineIdentity:
    """Judge one engine from its ``/server_info`` (and the client's ``gpu_arch`` override) against
    the sender's replica environment; raise :class:`EngineMismatch` naming both sides."""

    env = env or replica_environment()
    scheme = quant_scheme(config)
    fp8 = scheme is not None
    version = _version(server_info.get("version"))
    if version is None:
        if fp8:
            raise EngineMismatch(
                f"engine {engine} does not report its sglang version (/server_info 'version') and serves an FP8 "
                f"checkpoint, whose post-processing depends on it: refusing to connect",
                engine=engine, parameter="version", hint="run sglang's own server, or report 'version' from the "
                                                         "receiver's server_info hook")
        warnings.warn(f"engine {engine} does not report its sglang version (/server_info 'version'); the sender's "
                      f"replicas are built with sglang {env.sglang_version}", stacklevel=3)
    elif version != env.sglang_version:
        raise EngineMismatch(
            f"engine {engine} runs sglang {version}, the sender's replicas are built with sglang "
            f"{env.sglang_version}: the engine's layouts and post-processing may differ; refusing to connect",
            engine=engine, parameter="version",
            hint=f"install sglang=={version} where the sender runs, or serve with sglang=={env.sglang_version}")
    device = server_info.get("device")
    device = str(device) if device not in (None, "") else None
    arch, source = _reported_arch(engine, server_info, gpu_arch)
    identity = EngineIdentity(engine, version, device, arch, source, fp8,
                              scheme.scale_fmt if scheme is not None else None, env,
                              tuple(scheme.block) if scheme is not None else (128, 128))
    if not fp8:
        return identity
    missing = [k for k in FP8_RESOLVED_FLAGS if k not in server_info]
    if missing:
        raise EngineMismatch(
            f"engine {engine} serves an FP8 checkpoint but its /server_info does not report {', '.join(missing)}: "
            f"sglang resolves them per GPU architecture, and connect never assumes their defaults",
            engine=engine, parameter=missing[0], hint="connect to sglang's own HTTP server (its /server_info has "
                                                      "every resolved server arg)")
    if arch is None:
        raise EngineMismatch(
            f"engine {engine} serves an FP8 checkpoint but does not report its GPU architecture, and the "
            f"sender's replica reproduces FP8 post-processing only on {', '.join(FP8_ARCHS)}: refusing to connect",
            engine=engine, parameter="gpu_arch", hint=ARCH_HINT)
    why = fp8_refusal(arch, device, identity.scale_fmt, identity.block)
    if why:
        raise EngineMismatch(_fp8_message(engine, arch, source, why), engine=engine, parameter="gpu_arch",
                             hint=_fp8_hint(arch))
    runner, a2a = str(server_info["moe_runner_backend"]), str(server_info["moe_a2a_backend"])
    if runner not in FP8_MOE_RUNNERS:
        raise EngineMismatch(
            f"engine {engine} runs FP8 experts with moe_runner_backend={runner!r}, whose post-processing may "
            f"shuffle or interleave the expert weights; the replica reproduces {', '.join(FP8_MOE_RUNNERS)} only",
            engine=engine, parameter="moe_runner_backend", hint="serve with --moe-runner-backend triton")
    if a2a in FP8_MOE_A2A_REPACKING:
        raise EngineMismatch(
            f"engine {engine} runs FP8 experts with moe_a2a_backend={a2a!r}, which rebuilds the expert weights "
            f"into its own packed layout after loading; not reproduced", engine=engine,
            parameter="moe_a2a_backend", hint="serve with another --moe-a2a-backend (none, deepep)")
    return identity


def _reported_arch(engine: str, server_info: Mapping[str, Any], gpu_arch: Any) -> tuple[str | None, str]:
    """(the engine's architecture, where it came from): the client's override, else what the
    receiver's ranks or the sglang plugin reported; refuses reports that disagree."""
    reported: dict[str, str] = {}
    per_rank = server_info.get("p2pw_device_archs") or {}
    if not isinstance(per_rank, Mapping):
        raise EngineMismatch(f"engine {engine}: /server_info 'p2pw_device_archs' must map rank to architecture",
                             engine=engine, parameter="p2pw_device_archs")
    for rank, value in per_rank.items():
        try:
            arch = normalize_arch(value)
        except ValueError as e:
            raise EngineMismatch(f"engine {engine} rank {rank}: {e}", engine=engine, parameter="p2pw_device_archs") \
                from None
        if arch is not None:
            reported[str(rank)] = arch
    try:
        plugin_arch = normalize_arch(plugin_gpu_arch(server_info))
    except ValueError as e:
        raise EngineMismatch(f"engine {engine}: {PLUGIN_ARCH}: {e}", engine=engine, parameter="gpu_arch") from None
    archs = sorted(set(reported.values()))
    if plugin_arch is not None and archs and archs != [plugin_arch]:
        raise EngineMismatch(f"engine {engine} reports {plugin_arch} ({PLUGIN_ARCH}) and {', '.join(archs)} "
                             f"(p2pw_device_archs): refusing to connect", engine=engine, parameter="gpu_arch")
    if len(archs) > 1:
        shown = ", ".join(f"rank {r}: {a}" for r, a in sorted(reported.items()))
        raise EngineMismatch(f"engine {engine}'s ranks run on different architectures ({shown}): one replica "
                             f"cannot reproduce them all; refusing to connect", engine=engine,
                             parameter="p2pw_device_archs")
    try:
        override = normalize_arch(gpu_arch)
    except ValueError as e:
        raise EngineMismatch(f"engine {engine}: gpu_arch={gpu_arch!r}: {e}", engine=engine, parameter="gpu_arch",
                             hint=ARCH_HINT) from None
    if override is not None:
        if archs and archs[0] != override:
            raise EngineMismatch(
                f"engine {engine} was given gpu_arch={override}, but its ranks report {archs[0]} "
                f"(/server_info p2pw_device_archs): refusing to connect", engine=engine, parameter="gpu_arch",
                hint="drop or correct gpu_arch for this engine")
        if plugin_arch is not None and plugin_arch != override:
            raise EngineMismatch(
                f"engine {engine} was given gpu_arch={override}, but its sglang plugin reports {plugin_arch} "
                f"({PLUGIN_ARCH}): refusing to connect", engine=engine, parameter="gpu_arch",
                hint="drop or correct gpu_arch for this engine")
        return override, "the engine client's gpu_arch"
    if archs:
        return archs[0], "/server_info p2pw_device_archs"
    if plugin_arch is not None:
        return plugin_arch, PLUGIN_ARCH
    return None, ""
