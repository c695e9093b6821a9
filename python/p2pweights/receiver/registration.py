"""Publishing one engine rank's regions to its engine's server, from any process: the client side
of ``PUT /register_transfer_engine_info`` (a :class:`~p2pweights.receiver.ReceiverServer`, or
sglang's engine-info bootstrap server)."""
from __future__ import annotations

from ..control import bodies, error_answers, http, routes
from ..control import protocol as p
from ..errors import EngineUnreachable
from ..settings import value as setting


def register_transfer_engine_info(url: str, rank: int, session_id: str, weights_info: dict,
                                  timeout: float = 10.0, *, extra: dict | None = None,
                                  api_key: str | None = None) -> None:
    """Publish one rank's regions to an engine's server (a ReceiverServer, or sglang's bootstrap
    server on --engine-info-bootstrap-port): ``PUT /register_transfer_engine_info`` with sglang's body
    ``{"tp_rank", "transfer_engine_info": {"session_id", "weights_info_dict"}}``. ``extra`` keys go
    into ``transfer_engine_info`` too (a ReceiverServer publishes them; sglang ignores them).
    ``api_key`` (default ``P2PW_API_KEY``): the engine's key; without it a keyed server answers 401."""
    route = routes.route("register_transfer_engine_info")
    body = bodies.RegisterTransferEngineInfoReq(int(rank), {**(extra or {}), "session_id": session_id,
                                                        "weights_info_dict": weights_info})
    try:
        status, answer = http.request(route.method, url, route.path, body=bodies.encode(body), timeout=timeout,
                                      connect_timeout=timeout, api_key=setting("P2PW_API_KEY", api_key))
    except EngineUnreachable as e:
        raise EngineUnreachable(f"cannot register rank {rank}'s transfer-engine info: {e.message}", rank=int(rank),
                                hint=e.hint) from e
    if status != p.OK:
        said = error_answers.ErrorAnswer.of(answer)
        raise said.exception(f"registering rank {rank}'s transfer-engine info at {url} failed: "
                             f"HTTP {status}: {said.message}", rank=int(rank),
                             hint=error_answers.hint_for("register_transfer_engine_info", status, said.message) or None)
