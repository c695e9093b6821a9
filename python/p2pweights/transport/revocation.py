"""An engine rank's registered weight memory, revocable per epoch (docs/security.md, "Epochs").

One-sided writes never pass through the engine's code, so the engine cannot refuse a late one; it
can only make the old way in stop working. :class:`RevocableRegions` holds the rank's transport
endpoint for its regions and, on :meth:`revoke`, opens a new endpoint for the same memory (a new
Mooncake listener and session id, a new NIXL agent), publishes it under the next epoch, and closes
the old one: connections and remote keys of the old epoch then fail (measured per transport in
docs/security.md), so a sender that lost its session lands nothing after the takeover, even a
write it had posted before it stopped.

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

from . import make_receiver_endpoint
from .publication import EnginePublication

logger = logging.getLogger(__name__)

#: the first epoch of a rank's registrations (0 in a publication means "publishes none")
FIRST_EPOCH = 1
#: attempts at an endpoint whose peer (session id, agent name) no earlier epoch of this rank used
_FRESH_PEER_ATTEMPTS = 8


class RevocableRegions:
    """The rank's regions ``[(address, nbytes, device)]`` registered with ``transport`` and published
    with ``table`` (``{name: [data_ptr, numel, element_size]}``) for ``rank``; ``decorate`` adds the
    rank's own keys to each publication (build, architecture). ``make_endpoint`` opens each later
    epoch's endpoint (a host's own settings; tests). ``endpoint``: the first epoch's, already holding
    ``regions`` (registered by someone else, such as sglang's own transfer engine); it is adopted, and
    closed like any other at the first revocation. Without it the first endpoint is opened here."""

    def __init__(self, transport: str, regions: Sequence[tuple[int, int, str]], table: dict[str, Any],
                 rank: int, decorate: Callable[[EnginePublication], None] | None = None,
                 make_endpoint: Callable[[str], Any] = make_receiver_endpoint, endpoint: Any = None):
        self.transport = transport
        self.regions = [(int(a), int(n), str(d)) for a, n, d in regions]
        self.table = table
        self.rank = int(rank)
        self._decorate = decorate
        self._make_endpoint = make_endpoint
        self._peers: set[str] = set()  # every peer this rank published: never reused by a later epoch
        self.epoch = FIRST_EPOCH
        self.revoke_seconds = 0.0      # the last revocation's time (new endpoint, registration, old closed)
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

    def revoke(self, epoch: int) -> EnginePublication:
        """Move to ``epoch`` (> the current one): a new endpoint for the same memory, published; then
        the old one closed, so what the old epoch's senders hold (connections, remote keys) fails.
        On failure the old endpoint stays (the caller leaves the engine torn)."""
        if epoch <= self.epoch:
            raise ValueError(f"rank {self.rank}: epoch {epoch} is not after the current {self.epoch}")
        t0 = time.perf_counter()
        endpoint, publication = self._open(epoch)
        old, self.endpoint, self.publication, self.epoch = self.endpoint, endpoint, publication, epoch
        # The old endpoint closes on a thread of its own: a transport's close can wait on a connection
        # whose sender is stopped (seen with Mooncake TCP), and the takeover must not wait with it.
        threading.Thread(target=self._close_old, args=(old, epoch - 1), name=f"p2pw-revoke-{epoch - 1}",
                         daemon=True).start()
        self.revoke_seconds = time.perf_counter() - t0
        logger.warning("rank %d: revoked epoch %d's registrations (new %s peer %s) in %.3f s", self.rank, epoch - 1,
                       self.transport, endpoint.peer, self.revoke_seconds)
        return publication

    def _close_old(self, old: Any, epoch: int) -> None:
        t0 = time.perf_counter()
        try:
            old.close()
        except Exception as e:  # noqa: BLE001 - the new epoch is published; the old one is dropped anyway
            logger.warning("rank %d: closing the endpoint of epoch %d failed: %s", self.rank, epoch, e)
        logger.info("rank %d: epoch %d's endpoint closed in %.3f s", self.rank, epoch, time.perf_counter() - t0)

    def close(self) -> None:
        self.endpoint.close()
