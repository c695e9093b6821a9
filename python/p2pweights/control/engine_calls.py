"""One verb on many engines at once: ``call_engines`` runs it on every engine concurrently and
collects each engine's failure (``EngineCalls``); ``recording_verbs`` logs what each verb took.
``UpdateSession`` (update_session.py) drives a whole weight update with it."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from ..errors import EnginesFailed
from .sglang import SglangEngine


@dataclass
class EngineCalls:
    """What one verb did on each engine: ``results`` (name -> answer) and ``errors`` (name -> error)."""

    verb: str
    results: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_for_errors(self) -> None:
        """One EnginesFailed (an EngineError) naming every failed engine and why; ``.failures`` maps
        name -> text, ``.errors`` name -> exception."""
        if self.errors:
            raise engines_failed(self.verb, self.errors)


def engines_failed(verb: str, errors: Mapping[str, BaseException]) -> EnginesFailed:
    return EnginesFailed(dict(errors), what=verb)


#: where call_engines records (verb, seconds, engines) while ``recording_verbs()`` is active
verb_log: ContextVar[list | None] = ContextVar("p2pwverb_log", default=None)


@contextmanager
def recording_verbs() -> Iterator[list[tuple[str, float, int]]]:
    """Within the block, every ``call_engines`` of this thread appends (verb, seconds, number of
    engines) to the list it yields: the sender logs each control phase from it."""
    log: list[tuple[str, float, int]] = []
    token = verb_log.set(log)
    try:
        yield log
    finally:
        verb_log.reset(token)


def call_engines(engines: Iterable[SglangEngine], verb: str | Callable[[SglangEngine], Any], *args: Any,
                 **kwargs: Any) -> EngineCalls:
    """Run ``verb`` (an SglangEngine method name, or a callable taking the engine) on every engine
    concurrently, one thread each; never raises for an engine's failure, collects it instead."""
    engines = list(engines)
    check_unique_names(engines)
    label = verb if isinstance(verb, str) else getattr(verb, "__name__", "call")
    calls = EngineCalls(verb=label)
    if not engines:
        return calls

    def one(engine: SglangEngine) -> Any:
        if isinstance(verb, str):
            return getattr(engine, verb)(*args, **kwargs)
        return verb(engine, *args, **kwargs)

    t0 = time.perf_counter()
    if len(engines) == 1:  # one engine: in this thread (a thread's start is a tenth of a verb's round trip)
        try:
            calls.results[engines[0].name] = one(engines[0])
        except Exception as e:  # noqa: BLE001 - every engine's failure is data here
            calls.errors[engines[0].name] = e
    else:
        with ThreadPoolExecutor(max_workers=min(len(engines), 64), thread_name_prefix=f"p2pw-{label}") as pool:
            futures = {e.name: pool.submit(one, e) for e in engines}
            for name, fut in futures.items():
                try:
                    calls.results[name] = fut.result()
                except Exception as e:  # noqa: BLE001 - every engine's failure is data here
                    calls.errors[name] = e
    log = verb_log.get()
    if log is not None:
        log.append((label, time.perf_counter() - t0, len(engines)))
    return calls


def check_unique_names(engines: Sequence[SglangEngine]) -> None:
    seen: dict[str, str] = {}
    for e in engines:
        if e.name in seen:
            raise ValueError(f"two engines are named {e.name!r} ({seen[e.name]} and {e.base_url}); pass name=")
        seen[e.name] = e.base_url
