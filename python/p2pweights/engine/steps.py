"""What the engine core asks of its host, and how a host answers (``core.py``).

The core is a state machine without I/O, in the manner of a consensus library's core: a verb runs
as a generator that yields :class:`Step` requests (revoke every rank, ask the engine to begin, have
every rank apply its deltas, ...) and receives each step's result (or its exception, thrown back in
at the ``yield``). A host maps each step onto its engine's own verbs with one function ``do(step)``
and drives the generator with :func:`drive` (a thread-serving host: our receiver) or
:func:`drive_async` (an asyncio host: the sglang plugin's and the vLLM backend's gates). Host-neutral:
no HTTP, no engine imports.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Generator


@dataclasses.dataclass(frozen=True)
class Step:
    """One thing the core needs the host to do; each subclass says what its result is."""


@dataclasses.dataclass(frozen=True)
class PublishedEpochs(Step):
    """The registration epoch each rank publishes now. Result: an iterable of ints (empty: none)."""


@dataclasses.dataclass(frozen=True)
class Revoke(Step):
    """Every rank moves its registrations to a new endpoint under ``epoch`` and closes the old one,
    returning only once the old epoch can land nothing more. Result: the epoch the ranks publish
    now, or None where the engine holds nothing it can revoke; raises when a rank could not."""

    epoch: int


@dataclasses.dataclass(frozen=True)
class IsPaused(Step):
    """Whether the engine's generation is paused. Result: bool."""


@dataclasses.dataclass(frozen=True)
class DeltaSupport(Step):
    """Why this engine cannot take deltas now. Result: str ("" when every rank can)."""


@dataclasses.dataclass(frozen=True)
class AdapterSlot(Step):
    """The slot of the engine's LoRA pool that adapter ``name`` occupies on every rank (the engine's
    own registry decides it; the adapter must be loaded and kept there: pinned). Result: int; raises
    when the adapter is not loaded or the engine has no LoRA pool."""

    name: str


@dataclasses.dataclass(frozen=True)
class EngineVerb(Step):
    """The engine's own verb (begin, pause, continue, version, a write of its own, ...), with the
    ``body`` it takes. Result: :class:`Answer`; raising counts as a failed answer."""

    verb: str
    body: Any = None


@dataclasses.dataclass(frozen=True)
class End(Step):
    """Every rank applies its manifest of ``manifests`` (``{rank: manifest}``, None: no deltas), whole,
    then the engine ends its update (its post-processing), with ``body``. Result: :class:`Answer`;
    raising (a rank refused its deltas) counts as a failed end."""

    manifests: dict[int, dict] | None
    body: Any = None


@dataclasses.dataclass(frozen=True)
class ApplyDeltas(Step):
    """Every rank applies its manifest of ``manifests`` now, inside the session (``verify=True``
    digests after it). Result: ignored; raises when a rank refused."""

    manifests: dict[int, dict]


@dataclasses.dataclass
class Answer:
    """An engine's answer to a verb: its status and body (decoded JSON, or None); ``raw`` and
    ``headers``: the engine's own bytes, passed on unchanged unless the core changed ``body``
    (then ``raw`` is None). ``already_open``: the engine said its own update session is open already
    (the host reads that in its engine's words; the core decides what it means)."""

    status: int
    body: Any = None
    raw: bytes | None = None
    headers: list | None = None
    already_open: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def with_body(self, body: Any, status: int | None = None) -> "Answer":
        return Answer(self.status if status is None else status, body)


Verb = Generator[Step, Any, Answer]


def drive(verb: Verb, do: Callable[[Step], Any]) -> Answer:
    """Run ``verb`` to its answer, each step by ``do`` (a step's exception goes back into the verb)."""
    result, error = None, None
    while True:
        try:
            step = verb.throw(error) if error is not None else verb.send(result)
        except StopIteration as stop:
            return stop.value
        try:
            result, error = do(step), None
        except Exception as e:  # noqa: BLE001 - the verb decides what a failed step means
            result, error = None, e


async def drive_async(verb: Verb, do: Callable[[Step], Awaitable[Any]]) -> Answer:
    """:func:`drive` for a host whose steps are coroutines."""
    result, error = None, None
    while True:
        try:
            step = verb.throw(error) if error is not None else verb.send(result)
        except StopIteration as stop:
            return stop.value
        try:
            result, error = await do(step), None
        except Exception as e:  # noqa: BLE001 - the verb decides what a failed step means
            result, error = None, e
