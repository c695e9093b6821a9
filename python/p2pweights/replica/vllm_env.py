"""Build vLLM 0.33's own model of one engine rank in this process: no GPU, no process group.

vLLM is imported only when a vLLM engine is asked for (:func:`prepare`, idempotent). Two stand-ins
make a CPU host build, load and post-process exactly what a Hopper engine rank does
(docs/vllm.md, "The vLLM replica"):

- **the Hopper platform**: ``vllm.platforms._current_platform`` is a ``NonNvmlCudaPlatform`` that
  reports sm90, so layers, quantization methods and kernel oracles take an H100/H200's CUDA
  paths. The CUDA extension modules (``vllm._C_stable_libtorch`` needs ``libcuda.so.1``) and the
  ``torch.ops`` namespaces they would register are stubs: building and loading never call them,
  and anything that does raises, naming the op. Capability queries vLLM asks its extension at
  import are answered as its ``scaled_mm_entry.cu`` answers for sm90.
- **the parallel groups**: ``vllm.distributed.parallel_state``'s module globals (``_TP``, ``_DP``,
  ``_EP``, ...) hold ``GroupCoordinator`` objects that carry only rank lists, laid out as
  ``initialize_model_parallel`` lays them out, while a rank's model is built, loaded or
  post-processed (:func:`activate`). Parameters stamp their TP rank at construction.

No DeepGEMM (its extension needs ``libc10_cuda.so``) and no FlashInfer here: while a rank's vLLM
code runs, the oracles of the two kernels whose post-processing the sender replays (DeepGEMM FP8
linears, FlashInfer CUTLASS FP8 experts) hear the engine's answers instead
(:mod:`.vllm_engine_kernels`, :mod:`.vllm_replay`); layouts where the engine would pick another
kernel that rewrites bytes are refused before building (:mod:`.vllm_layout`), and
:func:`check_kernels` pins that what was built uses byte-keeping or replayed kernels.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import types
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import P2PWeightsError, UnsupportedLayout
from ..models import load_config, resolve_model
from .sglang_env import materialize as _materialize
from .vllm_engine_kernels import engine_kernels
from .vllm_layout import VllmLayout, check_refusal
from .vllm_refusals import is_mla_prefill_refusal, mla_prefill_refusal
from .vllm_replay import DEEPGEMM_LINEAR_KERNELS, FLASHINFER_W31_MOE_BACKENDS, replayed_transform

if TYPE_CHECKING:
    import torch

#: the vLLM release the stand-ins reach into (platform class, parallel_state globals, kernel names)
SUPPORTED_VERSION = "0.33."
_lock = threading.RLock()
_prepared = False
_CONFIG_ATTR = "_p2pw_vllm_config"
_RANK_ATTR = "_p2pw_vllm_rank"
_LAYOUT_ATTR = "_p2pw_vllm_layout"

# CUDA-only extension modules: importing them needs libcuda; any attribute is a function that raises.
_STUBBED_MODULES = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._qutlass_C",
                    "vllm.vllm_flash_attn")
# torch.ops namespaces vLLM's CUDA extensions register; layers look ops up at construction
# (SiluAndMul keeps torch.ops._C.silu_and_mul) and never call them while building or loading.
_OP_NAMESPACES = ("_C", "_moe_C", "_C_cache_ops", "_C_custom_ar")
# Kernels whose process_weights_after_loading keeps every byte the loaders wrote (checked by the
# byte-exactness check against a real post-processed load): FP8 block linears, MoE backends.
KEEPING_LINEAR_KERNELS = ("CutlassFp8BlockScaledMMKernel",)
KEEPING_MOE_BACKENDS = ("TRITON",)
# Kernels whose post-processing the sender replays (:mod:`.vllm_replay`)
REPLAYED_LINEAR_KERNELS = DEEPGEMM_LINEAR_KERNELS
REPLAYED_MOE_BACKENDS = FLASHINFER_W31_MOE_BACKENDS


class _Stub(types.ModuleType):
    """A CUDA-only module: any attribute is a function that raises when called."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{attr} needs CUDA; it is a stub in p2pweights' vLLM replica")
        return unavailable


def vllm_version() -> str | None:
    """The installed vLLM's version, None if it is not installed (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def prepare() -> None:
    """Import vLLM with the Hopper stand-in platform installed. Idempotent; must run before
    anything else reads ``vllm.platforms.current_platform``."""
    global _prepared
    with _lock:
        if _prepared:
            return
        found = vllm_version()
        if found is None:
            raise UnsupportedLayout("vLLM is not installed; the vLLM replica needs vllm 0.33 "
                                    "(docs/vllm.md says how to install it without a GPU stack)")
        if not found.startswith(SUPPORTED_VERSION):
            raise UnsupportedLayout(f"vLLM {found} is installed; the vLLM replica's stand-ins are written "
                                    f"for vLLM {SUPPORTED_VERSION}x (platform class, parallel-state globals)")
        # The shared-experts overlap stream is a torch.cuda.Stream (no effect on any weight).
        os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"
        # vLLM logs every kernel choice, and a traceback for the DeepGEMM extension this host cannot load
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        for name in _STUBBED_MODULES:
            sys.modules.setdefault(name, _Stub(name))
        import vllm.platforms as platforms

        resolved = platforms._current_platform  # sglang imports vllm._custom_ops on a CPU host if it can
        platforms._current_platform = _hopper_platform()
        if resolved is not None:  # vLLM modules imported since hold the host's platform: rebind them
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("vllm") and \
                        getattr(module, "current_platform", None) is resolved:
                    module.current_platform = platforms._current_platform
        import torch
        import vllm._custom_ops as ops

        # answered as vLLM's compiled scaled_mm_entry.cu answers on sm90 with CUDA >= 12.8
        ops.cutlass_scaled_mm_supports_fp8 = lambda capability: capability >= 89
        ops.cutlass_scaled_mm_supports_block_fp8 = lambda capability: capability >= 90
        ops.cutlass_group_gemm_supported = lambda capability: capability >= 90
        ops.cutlass_scaled_mm_supports_fp4 = lambda capability: capability >= 100
        ops.mxfp4_experts_quant_supported = lambda capability: capability >= 100
        for ns in _OP_NAMESPACES:  # after vllm._custom_ops, which registers fakes for the real ones
            torch.ops.__dict__[ns] = _Stub(f"torch.ops.{ns}")
        from vllm.triton_utils import HAS_TRITON, triton

        if not HAS_TRITON:  # vLLM's placeholder module: its Config returns a decorator, not a config
            triton.Config = _TritonConfig
        _prepared = True


class _TritonConfig:
    """``triton.Config`` where Triton is absent: the fields sm90 code reads from a config at import
    (mamba's ``ssd_chunk_scan`` drops configs by ``num_stages`` / ``num_warps`` / ``kwargs`` on sm90,
    which vLLM's GPU worker module imports); no kernel is ever compiled from it."""

    def __init__(self, kwargs: dict, num_warps: int = 4, num_stages: int = 3, **rest: Any):
        self.kwargs, self.num_warps, self.num_stages = dict(kwargs), num_warps, num_stages
        self.__dict__.update(rest)


def _hopper_platform() -> Any:
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class HopperStandIn(NonNvmlCudaPlatform):
        """An H200 as vLLM's CUDA platform sees it; nothing here touches a GPU."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200 (p2pweights stand-in)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 << 30

        @classmethod
        def device_count(cls) -> int:
            return 8

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 132  # MLA's Triton backend asks at construction

        @classmethod
        def is_integrated_gpu(cls, device_id: int = 0) -> bool:
            return False

        @classmethod
        def import_kernels(cls) -> None:
            pass

    return HopperStandIn()


# -- stand-in parallel groups ----------------------------------------------------------------------
class _StandInProcessGroup:
    """What model code asks a torch ProcessGroup while building (qwen3_moe: ``ep_group.size()``)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def group_ranks(layout: VllmLayout, is_moe: bool) -> dict[str, list[list[int]]]:
    """Every group's rank lists as ``initialize_model_parallel`` lays them out:
    ``arange(world).reshape(-1, dp, pp, pcp, tp)`` with pp = pcp = dcp = 1."""
    import torch

    tp, dp = layout.tp, layout.dp
    grid = torch.arange(layout.world_size).reshape(-1, dp, 1, 1, tp)

    def lists(t: "torch.Tensor", n: int) -> list[list[int]]:
        return [x.tolist() for x in t.reshape(-1, n).unbind(0)]

    out = {
        "world": [list(range(layout.world_size))],
        "tp": lists(grid, tp),
        "dcp": lists(grid, 1),
        "pcp": lists(grid.transpose(3, 4), 1),
        "pp": lists(grid.transpose(2, 4), 1),
        "dp": lists(grid.transpose(1, 4), dp),
    }
    if is_moe:
        out["ep"] = lists(grid.transpose(1, 2), dp * tp)
    return out


def _standin(name: str, rank_lists: list[list[int]], rank: int) -> Any:
    import torch
    import vllm.distributed.parallel_state as ps

    group = object.__new__(ps.GroupCoordinator)
    (ranks,) = [r for r in rank_lists if rank in r]
    group.unique_name = f"p2pw_standin_{name}"
    group.rank, group.ranks, group.world_size = rank, ranks, len(ranks)
    group.rank_in_group = ranks.index(rank)
    group.local_rank = group.device_index = rank
    group.group_ranks = rank_lists
    group.cpu_group = group.device_group = _StandInProcessGroup(group.world_size, group.rank_in_group)
    group.device = torch.device("cpu")
    group.use_device_communicator = False
    group.device_communicator = None
    group.mq_broadcaster = None
    group.use_custom_op_call = False
    group.torch_distributed_backend = "gloo"
    return group


_GROUP_GLOBALS = ("_WORLD", "_TP", "_ETP", "_DCP", "_PCP", "_PP", "_DP", "_EP", "_EPLB", "_ENGRAM_DP",
                  "_INNER_DP_WORLD", "_NODE_COUNT")


@contextlib.contextmanager
def _rank_groups(layout: VllmLayout, rank: int, is_moe: bool) -> Iterator[None]:
    """parallel_state reports engine rank ``rank`` of ``layout`` while the block runs."""
    import vllm.distributed.parallel_state as ps

    saved = {k: getattr(ps, k, None) for k in _GROUP_GLOBALS}
    try:
        groups = {k: _standin(k, v, rank) for k, v in group_ranks(layout, is_moe).items()}
        ps._WORLD, ps._TP, ps._DCP, ps._PCP, ps._PP, ps._DP = (
            groups[k] for k in ("world", "tp", "dcp", "pcp", "pp", "dp"))
        ps._ETP = ps._TP
        ps._INNER_DP_WORLD = ps._WORLD
        ps._EP = groups.get("ep")
        if ps._EP is not None:
            # post-processing sets up the MoE dispatch (DP x EP: all-gather / reduce-scatter), which
            # asks the EP group's all-to-all manager for its size only; no weight depends on it
            manager = types.SimpleNamespace(world_size=ps._EP.world_size, rank=ps._EP.rank_in_group,
                                            dp_world_size=layout.dp)
            ps._EP.device_communicator = types.SimpleNamespace(all2all_manager=manager)
        ps._EPLB = ps._ENGRAM_DP = None
        ps._NODE_COUNT = 1
        yield
    finally:
        for k, v in saved.items():
            setattr(ps, k, v)


# -- building --------------------------------------------------------------------------------------
def config_dir_of(config: Any) -> str:
    """A folder holding config.json (vLLM reads the model's config from a path)."""
    if isinstance(config, (str, os.PathLike)):
        path = resolve_model(config)
        return os.path.dirname(path) if str(path).endswith(".json") else os.fspath(path)
    directory = tempfile.mkdtemp(prefix="p2pw_vllm_config_")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(load_config(config), f)
    return directory


_configs: dict[tuple[str, VllmLayout], Any] = {}


def engine_config(config: Any, layout: VllmLayout) -> Any:
    """vLLM's ``VllmConfig`` of an engine of ``layout`` serving ``config`` (one per process)."""
    prepare()
    directory = config_dir_of(config)
    key = (os.path.abspath(directory), layout)
    with _lock:
        if key not in _configs:
            from vllm.engine.arg_utils import EngineArgs

            cfg = load_config(directory)
            max_len = min(256, int(cfg.get("max_position_embeddings") or 256))
            args = EngineArgs(model=directory, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                              max_model_len=max_len, **layout.engine_args())
            try:
                _configs[key] = args.create_engine_config()
            except Exception as e:  # vLLM refuses the flags for this model
                raise UnsupportedLayout(f"vLLM refuses engine layout {layout.describe()}: "
                                        f"{type(e).__name__}: {e}") from e
        return _configs[key]


@contextlib.contextmanager
def activate(model: "torch.nn.Module") -> Iterator[Any]:
    """Run vLLM code for ``model``'s rank: its ``VllmConfig`` current and parallel_state holding its
    rank's stand-in groups (loaders and post-processing read both). Holds the module lock: vLLM's
    current config and parallel state are process-global."""
    from vllm.config import set_current_vllm_config

    vllm_config = getattr(model, _CONFIG_ATTR)
    layout, rank = getattr(model, _LAYOUT_ATTR), getattr(model, _RANK_ATTR)
    with _lock, _rank_groups(layout, rank, vllm_config.model_config.is_moe), set_current_vllm_config(vllm_config), \
            engine_kernels(layout):
        dp_rank = vllm_config.parallel_config.data_parallel_rank
        vllm_config.parallel_config.data_parallel_rank = layout.rank_of(rank)[0]
        try:
            yield vllm_config
        finally:
            vllm_config.parallel_config.data_parallel_rank = dp_rank


def role_model_config(vllm_config: Any, layout: VllmLayout, role: str = "target") -> Any:
    """The ``ModelConfig`` vLLM builds a role's model from: the target's, or (``role="draft"``) the
    speculative config's ``draft_model_config`` (for method mtp: the same checkpoint, architecture
    ``DeepSeekMTPModel``), which the proposer hands ``get_model``."""
    if role == "target":
        return vllm_config.model_config
    spec = vllm_config.speculative_config
    if role != "draft" or spec is None or spec.draft_model_config is None:
        raise UnsupportedLayout(f"vLLM engine {layout.describe()} has no {role!r} model; its roles are "
                                f"{', '.join(layout.roles)}", parameter="spec")
    return spec.draft_model_config


def build_model(config: Any, layout: VllmLayout, rank: int, device: str = "meta", *,
                role: str = "target") -> "torch.nn.Module":
    """vLLM's model of engine rank ``rank`` (= DP rank x tp + TP rank) of ``layout``, built by
    vLLM's ``initialize_model`` under the Hopper stand-in. ``device="meta"`` allocates nothing.
    ``role="draft"``: the speculative draft as the proposer builds it (:mod:`.vllm_draft`), with
    the target's VllmConfig (same TP/EP layout, same quantization) and the draft's ModelConfig."""
    import torch

    check_refusal(load_config(config), layout)
    vllm_config = engine_config(config, layout)
    layout.rank_of(rank)
    model_config = role_model_config(vllm_config, layout, role)
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    holder = torch.nn.Module()  # carries the rank for activate() before the model exists
    setattr(holder, _CONFIG_ATTR, vllm_config)
    setattr(holder, _LAYOUT_ATTR, layout)
    setattr(holder, _RANK_ATTR, rank)
    with activate(holder):
        # attention layers register by name in the config: a second build would be a "Duplicate layer name"
        vllm_config.compilation_config.static_forward_context.clear()
        try:
            with set_default_torch_dtype(model_config.dtype), torch.device(device):
                model = initialize_model(vllm_config=vllm_config, model_config=model_config)
        except UnsupportedLayout:
            raise
        except Exception as e:
            if is_mla_prefill_refusal(e):  # vLLM's own refusal of the model's MLA head dims on this platform
                raise mla_prefill_refusal(e, model_config, layout) from e
            raise UnsupportedLayout(f"vLLM cannot build the {role} of engine layout {layout.describe()} rank {rank} "
                                    f"here: {type(e).__name__}: {e}") from e
    for attr in (_CONFIG_ATTR, _LAYOUT_ATTR, _RANK_ATTR):
        setattr(model, attr, getattr(holder, attr))
    check_kernels(model)
    return model.eval()


def refuse_what_vllm_refuses(model: str, spec: str) -> None:
    """check-layout's look, before any rank is built, for vLLM's own refusal of the model: its MLA
    prefill backend (:mod:`.vllm_refusals`), raised as :func:`build_model` raises it (one line,
    exit code 2). Only vLLM's selector runs unless it refuses; then rank 0 is built on meta, whose
    verdict is vLLM's (a sparse MLA layer goes on without a prefill backend). Anything else wrong
    with ``model`` or ``spec`` is left to check-layout's own checks."""
    try:
        path = resolve_model(model)
        layout = VllmLayout.parse(spec, command="check-layout")
        check_refusal(load_config(path), layout)
        vllm_config = engine_config(path, layout)
    except P2PWeightsError:
        return
    if not vllm_config.model_config.use_mla:
        return
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

    try:
        get_mla_prefill_backend(vllm_config)
    except ValueError as e:
        if is_mla_prefill_refusal(e):
            build_model(path, layout, 0)


def check_kernels(model: "torch.nn.Module") -> None:
    """Every FP8 linear and every MoE layer of the built rank uses a kernel whose
    post-processing keeps the loaded bytes, or one the sender replays; else
    :class:`UnsupportedLayout` naming the layer."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        kernel = getattr(method, "fp8_linear", None)
        if kernel is not None and type(kernel).__name__ not in KEEPING_LINEAR_KERNELS + REPLAYED_LINEAR_KERNELS:
            raise UnsupportedLayout(f"{name}: vLLM chose the FP8 linear kernel {type(kernel).__name__}, whose "
                                    "post-processing is not known to keep the checkpoint's bytes")
        replayed = REPLAYED_MOE_BACKENDS if replayed_transform(module) else ()  # block FP8 experts only
        for attr, allowed in (("fp8_backend", KEEPING_MOE_BACKENDS + replayed),
                              ("unquantized_backend", KEEPING_MOE_BACKENDS)):
            backend = getattr(method, attr, None)
            if backend is not None and getattr(backend, "name", str(backend)) not in allowed:
                raise UnsupportedLayout(f"{name}: vLLM chose the MoE backend {backend}, whose post-processing "
                                        "repacks the experts; start the engine with --moe-backend triton")


def materialize(model: "torch.nn.Module", device: str = "cpu") -> "torch.nn.Module":
    """Real, zeroed storage for every meta tensor; parameters keep their class and ``__dict__``
    (vLLM's ``BasevLLMParameter`` keeps its loader state there). sglang_env's implementation is
    engine-neutral; it is reused, not imported from sglang."""
    return _materialize(model, device)


def post_process(model: "torch.nn.Module", device: str = "cpu", role: str = "target") -> None:
    """vLLM's ``process_weights_after_loading`` for the rank, as its update's finish runs it
    (with the role's ModelConfig, as the loader that built the role passes it)."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with activate(model) as vllm_config:
        model_config = role_model_config(vllm_config, getattr(model, _LAYOUT_ATTR), role)
        process_weights_after_loading(model, model_config, torch.device(device))
