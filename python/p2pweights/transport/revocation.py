"""An engine rank's registered weight memory, revocable per epoch (docs/security.md, "Epochs").

One-sided writes never pass through the engine's code, so the engine cannot refuse a late one; it
can only make the old way in stop working. :class:`RevocableRegions` holds the rank's transport
endpoint for its regions and, on :meth:`~RevocableRegions.revoke`, opens a new endpoint for the same
memory (a new Mooncake listener and session id, a new NIXL agent), fences the old one and only then
publishes the new one under the next epoch. Fencing means nothing more can land through the old
endpoint: its regions unregistered and the connections senders opened to it cut, a request already
accepted and mid-write included (Mooncake TCP checks a request's address once, at its header, so
unregistering alone does not stop it: measured in docs/security.md). Endpoints that can do it
without closing have ``fence(deadline)`` (Mooncake); the others are closed (NIXL: the agent and its
UCX worker go). ``revoke`` waits for that, at most ``P2PW_REVOKE_TIMEOUT`` seconds, and raises
:class:`~p2pweights.errors.RevocationFailed` when it fails or overruns: the caller fails the begin and
leaves the engine torn. The old endpoint is then closed on a thread of its own (what is left: its
listener, its threads), which no longer matters to what lands.

The engine revokes when a session is taken over after its owner lost it (expired, released): the
only case in which an old owner may still have writes in flight. A session that ended (every write
landed) needs no revocation, so a steady update pays nothing. The receiver's ranks and the
transport tests' stand-in peer use this module, and so do the sglang plugin's ranks
(``sglang_plugin/rank_epochs.py``), whose first epoch is sglang's own Mooncake engine: memory registered
by someone else, adopted (``endpoint=``) rather than opened here.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from ..errors import RevocationFailed
from ..settings import value
from . import make_receiver_endpoint
from .publication import EnginePublication

logger = logging.getLogger(__name__)

#: the first epoch of a rank's registrations (0 in a publication means "publishes none")
FIRST_EPOCH = 1
#: attempts at an endpoint whose peer (session id, agent name) no earlier epoch of this rank used
_FRESH_PEER_ATTEMPTS = 8


class _Fencing:
    """One fence of an old endpoint, run on a thread of its own so that the revocation waits a bounded
    time: ``done`` once it ended, ``error`` what it raised."""

    def __init__(self, endpoint: Any, deadline: float, name: str):
        self.endpoint = endpoint
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.connections_cut = 0
        self.thread = threading.Thread(target=self._run, args=(deadline,), name=name, daemon=True)
        self.thread.start()

    def _run(self, deadline: float) -> None:
        try:
            fence = getattr(self.endpoint, "fence", None)
            if fence is not None:
                self.connections_cut = int(fence(deadline) or 0)
            else:  # an endpoint that can only be closed (NIXL: closing the agent ends its UCX worker)
                self.endpoint.close()
        except BaseException as e:  # noqa: BLE001 - reported by the revocation waiting for it
            self.error = e
        finally:
            self.done.set()


class RevocableRegions:
    """The rank's regions ``[(address, nbytes, device)]`` registered with ``transport`` and published
    with ``table`` (``{name: [data_ptr, numel, element_size]}``) for ``rank``; ``decorate`` adds the
    rank's own keys to each publication (build, architecture). ``make_endpoint`` opens each later
    epoch's endpoint (a host's own settings; tests). ``endpoint``: the first epoch's, already holding
    ``regions`` (registered by someone else, such as sglang's own transfer engine); it is adopted, and
    fenced like any other at the first revocation. Without it the first endpoint is opened here.
    ``revoke_timeout``: seconds a revocation waits for the old endpoint's fence (``P2PW_REVOKE_TIMEOUT``)."""

    def __init__(self, transport: str, regions: Sequence[tuple[int, int, str]], table: dict[str, Any],
                 rank: int, decorate: Callable[[EnginePublication], None] | None = None,
                 make_endpoint: Callable[[str], Any] = make_receiver_endpoint, endpoint: Any = None,
                 revoke_timeout: float | None = None):
        self.transport = transport
        self.regions = [(int(a), int(n), str(d)) for a, n, d in regions]
        self.table = table
        self.rank = int(rank)
        self.revoke_timeout = float(value("P2PW_REVOKE_TIMEOUT", revoke_timeout))
        self._decorate = decorate
        self._make_endpoint = make_endpoint
        self._peers: set[str] = set()  # every peer this rank published: never reused by a later epoch
        self._fencing: _Fencing | None = None  # the last fence, kept while it may still run
        self.epoch = FIRST_EPOCH
        self.revoke_seconds = 0.0      # the last revocation's time (new endpoint opened, old one fenced)
        self.fence_seconds = 0.0       # of which the old endpoint's fence
        if endpoint is None:
            self.endpoint, self.publication = self._open(self.epoch)
        else:
            self.endpoint, self.publication = endpoint, self._publish(endpoint, self.epoch)

    def _open(self, epoch: int) -> tuple[Any, EnginePublication]:
        for _ in range(_FRESH_PEER_ATTEMPTS):
            endpoint = self._make_endpoint(self.transport)
            if endpoint.peer not in self._peers:
                break
            endpoint.close()  # an earlier epoch's port or name again: its old senders could reach it
        else:
            raise RuntimeError(f"rank {self.rank}: the {self.transport} transport gave {_FRESH_PEER_ATTEMPTS} "
                               f"endpoints in a row that an earlier epoch published; cannot revoke")
        try:
            for address, nbytes, device in self.regions:
                endpoint.register(address, nbytes, device)
            return endpoint, self._publish(endpoint, epoch)
        except BaseException:
            endpoint.close()
            raise

    def _publish(self, endpoint: Any, epoch: int) -> EnginePublication:
        publication = endpoint.publication(self.table, rank=self.rank)
        publication.registered = [(a, n) for a, n, _ in self.regions]  # senders check entries lie inside
        publication.epoch = epoch
        if self._decorate is not None:
            self._decorate(publication)
        self._peers.add(endpoint.peer)
        return publication

    def revoke(self, epoch: int, timeout: float | None = None) -> EnginePublication:
        """Move to ``epoch`` (> the current one): a new endpoint for the same memory; the old one fenced
        (nothing more lands through it: regions unregistered, connections cut, a request mid-write
        included), waited for at most ``timeout`` seconds (default: ``revoke_timeout``); then the new
        one is current and its publication returned.

        On failure (the new endpoint cannot be opened, or the fence fails or overruns:
        :class:`~p2pweights.errors.RevocationFailed`) nothing is published: ``epoch``, ``endpoint`` and
        ``publication`` stay the old ones, the new endpoint is closed (its peer never reused), and the
        caller must fail the begin and leave the engine torn. The old endpoint may be half fenced (some
        regions unregistered, some connections cut: writes through it may fail); a later ``revoke``
        (the same epoch again, or a later one) waits for a fence still running, then fences it again
        (idempotent) before it moves."""
        if epoch <= self.epoch:
            raise ValueError(f"rank {self.rank}: epoch {epoch} is not after the current {self.epoch}")
        timeout = self.revoke_timeout if timeout is None else float(value("P2PW_REVOKE_TIMEOUT", timeout))
        t0 = time.perf_counter()
        endpoint, publication = self._open(epoch)
        try:
            cut = self._fence(self.endpoint, self.epoch, timeout)
        except BaseException:
            # never published, so no sender knows it (and its peer is never used again); closed on a thread
            # of its own, as an old endpoint is, so that the failure is answered now
            threading.Thread(target=self._close_old, args=(endpoint, epoch), name=f"p2pw-close-unpublished-{epoch}",
                             daemon=True).start()
            raise
        old, self.endpoint, self.publication, self.epoch = self.endpoint, endpoint, publication, epoch
        # What is left of the old endpoint (its listener, threads, a transport's own state) closes on a
        # thread of its own: nothing lands through it any more, and a close can take long (Mooncake's
        # handshake listener polls once a second; a sender stopped inside its handshake holds it 5 s).
        threading.Thread(target=self._close_old, args=(old, epoch - 1), name=f"p2pw-close-epoch-{epoch - 1}",
                         daemon=True).start()
        self.revoke_seconds = time.perf_counter() - t0
        logger.warning("rank %d: revoked epoch %d's registrations (%d connection(s) cut, fenced in %.3f s; new %s "
                       "peer %s) in %.3f s", self.rank, epoch - 1, cut, self.fence_seconds, self.transport,
                       endpoint.peer, self.revoke_seconds)
        return publication

    def _fence(self, old: Any, epoch: int, timeout: float) -> int:
        """Fences ``old`` (epoch ``epoch``'s endpoint) within ``timeout`` seconds; the connections cut.
        RevocationFailed when it fails or overruns (its thread then goes on; the next call waits for it)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        where = f"rank {self.rank}: epoch {epoch}'s {self.transport} endpoint {getattr(old, 'peer', '?')}"
        hint = ("the takeover's begin fails and the engine stays torn; the next takeover tries again. "
                "P2PW_REVOKE_TIMEOUT sets the bound")
        try:
            pending = self._fencing
            if pending is not None and pending.endpoint is old and not pending.done.wait(max(0.0, deadline -
                                                                                            time.monotonic())):
                raise RevocationFailed(f"{where}: an earlier fence of it is still running after {timeout:g} s",
                                       rank=self.rank, hint=hint)
            self._fencing = fencing = _Fencing(old, deadline, f"p2pw-fence-epoch-{epoch}")
            if not fencing.done.wait(max(0.0, deadline - time.monotonic())):
                raise RevocationFailed(f"{where} was not fenced within {timeout:g} s: its regions may still be "
                                       f"registered or its connections open, so a lost owner's write may still land",
                                       rank=self.rank, hint=hint)
            if fencing.error is not None:
                raise RevocationFailed(f"{where} could not be fenced (a lost owner's write may still land): "
                                       f"{type(fencing.error).__name__}: {fencing.error}", rank=self.rank,
                                       hint=hint) from fencing.error
            self._fencing = None
            return fencing.connections_cut
        finally:
            self.fence_seconds = time.monotonic() - t0

    def _close_old(self, old: Any, epoch: int) -> None:
        t0 = time.perf_counter()
        try:
            old.close()
        except Exception as e:  # noqa: BLE001 - fenced (or never published): nothing lands through it any more
            logger.warning("rank %d: closing an endpoint of epoch %d failed: %s", self.rank, epoch, e)
        logger.info("rank %d: epoch %d's endpoint closed in %.3f s", self.rank, epoch, time.perf_counter() - t0)

    def close(self) -> None:
        self.endpoint.close()
