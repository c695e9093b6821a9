"""vLLM's post-processing, replayed on send for the modules whose kernels rewrite the loaded bytes.

On vLLM's default Hopper configuration two kernels post-process FP8 128 x 128 block weights into
other bytes (docs/vllm.md, "Replaying the default kernels' post-processing on send"):

- ``deepgemm_e8m0``: an FP8 block linear vLLM's oracle gives DeepGEMM (``VLLM_USE_DEEP_GEMM=1``,
  the default). ``DeepGemmFp8BlockScaledMMKernel.process_weights_after_loading`` runs
  ``fp8_utils.deepgemm_post_process_fp8_weight_block``: ``requant_weight_ue8m0_inplace`` (every
  128 x 128 block dequantized and requantized with a power-of-two scale, in place), then DeepGEMM's
  scale layout, which on sm90 keeps FP32 128 x 128 weight scales as they are
  (:mod:`.vllm_engine_kernels`). ``FlashInferFp8DeepGEMMDynamicBlockScaledKernel`` runs the same
  (its DeepGEMM fallback's post-processing).
- ``flashinfer_cutlass_w31``: FP8 block experts vLLM's FP8 MoE oracle gives FlashInfer CUTLASS (first
  on sm90 under expert parallelism, or ``--moe-backend flashinfer_cutlass``).
  ``Fp8MoEMethod.process_weights_after_loading`` runs ``flashinfer_utils.prepare_fp8_moe_layer_for_fi``:
  ``swap_w13_to_w31`` of ``w13_weight`` and of its block scales, and block scales clamped to 1e-10.

Both are functions of the loaded bytes of one parameter (a weight with its scale, which are always
in one parameter group: :mod:`.groups`), so the sender produces them itself:
:func:`replay_post_processing` takes the loaders' bytes of a group from its slot, puts them in a
materialized copy of each such module (its parameters cloned, the module and its quantization
method shallow-copied), runs that module's own ``quant_method.process_weights_after_loading`` under
the rank's vLLM context, and writes the post-processed parameters back over the loaders' bytes:
what the engine's parameters hold once its own post-processing ran. Parameters of the module the
group does not hold are zeros in the copy and are not read back.

The engine, at the end of an update, must then not post-process those modules again (a second
``swap_w13_to_w31`` swaps back): :func:`replayed_already` has vLLM's own ``weights_already_processed``
(its weight-cache loader's "already in runtime format") active for exactly those modules' quant
methods. Both sides decide which modules with :func:`replayed_transform`, from the kernel vLLM
chose for the module; this module imports neither torch nor vLLM at import time.
"""
from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from ..errors import LayoutMismatch
from .sglang_env import rebuild_parameter

if TYPE_CHECKING:
    import torch

    from .groups import SlotRegion

#: FP8 linear kernels whose post-processing is DeepGEMM's (E8M0 requantization; sm90 scale layout: kept)
DEEPGEMM_LINEAR_KERNELS = ("DeepGemmFp8BlockScaledMMKernel", "FlashInferFp8DeepGEMMDynamicBlockScaledKernel")
#: FP8 MoE backends whose post-processing swaps w13 to w31 (block FP8 on sm90)
FLASHINFER_W31_MOE_BACKENDS = ("FLASHINFER_CUTLASS",)
#: the transforms, by name (tests and check-layout name them)
TRANSFORMS = ("deepgemm_e8m0", "flashinfer_cutlass_w31")


def replayed_transform(module: Any) -> str | None:
    """The transform the sender replays for ``module`` (one of :data:`TRANSFORMS`), or None when its
    post-processing keeps the loaded bytes or it has no quantization method."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return None
    kernel = getattr(method, "fp8_linear", None)
    if kernel is not None and type(kernel).__name__ in DEEPGEMM_LINEAR_KERNELS:
        return "deepgemm_e8m0"
    backend = getattr(method, "fp8_backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) in FLASHINFER_W31_MOE_BACKENDS \
            and getattr(method, "block_quant", False):
        return "flashinfer_cutlass_w31"
    return None


def replayed_modules(model: "torch.nn.Module") -> dict[str, str]:
    """Module name -> transform, for every module of ``model`` the sender replays."""
    out = {}
    for name, module in model.named_modules():
        transform = replayed_transform(module)
        if transform is not None:
            out[name] = transform
    return out


class ModuleReplay:
    """One replica's replayed modules: which parameters belong to which, and the replay itself."""

    def __init__(self, model: "torch.nn.Module"):
        self.model = model
        self.transforms = replayed_modules(model)
        self.module_of: dict[str, str] = {}  # parameter name -> replayed module name
        for mname in self.transforms:
            for attr, p in model.get_submodule(mname)._parameters.items():
                if p is not None:
                    self.module_of[f"{mname}.{attr}" if mname else attr] = mname

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def why_not_a_copy(self, params: Sequence[str]) -> str | None:
        """Why a group holding ``params`` cannot be a copy plan: its bytes are post-processed."""
        touched = sorted({self.transforms[self.module_of[p]] for p in params if p in self.module_of})
        if not touched:
            return None
        return f"vLLM's post-processing ({', '.join(touched)}) is replayed on its bytes, which a copy cannot do"

    def apply(self, regions: Sequence["SlotRegion"], slot: "torch.Tensor", specs: Mapping[str, Any],
              context: Any) -> list[str]:
        """Replace the loaders' bytes of every replayed module's parameters among ``regions`` (in
        ``slot``) by the module's post-processed bytes. ``specs``: parameter name -> TensorSpec;
        ``context(model)``: the rank's vLLM context. Returns the modules replayed."""
        import torch

        by_module: dict[str, dict[str, "torch.Tensor"]] = {}
        for region in regions:
            mname = self.module_of.get(region.param_name)
            if mname is None:
                continue
            spec = specs[region.param_name]
            view = slot[region.offset:region.offset + region.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)
            attr = region.param_name[len(mname) + 1:] if mname else region.param_name
            by_module.setdefault(mname, {})[attr] = view
        if not by_module:
            return []
        with context(self.model):
            for mname, views in by_module.items():
                _replay_module(self.model.get_submodule(mname), mname, views)
        return sorted(by_module)


def _replay_module(module: "torch.nn.Module", name: str, views: Mapping[str, "torch.Tensor"]) -> None:
    """Run ``module``'s own ``quant_method.process_weights_after_loading`` on a materialized copy
    holding ``views``' bytes (other parameters zero), then write the results into ``views``."""
    import torch

    clone = copy.copy(module)  # a shallow copy: the parameter tables and the method are copied below
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = dict(module._modules)
    clone.quant_method = copy.copy(module.quant_method)  # the method keeps state (its MoE kernel)
    device = next(iter(views.values())).device
    for attr, p in module._parameters.items():
        if p is None:
            continue
        data = views[attr].clone() if attr in views else torch.zeros(p.shape, dtype=p.dtype, device=device)
        clone._parameters[attr] = rebuild_parameter(p, data)
    clone.quant_method.process_weights_after_loading(clone)
    for attr, view in views.items():
        out = clone._parameters.get(attr)
        if out is None or tuple(out.shape) != tuple(view.shape) or out.dtype != view.dtype \
                or (out.numel() > 1 and not out.is_contiguous()):
            got = "nothing" if out is None else f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
            raise LayoutMismatch(f"vLLM's post-processing of {name} left {attr} as {got}; the engine's parameter is "
                                 f"{tuple(view.shape)} {view.dtype}, contiguous: the replay cannot write it there")
        view.copy_(out.data)


@contextlib.contextmanager
def replayed_already(models: Sequence["torch.nn.Module"]) -> Iterator[list[str]]:
    """The engine's side: while the block runs (vLLM's ``process_weights_after_loading`` at the end of
    an update), every module of ``models`` whose post-processing the sender replayed runs its quant
    method's ``process_weights_after_loading`` under vLLM's ``weights_already_processed()``: the
    weights are already in the kernel's format, so vLLM rebuilds only the kernel's state (the MoE
    kernel) and transforms no tensor. Yields the names of those modules."""
    from vllm.model_executor.utils import weights_already_processed

    wrapped: list[tuple[Any, bool, Any]] = []
    names: list[str] = []

    def already(method: Any, original: Any) -> Any:
        def process_weights_after_loading(layer: Any) -> Any:
            with weights_already_processed():
                return original(layer)
        return process_weights_after_loading

    seen: set[int] = set()
    for model in models:
        for name, module in model.named_modules():
            if replayed_transform(module) is None or id(module.quant_method) in seen:
                continue
            method = module.quant_method
            seen.add(id(method))
            own = "process_weights_after_loading" in vars(method)
            wrapped.append((method, own, vars(method).get("process_weights_after_loading")))
            method.process_weights_after_loading = already(method, method.process_weights_after_loading)
            names.append(name)
    try:
        yield names
    finally:
        for method, own, before in reversed(wrapped):
            if own:
                method.process_weights_after_loading = before
            else:
                del method.process_weights_after_loading
