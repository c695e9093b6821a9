"""Where a host's blocking verbs run (:class:`Workers`): on worker threads, off the event loop, so
the loop keeps reading other requests while a hook fans a verb out to the engine's ranks for
seconds. The server's locks are threading locks; a verb holds them on its own thread.

A request takes a thread only while its verb runs: never while its client sends the request (the
body is read whole first, :mod:`.guard`), nor while it waits for the answer to be read. Requests
that carried the engine's key (:data:`.guard.KEYED`, True where no key is set) have
``keyed`` threads of their own; requests without it (the health routes, which need no key) share a
few others: however many of those arrive, a keyed request waits only for other keyed ones.
Threads are daemon threads, one per running verb: a hook that never returns does not keep the
process from exiting (a pool's threads would be joined at exit)."""
from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Callable

from .guard import KEYED

KEYED_WORKERS = 64   # verbs of keyed requests that run at once (more wait their turn; none is refused)
OPEN_WORKERS = 4     # verbs of requests without the key (the health routes) that run at once


class Workers:
    """``await workers.run(scope, fn, *args)``: ``fn(*args)`` on a worker thread of the request's
    kind (keyed or not), its result or its exception. Create it anywhere; use it on one event loop."""

    def __init__(self, keyed: int = KEYED_WORKERS, unkeyed: int = OPEN_WORKERS, name: str = "p2pw-verb"):
        self.sizes = {True: max(1, int(keyed)), False: max(1, int(unkeyed))}
        self.name = name
        self._slots: dict[bool, asyncio.Semaphore] = {}
        self._busy = {True: 0, False: 0}

    def busy(self, keyed: bool | None = None) -> int:
        """Threads running a verb now (of keyed requests, of the others, or all)."""
        return sum(self._busy.values()) if keyed is None else self._busy[bool(keyed)]

    async def run(self, scope: dict, fn: Callable[..., Any], *args: Any) -> Any:
        keyed = bool(scope.get(KEYED, True))
        slots = self._slots.get(keyed)
        if slots is None:
            slots = self._slots[keyed] = asyncio.Semaphore(self.sizes[keyed])
        async with slots:
            self._busy[keyed] += 1
            try:
                return await in_thread(fn, *args, name=self.name)
            finally:
                self._busy[keyed] -= 1


async def in_thread(fn: Callable[..., Any], *args: Any, name: str = "p2pw-verb") -> Any:
    """``fn(*args)`` on a new daemon thread (in this task's context variables), awaited. Cancelled,
    the awaiting task returns at once; the thread finishes on its own and its result is dropped."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        result, error = None, None
        try:
            result = context.run(fn, *args)
        except Exception as e:  # noqa: BLE001 - handed to the awaiting task
            error = e
        except BaseException as e:  # noqa: BLE001 - SystemExit and the like cannot cross into a future
            error = RuntimeError(f"the verb's thread stopped: {type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: the server stopped meanwhile
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    return await done
