"""A Python thread spinning beside the work being measured, as a trainer's loaders would run: how
much of the GIL (and the CPU) does the work leave to Python? Used by `p2pweights bench transport`
and the NIXL/Mooncake GIL benchmarks under benchmarks/."""
from __future__ import annotations

import time
from typing import Any


def _schedstat() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable but waiting for one); Linux only."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, wait, _ = f.read().split()
        return int(cpu) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


class PythonLoop:
    """A Python thread counting loop turns, as a trainer's loaders would run beside the writes.

    rate: turns per second ("py loop" = rate while the writes run / rate idle: what the data path
    leaves to Python, GIL and CPU together). blocked: the share of the wall time the loop was
    neither on a CPU nor waiting for one, i.e. asleep waiting for the GIL ("py blocked"); it does not
    depend on how loaded the machine's cores are."""

    def __init__(self) -> None:
        import threading

        self.turns = 0
        self.blocked = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        stop = self._stop
        t0, (cpu0, wait0) = time.perf_counter(), _schedstat()
        while not stop.is_set():
            self.turns += 1
        wall, (cpu1, wait1) = time.perf_counter() - t0, _schedstat()
        if cpu1 > 0:
            self.blocked = max(0.0, 1 - ((cpu1 - cpu0) + (wait1 - wait0)) / wall)

    def __enter__(self) -> "PythonLoop":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.rate = self.turns / (time.perf_counter() - self._t0)

    @classmethod
    def idle_rate(cls, seconds: float = 0.3) -> float:
        with cls() as loop:
            time.sleep(seconds)
        return loop.rate
