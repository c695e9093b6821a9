"""A sender's warm-up: what a cold connect would import, done on a thread from construction on.

``WeightSender(model, prepare=True)`` (or ``P2PW_PREPARE=1``) starts it: sglang is imported and the
model's sglang module with it (``sglang_env.import_model_modules``), most of a cold connect, while
the trainer builds its model, loads its checkpoint and starts its process groups. The transport
agent (and GPU slots) start then too (early_slots.py). A ``connect`` that builds a replica waits for
what is not done yet: calling it early is correct, only slower. One that finds every replica cached
(in the process or on disk) needs no sglang and leaves the warm-up running. The replicas themselves
are built in ``connect``: their layout is the engine's, read from it there.

A failure in the warm-up is raised by the next ``connect`` that waits for it (or comes after it
ended), as it was raised on the thread (the exception itself, with a note saying it came from the
warm-up); that connect does not retry it, the one after does.
"""
from __future__ import annotations

import threading
import time
from typing import Any


class Warmup:
    """``sglang_env.import_model_modules(config)`` on a daemon thread (an import cannot be stopped;
    a sender closed before it ends leaves it to finish)."""

    def __init__(self, config: Any):
        self.seconds: float | None = None  # the warm-up's own seconds, once done
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config,), name="p2pw-warmup", daemon=True)
        self._thread.start()

    def _run(self, config: Any) -> None:
        t0 = time.perf_counter()
        try:
            from ..replica import sglang_env

            sglang_env.import_model_modules(config)
        except BaseException as e:  # handed to wait()
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the warm-up ends; re-raise what it raised."""
        self._done.wait()
        if self.error is not None:
            error, self.error = self.error, None
            error.add_note("raised by the sender's warm-up (WeightSender(prepare=True) / P2PW_PREPARE=1), "
                           "which imports sglang and the model's sglang module on a thread from construction")
            raise error
