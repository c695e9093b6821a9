"""A receiver engine's hooks: what the engine does for each control call its ``ReceiverServer``
serves. :class:`ReceiverHooks` is the interface (any PyTorch engine subclasses it; the defaults are
no-ops); :class:`LeaderHooks` is its implementation for an engine of rank processes, run by the
leader (rank 0): every verb is sent to every other rank over HTTP (:class:`rank_server.RankCall`),
then runs on rank 0 in this process, then the others' answers are read; the call answers when all
ranks did, and a failing or unreachable rank fails it, named. The session verbs (begin, end) check
the ranks in the same round trip: each rank acknowledges the verb within the ping's time or is named
as not answering (``P2PW_RECEIVER_CONTROL=folded``; ``separate``: a ping of every rank first).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import EngineError, P2PWeightsError, error_named
from ..models.checkpoint import load_config
from ..settings import value as setting
from .phases import record_phase
from .rank_server import RankCall, call_rank, ping_timeout
from .registration import RankEndpoints, check_claim

if TYPE_CHECKING:
    from .rank import EngineRank


class ReceiverHooks:
    """What the engine does for each control call. Subclass and override what your engine needs;
    the defaults are no-ops. A hook that raises makes the call answer 500 with the error's text,
    and leaves the state unchanged (so ``end_weight_update`` can be retried). A hook that raises a
    ``p2pweights.errors`` class (``LayoutMismatch(..., rank=1, parameter=..., hint=...)``) reaches
    the client as that class with those fields.

    Hooks run on the server's request threads; control hooks (pause, continue, begin, end,
    weight version) run one at a time, never concurrently with each other.
    """

    def server_info(self) -> dict:
        """``GET /server_info``: the engine's resolved server args (sglang's field names: tp_size,
        dtype, quantization, ...), as the sender builds its replica from them."""
        return {}

    def model_info(self) -> dict:
        """``GET /model_info``: model_path, architectures, ...; the server adds ``weight_version``."""
        return {}

    def transfer_engine_info(self, rank: int) -> Any:
        """Rank ``rank``'s published regions: the value served as
        ``remote_instance_transfer_engine_info`` (sglang's ``[session_id, {name: [ptr, numel, elem_size]}]``,
        or the NIXL form of p2pweights.transport.publication). None: use what the rank registered."""
        return None

    def on_pause(self, mode: str) -> None:
        """Stop generating (mode: abort | retract | in_place, as sglang's PauseGenerationReqInput)."""

    def on_continue(self, torch_empty_cache: bool) -> None:
        """Generate again."""

    def on_begin_update(self, selector: str) -> None:
        """A weight update starts: make the parameters writable (e.g. undo in-place packing)."""

    def on_end_update(self) -> None:
        """Every write landed: run the engine's post-processing (post_load_weights,
        process_weights_after_loading, derived buffers)."""

    def on_apply_deltas(self, manifests: dict[int, dict]) -> None:
        """Before ``on_end_update``, in a session whose deltas were accepted at begin: each rank applies
        what its delta area holds (``deltas.area.DeltaArea.apply``, the rank's manifest, or nothing
        when the sender named none for it). The default: this engine applies no deltas."""
        raise NotImplementedError("this engine applies no deltas")

    def on_apply_deltas_then_end(self, manifests: dict[int, dict]) -> None:
        """An end that carries the session's deltas: :meth:`on_apply_deltas`, then (only when it
        succeeded) :meth:`on_end_update`. An engine of several processes may do both in one call to
        each (``LeaderHooks``: a failure on any rank fails the end, and the engine is torn either way)."""
        self.on_apply_deltas(manifests)
        self.on_end_update()

    def on_weight_version(self, new_version: str, abort_all_requests: bool) -> None:
        """The version was bumped (the server tracks it; this is for the engine's own use)."""

    def adapter(self, op: str, name: str, path: str | None = None, pinned: bool = True) -> int | None:
        """The engine's LoRA registry (docs/lora.md): ``op`` ``load`` (sglang's ``/load_lora_adapter``
        of PEFT files at ``path``: the engine picks the slot), ``unload``, or ``slot`` (where a loaded
        adapter is). Answers the slot (None for unload); raises when the engine has no LoRA pool or the
        adapter is not loaded. An adapter update (begin with ``adapter``) runs neither
        ``on_begin_update`` nor ``on_end_update``: no base weight changes."""
        raise NotImplementedError("this engine has no LoRA adapter pool")

    def weights_checker(self, request: dict) -> dict:
        """``/weights_checker`` with sglang's CheckWeightsReqInput fields (defaults filled).
        Return sglang's answer: ``{"success": bool, "message": str, ["ranks"], ["per_engine_checksum"]}``."""
        return {"success": False, "message": "this engine does not implement weights_checker"}

    def get_weights_by_name(self, name: str, truncate_size: int) -> Any:
        """The parameter's first ``truncate_size`` rows (a tensor or nested lists); None if unknown."""
        return None

    def weights_digest(self, names: dict[int, list[str]]) -> dict[int, dict[str, str]]:
        """``POST /p2pw_weights_digest`` (``update(verify=True)``): for each engine rank, the digest
        (``p2pweights.control.weights_digest``) of the bytes it holds for each named parameter. Raise
        NotImplementedError (the default) to answer 501 (an sglang server answers 404: no route)."""
        raise NotImplementedError("this engine does not digest its weights (/p2pw_weights_digest)")

    def on_renew_lease(self) -> None:
        """The session's owner renewed its lease: check, cheaply, that every rank of the engine still
        answers; raise (naming the rank) when one does not, so a stalled rank is found while the
        owner still holds the engine."""

    def on_revoke(self, epoch: int) -> dict[int, tuple[str, dict, dict]] | None:
        """A takeover of a session whose owner was lost: move every rank's registered weight memory
        to a new transport endpoint published under ``epoch`` (``transport.revocation``), so that the
        lost owner's connections and keys fail. Answer ``{rank: (peer, table, extra)}``, what each
        rank now publishes; None (the default): this engine cannot revoke."""
        return None

    def on_register_transfer_engine_info(self, rank: int, info: dict) -> None:
        """A rank registered its regions (``PUT /register_transfer_engine_info``); ``info`` is the whole
        ``transfer_engine_info`` object, extra keys included (keys starting with ``p2pw_`` are for the
        engine only and are not published)."""

    # the broadcast path (sglang's update_weights_from_distributed), for the baseline -------------
    def init_weights_update_group(self, request: dict) -> None:
        """``POST /init_weights_update_group`` (InitWeightsUpdateGroupReqInput: master_address,
        master_port, rank_offset, world_size, group_name, backend): every rank joins the group.
        Raise to answer 400 with the error's text."""
        raise NotImplementedError("this engine does not implement init_weights_update_group")

    def update_weights_from_distributed(self, request: dict) -> None:
        """``POST /update_weights_from_distributed`` (UpdateWeightsFromDistributedReqInput: names, dtypes,
        shapes, group_name, ...): receive each tensor by broadcast from group rank 0 and load it."""
        raise NotImplementedError("this engine does not implement update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name: str) -> None:
        """``POST /destroy_weights_update_group``: leave the group."""
        raise NotImplementedError("this engine does not implement destroy_weights_update_group")


class LeaderHooks(ReceiverHooks):
    """The leader's hooks: the verbs run on rank 0 here and on every other rank over HTTP, at once."""

    def __init__(self, local: "EngineRank", instance: str, api_key: str | None = None,
                 endpoints: RankEndpoints | None = None):
        self.local = local
        self.instance = instance
        self.api_key = api_key  # the engine's key: its ranks' internal endpoints require it too
        self.world = local.engine.world_size
        self.rank_urls: dict[int, str] = {}
        # the only control URLs the key is ever sent to (registration.py): the launcher's, else first-registered
        self.endpoints = endpoints or RankEndpoints()
        if self.endpoints.world is None:
            self.endpoints.world = self.world
        self._lock = threading.Lock()
        # folded: the ranks' acknowledgement is the ping, and the end carries the deltas (P2PW_RECEIVER_CONTROL)
        self.folded = setting("P2PW_RECEIVER_CONTROL") == "folded"

    # -- reading ---------------------------------------------------------------------------------
    def server_info(self) -> dict:
        info = dict(self.local.engine.args)
        info.update({
            "model_path": self.local.config,
            "served_model_name": self.local.name,
            "device": "cuda",  # the layout is a GPU rank's (the memory is host memory here)
            "remote_instance_weight_loader_start_seed_via_transfer_engine": self.local.transport == "mooncake",
            "internal_states": [{}],
            "p2pw_receiver": True,
            "p2pw_engine_name": self.local.name,
            "p2pw_transport": self.local.transport,
            "p2pw_instance": self.instance,
            "p2pw_ranks_ready": sorted([0, *self.rank_urls]),
        })
        if self.local.adapters is not None:  # sglang's LoRA server args (LoRASetting.from_server_info reads them)
            info.update(self.local.adapters.server_args())
        if info.get("speculative_algorithm") not in (None, "", "NGRAM"):
            # as sglang resolves it for an MTP draft: the draft is the target's own checkpoint
            info["speculative_draft_model_path"] = self.local.config
        return info

    def model_info(self) -> dict:
        cfg = load_config(self.local.config)
        return {"model_path": self.local.config, "tokenizer_path": None, "is_generation": True,
                "architectures": cfg.get("architectures"), "model_type": cfg.get("model_type")}

    def on_register_transfer_engine_info(self, rank: int, info: dict) -> None:
        """Rank >= 1: its control URL must be the one its launcher gave it (nothing is sent to any
        other), and what it registered must be what the rank process publishes there (asked with
        the key, at that URL); rank 0 (this process): what it publishes. Else InvalidRequest (400),
        and the registration changes nothing."""
        if rank == 0:  # the leader's own rank, in this process: what it publishes is known here
            peer, table, extra = self.local.published()
            check_claim(0, info, {"peer": peer, "table": table, "extra": extra})
            return
        url = self.endpoints.admit(rank, info.get("p2pw_control_url"))
        own = call_rank(url, rank, "publication", {}, timeout=ping_timeout() + 30.0, api_key=self.api_key)
        check_claim(rank, info, own)
        with self._lock:
            self.endpoints.bind(rank, url)
            self.rank_urls[int(rank)] = url

    def get_weights_by_name(self, name: str, truncate_size: int) -> Any:
        return self.local.weights_by_name(name, truncate_size)

    # -- fan-out ----------------------------------------------------------------------------------
    def on_all(self, verb: str, body: dict | None = None, timeout: float | None = None, *,
               acknowledged_within: float | None = None) -> dict[int, Any]:
        """Run ``verb`` on every rank concurrently; raise one error naming every rank that failed.
        ``timeout`` bounds each rank's answer (default ``rank_server.rank_timeout()``). The verb is
        sent to every other rank first, then run on rank 0 here, then their answers are read.
        ``acknowledged_within``: every other rank must say within that many seconds that it took the
        verb (its handler thread runs; the work may take longer); one that does not is named as not
        answering and its call given up (it will not run it), and rank 0 then does not run it either:
        the same round trip checks the ranks and runs the verb (no ping before it)."""
        body = body or {}
        with self._lock:
            urls = dict(self.rank_urls)
        missing = [r for r in range(1, self.world) if r not in urls]
        if missing:
            raise EngineError(f"engine {self.local.name}: rank(s) {missing} have not registered with the leader "
                              f"(still starting, or dead)", engine=self.local.name,
                              rank=missing[0] if len(missing) == 1 else None)

        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        raised: dict[int, BaseException] = {}
        at_rank: dict[int, float] = {}  # rank -> the verb's seconds on the rank's own clock
        t0 = time.perf_counter()
        acknowledge = acknowledged_within is not None
        calls = {r: RankCall(urls[r], r, verb, body, timeout, api_key=self.api_key, acknowledge=acknowledge)
                 for r in range(1, self.world)}
        silent = []
        if acknowledge:
            deadline = time.monotonic() + acknowledged_within
            for r, call in calls.items():
                if not call.acknowledged(deadline - time.monotonic()):
                    silent.append(r)
                    call.abandon(f"rank {r} ({urls[r]}) does not answer: it did not take {verb} within "
                                 f"{acknowledged_within:g}s (stopped or wedged); {verb} was not run on it")
        if not silent:
            t_local = time.perf_counter()
            try:  # rank 0 here, in this thread, while the others run theirs
                results[0] = self.local.call(verb, body)
            except Exception as e:  # noqa: BLE001 - each rank's failure is named
                errors[0], raised[0] = f"{type(e).__name__}: {e}", e
            at_rank[0] = time.perf_counter() - t_local
        for r, call in calls.items():
            try:
                results[r] = call.result(at_rank)
            except Exception as e:  # noqa: BLE001 - each rank's failure is named
                errors[r], raised[r] = str(e), e
        record_phase(f"{verb}_s", time.perf_counter() - t0)
        record_phase(f"{verb}_at_rank_s", {str(r): s for r, s in sorted(at_rank.items())})
        if errors:
            lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
            only = next(iter(errors)) if len(errors) == 1 else None
            message = f"engine {self.local.name}: {verb} failed on {len(errors)} rank(s): {lines}"
            first = raised[only] if only is not None else None
            if isinstance(first, P2PWeightsError):  # one rank's typed error keeps its class and fields
                cls = error_named(type(first).__name__)
                raise cls(message, **{**first.fields(), "engine": self.local.name, "rank": only})
            raise EngineError(message, engine=self.local.name, rank=only)
        return results

    # -- control verbs ------------------------------------------------------------------------------
    def check_ranks(self) -> None:
        """Every rank answers a ping within ``rank_server.ping_timeout()``, or the error names the
        one that did not (a stopped or wedged rank is found in seconds, not at a verb's long timeout)."""
        self.on_all("ping", timeout=ping_timeout())

    def on_renew_lease(self) -> None:
        self.check_ranks()

    def on_revoke(self, epoch: int) -> dict[int, tuple[str, dict, dict]]:
        self.check_ranks()
        answers = self.on_all("revoke", {"epoch": int(epoch)})
        return {r: (a["peer"], a["table"], a["extra"]) for r, a in answers.items()}

    def on_begin_update(self, selector: str) -> None:
        self._session_verb("begin", {"selector": selector})

    def on_end_update(self) -> None:
        self._session_verb("end", {})

    def on_apply_deltas(self, manifests: dict[int, dict]) -> None:
        self.on_all("apply_deltas", {"manifests": _by_rank(manifests)})

    def on_apply_deltas_then_end(self, manifests: dict[int, dict]) -> None:
        if not self.folded:
            return super().on_apply_deltas_then_end(manifests)
        self._session_verb("end", {"manifests": _by_rank(manifests)})  # each rank: its deltas, then its hooks

    def _session_verb(self, verb: str, body: dict) -> None:
        """A session verb on every rank, once every rank answers: in the same round trip (each rank
        acknowledges it within the ping's time; folded), or after a ping of every rank (separate)."""
        if self.folded:
            self.on_all(verb, body, acknowledged_within=ping_timeout())
            return
        self.check_ranks()
        self.on_all(verb, body)

    def weights_checker(self, request: dict) -> dict:
        action = request.get("action")
        if action == "p2pw_compare":
            try:  # a bad body is a 400 (success false), never a 500
                seed = int(request["hf_seed"])
            except (KeyError, TypeError, ValueError):
                return {"success": False, "message": "action p2pw_compare needs hf_seed, an integer (the seed of "
                                                     "random_checkpoint the update was made from)"}
            changed = {k: request[k] for k in ("changed_fraction", "changed_steps") if request.get(k) is not None}
            ranks = self.on_all("compare", {"hf_seed": seed, **changed,  # a version of the seed's changed family
                                            "skip": request.get("skip_tensor_list") or []})
            per_rank = [ranks[r] for r in sorted(ranks)]
            bad = [f"rank {r['rank']}: {m['name']}: {m['why']}" for r in per_rank for m in r["mismatches"]]
            compared = sum(r["compared"] for r in per_rank)
            if bad:
                shown = "; ".join(bad[:20]) + (f"; ... {len(bad) - 20} more" if len(bad) > 20 else "")
                message = f"engine {self.local.name}: {len(bad)} tensor(s) differ from sglang's loader: {shown}"
            else:
                version = "".join(f", {k} {v}" for k, v in changed.items())
                message = (f"engine {self.local.name}: all {compared} tensors on {len(per_rank)} rank(s) equal "
                           f"sglang's loader (hf_seed {request['hf_seed']}{version})")
            return {"success": not bad, "message": message, "ranks": per_rank, "mismatches": bad}
        if action == "checksum":
            ranks = self.on_all("checksum")
            sums = [ranks[r]["checksum"] for r in sorted(ranks)]
            return {"success": True, "message": "checksums of every parameter, buffer and derived tensor",
                    "ranks": sorted(ranks), "per_engine_checksum": sums}
        return {"success": False, "message": f"action {action!r} is not supported by this receiver "
                                             f"(p2pw_compare, checksum)"}

    def adapter(self, op: str, name: str, path: str | None = None, pinned: bool = True) -> int | None:
        """Every rank runs sglang's registry op; every rank must answer the same slot (sglang's
        schedulers fill their pools alike), else the engine is inconsistent and that is an error."""
        answers = self.on_all("adapter", {"op": op, "lora_name": name, "lora_path": path, "pinned": bool(pinned)})
        slots = {r: a.get("slot") for r, a in answers.items()}
        if len(set(slots.values())) > 1:
            raise EngineError(f"engine {self.local.name}: the ranks put LoRA adapter {name!r} in different slots "
                              f"({slots})", engine=self.local.name, parameter=name)
        return next(iter(slots.values()))

    def weights_digest(self, names: dict[int, list[str]]) -> dict[int, dict[str, str]]:
        """Every rank digests the parameters named for it, at once (ranks not named answer {})."""
        return self.on_all("digest", {"names": {str(r): list(ns) for r, ns in names.items()}})

    def init_weights_update_group(self, request: dict) -> None:
        self.on_all("init_group", request)

    def update_weights_from_distributed(self, request: dict) -> None:
        self.on_all("update_from_distributed", request)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.on_all("destroy_group", {"group_name": group_name})


def _by_rank(manifests: dict[int, dict]) -> dict[str, dict]:
    return {str(r): m for r, m in manifests.items()}
