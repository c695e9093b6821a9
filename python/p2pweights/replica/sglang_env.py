"""Build a real sglang model of one engine rank in this process, with no GPU and no process group.

sglang derives every rank (tp, attention tp/dp, moe ep/tp) from the world rank and reads its
parallel groups from a runtime context. Here each model gets a context of its own
(``runtime_context.create_context``) holding stand-in groups of the right size and rank, so
several replicas of different layouts live in one process. Loaders read the context too, so
run them inside :func:`activate`.

Public API::

    prepare()                                        # idempotent; call before importing sglang
    import_model_modules(config)                     # prepare() + the config's model module(s)
    build_model(config, engine, rank, device="meta") # -> torch.nn.Module of that engine rank
    activate(model)                                  # context manager: its runtime context
    materialize(model, device="cpu")                 # real storage, parameters keep class+__dict__
    replace_parameters(model, make)                  # every parameter over new storage (the one rebuild)

The model is built as a GPU rank's (``ServerArgs(device="cuda")``) so its layout is the
engine's; nothing runs on a GPU. Never set SGLANG_USE_CPU_ENGINE=1 (CPU loaders differ).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import pkgutil
import sys
import tempfile
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..errors import UnsupportedLayout
from ..models import load_config
from ..models.engine_layout import EngineLayout
from ..settings import value as setting
from . import fp8_engine
from .sglang_imports import StubFinder, sglang_imports

if TYPE_CHECKING:
    import torch

_prepared = False
_lock = threading.RLock()
_CONTEXT_ATTR = "_p2pw_runtime_context"
_SERVER_ARGS_ATTR = "_p2pw_server_args"
_LAYOUT_ATTR = "_p2pw_engine_layout"


# -- making sglang importable on a CPU host --------------------------------------------------------
# sglang imports torchvision at module level (multimodal processors) but the model classes we build
# never call it; the registry's torchvision drags in a CUDA torch. Without one, a stub (every thread).
_TORCHVISION_STUB = ("torchvision",)


def _torchvision_importable() -> bool:
    try:
        return importlib.util.find_spec("torchvision") is not None
    except (ImportError, ValueError):
        return False


def is_prepared() -> bool:
    """Whether this process has imported sglang through :func:`prepare` (children forked from it inherit it)."""
    return _prepared


def prepare() -> None:
    """Make sglang's model classes and loaders importable and buildable here. Idempotent."""
    global _prepared
    with _lock:
        if _prepared:
            return
        if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
            raise UnsupportedLayout(
                "SGLANG_USE_CPU_ENGINE=1 switches sglang's loaders to CPU layouts; "
                "unset it: replicas must reproduce a GPU rank's bytes"
            )
        # transformers probes for torchvision when its import utils load; the stub must come
        # after that probe (it would otherwise believe a real torchvision is there).
        import transformers.utils.import_utils  # noqa: F401

        if not _torchvision_importable():
            sys.meta_path.insert(0, StubFinder(_TORCHVISION_STUB))
        # P2PW_SGLANG_IMPORT_AS_CPU=1: import sglang as on a host without CUDA (the code path the
        # byte-exact tests cover) even where a GPU exists; its GPU-only kernels are never called
        # by model construction or the loaders. For a sender on a GPU host without sgl_kernel.
        with _sglang_imports():
            _import_sglang()
        for name in ("sglang", "sglang.srt"):
            logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))
        _prepared = True


@contextlib.contextmanager
def _sglang_imports() -> Iterator[None]:
    """Where sglang modules get imported: in this thread, torch.compile is deferred to a function's
    first call and IPython is a stub (neither is needed to build or load a model); with
    P2PW_SGLANG_IMPORT_AS_CPU=1 sglang sees no CUDA. See replica/sglang_imports.py."""
    with sglang_imports(as_cpu=setting("P2PW_SGLANG_IMPORT_AS_CPU")):
        yield


def _import_sglang() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.layers.rotary_embedding.base as rotary_base

        # Rotary embeddings hold no parameters; the CPU path avoids CUDA-only kernels
        # (DeepSeek's rope asserts otherwise) without changing any parameter's layout.
        rotary_base._is_cpu = True
        _rope_buffers_on_cpu_without_accelerator()
        import sglang.srt.model_loader.loader  # noqa: F401  (the heavy imports, once)
        _import_registry_empty()
        fp8_engine.post_load_as_on_hopper()


def _model_modules() -> list[str]:
    import sglang.srt.models as models

    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if not m.ispkg)


def _import_registry_empty() -> None:
    """Import sglang's model registry without importing its ~200 model modules (≈4 s of every
    process's start-up): each replica registers only its own architecture (:func:`_register_architecture`)."""
    key = "SGLANG_DISABLED_MODEL_ARCHS"
    saved = os.environ.get(key)
    if saved is None:
        os.environ[key] = ",".join(_model_modules())
    try:
        import sglang.srt.models.registry  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop(key, None)


def _register_architecture(architectures: list[str]) -> None:
    """Import the sglang model module(s) defining these architectures into the registry."""
    import importlib

    import sglang.srt.models as models
    from sglang.srt.models.registry import ModelRegistry

    missing = [a for a in architectures if a not in ModelRegistry.models]
    if not missing:
        return
    root = models.__path__[0]
    for name in _model_modules():
        path = os.path.join(root, name + ".py")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        if "EntryClass" not in text or not any(f"class {a}(" in text or a in text.split("EntryClass", 1)[1]
                                               for a in missing):
            continue
        with _sglang_imports():
            module = importlib.import_module(f"sglang.srt.models.{name}")
        entries = getattr(module, "EntryClass", [])
        for cls in entries if isinstance(entries, list) else [entries]:
            ModelRegistry.models.setdefault(cls.__name__, cls)
        missing = [a for a in missing if a not in ModelRegistry.models]
        if not missing:
            return


def import_model_modules(config: Any) -> None:
    """:func:`prepare`, then import the sglang model module(s) of ``config``'s architectures (a
    built-in name, a folder, a config.json path, a dict or a transformers config): what a first
    build imports, done ahead of it (sender/warmup.py). Idempotent."""

    architectures = load_config(config).get("architectures")
    prepare()
    with _lock:
        _register_architecture(list(architectures or []))


def _rope_buffers_on_cpu_without_accelerator() -> None:
    """Some rope variants (GLM-4.7-Flash's DeepSeek-style scaling) ask for the accelerator to
    place their cos/sin cache, a buffer and no parameter: fall back to the CPU when none exists."""
    try:
        import sglang.srt.layers.rotary_embedding.rope_variant as rope_variant
    except ImportError:
        return
    original = getattr(rope_variant, "get_device", None)
    if original is None or getattr(original, "_p2pw_fallback", False):
        return

    def get_device(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RuntimeError:
            return "cpu"

    get_device._p2pw_fallback = True  # type: ignore[attr-defined]
    rope_variant.get_device = get_device


# -- stand-in parallel groups ----------------------------------------------------------------------
class StandInGroup:
    """The parts of sglang's GroupCoordinator that model construction and loaders read."""

    def __init__(self, name: str, ranks: list[int], rank: int):
        self.unique_name = f"p2pw_standin_{name}"
        self.ranks = list(ranks)
        self.rank = rank
        self.world_size = len(ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.local_rank = rank
        self.first_rank = self.ranks[0]
        self.last_rank = self.ranks[-1]
        self.is_first_rank = self.rank_in_group == 0
        self.is_last_rank = self.rank_in_group == self.world_size - 1
        self.device_group = None
        self.cpu_group = None

    def __repr__(self) -> str:
        return f"StandInGroup({self.unique_name}, rank {self.rank_in_group} of {self.ranks})"


def parallel_group_ranks(
    *,
    tp_size: int,
    pp_size: int = 1,
    attn_dp_size: int = 1,
    attn_cp_size: int = 1,
    moe_ep_size: int = 1,
    moe_dp_size: int = 1,
) -> dict[str, list[list[int]]]:
    """Every parallel group's rank lists, as ``initialize_model_parallel`` lays them out."""
    world = tp_size * pp_size
    attn_tp = tp_size // attn_dp_size // attn_cp_size
    moe_tp = tp_size // moe_ep_size // moe_dp_size
    tp_blocks = range(0, world, tp_size)
    groups: dict[str, list[list[int]]] = {
        "world_group": [list(range(world))],
        "tp_group": [list(range(b, b + tp_size)) for b in tp_blocks],
        "pp_group": [list(range(i, world, tp_size)) for i in range(tp_size)],
        "attn_tp_group": [
            list(range(b + i * attn_tp, b + (i + 1) * attn_tp)) for b in tp_blocks for i in range(attn_cp_size * attn_dp_size)
        ],
        "attn_cp_group": [
            list(range(b + d * attn_tp * attn_cp_size + t, b + (d + 1) * attn_tp * attn_cp_size + t, attn_tp))
            for b in tp_blocks
            for d in range(attn_dp_size)
            for t in range(attn_tp)
        ],
        "moe_dp_group": [
            list(range(b + i, b + tp_size + i, moe_tp * moe_ep_size)) for b in tp_blocks for i in range(moe_tp * moe_ep_size)
        ],
        "moe_ep_group": [
            list(range(b + d * tp_size // moe_dp_size + t, b + (d + 1) * tp_size // moe_dp_size + t, moe_tp))
            for b in tp_blocks
            for d in range(moe_dp_size)
            for t in range(moe_tp)
        ],
        "moe_tp_group": [
            list(range(b + i * moe_tp, b + (i + 1) * moe_tp)) for b in tp_blocks for i in range(moe_ep_size * moe_dp_size)
        ],
    }
    return groups


def stand_in_groups(parallel: Any, world_rank: int) -> dict[str, StandInGroup]:
    """The stand-in group holding ``world_rank`` for each parallel group of a published context."""
    lists = parallel_group_ranks(
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        attn_dp_size=parallel.attn_dp_size,
        attn_cp_size=parallel.attn_cp_size,
        moe_ep_size=parallel.moe_ep_size,
        moe_dp_size=parallel.moe_dp_size,
    )
    out = {}
    for name, rank_lists in lists.items():
        (ranks,) = [r for r in rank_lists if world_rank in r]
        out[name] = StandInGroup(name.removesuffix("_group"), ranks, world_rank)
    return out


# -- building ------------------------------------------------------------------------------------
def config_dir_of(config: Any) -> str:
    """A directory holding ``config.json``: the path itself, or a temp dir for an HF config."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        return os.path.dirname(path) if path.endswith(".json") else path
    directory = tempfile.mkdtemp(prefix="p2pw_config_")
    config.to_json_file(os.path.join(directory, "config.json"))
    return directory


def make_server_args(config: Any, engine: EngineLayout) -> Any:
    """sglang ``ServerArgs`` of the engine layout, for a GPU rank, unresolved."""
    prepare()
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=config_dir_of(config),
        device="cuda",
        skip_tokenizer_init=True,
        **engine.server_args(),
    )


def rank_context(server_args: Any, rank: int) -> Any:
    """A runtime context of engine rank ``rank`` with stand-in groups; DP attention initialized."""
    prepare()
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers import dp_attention

    context = rc.create_context(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
    parallel = context.parallel
    world = parallel.tp_size * parallel.pp_size
    if not 0 <= rank < world:
        raise ValueError(f"engine rank {rank} is not a rank of an engine of {world} ranks")
    with rc.use_context(context):
        parallel.override_permanently(**stand_in_groups(parallel, rank))
        # Without this, DP-attention layouts come out wrong with no error (PLATFORM.md).
        dp_attention.initialize_dp_attention(server_args)
    return context


def build_model(config: Any, engine: EngineLayout, rank: int, device: str = "meta") -> "torch.nn.Module":
    """The sglang model of engine rank ``rank`` of an engine with layout ``engine``.

    ``config`` is a directory with ``config.json`` (or the file, or a transformers config).
    ``device="meta"`` (the default) allocates nothing; see :func:`materialize` for real storage.
    The model carries its runtime context: run its loaders inside :func:`activate`.
    """
    import torch

    prepare()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    fp8_engine.check_quantization(config, engine)
    server_args = make_server_args(config, engine)
    with _lock, warnings.catch_warnings(), fp8_engine.block_shard_checks(engine, rank):
        warnings.simplefilter("ignore")
        from sglang.srt import runtime_context as rc

        try:
            context = rank_context(server_args, rank)
            with rc.use_context(context):
                if engine.gpu_arch is not None:  # its MoE runner decides whether experts are requantized
                    fp8_engine.moe_runner_flags()
                model_config = ModelConfig.from_server_args(server_args)
                _register_architecture(list(model_config.hf_config.architectures or []))
                load_config = LoadConfig()
                quant_config = _get_quantization_config(model_config, load_config)
                target = torch.device("meta") if device == "meta" else torch.device(device)
                # a Blackwell layout: sglang picks its kernels as on that engine (ServerArgs stay this host's)
                with set_default_torch_dtype(model_config.dtype), target, fp8_engine.engine_answers(engine):
                    model = _initialize_model(model_config, load_config, quant_config)
        except UnsupportedLayout:
            raise
        except Exception as e:  # sglang refuses the flags, or cannot build them on this host
            raise UnsupportedLayout(
                f"sglang cannot build engine layout {engine.describe()} rank {rank} here: {type(e).__name__}: {e}"
            ) from e
    setattr(model, _CONTEXT_ATTR, context)
    setattr(model, _SERVER_ARGS_ATTR, server_args)
    setattr(model, _LAYOUT_ATTR, engine)
    return model.eval()


@contextlib.contextmanager
def activate(model: "torch.nn.Module") -> Iterator[Any]:
    """Make ``model``'s runtime context current (its loaders read ranks from it), and, for a
    Blackwell layout, that engine's answers (``fp8_engine.engine_answers``). Not thread-safe
    against other contexts: sglang's context is process-global, so this holds a lock."""
    from sglang.srt import runtime_context as rc

    context = getattr(model, _CONTEXT_ATTR)
    with _lock, rc.use_context(context), warnings.catch_warnings(), \
            fp8_engine.engine_answers(getattr(model, _LAYOUT_ATTR, None)):
        warnings.simplefilter("ignore")
        yield context


def parameter_sites(model: "torch.nn.Module") -> dict[str, list[tuple["torch.nn.Module", str]]]:
    """Parameter name (as ``named_parameters`` gives it) → every (module, attribute) holding it.
    A tied parameter (lm_head = embed_tokens) has several sites; all must move together."""
    by_id: dict[int, list[tuple[Any, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append((module, attr))
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


def rebuild_parameter(old: "torch.nn.Parameter", data: "torch.Tensor") -> "torch.nn.Parameter":
    """A parameter of ``old``'s class and ``__dict__`` (``weight_loader``, ``output_dim``, ...)
    over ``data``. A meta parameter's ``.data`` cannot be set to a real tensor, and
    ``nn.Module.to_empty`` drops the attributes the loaders need."""
    import torch

    new = torch.Tensor._make_subclass(type(old), data, old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new


def install_parameter(sites: list[tuple["torch.nn.Module", str]], param: "torch.nn.Parameter") -> None:
    for module, attr in sites:
        module._parameters[attr] = param


def replace_parameters(model: "torch.nn.Module",
                       make: Callable[[str, "torch.nn.Parameter"], "torch.Tensor | None"]) -> None:
    """Rebuild every parameter over ``make(name, old)``'s storage (None keeps ``old``), in
    ``named_parameters`` order; tied parameters are rebuilt once and stay tied. What
    :func:`materialize` and the receiver's weight region (``receiver.region``) both use; the
    replica's slot views swap single parameters with :func:`rebuild_parameter` the same way."""
    params = dict(model.named_parameters())
    for name, sites in parameter_sites(model).items():
        data = make(name, params[name])
        if data is not None:
            install_parameter(sites, rebuild_parameter(params[name], data))


def materialize(model: "torch.nn.Module", device: str = "cpu", fill: float | None = 0.0) -> "torch.nn.Module":
    """Give every parameter, buffer and tensor attribute still on the meta device real storage on
    ``device``, in place.

    Each parameter keeps its class and ``__dict__`` (``weight_loader`` and friends); tied
    parameters stay tied. ``fill`` (default 0) initializes the storage so padding that loaders
    leave untouched compares equal.
    """
    import torch

    def real(t: "torch.Tensor") -> "torch.Tensor":
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        if fill is not None:
            out.fill_(fill)
        return out

    replace_parameters(model, lambda name, old: real(old) if old.device.type == "meta" else None)
    for module in model.modules():
        for attr, buf in module._buffers.items():
            if buf is not None and buf.device.type == "meta":
                module._buffers[attr] = real(buf)
        for attr, value in list(vars(module).items()):  # derived tensors some modules keep as attributes
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.is_meta:
                setattr(module, attr, real(value))
    return model


def run_update_session_hooks(model: "torch.nn.Module", device: str = "cpu") -> None:
    """What an engine's update session runs around the writes, on a materialized model:
    ``begin_weight_update`` (restore_weights_before_loading) then ``end_weight_update``
    (post_load_weights + process_weights_after_loading). For the layouts a replica supports the
    parameter bytes come out unchanged (see docs/replica.md); tests pin that."""
    import torch
    from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

    with activate(model):
        DefaultModelLoader.restore_weights_before_loading(model, torch.device(device))
        post_load_weights(model)
        DefaultModelLoader.postprocess_weights(model, torch.device(device))
