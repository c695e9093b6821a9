"""The first write waits for the engines' sessions: the writer as the slot pipeline sees it while
sender 0 pauses the engines and opens their session on a thread (sender/update.py).

Producing slots touches no engine (the slots are the sender's own memory), so the loaders may fill
them while ``pause_generation`` and ``begin_weight_update`` are in flight; but no byte may reach
an engine before every engine's session is open. Every slot reaches the writer through
:meth:`OpenGate.submit` (``SlotHandOver`` holds this gate in the writer's place), which blocks
until the opening is over; when it failed, the slot is released unwritten and nothing is ever
written by this update. ``submitted`` counts the slots that did reach the writer.
"""
from __future__ import annotations

import threading
import time
from typing import Any


class OpenGate:
    """The writer's ``acquire``/``submit``/``release_slot``/``buffers``, with ``submit`` held until
    :meth:`opened` (or :meth:`failed`) was called. Starts open unless :meth:`close` was called."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.submitted = 0  # slots handed to the writer
        self.dropped = 0    # slots released unwritten because the opening failed
        self.first_submit_at: float | None = None  # perf_counter() when the first slot reached the writer
        self.held_seconds = 0.0  # how long submits waited for the opening
        self.holding = 0         # submits waiting for the opening now
        self._open = threading.Event()
        self._open.set()
        self._failed = False

    @property
    def buffers(self) -> Any:
        return self.writer.buffers

    def acquire(self, *args: Any, **kwargs: Any) -> int:
        return self.writer.acquire(*args, **kwargs)

    def release_slot(self, slot: int) -> None:
        self.writer.release_slot(slot)

    def close(self) -> None:
        """The sessions are being opened: hold every submit until :meth:`opened` or :meth:`failed`."""
        self._failed = False
        self._open.clear()

    def opened(self) -> None:
        self._open.set()

    def failed(self) -> None:
        """The opening failed: every slot submitted from now on is released unwritten."""
        self._failed = True
        self._open.set()

    def submit(self, slot: int, rows: Any) -> None:
        if not self._open.is_set():
            t0 = time.perf_counter()
            self.holding += 1
            self._open.wait()  # the opening ends by itself: every control call it makes has a timeout
            self.holding -= 1
            self.held_seconds += time.perf_counter() - t0
        if self._failed:
            self.dropped += 1
            self.writer.release_slot(slot)
            return
        self.submitted += 1
        if self.first_submit_at is None:
            self.first_submit_at = time.perf_counter()
        self.writer.submit(slot, rows)
