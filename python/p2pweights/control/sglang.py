"""Control-plane client for sglang 0.5.23 servers (and p2pweights receivers), over sglang's own HTTP API.

Every request this module sends is one of sglang's routes with one of sglang's request bodies
(``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``); ``ROUTES`` lists them and a
test checks them against sglang's source. The standard library does the HTTP (no extra dependency).

One update, seen from the control plane (``UpdateSession`` does exactly this, on many engines at
once)::

    pause_generation -> begin_weight_update -> (the one-sided writes) ->
        end_weight_update -> update_weight_version(abort_all_requests=false) -> continue_generation

Engines are told to end the update and bump their version only after every write of the update
succeeded (DESIGN invariant 3). What happens to an engine whose update failed is explained on
``UpdateSession``.
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import urlencode, urlsplit

from ..errors import EngineError

logger = logging.getLogger(__name__)

#: verb -> (HTTP method, path, sglang request class of the body or None). Only these are sent.
ROUTES: dict[str, tuple[str, str, str | None]] = {
    "health": ("GET", "/health", None),
    "server_info": ("GET", "/server_info", None),
    "model_info": ("GET", "/model_info", None),
    "remote_instance_transfer_engine_info": ("GET", "/remote_instance_transfer_engine_info", None),
    "pause_generation": ("POST", "/pause_generation", "PauseGenerationReqInput"),
    "continue_generation": ("POST", "/continue_generation", "ContinueGenerationReqInput"),
    "begin_weight_update": ("POST", "/begin_weight_update", "BeginWeightUpdateReqInput"),
    "end_weight_update": ("POST", "/end_weight_update", "EndWeightUpdateReqInput"),
    "update_weight_version": ("POST", "/update_weight_version", "UpdateWeightVersionReqInput"),
    "weights_checker": ("POST", "/weights_checker", "CheckWeightsReqInput"),
    "get_weights_by_name": ("POST", "/get_weights_by_name", "GetWeightsByNameReqInput"),
    # the broadcast path (what RL frameworks use today; p2pweights.baseline.broadcast drives it)
    "init_weights_update_group": ("POST", "/init_weights_update_group", "InitWeightsUpdateGroupReqInput"),
    "update_weights_from_distributed": ("POST", "/update_weights_from_distributed",
                                        "UpdateWeightsFromDistributedReqInput"),
    "destroy_weights_update_group": ("POST", "/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput"),
}
#: the engine-info bootstrap server's route (``--engine-info-bootstrap-port``, default 6789).
BOOTSTRAP_ROUTES: dict[str, tuple[str, str, str | None]] = {
    "get_transfer_engine_info": ("GET", "/get_transfer_engine_info", None),
}

PAUSE_MODES = ("abort", "retract", "in_place")
SELECTORS = ("target", "draft", "all")
DEFAULT_TIMEOUT = 300.0  # end_weight_update runs the engine's post-processing: give it time
DEFAULT_CONNECT_TIMEOUT = 3.0

_SEED_FLAG = "--remote-instance-weight-loader-start-seed-via-transfer-engine"
_SESSION_ALREADY_OPEN = "already open"  # sglang: "a weight-update session is already open; ..."


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected seconds as a number") from None


class SglangEngine:
    """One rollout engine's control plane: an sglang server, or a ``p2pweights.receiver`` server.

    ``base_url`` is the engine's HTTP server (``http://host:port``). ``bootstrap_url`` is its
    engine-info bootstrap server (``http://host:6789``); when given, transfer-engine info is read
    there directly, else through the HTTP server's ``/remote_instance_transfer_engine_info`` proxy.
    ``timeout`` bounds each answer (``P2PW_ENGINE_TIMEOUT``), ``connect_timeout`` each connect
    (``P2PW_ENGINE_CONNECT_TIMEOUT``): an engine that is down fails in about that long.
    ``api_key`` is sent as ``Authorization: Bearer`` (sglang's ``--api-key`` / ``--admin-api-key``).
    """

    def __init__(
        self,
        base_url: str,
        bootstrap_url: str | None = None,
        name: str | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        api_key: str | None = None,
    ):
        self.base_url = _normalize_url(base_url)
        self.bootstrap_url = _normalize_url(bootstrap_url) if bootstrap_url else None
        self.name = name or urlsplit(self.base_url).netloc
        self.timeout = timeout if timeout is not None else _env_float("P2PW_ENGINE_TIMEOUT", DEFAULT_TIMEOUT)
        self.connect_timeout = (connect_timeout if connect_timeout is not None
                                else _env_float("P2PW_ENGINE_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT))
        if not self.timeout > 0 or not self.connect_timeout > 0:
            raise ValueError(f"engine {self.name}: timeout and connect_timeout must be positive")
        self.api_key = api_key

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
        """``GET /server_info``: the resolved server args (flat), ``internal_states``, ``version``."""
        return self._json("server_info")

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
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        return self._json("pause_generation", body={"mode": mode})

    def continue_generation(self, torch_empty_cache: bool = True) -> dict:
        """``POST /continue_generation {"torch_empty_cache": ...}``."""
        return self._json("continue_generation", body={"torch_empty_cache": bool(torch_empty_cache)})

    def begin_weight_update(self, selector: str = "all") -> dict:
        """``POST /begin_weight_update {"selector": ...}``: opens the engine's weight-update session
        (sglang restores in-place-packed quantized weights so they can be overwritten)."""
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {', '.join(SELECTORS)}, got {selector!r}")
        return self._json("begin_weight_update", body={"selector": selector})

    def end_weight_update(self) -> dict:
        """``POST /end_weight_update {}``: closes the session; the engine runs its post-processing
        (post_load_weights, process_weights_after_loading: derived buffers such as w_kc/w_vc)."""
        return self._json("end_weight_update", body={})

    def update_weight_version(self, version: str | int) -> dict:
        """``POST /update_weight_version {"new_version": str, "abort_all_requests": false}``.

        Never aborts requests: the engine was paused before the writes."""
        return self._json("update_weight_version",
                          body={"new_version": str(version), "abort_all_requests": False})

    def weights_checker(self, action: str = "checksum", allow_quant_error: bool = False,
                        skip_tensor_list: Sequence[str] | None = None, selector: str = "all",
                        **extra: Any) -> dict:
        """``POST /weights_checker`` (sglang's CheckWeightsReqInput); answers ``success``, ``message``
        and, for checksums, ``ranks`` and ``per_engine_checksum``. ``extra`` fields are sent as they
        are (sglang ignores them; a p2pweights receiver reads ``hf_seed`` for action ``p2pw_compare``)."""
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {', '.join(SELECTORS)}, got {selector!r}")
        body: dict[str, Any] = {**extra, "action": action, "allow_quant_error": bool(allow_quant_error),
                                "selector": selector}
        if skip_tensor_list is not None:
            body["skip_tensor_list"] = list(skip_tensor_list)
        return self._json("weights_checker", body=body)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        """``POST /init_weights_update_group`` (InitWeightsUpdateGroupReqInput): the engine's ranks join a
        torch.distributed group as ranks ``rank_offset + tp_rank``; answers once every member joined."""
        return self._json("init_weights_update_group", body={
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version: str | None = None) -> dict:
        """``POST /update_weights_from_distributed`` (UpdateWeightsFromDistributedReqInput): the engine
        receives each tensor by broadcast from group rank 0 and loads it. sglang 0.5.23 requires an open
        weight-update session (begin_weight_update)."""
        body: dict[str, Any] = {"names": list(names), "dtypes": [str(d) for d in dtypes],
                                "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name,
                                "flush_cache": bool(flush_cache)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._json("update_weights_from_distributed", body=body)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """``POST /destroy_weights_update_group`` (DestroyWeightsUpdateGroupReqInput)."""
        return self._json("destroy_weights_update_group", body={"group_name": group_name})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """``POST /get_weights_by_name {"name", "truncate_size"}``: the parameter's first
        ``truncate_size`` rows as nested lists (a list per DP rank when the engine has DP > 1)."""
        return self._json("get_weights_by_name", body={"name": name, "truncate_size": int(truncate_size)})

    # ---- HTTP -------------------------------------------------------------------------------

    def _json(self, verb: str, *, body: dict | None = None, params: Mapping[str, Any] | None = None,
              base: str | None = None) -> Any:
        _, payload = self._call(verb, body=body, params=params, base=base)
        return payload

    def _call(self, verb: str, *, body: dict | None = None, params: Mapping[str, Any] | None = None,
              base: str | None = None, expect_ok: bool = True) -> tuple[int, Any]:
        method, path, _ = ROUTES.get(verb) or BOOTSTRAP_ROUTES[verb]
        base = base or self.base_url
        target = path + ("?" + urlencode(params) if params else "")
        status, raw = self._send(method, base, target, body)
        text = raw.decode("utf-8", "replace")
        if expect_ok and not 200 <= status < 300:
            raise EngineError(self._describe(method, base, target, f"HTTP {status}: {_clip(text)}",
                                             _hint(verb, status, text)))
        if not text.strip():
            return status, {}
        try:
            return status, json.loads(text)
        except ValueError:
            if not expect_ok:
                return status, text
            raise EngineError(self._describe(method, base, target, f"HTTP {status} with a body that is not JSON: "
                                             f"{_clip(text)}", "is this URL an sglang server?")) from None

    def _send(self, method: str, base: str, target: str, body: dict | None) -> tuple[int, bytes]:
        """One request on a fresh connection; returns (status, body). Transport failures -> EngineError."""
        parts = urlsplit(base)
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.hostname, parts.port, timeout=self.connect_timeout)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        full_target = parts.path.rstrip("/") + target
        try:
            try:
                conn.connect()
            except (ConnectionRefusedError, socket.timeout, OSError) as e:
                why = "connection refused" if isinstance(e, ConnectionRefusedError) else (
                    f"no connection within {self.connect_timeout:g}s" if isinstance(e, socket.timeout) else str(e))
                raise EngineError(self._describe(method, base, target, why,
                                                 f"is the engine running and listening at {base}?")) from e
            conn.sock.settimeout(self.timeout)
            try:
                conn.request(method, full_target, body=data, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except socket.timeout as e:
                raise EngineError(self._describe(
                    method, base, target, f"no answer within {self.timeout:g}s",
                    "the engine may be stuck or still post-processing; raise timeout= (P2PW_ENGINE_TIMEOUT)")) from e
            except (http.client.HTTPException, OSError) as e:
                raise EngineError(self._describe(method, base, target, f"connection lost: {e!r}",
                                                 "did the engine process exit?")) from e
        finally:
            conn.close()

    def _describe(self, method: str, base: str, target: str, what: str, hint: str) -> str:
        msg = f"engine {self.name} ({base}): {method} {target} failed: {what}"
        return f"{msg}. Hint: {hint}" if hint else msg


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine URL must look like http://host:port, got {url!r}")
    return url


def _clip(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _hint(verb: str, status: int, text: str) -> str:
    if verb in ("remote_instance_transfer_engine_info", "get_transfer_engine_info") and status in (400, 404):
        return (f"is the engine started with {_SEED_FLAG} and done loading? Its ranks publish their "
                f"weights to the engine-info bootstrap server (--engine-info-bootstrap-port, default 6789)")
    if status == 404:
        return ("the engine does not serve this route: p2pweights needs sglang 0.5.23's control endpoints "
                "(or a p2pweights.receiver server)")
    if status in (401, 403):
        return "the engine requires an API key: pass api_key= (its --api-key or --admin-api-key)"
    if verb == "begin_weight_update" and _SESSION_ALREADY_OPEN in text:
        return ("a previous update left this engine's weight-update session open (it failed after the "
                "writes began); UpdateSession resumes such a session, or end it by hand")
    if verb == "end_weight_update" and "no weight-update session" in text:
        return "call begin_weight_update first"
    if verb == "update_weight_version" and "session" in text:
        return "end the weight update before bumping the version"
    if status >= 500:
        return "the engine failed while handling the call; see its log"
    return ""


# ---- many engines at once --------------------------------------------------------------------


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
        """One EngineError naming every failed engine and why; ``.failures`` maps name -> text."""
        if self.errors:
            raise _engines_failed(self.verb, self.errors)


def _engines_failed(verb: str, errors: Mapping[str, BaseException]) -> EngineError:
    lines = [f"{verb} failed on {len(errors)} engine(s):"] + [f"  {n}: {e}" for n, e in errors.items()]
    err = EngineError("\n".join(lines))
    err.failures = {n: str(e) for n, e in errors.items()}  # type: ignore[attr-defined]
    return err


def call_engines(engines: Iterable[SglangEngine], verb: str | Callable[[SglangEngine], Any], *args: Any,
                 **kwargs: Any) -> EngineCalls:
    """Run ``verb`` (an SglangEngine method name, or a callable taking the engine) on every engine
    concurrently, one thread each; never raises for an engine's failure, collects it instead."""
    engines = list(engines)
    _check_unique_names(engines)
    label = verb if isinstance(verb, str) else getattr(verb, "__name__", "call")
    calls = EngineCalls(verb=label)
    if not engines:
        return calls

    def one(engine: SglangEngine) -> Any:
        if isinstance(verb, str):
            return getattr(engine, verb)(*args, **kwargs)
        return verb(engine, *args, **kwargs)

    with ThreadPoolExecutor(max_workers=min(len(engines), 64), thread_name_prefix=f"p2pw-{label}") as pool:
        futures = {e.name: pool.submit(one, e) for e in engines}
        for name, fut in futures.items():
            try:
                calls.results[name] = fut.result()
            except Exception as e:  # noqa: BLE001 - every engine's failure is data here
                calls.errors[name] = e
    return calls


def _check_unique_names(engines: Sequence[SglangEngine]) -> None:
    seen: dict[str, str] = {}
    for e in engines:
        if e.name in seen:
            raise ValueError(f"two engines are named {e.name!r} ({seen[e.name]} and {e.base_url}); pass name=")
        seen[e.name] = e.base_url


# ---- the update session ----------------------------------------------------------------------

#: per-engine outcomes recorded in UpdateSession.outcome
UPDATED = "updated"                  # ended, version bumped, generating again
ROLLED_BACK = "rolled back"          # opening failed elsewhere before any write: ended without bump, generating
RESUMED_GENERATION = "generating"    # paused but never opened: continued, nothing changed
LEFT_PAUSED = "paused, session open" # writes may have landed: paused, session open, old version
CONTINUED_UNFINISHED = "generating, session open"  # on_failure="continue": serving partly written weights
FAILED = "failed"                    # a control call on this engine failed; see errors


class UpdateSession:
    """The control plane of one weight update on many engines, as a context manager::

        with UpdateSession(engines, version=step) as session:
            ...  # every one-sided write; raise if any failed
        # here: every engine ended the update, bumped its version, and generates again

    Opening (``__enter__``): ``pause_generation`` on every engine, then ``begin_weight_update``.
    If an engine's ``begin`` answers that a session is already open (a previous update failed
    after its writes began and left it so) the session is resumed: the new writes cover every byte.

    Success (the block returns): ``end_weight_update`` -> ``update_weight_version`` ->
    ``continue_generation`` on every engine. An engine whose ``end`` fails is not bumped and is left
    paused; the others (whose weights are the new version) are bumped and continued; then one
    EngineError names the failed ones.

    Failure inside the block (a write failed, a timeout, any exception): no engine is told to end
    the update or bump its version (DESIGN invariant 3). What happens next is ``on_failure``:

    - ``"stay_paused"`` (default): every engine stays paused with its session open and its old
      version. Why: after ``begin`` an sglang engine's parameters may be partly overwritten and, for
      in-place-quantized models, unpacked (``restore_weights_before_loading``); its weights are
      neither the old nor the new version. Continuing would serve samples from an undefined model
      labelled with the old version (silently poisoned rollouts); ending would run the
      post-processing on torn weights and close the session as if it had succeeded. The engine is
      safe to resume by the next update (which rewrites every byte), or by hand
      (``end_weight_update`` + ``continue_generation``) if you accept the torn weights.
    - ``"continue"``: ``continue_generation`` without ending or bumping: the engine serves again
      right away, on partly written weights, under the old version label, with its session open.
      Only for trainers that tolerate that (unquantized models, off-policy-tolerant RL).

    Failure while opening (before any write): engines that opened a fresh session are ended
    without a version bump (their weights are untouched; ``end`` re-derives the same buffers) and
    continued; engines only paused are continued; engines with a resumed session stay paused.

    ``outcome`` maps each engine's name to what happened to it; ``errors`` to its control error.
    """

    def __init__(self, engines: SglangEngine | Iterable[SglangEngine], version: str | int, *,
                 pause_mode: str = "abort", selector: str = "all", on_failure: str = "stay_paused",
                 torch_empty_cache: bool = True):
        self.engines = [engines] if isinstance(engines, SglangEngine) else list(engines)
        if not self.engines:
            raise ValueError("UpdateSession needs at least one engine")
        _check_unique_names(self.engines)
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {', '.join(SELECTORS)}, got {selector!r}")
        if on_failure not in ("stay_paused", "continue"):
            raise ValueError(f"on_failure must be 'stay_paused' or 'continue', got {on_failure!r}")
        self.version = str(version)
        self.pause_mode = pause_mode
        self.selector = selector
        self.on_failure = on_failure
        self.torch_empty_cache = torch_empty_cache
        self.outcome: dict[str, str] = {}
        self.errors: dict[str, BaseException] = {}
        self.resumed: set[str] = set()   # engines whose session a previous update had left open
        self._state = "new"              # new -> open -> committed | aborted
        self.paused_at: float | None = None  # perf_counter() when pause_generation returned
        self._lock = threading.Lock()

    def __enter__(self) -> "UpdateSession":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._state != "open":
            return False
        if exc_type is None:
            self.commit()
        else:
            self.abort(reason=f"{exc_type.__name__}: {exc}")
        return False

    # explicit API (the context manager calls these) -------------------------------------------

    def open(self) -> None:
        """pause_generation then begin_weight_update on every engine; on any failure, roll back
        (see the class doc) and raise one EngineError naming each failed engine."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"UpdateSession.open() called twice (state {self._state})")
            self._state = "opening"
        paused = call_engines(self.engines, "pause_generation", self.pause_mode)
        self.paused_at = time.perf_counter()  # the update's measured time starts here
        self.errors.update(paused.errors)
        begun: EngineCalls | None = None
        if paused.ok:
            begun = call_engines(self.engines, self._begin)
            self.errors.update(begun.errors)
        if not self.errors:
            self._state = "open"
            return
        # roll back: nothing has been written yet
        by_name = {e.name: e for e in self.engines}
        opened_fresh = [by_name[n] for n in (begun.results if begun else {}) if n not in self.resumed]
        only_paused = [by_name[n] for n in paused.results if not (begun and n in begun.results)]
        ended = call_engines(opened_fresh, "end_weight_update")
        continued = call_engines(list(only_paused) + [by_name[n] for n in ended.results],
                                 "continue_generation", self.torch_empty_cache)
        for n, err in list(ended.errors.items()) + list(continued.errors.items()):
            self.errors.setdefault(n, err)
        for e in self.engines:
            n = e.name
            if n in self.errors:
                self.outcome[n] = FAILED
            elif n in self.resumed:
                self.outcome[n] = LEFT_PAUSED
            elif n in ended.results:
                self.outcome[n] = ROLLED_BACK
            else:
                self.outcome[n] = RESUMED_GENERATION
        self._state = "aborted"
        raise _engines_failed("opening the weight update", self.errors)

    def commit(self) -> None:
        """Every write succeeded: end -> bump version -> continue on every engine."""
        self._require_open("commit")
        ended = call_engines(self.engines, "end_weight_update")
        self.errors.update(ended.errors)
        done = [e for e in self.engines if e.name in ended.results]
        bumped = call_engines(done, "update_weight_version", self.version)
        self.errors.update(bumped.errors)
        # an engine is continued only once its version says what its weights are
        continued = call_engines([e for e in done if e.name in bumped.results], "continue_generation",
                                 self.torch_empty_cache)
        self.errors.update(continued.errors)
        for e in self.engines:
            if e.name not in self.errors:
                self.outcome[e.name] = UPDATED
            elif e.name in ended.errors:
                self.outcome[e.name] = LEFT_PAUSED
            else:
                self.outcome[e.name] = FAILED
        self._state = "committed"
        if self.errors:
            raise _engines_failed(f"finishing weight update {self.version}", self.errors)

    def abort(self, reason: str = "") -> None:
        """The update failed: no end, no version bump; then ``on_failure`` (see the class doc).
        Never raises for the engines' sake (the caller is already handling the real error)."""
        self._require_open("abort")
        self._state = "aborted"
        if reason:
            logger.warning("weight update %s failed (%s): engines %s", self.version, reason,
                           "stay paused with their session open" if self.on_failure == "stay_paused"
                           else "continue without ending the update")
        if self.on_failure == "continue":
            continued = call_engines(self.engines, "continue_generation", self.torch_empty_cache)
            self.errors.update(continued.errors)
            for e in self.engines:
                self.outcome[e.name] = FAILED if e.name in continued.errors else CONTINUED_UNFINISHED
        else:
            for e in self.engines:
                self.outcome[e.name] = LEFT_PAUSED

    def _begin(self, engine: SglangEngine) -> dict:
        try:
            return engine.begin_weight_update(self.selector)
        except EngineError as e:
            if _SESSION_ALREADY_OPEN in str(e) and "HTTP 400" in str(e):
                logger.warning("engine %s: resuming the weight-update session a failed update left open",
                               engine.name)
                with self._lock:
                    self.resumed.add(engine.name)
                return {"success": True, "message": "resumed an open weight-update session"}
            raise

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise RuntimeError(f"UpdateSession.{what}() needs an open session (state {self._state})")
