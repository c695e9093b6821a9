"""Control-plane client for sglang 0.5.23 servers (and p2pweights receivers), over sglang's own HTTP API.

Every request this client sends is a route of :mod:`p2pweights.control.routes` with its request
body (:mod:`p2pweights.control.bodies`); a test checks that table against sglang's source. :mod:`p2pweights.control.http` does the
HTTP (standard library only). Many engines at once are in :mod:`p2pweights.control.engine_calls`,
the update session in :mod:`p2pweights.control.update_session`.

An error answer becomes the exception it names (a receiver's error payload: its class, engine,
rank, parameter and hint) or an EngineError (sglang's own answers); a connection that fails is an
EngineUnreachable. Every message names the engine, its URL, the route and what to do.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence
from urllib.parse import urlencode, urlsplit

from ..errors import EngineError, EngineUnreachable, Unauthorized
from ..settings import value
from . import bodies, error_answers, http, routes
from . import protocol as p


class SglangEngine:
    """One rollout engine's control plane: an sglang server, or a ``p2pweights.receiver`` server.

    ``base_url`` is the engine's HTTP server (``http://host:port``). ``bootstrap_url`` is its
    engine-info bootstrap server (``http://host:6789``); when given, transfer-engine info is read
    there directly, else through the HTTP server's ``/remote_instance_transfer_engine_info`` proxy.
    ``timeout`` bounds each answer (``P2PW_ENGINE_TIMEOUT``), ``connect_timeout`` each connect
    (``P2PW_ENGINE_CONNECT_TIMEOUT``): an engine that is down fails in about that long.
    ``api_key`` is sent as ``Authorization: Bearer`` on every call (sglang's ``--api-key`` /
    ``--admin-api-key``; a receiver's ``--api-key``); default ``P2PW_API_KEY``.
    ``gpu_arch`` is the engine's GPU architecture (``sm90``, ``9.0``, ``gfx942``) for engines that do
    not report it: plain sglang servers do not; a p2pweights receiver does (``/server_info``
    ``p2pw_device_archs``), and so does an sglang server with the p2pweights plugin (``p2pw_plugin``
    ``gpu_arch``), whose report is taken when ``gpu_arch`` is None. Connect needs it for FP8
    checkpoints, whose post-processing depends on it, and refuses an override that contradicts what
    the engine reports. ``api_key`` also goes to ``bootstrap_url``: the plugin's bootstrap server
    requires it (``plugin_offers`` has ``bootstrap_key``).
    """

    def __init__(
        self,
        base_url: str,
        bootstrap_url: str | None = None,
        name: str | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        api_key: str | None = None,
        gpu_arch: str | None = None,
    ):
        self.base_url = _normalize_url(base_url)
        self.bootstrap_url = _normalize_url(bootstrap_url) if bootstrap_url else None
        self.plugin_offers: frozenset[str] = frozenset()  # the sglang plugin's guarantees (server_info)
        self.name = name or urlsplit(self.base_url).netloc
        self.timeout = float(value("P2PW_ENGINE_TIMEOUT", timeout))
        self.connect_timeout = float(value("P2PW_ENGINE_CONNECT_TIMEOUT", connect_timeout))
        self.api_key: str | None = value("P2PW_API_KEY", api_key)
        self.gpu_arch = gpu_arch
        # p2pweights' keys for the next begin / end body (a delta claim, manifests: sender/delta_writes.py)
        self.begin_extra: dict = {}
        self.end_extra: dict = {}
        #: the owner token of the update session this client's calls belong to (UpdateSession sets it
        #: while it owns a session on this engine): a secret, sent on every call (protocol.SESSION_OWNER_HEADER)
        #: with ``session_label``, what the engine shows of its owner (protocol.SESSION_LABEL_HEADER)
        self.session_owner: str | None = None
        self.session_label: str | None = None

    def __repr__(self) -> str:
        return f"SglangEngine(name={self.name!r}, base_url={self.base_url!r})"

    # ---- reading the engine ----------------------------------------------------------------

    def health(self) -> bool:
        """True when ``GET /health`` answers 200; False when it answers (e.g. 503 while starting).

        Raises EngineError when the engine cannot be reached at all.
        """
        status, _ = self._call("health", expect_ok=False)
        return status == 200

    def server_info(self) -> dict:
        """``GET /server_info``: the resolved server args (flat), ``internal_states``, ``version``;
        what the p2pweights plugin enforces there is kept (``plugin_offers``)."""
        info = self._json("server_info")
        self.plugin_offers = p.plugin_offers(info)
        return info

    def model_info(self) -> dict:
        """``GET /model_info``: model path, ``weight_version``, architectures, ..."""
        return self._json("model_info")

    def weight_version(self) -> str:
        """The engine's current weight version (``/model_info``'s ``weight_version``)."""
        return str(self.model_info().get("weight_version"))

    def transfer_engine_info(self, rank: int) -> dict:
        """Rank ``rank``'s published weight regions, as sglang serves them::

            {"rank": N, "remote_instance_transfer_engine_info": [session_id, {param: [ptr, numel, elem_size]}]}

        ``rank`` is the engine's tp rank (sglang registers one entry per tp rank).
        """
        if int(rank) < 0:
            raise ValueError(f"engine {self.name}: rank must be >= 0, got {rank}")
        if self.bootstrap_url:
            return self._json("get_transfer_engine_info", params={"rank": int(rank)}, base=self.bootstrap_url)
        return self._json("remote_instance_transfer_engine_info", params={"rank": int(rank)})

    # ---- the update session verbs ------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> dict:
        """``POST /pause_generation {"mode": ...}``; sglang's modes: abort (its default), retract, in_place."""
        return self._json("pause_generation", body=bodies.PauseGenerationReq(mode=mode))

    def continue_generation(self, torch_empty_cache: bool = True) -> dict:
        """``POST /continue_generation {"torch_empty_cache": ...}``."""
        return self._json("continue_generation", body=bodies.ContinueGenerationReq(bool(torch_empty_cache)))

    def begin_weight_update(self, selector: str = "all", lease: float | None = None) -> dict:
        """``POST /begin_weight_update {"selector": ...}``: opens the engine's weight-update session
        (sglang restores in-place-packed quantized weights so they can be overwritten). A receiver
        records ``session_owner`` as its owner, with a lease of ``lease`` seconds (its own
        ``P2PW_SESSION_LEASE`` when None) that the owner renews; it answers ``lease``."""
        return self._json("begin_weight_update", body=bodies.BeginWeightUpdateReq(
            selector=selector, extra=dict(self.begin_extra)), headers=_lease_header(lease))

    def renew_weight_update(self, release: bool = False, lease: float | None = None,
                            timeout: float | None = None) -> dict:
        """``POST /renew_weight_update {"release": ...}`` (a receiver's, or the sglang plugin's): the
        session's owner renews its lease (the engine's leader also checks every rank answers), or
        with ``release`` gives the session up (the engine is torn until a complete update).
        ``timeout`` bounds this one call (default: the client's)."""
        return self._json("renew_weight_update", body=bodies.RenewWeightUpdateReq(release=bool(release)),
                          headers=_lease_header(lease), timeout=timeout)

    def end_weight_update(self, then_version: str | None = None, then_continue: bool = True,
                          torch_empty_cache: bool = True) -> dict:
        """``POST /end_weight_update {}``: closes the session; the engine runs its post-processing
        (post_load_weights, process_weights_after_loading: derived buffers such as w_kc/w_vc).

        ``then_version`` (only for an engine whose begin answered ``protocol.END_FOLDS``: a
        receiver): in the same call, once ended, bump the version to it and (``then_continue``)
        continue generation; the answer's ``protocol.END_THEN`` says what each of them did."""
        extra = {} if then_version is None else {p.END_THEN: {
            "new_version": str(then_version), "continue": bool(then_continue),
            "torch_empty_cache": bool(torch_empty_cache)}}
        return self._json("end_weight_update", body=bodies.EndWeightUpdateReq(extra={**extra, **self.end_extra}))

    def p2pw_apply_deltas(self, manifests: dict[str, dict]) -> dict:
        """``POST /p2pw_apply_deltas`` (a receiver's; the session's owner): apply the session's deltas now
        (``{rank: manifest}``, deltas/area.py), before ``verify``'s digests, instead of at the end."""
        return self._json("p2pw_apply_deltas", body=bodies.ApplyDeltasReq(manifests=dict(manifests)))

    def update_weight_version(self, version: str | int) -> dict:
        """``POST /update_weight_version {"new_version": str, "abort_all_requests": false}``.

        Never aborts requests: the engine was paused before the writes."""
        return self._json("update_weight_version",
                          body=bodies.UpdateWeightVersionReq(new_version=str(version), abort_all_requests=False))

    def load_lora_adapter(self, name: str, path: str, pinned: bool = True) -> dict:
        """``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}``: the engine's own load of a
        PEFT adapter from files; the engine picks its slot. ``pinned`` keeps it there, which
        ``sender.update(step, adapter=name)`` needs (docs/lora.md)."""
        return self._json("load_lora_adapter", body=bodies.LoadLoRAAdapterReq(str(name), str(path), bool(pinned)))

    def unload_lora_adapter(self, name: str) -> dict:
        """``POST /unload_lora_adapter {"lora_name"}``."""
        return self._json("unload_lora_adapter", body=bodies.UnloadLoRAAdapterReq(str(name)))

    def weights_checker(self, action: str = "checksum", allow_quant_error: bool = False,
                        skip_tensor_list: Sequence[str] | None = None, selector: str = "all",
                        **extra: Any) -> dict:
        """``POST /weights_checker`` (sglang's CheckWeightsReqInput); answers ``success``, ``message``
        and, for checksums, ``ranks`` and ``per_engine_checksum``. ``extra`` fields are sent as they
        are (sglang ignores them; a p2pweights receiver reads ``hf_seed`` for action ``p2pw_compare``, and
        ``changed_fraction`` with ``changed_steps`` for a version of that seed's changed family)."""
        return self._json("weights_checker", body=bodies.CheckWeightsReq(
            action=action, allow_quant_error=bool(allow_quant_error),
            skip_tensor_list=list(skip_tensor_list) if skip_tensor_list is not None else None,
            selector=selector, extra=dict(extra)))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        """``POST /init_weights_update_group`` (InitWeightsUpdateGroupReqInput): the engine's ranks join a
        torch.distributed group as ranks ``rank_offset + tp_rank``; answers once every member joined."""
        return self._json("init_weights_update_group", body=bodies.InitWeightsUpdateGroupReq(
            master_address=master_address, master_port=int(master_port), rank_offset=int(rank_offset),
            world_size=int(world_size), group_name=group_name, backend=backend))

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version: str | None = None) -> dict:
        """``POST /update_weights_from_distributed`` (UpdateWeightsFromDistributedReqInput): the engine
        receives each tensor by broadcast from group rank 0 and loads it. sglang 0.5.23 requires an open
        weight-update session (begin_weight_update)."""
        return self._json("update_weights_from_distributed", body=bodies.UpdateWeightsFromDistributedReq(
            names=list(names), dtypes=[str(d) for d in dtypes], shapes=[[int(x) for x in s] for s in shapes],
            group_name=group_name, flush_cache=bool(flush_cache),
            weight_version=str(weight_version) if weight_version is not None else None))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """``POST /destroy_weights_update_group`` (DestroyWeightsUpdateGroupReqInput)."""
        return self._json("destroy_weights_update_group", body=bodies.DestroyWeightsUpdateGroupReq(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """``POST /get_weights_by_name {"name", "truncate_size"}``: the parameter's first
        ``truncate_size`` rows as nested lists (a list per DP rank when the engine has DP > 1)."""
        return self._json("get_weights_by_name", body=bodies.GetWeightsByNameReq(name=name, truncate_size=int(truncate_size)))

    # ---- HTTP -------------------------------------------------------------------------------

    def _route(self, verb: str) -> routes.Route:
        """The route this engine serves ``verb`` on (an engine of another kind maps its own: control/vllm.py)."""
        return routes.route(verb)

    def _json(self, verb: str, *, body: bodies.Body | None = None, params: Mapping[str, Any] | None = None,
              base: str | None = None, headers: Mapping[str, str] | None = None,
              timeout: float | None = None) -> Any:
        _, payload = self._call(verb, body=body, params=params, base=base, headers=headers, timeout=timeout)
        return payload

    def _call(self, verb: str, *, body: bodies.Body | None = None, params: Mapping[str, Any] | None = None,
              base: str | None = None, expect_ok: bool = True, headers: Mapping[str, str] | None = None,
              timeout: float | None = None) -> tuple[int, Any]:
        """One call of ``verb``'s route; (status, answer: JSON, text, or {} when empty). ``headers``
        are added to the client's own (the key, the session owner); ``timeout`` overrides the client's."""
        extra_headers = headers
        route = self._route(verb)
        base = base or self.base_url
        target = route.path + ("?" + urlencode(params) if params else "")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        owner = self.session_owner if base == self.base_url else None  # the token goes to the engine only
        headers = {**(headers or {}), **_owner_header(owner, self.session_label), **(extra_headers or {})} or None
        try:
            status, answer = http.request(route.method, base, route.path,
                                          body=bodies.encode(body) if body is not None else None, params=params,
                                          timeout=timeout or self.timeout, connect_timeout=self.connect_timeout,
                                          headers=headers)
        except EngineUnreachable as e:
            raise EngineUnreachable(f"engine {self.name}: {e.message}", engine=self.name, hint=e.hint) from e
        context = f"engine {self.name} ({base}): {route.method} {target} failed"
        if expect_ok and status in (p.UNAUTHORIZED, p.FORBIDDEN):
            said = error_answers.ErrorAnswer.of(answer)
            raise Unauthorized(f"{context}: HTTP {status}: {said.message}", engine=self.name,
                               hint=error_answers.hint_for(verb, status, said.message))
        if expect_ok and not p.ok(status):
            said = error_answers.ErrorAnswer.of(answer)
            raise said.exception(f"{context}: HTTP {status}: {said.message}", engine=self.name,
                                 hint=error_answers.hint_for(verb, status, said.message) or None)
        if answer is None:
            return status, {}
        if expect_ok and isinstance(answer, str):
            raise EngineError(f"{context}: HTTP {status} with a body that is not JSON: {error_answers.clip(answer)}",
                              engine=self.name, hint="is this URL an sglang server?")
        return status, answer


def _owner_header(owner: str | None, label: str | None = None) -> dict[str, str]:
    if not owner:
        return {}
    return {p.SESSION_OWNER_HEADER: owner, **({p.SESSION_LABEL_HEADER: label} if label else {})}


def _lease_header(lease: float | None) -> dict[str, str] | None:
    return {p.SESSION_LEASE_HEADER: f"{float(lease):g}"} if lease is not None else None


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine URL must look like http://host:port, got {url!r}")
    return url
