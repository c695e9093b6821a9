"""Where an engine rank's delta records may write, and the tensors its index records are applied
through (:meth:`~p2pweights.deltas.area.DeltaArea.apply`'s ``regions`` and ``tensors``), for the hosts
that keep an area beside weights an engine placed (the sglang plugin, the vLLM backend).

- Weights in host memory: the registered byte ranges, merged where they touch, each seen as one
  uint8 tensor over its addresses.
- Weights on a GPU: one range per parameter, each seen through the parameter's own storage (a GPU
  address cannot be wrapped from outside torch; the caching allocator's neighbouring blocks are not
  one tensor). Index records find their rows by range, so many ranges cost the host's check a
  binary search, not a pass.
"""
from __future__ import annotations

import ctypes
from typing import Any, Iterable

from ..errors import LayoutMismatch
from ..transport.publication import merge_regions


def weights_device(params: Iterable[Any]) -> str:
    """Where every one of ``params`` lives (``cpu`` or ``cuda:N``): the device of a rank's delta area.
    LayoutMismatch when they are spread over devices, on meta, or none."""
    devices = {str(p.device) if p.device.type != "cuda" else f"cuda:{p.device.index or 0}" for p in params}
    if len(devices) != 1 or "meta" in devices:
        raise LayoutMismatch(f"the model's parameters are on {sorted(devices) or 'no device'}: p2pweights registers "
                             f"one rank's parameters on one device")
    return devices.pop()


def host_bytes(address: int, nbytes: int) -> Any:
    """A uint8 tensor over ``nbytes`` of host memory at ``address``."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)))


def host_views(ranges: Iterable[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[Any]]:
    """(regions, uint8 tensors) of host-memory weights at ``ranges`` (address, bytes), merged."""
    regions = list(merge_regions(ranges))
    return regions, [host_bytes(a, n) for a, n in regions]


def parameter_bytes(param: Any) -> Any:
    """A uint8 tensor over exactly the bytes a published parameter spans (``data_ptr``, ``numel`` x
    ``element_size``), through its own storage, on its device."""
    import torch

    nbytes = int(param.numel()) * param.element_size()
    storage = param.untyped_storage()
    start = int(param.data_ptr()) - int(storage.data_ptr())
    if start < 0 or start + nbytes > storage.nbytes():
        raise LayoutMismatch(f"a parameter of {tuple(param.shape)} spans bytes outside its own storage: "
                             f"no delta records can be applied to it")
    return torch.empty(0, dtype=torch.uint8, device=param.device).set_(storage, start, (nbytes,))


def device_views(named: Iterable[tuple[str, Any]]) -> tuple[list[tuple[int, int]], list[Any]]:
    """(regions, uint8 tensors) of GPU weights: one per parameter of ``named`` (name, parameter)."""
    regions, tensors = [], []
    for _, param in named:
        view = parameter_bytes(param)
        regions.append((int(view.data_ptr()), int(view.numel())))
        tensors.append(view)
    return regions, tensors
