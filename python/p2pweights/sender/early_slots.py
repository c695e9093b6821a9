"""A cold connect's transport agent (and GPU slots), made on a thread while the replicas build.

The first connect of a sender imports sglang, builds and probes its replicas, creates the
transport agent, and allocates and registers the slots. The agent needs no replica, nor do GPU
slots at the requested size (``P2PW_BUFFER_SIZE``, which the largest parameter group rarely
exceeds): they run beside the import (NIXL/UCX and CUDA start-up; the native calls release the
GIL). When a group turns out larger, the connect grows the slots as it always did. A sender made
with ``prepare=True`` starts them at construction instead (warmup.py).

Host slots are not made here: pinning them (mlock, cudaHostRegister) holds the process's memory-map
lock while it faults the pages in, and the import beside it -- every shared library it loads,
every large allocation -- waits on that lock. Measured on the CPU machine (1 GiB, mlock): the
import slowed by the pinning's own 3 s, a connect no faster (benchmarks/RESULTS.md, "Connect phases").
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .buffers import TransferBuffers


class EarlySlots:
    """``make_transport()`` then, for GPU slots (``device`` not "cpu"), ``TransferBuffers(slot_bytes,
    ...)`` registered with it, on a thread.

    :meth:`take` waits for them and returns ``(transport, buffers or None)``, or re-raises what
    failed there (after closing what was made). :meth:`discard` frees them unused. Seconds of each
    step are in ``seconds`` (they overlap the caller's own work)."""

    def __init__(self, make_transport: Callable[[], Any], slot_bytes: int, num_slots: int, *, pin: str,
                 device: str, spare_bytes: int = 0):
        self.seconds: dict[str, float] = {}
        self._result: tuple[Any, TransferBuffers | None] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(make_transport, slot_bytes, num_slots, pin, device, spare_bytes),
                                        name="p2pw-early-slots", daemon=True)
        self._thread.start()

    def _run(self, make_transport: Callable[[], Any], slot_bytes: int, num_slots: int, pin: str, device: str,
             spare_bytes: int) -> None:
        transport = buffers = None
        try:
            t0 = time.perf_counter()
            transport = make_transport()
            self.seconds = {"transport agent": time.perf_counter() - t0}
            if device != "cpu":  # host slots: after the replicas (the module's docstring says why)
                t1 = time.perf_counter()
                buffers = TransferBuffers(slot_bytes, num_slots, pin=pin, device=device, spare_bytes=spare_bytes)
                t2 = time.perf_counter()
                transport.register_memory(buffers.address, buffers.total_bytes, buffers.location)
                self.seconds.update({"buffer allocation + pinning": t2 - t1, "registration": time.perf_counter() - t2})
            self._result = (transport, buffers)
        except BaseException as e:  # handed to take()
            self._error = e
            if buffers is not None:
                buffers.close()
            if transport is not None:
                transport.close()

    def take(self) -> tuple[Any, TransferBuffers | None]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def discard(self) -> None:
        self._thread.join()
        if self._result is not None:
            transport, buffers = self._result
            self._result = None
            if buffers is not None:
                transport.deregister_memory(buffers.address)
                buffers.close()
            transport.close()
