"""The gate's calls into vLLM's workers, from the API server process: vLLM's own
``engine_client.collective_rpc`` with the method ``weight_transfer_engine`` (vLLM's ``run_method``
takes that attribute of each worker by name, the ``P2PWeightsEngine``, and calls it with the verb),
one answer per worker. No other channel: nothing is serialized but the verb's plain JSON-like body,
so vLLM's insecure (pickled) serialization stays off."""
from __future__ import annotations

from typing import Any

from ..control.weights_digest import ALGORITHM
from ..errors import EngineError, InvalidRequest

#: the worker attribute the gate calls; the gate refuses it on vLLM's own ``/collective_rpc`` route
RPC_METHOD = "weight_transfer_engine"


async def call_ranks(client: Any, verb: str, body: dict | None = None) -> list[Any]:
    """Every worker's answer to ``verb`` (a list, one per worker). A worker that raises fails the
    call (EngineError naming the verb and what vLLM reported)."""
    try:
        answers = await client.collective_rpc(RPC_METHOD, args=(verb, body or {}))
    except Exception as e:  # noqa: BLE001 - vLLM reports a worker's error as its own exception types
        raise EngineError(f"the vLLM workers failed p2pweights' {verb!r}: {type(e).__name__}: {e}") from e
    return list(answers or [])


async def attach_drafts(client: Any) -> bool:
    """Before the workers register: every worker that runs a speculative drafter vLLM can update
    (``supports_draft_weight_updates``: a drafter model and its config) hands it to its backend with
    vLLM's own ``_set_draft_weight_update_target``, the step vLLM's ``/start_draft_weight_update``
    takes, so the init registers the draft's parameters with the target's. True when they did. Workers
    that disagree (some with a drafter, some without) are refused: one table per engine holds both roles."""
    try:
        drafting = list(await client.collective_rpc("supports_draft_weight_updates") or [])
        if drafting and all(drafting):
            await client.collective_rpc("_set_draft_weight_update_target")
    except Exception as e:  # noqa: BLE001 - vLLM reports a worker's error as its own exception types
        raise EngineError(f"the vLLM workers failed to hand p2pweights their draft models: {type(e).__name__}: {e}") from e
    if any(drafting) and not all(drafting):
        raise InvalidRequest(f"only some vLLM workers run a draft model ({drafting}); p2pweights registers every "
                             f"rank's target and draft together")
    return bool(drafting) and all(drafting)


async def publications(client: Any) -> dict[int, dict]:
    """rank -> what that worker publishes now (workers not registered yet publish nothing)."""
    return {int(a["rank"]): a for a in await call_ranks(client, "publication") if isinstance(a, dict)}


async def publication(client: Any, rank: int) -> dict:
    """Rank ``rank``'s publication; InvalidRequest when it published nothing."""
    found = (await publications(client)).get(int(rank))
    if found is None:
        raise InvalidRequest(f"rank {rank} published nothing: call /init_weight_transfer_engine with the "
                             f"p2pweights backend first (or this engine has no rank {rank})", rank=int(rank))
    return found


async def delta_support(client: Any) -> str:
    """Why this engine cannot take deltas now ("" when it can): every worker must publish a delta area."""
    pubs = await publications(client)
    missing = sorted(r for r, pub in pubs.items() if not pub.get("delta_area"))
    if not pubs or missing:
        return (f"engine rank(s) {missing or 'none'} publish no delta area (weights on a GPU take full writes; "
                f"or the ranks are not registered)")
    return ""


async def revoke(client: Any, epoch: int) -> dict[int, dict]:
    """Every worker moves its registrations to a new endpoint under ``epoch`` (a takeover)."""
    return {int(a["rank"]): a for a in await call_ranks(client, "revoke", {"epoch": int(epoch)})}


async def digests(client: Any, names: dict[str, list[str]]) -> dict:
    """``POST /p2pw_weights_digest``'s answer: each named rank's digests of the parameters named."""
    ranks: dict[str, dict] = {}
    for answer in await call_ranks(client, "digest", {"names": names}):
        if str(answer["rank"]) in names:
            ranks[str(answer["rank"])] = answer["digests"]
    missing = sorted(set(names) - set(ranks))
    if missing:
        raise InvalidRequest(f"this engine has no rank {missing[0]} to digest", rank=int(missing[0]))
    return {"success": True, "algorithm": ALGORITHM, "ranks": ranks}
