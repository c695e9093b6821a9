"""Transfer buffers: the process's slots, allocated once, pinned, visible to numpy/torch without copies."""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import _native


class TransferBuffers:
    """``num_slots`` equal slots of ``slot_bytes`` (rounded up to the 2 MiB alignment).

    Host slots (``device="cpu"``) are pinned by CUDA host registration when a CUDA runtime and a
    device exist, else by mlock; if both fail, one warning and unpinned memory. GPU slots
    (``device="cuda[:N]"``) are one torch allocation wrapped by the native core.
    """

    def __init__(self, slot_bytes: int, num_slots: int = 2, *, pin: str = "auto", device: str = "cpu",
                 spare_bytes: int = 0):
        self.device = device
        self._gpu_tensor = None
        # slots may carry spare bytes after their data (a delta update's records, sender/delta_writes.py):
        # the writer posts from both parts; the loaders see the data part only
        self._data_bytes = slot_size(slot_bytes) if spare_bytes else 0
        if device == "cpu":
            self._native = _native.TransferBuffer.allocate(self._data_bytes + int(spare_bytes) if spare_bytes
                                                           else int(slot_bytes), int(num_slots), pin)
            if self._native.pin_warning:
                warnings.warn(self._native.pin_warning, RuntimeWarning, stacklevel=2)
        else:
            import torch  # GPU slots only: the native core itself never links torch

            align = _native.TransferBuffer.alignment
            slot = (int(slot_bytes) + int(spare_bytes) + align - 1) // align * align
            self._gpu_tensor = torch.empty(slot * int(num_slots), dtype=torch.uint8, device=device)
            index = self._gpu_tensor.device.index or 0
            self._native = _native.TransferBuffer.wrap(self._gpu_tensor.data_ptr(), slot, int(num_slots), f"cuda:{index}")

    @property
    def native(self) -> "_native.TransferBuffer":
        return self._native

    @property
    def slot_bytes(self) -> int:
        """The bytes of a slot the loaders fill (its spare bytes, if any, follow them)."""
        return self._data_bytes or self._native.slot_bytes

    @property
    def spare_bytes(self) -> int:
        return self._native.slot_bytes - self.slot_bytes

    @property
    def num_slots(self) -> int:
        return self._native.num_slots

    @property
    def address(self) -> int:
        return self._native.address

    @property
    def total_bytes(self) -> int:
        return self._native.total_bytes

    @property
    def pin_mode(self) -> str:
        return self._native.pin_mode

    @property
    def location(self) -> str:
        return self._native.location

    def slot_address(self, i: int) -> int:
        return self._native.slot_address(i)

    def slot_array(self, i: int) -> np.ndarray:
        """Slot i's data part as a writable uint8 numpy array (host slots; no copy)."""
        return np.frombuffer(self._native.slot_view(i), dtype=np.uint8)[:self.slot_bytes]

    def spare_array(self, i: int) -> np.ndarray:
        """Slot i's spare bytes (host slots; writes at slot offsets from ``slot_bytes`` on post them)."""
        return np.frombuffer(self._native.slot_view(i), dtype=np.uint8)[self.slot_bytes:]

    def slot_tensor(self, i: int):
        """Slot i as a uint8 torch tensor on the slot's device (no copy)."""
        import torch

        if self._gpu_tensor is not None:
            at = i * self._native.slot_bytes
            return self._gpu_tensor[at:at + self.slot_bytes]
        return torch.frombuffer(self._native.slot_view(i), dtype=torch.uint8)[:self.slot_bytes]

    def spare_tensor(self, i: int):
        """Slot i's spare bytes as a uint8 torch tensor on the slot's device (no copy)."""
        import torch

        if self._gpu_tensor is not None:
            at = i * self._native.slot_bytes
            return self._gpu_tensor[at + self.slot_bytes:at + self._native.slot_bytes]
        return torch.frombuffer(self._native.slot_view(i), dtype=torch.uint8)[self.slot_bytes:]

    def close(self) -> None:
        self._native.close()
        self._gpu_tensor = None

    def __enter__(self) -> "TransferBuffers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: slots when P2PW_NUM_SLOTS is unset: host slots double-buffer; GPU slots refill faster than a slot's
#: writes are seen complete, so two more hide that wait (benchmarks/RESULTS.md, issue 36 item 6)
HOST_SLOTS, GPU_SLOTS = 2, 4


def slot_count(settings: Any) -> int:
    """The number of slots of a sender's ``settings``: its ``num_slots`` (P2PW_NUM_SLOTS) when set,
    else by where they live (``buffer_device``)."""
    if settings.num_slots is not None:
        return int(settings.num_slots)
    return GPU_SLOTS if str(settings.buffer_device).startswith("cuda") else HOST_SLOTS


def slot_size(requested: int, largest_group_bytes: int = 0) -> int:
    """Slot size = max(requested buffer size, largest parameter group), rounded up to the alignment."""
    align = _native.TransferBuffer.alignment
    n = max(int(requested), int(largest_group_bytes), 1)
    return (n + align - 1) // align * align
