"""Registering a rank's weights with Mooncake when they live in host memory (a CPU engine, such as
one on the ``p2pw_cpu`` platform), for sglang's
``--remote-instance-weight-loader-start-seed-via-transfer-engine``.

sglang 0.5.23's ``register_memory_region(model, transfer_engine)`` registers the CUDA caching
allocator's blocks that hold weights (``register_memory_region_v2``, from
``torch.cuda.memory.memory_snapshot()``). A CPU engine has no such blocks: on a CPU build of torch
the snapshot raises ``AttributeError: module 'torch._C' has no attribute '_cuda_memorySnapshot'`` and
the scheduler dies while starting. This AROUND hook leaves every engine with a CUDA parameter to
sglang. When every parameter is in host memory, it registers the parameters' byte ranges, merged
where they touch. These are the ranges a sender's writes are checked against
(``transport.publication.merge_regions``), so a write that the sender merged across two touching
parameters stays inside one registration. The hook returns sglang's own table
(``{name: (data_ptr, numel, element_size)}``), which sglang then publishes unchanged at the
engine-info bootstrap server.
"""
from __future__ import annotations

from typing import Any, Callable

from ..transport.publication import merge_regions

TARGET = "sglang.srt.model_loader.remote_instance_weight_loader_utils.register_memory_region"


def register_memory_region(original: Callable[..., Any], model: Any, transfer_engine: Any) -> Any:
    """sglang's registration for an engine with a CUDA parameter; for one whose parameters are all in
    host memory, register them and return sglang's weights table. Raises like sglang when Mooncake
    refuses a registration."""
    params = list(model.named_parameters())
    if not params or any(p.device.type != "cpu" for _, p in params):
        return original(model, transfer_engine)
    table = {name: (int(p.data_ptr()), int(p.numel()), int(p.element_size())) for name, p in params}
    for address, nbytes in merge_regions((ptr, numel * size) for ptr, numel, size in table.values()):
        ret = transfer_engine.register_memory(address, nbytes)
        if ret != 0:  # sglang's own message for a refused registration
            raise RuntimeError(f"register memory failed for weight block at address {address} "
                               f"with size {nbytes}, error: {ret}")
    return table
