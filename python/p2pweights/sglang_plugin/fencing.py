"""Epoch fencing in a real sglang server, the launcher's side (docs/security.md, "Epochs"; docs/sglang.md,
"Fencing"); each rank's side is ``rank_epochs.py``.

When the session gate grants a takeover of a lost owner's session (expired, given up), the old owner
may still have one-sided writes in flight. Before the takeover's begin reaches sglang, :func:`revoke`
has every TP rank move its registrations to a new Mooncake endpoint published under the next epoch
and close the old one (sglang's ``CheckWeightsReqInput`` with the action ``rank_epochs.ACTION``
through the weight checker's communicator, the channel of the digest and of the delta apply). It
then checks that the bootstrap server's book (``delta_updates.AreaBook``: the ``epoch`` each rank's
PUT carried) shows every rank at the new epoch, and only then moves the session's epoch, which the
begin's answer and ``/server_info``'s ``p2pw_weight_update`` carry. A sender whose begin answers a
newer epoch than it connected to fetches the new publications and re-attaches before writing.

A failed revocation fails the begin (500) and leaves the engine torn; the next takeover asks every
rank for an epoch after any a rank already reached. A server whose ranks publish no epoch (no
Mooncake publication: nothing to write into one-sided) keeps its epoch, and the log says so.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from ..control import protocol as p
from ..errors import EngineError
from . import delta_updates, rank_epochs

logger = logging.getLogger(__name__)

OFFER = p.PLUGIN_FENCING  # what p2pw_plugin.offers lists while every TP rank publishes a revocable epoch


def support() -> str:
    """Why a takeover cannot revoke every rank now ("" when it can)."""
    if delta_updates.TOKENIZER is None:
        return delta_updates.REFUSED or "fencing not offered: the plugin's hooks did not run in this server"
    missing = sorted(set(range(delta_updates.TP_SIZE)) - set(delta_updates.EPOCHS))
    return (f"engine rank(s) {missing} publish no revocable registrations (no epoch): a takeover cannot revoke "
            f"them" if missing else "")


def live() -> dict[str, Any]:
    """What ``/server_info`` says of fencing (``server_info.after_build``): the offer, never an error
    (a server without Mooncake publications has nothing to fence)."""
    return {"offers": [] if support() else [OFFER], "error": None}


async def revoke(epoch: int, engine: str) -> int | None:
    """The engine core's :class:`~p2pweights.engine.steps.Revoke`: every rank that publishes an epoch
    moves to ``epoch`` (the core chose it: after the session's and any rank's); ``epoch`` once the
    bootstrap server's book shows every such rank there, None when no rank publishes one. Raises
    EngineError naming the rank that could not, before the takeover's begin reaches sglang."""
    published = dict(delta_updates.EPOCHS)
    if not published:
        return None
    tokenizer = delta_updates.TOKENIZER
    if tokenizer is None:
        raise EngineError(f"engine {engine}: the ranks cannot be reached to revoke their registrations ({support()})",
                          engine=engine)
    why = support()
    if why:
        raise EngineError(f"engine {engine}: {why}", engine=engine)
    try:
        tokenizer.auto_create_handle_loop()
        outputs = await tokenizer.check_weights_communicator(rank_epochs.revoke_request(epoch))
    except Exception as e:  # noqa: BLE001 - answered as the begin's failure, not as a broken connection
        raise EngineError(f"engine {engine}: could not reach the ranks: {type(e).__name__}: {e}", engine=engine) from e
    for out in outputs:
        if not out.success:
            try:
                detail = json.loads(out.message)[rank_epochs.ERROR_KEY]
                reason = f"{detail.get('type')}: {detail.get('message')}"
            except (ValueError, TypeError, KeyError):
                reason = f"the schedulers did not revoke: {out.message!r}"
            raise EngineError(f"engine {engine}: {reason}", engine=engine, hint="retry the update; the rank's log says more")
    behind = sorted(r for r in published if delta_updates.EPOCHS.get(r) != epoch)
    if behind:
        raise EngineError(f"engine {engine}: rank(s) {behind} moved to epoch {epoch} but their new publication did not "
                          f"reach the engine-info bootstrap server", engine=engine,
                          hint="retry the update; the rank's log names the failed PUT")
    return epoch
