"""GPU staging for host slots fed from GPU tensors.

sglang's loaders copy parameter by parameter; into a host slot that is hundreds of small
synchronous D2H copies at a third of the pinned bandwidth. Instead the loaders write a GPU staging
buffer, and asynchronous D2H copies on a side stream move it into the pinned host slot, one per
batch of loaded groups (a quarter of a slot), while the loaders go on with the next batch or the
next slot in the other staging buffer. So host-slot production runs at
the pinned D2H rate as long as the loaders on the GPU are faster than it.
"""
from __future__ import annotations

from typing import Any


class GpuStaging:
    """``depth`` GPU buffers of ``nbytes``, used in turn, and the side stream that copies them out."""

    def __init__(self, nbytes: int, device: Any, depth: int = 2):
        import torch

        if depth < 1:
            raise ValueError(f"staging depth must be >= 1, got {depth}")
        self.device = torch.device(device)
        self.buffers = [torch.empty(int(nbytes), dtype=torch.uint8, device=self.device) for _ in range(depth)]
        self.stream = torch.cuda.Stream(device=self.device)
        self._copies: list[Any] = [None] * depth  # the event of the last copy out of each buffer
        self._next = 0

    @property
    def nbytes(self) -> int:
        return self.buffers[0].numel()

    def fits(self, nbytes: int, device: Any) -> bool:
        import torch

        return self.nbytes >= nbytes and torch.device(device) == self.device

    def target(self) -> Any:
        """The buffer the next slot's loaders write; waits until its previous copy-out is done
        (with two buffers that copy had a whole slot of loading to finish in)."""
        done = self._copies[self._next]
        if done is not None:
            done.synchronize()
            self._copies[self._next] = None
        return self.buffers[self._next]

    def copy_out(self, host: Any, start: int, end: int) -> Any:
        """Queue ``buffer[start:end] → host[start:end]`` behind the loaders' work queued so far on
        the current stream. Returns the CUDA event that marks it (and every earlier copy) done:
        the slot may be written out only after its last one."""
        import torch

        buf = self.buffers[self._next]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host[start:end].copy_(buf[start:end], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._copies[self._next] = done
        return done

    def advance(self) -> None:
        """The current slot is complete: the next one's loaders take the next buffer."""
        self._next = (self._next + 1) % len(self.buffers)

    def synchronize(self) -> None:
        """Every queued copy-out has landed."""
        for i, done in enumerate(self._copies):
            if done is not None:
                done.synchronize()
                self._copies[i] = None
