"""An engine rank's weight region: every parameter of its model in ONE contiguous, page-aligned
allocation (host memory, or GPU memory), registered once with the transport.

Parameters are placed in ``named_parameters`` order, each on a :data:`PARAM_ALIGNMENT` boundary;
each keeps its class and ``__dict__`` (``weight_loader``, ``output_dim``, ...) and tied parameters
stay tied (``replica.sglang_env.replace_parameters``, the one place parameters are rebuilt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..control.weights_digest import in_memory_order
from ..replica import sglang_env

if TYPE_CHECKING:
    import torch

PAGE = 4096
PARAM_ALIGNMENT = 256          # every parameter starts on this boundary inside the region


@dataclass
class WeightRegion:
    """One allocation holding every parameter of a rank: ``offsets[name] = (offset, nbytes)``."""

    storage: "torch.Tensor"     # the aligned uint8 view (keep alive)
    address: int
    nbytes: int
    offsets: dict[str, tuple[int, int]]


def aligned_bytes(nbytes: int, device: str = "cpu") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(the allocation, its page-aligned ``nbytes`` view), zeroed."""
    import torch

    raw = torch.zeros(nbytes + PAGE, dtype=torch.uint8, device=device)
    skip = (-raw.data_ptr()) % PAGE
    return raw, raw[skip:skip + nbytes]


def place_parameters(model: "torch.nn.Module", alignment: int = PARAM_ALIGNMENT, device: str = "cpu") -> WeightRegion:
    """Put every parameter of a meta-built model into one zeroed, page-aligned allocation (host, or
    GPU memory with ``device="cuda:N"``), in ``named_parameters`` order, each on an ``alignment``
    boundary; buffers and derived tensors get zeroed host storage of their own."""
    offsets: dict[str, tuple[int, int]] = {}
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        offsets[name] = (total, n)
        total += (n + alignment - 1) // alignment * alignment
    raw, region = aligned_bytes(max(total, 1), device)

    def view(name: str, old: "torch.nn.Parameter") -> "torch.Tensor":
        off, n = offsets[name]
        flat = region[off:off + n].view(old.dtype)
        if old.is_contiguous():
            return flat.view(old.shape)
        # a dense permutation of dimensions (Blackwell's MN-major packed scales): its strides, and its
        # numel x size bytes from its address in memory order, as the engine holds it
        if not in_memory_order(old).is_contiguous():
            raise ValueError(f"parameter {name} of shape {tuple(old.shape)} and strides {old.stride()} does not "
                             "fill its memory: it cannot be published as numel x size bytes from its address")
        return flat.as_strided(old.shape, old.stride())

    sglang_env.replace_parameters(model, view)
    sglang_env.materialize(model, "cpu")  # what is left on the meta device: buffers, tensor attributes
    model._p2pw_region_raw = raw  # type: ignore[attr-defined]  # keeps the allocation alive
    return WeightRegion(region, int(region.data_ptr()), int(total), offsets)
