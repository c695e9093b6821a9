"""Where a host's blocking verbs run (:class:`Workers`): on worker threads, off the event loop, so
the loop keeps reading other requests while a hook fans a verb out to the engine's ranks for
seconds. The server's locks are threading locks; a verb holds them on its own thread.

A request takes a thread only while its verb runs: never while its client sends the request (the
body is read whole first, :mod:`.guard`), nor while it waits for the answer to be read. Requests
that carried the engine's key (:data:`.guard.KEYED`, True where no key is set) have
``keyed`` threads of their own; requests without it (the health routes, which need no key) share a
few others: however many of those arrive, a keyed request waits only for other keyed ones.
Threads are daemon threads, kept a while for the next verb (:class:`DaemonThreads`): a hook that
never returns does not keep the process from exiting (the standard pools' threads are joined at
exit), and a verb does not pay for a new thread (0.2 ms, as much as the rest of its HTTP)."""
from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from typing import Any, Callable

from .guard import KEYED

KEYED_WORKERS = 64   # verbs of keyed requests that run at once (more wait their turn; none is refused)
OPEN_WORKERS = 4     # verbs of requests without the key (the health routes) that run at once
IDLE_S = 30.0        # seconds an idle worker thread waits for another verb before it ends


class DaemonThreads:
    """Daemon threads that run jobs (no-argument callables) handed to :meth:`run`: an idle one takes
    the job, else a new one starts; a thread idle for ``IDLE_S`` ends. How many run at once is the
    caller's to bound (:class:`Workers`' slots)."""

    def __init__(self, name: str, idle_s: float = IDLE_S):
        self.name, self.idle_s = name, idle_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0  # idle threads no job is promised to yet
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread's next job is this one
        if start:
            threading.Thread(target=self._work, args=(job,), name=self.name, daemon=True).start()
        else:
            self._jobs.put(job)

    def _work(self, job: Callable[[], None]) -> None:
        while True:
            job()
            with self._lock:
                self._idle += 1
            while True:
                try:
                    job = self._jobs.get(timeout=self.idle_s)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # no job is promised to an idle thread: this one may end
                            self._idle -= 1
                            return


class Workers:
    """``await workers.run(scope, fn, *args)``: ``fn(*args)`` on a worker thread of the request's
    kind (keyed or not), its result or its exception. Create it anywhere; use it on one event loop."""

    def __init__(self, keyed: int = KEYED_WORKERS, unkeyed: int = OPEN_WORKERS, name: str = "p2pw-verb"):
        self.sizes = {True: max(1, int(keyed)), False: max(1, int(unkeyed))}
        self.name = name
        self.threads = DaemonThreads(name)
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
                return await in_thread(fn, *args, threads=self.threads)
            finally:
                self._busy[keyed] -= 1


async def in_thread(fn: Callable[..., Any], *args: Any, threads: DaemonThreads | None = None) -> Any:
    """``fn(*args)`` on a daemon thread of ``threads`` (a new one without), in this task's context
    variables, awaited. Cancelled, the awaiting task returns at once; the thread finishes on its own
    and its result is dropped."""
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

    if threads is None:
        threading.Thread(target=work, name="p2pw-verb", daemon=True).start()
    else:
        threads.run(work)
    return await done
