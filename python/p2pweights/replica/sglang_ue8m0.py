"""sglang's Blackwell FP8 post-processing (DeepGEMM with UE8M0 scales), replayed on send.

On an sm100 engine sglang 0.5.23 runs FP8 block GEMMs on DeepGEMM with UE8M0 scales
(``deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0``), and its ``process_weights_after_loading`` rewrites
each such layer's loaded bytes (``fp8_utils.requant_block_scale_ue8m0_for_deepgemm``, gated by
``should_deepgemm_weight_requant_ue8m0``: 128x128 blocks, BF16 output, N % 64, K % 128):

- **ue8m0_requant** (``requant_weight_ue8m0``): the FP8 weight is dequantized to BF16
  (``block_quant_dequant``) and quantized again with power-of-two scales
  (``quant_weight_ue8m0`` -> ``per_block_cast_to_fp8`` -> ``ceil_to_ue8m0``); experts group by group
  (``_requant_weight_ue8m0_grouped``). Plain torch: it runs here as on the engine.
- **ue8m0_pack** (``transform_scale_ue8m0``): the float32 scales are repeated per weight row
  (``index_select``, torch) and packed four UE8M0 bytes to an int32, MN-major and TMA-aligned, by
  DeepGEMM's ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` (a JIT CUDA kernel of DeepGEMM's
  extension: it cannot load here). Its reference is DeepGEMM's torch implementation, which DeepGEMM's
  ``tests/test_layout.py`` holds equal to the kernel in values, shape and strides, which the kernel's
  own C++ falls back to for some shapes, and which sglang keeps as
  ``fp8_utils._get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl`` (``inverse_transform_scale_ue8m0``
  asserts the engine's packed scales equal it). :func:`.fp8_engine.engine_answers` runs that function in the
  kernel's place, with DeepGEMM's two size helpers (``align``, ``get_tma_aligned_size``: 16-byte TMA
  alignment, ``csrc/utils/math.hpp``) stood in. The kernel itself is read, not run.

The scale parameter then holds int32 ``[N, ceil(K/512)]`` (experts ``[E, N, ceil(K/512)]``) with
strides ``(1, N)``: its bytes in memory are the packed scales MN-major (N % 64 == 0, so no TMA
padding rows), ``numel * 4`` bytes from its address, what the engine publishes. The slot holds
exactly those bytes (:func:`memory_bytes`).

**Not applied twice.** ``requant_block_scale_ue8m0_for_deepgemm`` skips a scale whose parameter has
``format_ue8m0`` set, which it sets at the engine's first load; an update's ``end_weight_update``
therefore keeps the bytes the sender wrote. The requantization itself is not idempotent (a block
whose largest FP8 value is 224 or less gets half the scale and doubled bytes on a second pass,
sglang's own remark in ``model_runner._gather_block_fp8_linear``): tests/test_sglang_ue8m0_replay.py
proves both.

Everything here is scoped: :func:`.fp8_engine.engine_answers` changes sglang's answers only while a Blackwell
layout's model is built, loaded or post-processed (under the replica's lock), never globally.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..control.weights_digest import in_memory_order
from ..errors import LayoutMismatch, UnsupportedLayout
from ..models.checkpoint import TensorSpec
from .groups import SLOT_ALIGNMENT, ParameterGroup, SlotRegion
from .sglang_env import activate, rebuild_parameter

if TYPE_CHECKING:
    import torch

#: the transforms, by name (tests and docs name them)
TRANSFORMS = ("ue8m0_requant", "ue8m0_pack")


def memory_bytes(t: "torch.Tensor") -> "torch.Tensor":
    """A tensor's bytes as they lie in memory from its address (flat uint8): its contiguous bytes,
    or, for a dense permutation of dimensions (DeepGEMM's MN-major packed scales), those of the
    permuted tensor. Anything with holes is refused (a publication of numel x size bytes from the
    address would not be its elements)."""
    import torch

    t = in_memory_order(t.detach())  # the verify digest's order too (control/weights_digest.py)
    if not t.is_contiguous():
        raise LayoutMismatch(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} does not fill its "
                             "memory: its bytes are not numel x size from its address")
    return t.reshape(-1).view(torch.uint8)


def _clone(module: "torch.nn.Module", data: Mapping[str, "torch.Tensor"], device: Any) -> "torch.nn.Module":
    """A shallow copy of ``module`` whose parameters hold ``data`` (others: zeros on ``device``) and
    whose quant method is its own copy (post-processing keeps state on it)."""
    import torch

    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = dict(module._modules)
    clone.quant_method = copy.copy(module.quant_method)
    for attr, p in module._parameters.items():
        if p is not None:
            tensor = data[attr] if attr in data else torch.zeros(p.shape, dtype=p.dtype, device=device)
            clone._parameters[attr] = rebuild_parameter(p, tensor)
    return clone


def _post_processed(module: "torch.nn.Module", data: Mapping[str, "torch.Tensor"], device: Any) -> "torch.nn.Module":
    clone = _clone(module, data, device)
    clone.quant_method.process_weights_after_loading(clone)
    return clone


class Ue8m0Replay:
    """One Blackwell rank's replayed modules: learned by running sglang's own post-processing of
    every quantized module on a meta copy (which parameters change shape, dtype or strides, and that
    ``requant_block_scale_ue8m0_for_deepgemm`` marked them ``format_ue8m0``), then run on the loaded
    bytes of each group."""

    def __init__(self, model: "torch.nn.Module", engine: Any):
        import torch

        self.model, self.engine = model, engine
        self.transforms: dict[str, str] = {}  # module name -> "ue8m0_requant+ue8m0_pack"
        self.module_of: dict[str, str] = {}  # parameter name -> replayed module name
        self.specs: dict[str, TensorSpec] = {}  # parameter name -> the post-processed spec
        with activate(model):
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                if method is None or not hasattr(method, "process_weights_after_loading") \
                        or type(method).__name__ not in ("Fp8LinearMethod", "Fp8MoEMethod"):
                    continue
                meta = {a: torch.empty(p.shape, dtype=p.dtype, device="meta")
                        for a, p in module._parameters.items() if p is not None}
                out = _post_processed(module, meta, "meta")
                marked = [a for a, p in out._parameters.items() if getattr(p, "format_ue8m0", False)]
                changed = [a for a, p in out._parameters.items() if p is not None and
                           (tuple(p.shape) != tuple(meta[a].shape) or p.dtype != meta[a].dtype or not p.is_contiguous())]
                if changed and not marked:
                    raise UnsupportedLayout(f"{name}: sglang's post-processing on {engine.get('gpu_arch')} rewrites "
                                            f"{', '.join(changed)} by another transform than the UE8M0 one replayed")
                if not marked:
                    continue
                self.transforms[name] = "+".join(TRANSFORMS)
                for attr, p in out._parameters.items():
                    if p is None:
                        continue
                    full = f"{name}.{attr}" if name else attr
                    self.module_of[full] = name
                    self.specs[full] = TensorSpec(tuple(p.shape), str(p.dtype).removeprefix("torch."))

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def why_not_a_copy(self, params: Sequence[str]) -> str | None:
        if any(p in self.module_of for p in params):
            return ("sglang's Blackwell post-processing (UE8M0 requantization and DeepGEMM scale packing) is "
                    "replayed on its bytes, which a copy cannot do")
        return None

    def apply(self, loaded: Mapping[str, "torch.Tensor"], out: Mapping[str, "torch.Tensor"]) -> list[str]:
        """``loaded``: parameter -> the loaders' tensor; ``out``: parameter -> its flat uint8 slot
        region. Writes each replayed module's post-processed bytes in memory order; returns the modules."""
        by_module: dict[str, dict[str, "torch.Tensor"]] = {}
        for param, tensor in loaded.items():
            name = self.module_of.get(param)
            if name is not None:
                by_module.setdefault(name, {})[param[len(name) + 1:] if name else param] = tensor
        if not by_module:
            return []
        with activate(self.model):
            for name, data in by_module.items():
                done = _post_processed(self.model.get_submodule(name), data, next(iter(data.values())).device)
                for attr in data:
                    param = f"{name}.{attr}" if name else attr
                    got, region = memory_bytes(done._parameters[attr].data), out[param]
                    if got.numel() != region.numel():
                        raise LayoutMismatch(f"sglang's post-processing of {name} left {attr} with {got.numel()} "
                                             f"bytes, the engine's parameter has {region.numel()}")
                    region.copy_(got)
        return sorted(by_module)


def load_post_processed(loading: Any, replay: Ue8m0Replay, placed: Sequence[tuple[ParameterGroup, int]],
                        hf_tensors: Mapping[str, "torch.Tensor"], slot: "torch.Tensor") -> list[SlotRegion]:
    """A Blackwell replica's ``load_groups``: ``loading`` (the replica laid out by the loaders'
    shapes) loads the groups into a scratch slot; then each replayed module's parameters get sglang's
    post-processed bytes (``replay``) and every other parameter its loaded bytes, in ``slot`` laid
    out by ``placed`` (the engine's post-processed shapes, what it publishes)."""
    import torch

    scratch_placed, offset = [], 0
    for group, _ in placed:
        scratch_placed.append((loading.groups[group.index], offset))
        offset += -(-loading.groups[group.index].nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    scratch = torch.empty(max(offset, 1), dtype=torch.uint8, device=slot.device)
    loaded_regions = {r.param_name: r for r in loading.load_groups(scratch_placed, hf_tensors, scratch)}
    regions, loaded, out = [], {}, {}
    for group, base in placed:
        if slot.numel() < base + group.nbytes:
            raise LayoutMismatch(f"slot of {slot.numel()} bytes has no room for group {group.index} "
                                 f"({group.nbytes} bytes) at offset {base}")
        for region in group.regions:
            placed_region = SlotRegion(region.param_name, base + region.offset, region.nbytes)
            regions.append(placed_region)
            src = loaded_regions[region.param_name]
            raw = scratch[src.offset:src.offset + src.nbytes]
            dst = slot[placed_region.offset:placed_region.offset + region.nbytes]
            if region.param_name in replay.module_of:
                spec = loading.param_specs[region.param_name]
                loaded[region.param_name] = raw.view(getattr(torch, spec.dtype)).view(spec.shape)
                out[region.param_name] = dst
            else:
                dst.copy_(raw)
    replay.apply(loaded, out)
    return regions


def post_process_as_loaded(model: "torch.nn.Module", engine: Any) -> Ue8m0Replay:
    """A Blackwell rank's model (built on the meta device) as an sm100 engine holds it after its
    first load: each module :class:`Ue8m0Replay` replays post-processed in place by its own
    ``process_weights_after_loading`` (the same call the replay and check-layout's reference make),
    so its scale is the int32 packed MN-major parameter marked ``format_ue8m0`` and its shapes are
    those the replica publishes. What a receiver rank emulating sm100 does before placing its
    parameters (``receiver/rank.py``); the bytes a sender writes there stay, as on the engine."""
    replay = Ue8m0Replay(model, engine)
    with activate(model):
        for name in replay.transforms:
            module = model.get_submodule(name)
            module.quant_method.process_weights_after_loading(module)
    return replay
