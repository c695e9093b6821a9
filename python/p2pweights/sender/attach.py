"""Connecting one engine rank a sender writes (``WeightSender.connect``): from the publication it
fetched, or, where a takeover revoked that epoch in between (its endpoint is closed), from the rank's
publication fetched again, checked as the first was."""
from __future__ import annotations

import logging
from typing import Any, Callable

from .. import transport as transports
from ..errors import RemoteDisconnected, TransportError
from ..transport.publication import EnginePublication
from .prepared import EngineTarget

logger = logging.getLogger(__name__)


def attach_target(transport: Any, writer: Any, writer_id: int, rank: int, client: Any, pub: EnginePublication, *,
                  check: Callable[[EnginePublication], None]) -> EngineTarget:
    """Engine rank ``rank`` of ``client`` connected and added to ``writer`` as ``writer_id``. A connect
    that fails because the epoch of ``pub`` was revoked meanwhile (the rank now publishes a later one)
    connects to the later publication once ``check`` (the connect's own checks) passed it."""
    target = EngineTarget(client, rank, writer_id, pub)
    try:
        transports.attach_engine(transport, writer, writer_id, target.name, pub)
        return target
    except (RemoteDisconnected, TransportError):  # Mooncake: the peer is gone; NIXL: its agent is
        fresh = EnginePublication.from_json(client.transfer_engine_info(rank))
        if not (fresh.epoch or 0) > (pub.epoch or 0):
            raise
    logger.warning("engine %s: epoch %s was revoked while this sender connected; connecting to epoch %s",
                   target.name, pub.epoch, fresh.epoch)
    check(fresh)
    target.publication = fresh
    transports.attach_engine(transport, writer, writer_id, target.name, fresh)
    return target
