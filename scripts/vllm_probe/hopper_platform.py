"""Make vLLM believe it runs on an H100/H200 (sm90) so model construction, loaders and
process_weights_after_loading take the CUDA code paths (the engine's layout), on a CPU-only host.

Must run before anything reads vllm.platforms.current_platform. The CUDA extension modules
(vllm._C_stable_libtorch needs libcuda.so.1) are stubbed: building and loading never call them;
a post-processing step that does fails loudly (AttributeError on torch.ops._C.*).
"""
import sys, types


class _Stub(types.ModuleType):
    """A CUDA-only module: any attribute is a function that raises when called."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*a, **k):
            raise RuntimeError(f"{self.__name__}.{attr} needs CUDA (stubbed on this host)")
        return unavailable


STUBBED = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._qutlass_C",
           "vllm.vllm_flash_attn")


# torch.ops namespaces the CUDA extensions would register; layers look ops up at construction
# (SiluAndMul keeps torch.ops._C.silu_and_mul), never call them while building or loading.
OP_NAMESPACES = ("_C", "_moe_C", "_C_cache_ops", "_C_custom_ar")


def install(major=9, minor=0, name="NVIDIA H200"):
    import os
    import torch
    # The shared-experts overlap stream is a torch.cuda.Stream (no layout effect).
    os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"
    for mod in STUBBED:
        sys.modules.setdefault(mod, _Stub(mod))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class HopperStandIn(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(major=major, minor=minor)

        @classmethod
        def get_device_name(cls, device_id=0):
            return name

        @classmethod
        def get_device_total_memory(cls, device_id=0):
            return 141 << 30

        @classmethod
        def device_count(cls):
            return 8

        @classmethod
        def num_compute_units(cls, device_id=0):
            return 132

        @classmethod
        def is_integrated_gpu(cls, device_id=0):
            return False

        @classmethod
        def import_kernels(cls):
            pass

    platforms._current_platform = HopperStandIn()
    # Capability queries vLLM asks its CUDA extension at import time; answered as the compiled
    # scaled_mm_entry.cu answers for this capability with CUDA >= 12.8.
    import vllm._custom_ops as ops
    cap = major * 10 + minor
    ops.cutlass_scaled_mm_supports_fp8 = lambda c: c >= 89
    ops.cutlass_scaled_mm_supports_block_fp8 = lambda c: c >= 90
    ops.cutlass_group_gemm_supported = lambda c: c >= 90
    ops.cutlass_scaled_mm_supports_fp4 = lambda c: c >= 100
    ops.mxfp4_experts_quant_supported = lambda c: c >= 100
    # After vllm._custom_ops: it registers fake impls for the ops hasattr() finds.
    for ns in OP_NAMESPACES:
        torch.ops.__dict__[ns] = _Stub(f"torch.ops.{ns}")
    return platforms._current_platform
