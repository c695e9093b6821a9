"""The control plane's request and answer bodies: sglang 0.5.23's io_struct classes, field for
field (``SGLANG`` names each one's class), p2pweights' own, the bodies of a leader's calls to its
other ranks (:data:`RANK_BODIES`), and their JSON form: :func:`encode` and :func:`decode`.

The one place a body is checked: every field's annotation is its JSON type, checked all the way
down (``list[str]``: a list of strings; ``int``: a JSON integer, never a bool, within int64;
``float``: finite), with its choices; the p2pweights fields that ride in an ``extra`` field
(``hf_seed``, ``changed_fraction``, ``changed_steps``) are typed by the ``extra`` field's metadata.
A body that fails is an InvalidRequest naming the field (a 400 on every server), never a crash in
a hook.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from ..errors import InvalidRequest
from .protocol import END_THEN, PAUSE_FIRST, PAUSE_MODES, SELECTORS

# ---- request bodies ------------------------------------------------------------------------------


def _choices(options: tuple[str, ...]) -> Any:
    return {"choices": options}


def _extra(**typed: Any) -> Any:
    """An ``extra`` field (unknown keys kept, sent flat); ``typed``: the known ones and their types."""
    return field(default_factory=dict, metadata={"extra": True, "typed": typed})


class Body:
    """A request or answer body. ``SGLANG`` names sglang's class of the same fields. ``LARGE``: a
    body that may need the server's whole body limit (a rank's weights table, lists of every
    parameter name); any other is refused over :data:`SMALL_BODY_BYTES` (413, unread)."""

    SGLANG: ClassVar[str | None] = None
    LARGE: ClassVar[bool] = False


SMALL_BODY_BYTES = 1 << 20   # a verb's arguments (a mode, a version, a flag): far smaller


@dataclass
class PauseGenerationReq(Body):
    SGLANG: ClassVar[str | None] = "PauseGenerationReqInput"
    mode: str = field(default="abort", metadata=_choices(PAUSE_MODES))


@dataclass
class ContinueGenerationReq(Body):
    SGLANG: ClassVar[str | None] = "ContinueGenerationReqInput"
    torch_empty_cache: bool = True


@dataclass
class BeginWeightUpdateReq(Body):
    SGLANG: ClassVar[str | None] = "BeginWeightUpdateReqInput"
    selector: str = field(default="all", metadata=_choices(SELECTORS))
    # p2pweights' ``p2pw_delta`` (deltas/committed.py), sent only to engines publishing a delta area
    extra: dict = field(default_factory=dict, metadata={"extra": True})


@dataclass
class EndWeightUpdateReq(Body):
    """sglang's body is empty. ``extra`` carries p2pweights' ``p2pw_then`` (:data:`END_THEN`), sent
    only to an engine whose begin answered :data:`END_FOLDS` (a receiver; never to sglang)."""

    SGLANG: ClassVar[str | None] = "EndWeightUpdateReqInput"
    extra: dict = field(default_factory=dict, metadata={"extra": True})


@dataclass
class LoadLoRAAdapterReq(Body):
    """sglang's load of a LoRA adapter from files (its own API: the engine picks the adapter's slot;
    ``pinned`` keeps it there, which one-sided adapter updates need: docs/lora.md)."""

    SGLANG: ClassVar[str | None] = "LoadLoRAAdapterReqInput"
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None  # sglang's tokenizer manager fills it; a client sends none


@dataclass
class UnloadLoRAAdapterReq(Body):
    SGLANG: ClassVar[str | None] = "UnloadLoRAAdapterReqInput"
    lora_name: str
    lora_id: str | None = None


@dataclass
class UpdateWeightVersionReq(Body):
    """sglang aborts running requests by default; p2pweights' client always sends false (the
    engine was paused before the writes)."""

    SGLANG: ClassVar[str | None] = "UpdateWeightVersionReqInput"
    new_version: str
    abort_all_requests: bool = True


@dataclass
class CheckWeightsReq(Body):
    """``extra``: fields sglang does not define (a receiver reads ``hf_seed`` for ``p2pw_compare``,
    and ``changed_fraction`` with ``changed_steps`` for a version of the seed's changed family,
    ``models.checkpoint``); sent and received flat, next to sglang's fields."""

    LARGE: ClassVar[bool] = True
    SGLANG: ClassVar[str | None] = "CheckWeightsReqInput"
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: str = field(default="all", metadata=_choices(SELECTORS))
    extra: dict = _extra(hf_seed=int, changed_fraction=float, changed_steps=int)

    def __post_init__(self) -> None:
        _check_changed(self.extra.get("changed_fraction"), self.extra.get("changed_steps"))


@dataclass
class GetWeightsByNameReq(Body):
    SGLANG: ClassVar[str | None] = "GetWeightsByNameReqInput"
    name: str
    truncate_size: int = 100


@dataclass
class InitWeightsUpdateGroupReq(Body):
    SGLANG: ClassVar[str | None] = "InitWeightsUpdateGroupReqInput"
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class UpdateWeightsFromDistributedReq(Body):
    LARGE: ClassVar[bool] = True
    SGLANG: ClassVar[str | None] = "UpdateWeightsFromDistributedReqInput"
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = field(default="all", metadata=_choices(SELECTORS))
    torch_empty_cache: bool = False

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise InvalidRequest("names, dtypes and shapes must have the same length")


@dataclass
class DestroyWeightsUpdateGroupReq(Body):
    SGLANG: ClassVar[str | None] = "DestroyWeightsUpdateGroupReqInput"
    group_name: str = "weight_update_group"


@dataclass
class RegisterTransferEngineInfoReq(Body):
    """The bootstrap server's ``PUT /register_transfer_engine_info`` (sglang parses it by hand):
    ``transfer_engine_info`` is ``{"session_id", "weights_info_dict", <extra publication keys>}``."""

    LARGE: ClassVar[bool] = True
    tp_rank: int
    transfer_engine_info: dict

    def __post_init__(self) -> None:
        if self.tp_rank < 0:
            raise InvalidRequest(f"field 'tp_rank' must be >= 0, got {self.tp_rank}")
        missing = [k for k in ("session_id", "weights_info_dict") if k not in self.transfer_engine_info]
        if missing:
            raise InvalidRequest(f"field 'transfer_engine_info' needs {', '.join(map(repr, missing))}")
        _check_value("transfer_engine_info.session_id", str, self.transfer_engine_info["session_id"])


@dataclass
class RenewWeightUpdateReq(Body):
    """p2pweights' ``POST /renew_weight_update`` (no sglang counterpart): the session's owner renews
    its lease; ``release``: the owner gives the session up (the engine is then torn until a complete
    update)."""

    release: bool = False


@dataclass
class WeightsDigestReq(Body):
    """p2pweights' ``POST /p2pw_weights_digest`` (no sglang counterpart; ``update(verify=True)``):
    ``names`` maps an engine rank (as a string) to the parameters whose bytes it digests. The answer:
    ``{"success": true, "algorithm": ..., "ranks": {"<rank>": {param: digest}}}`` (control.weights_digest)."""

    LARGE: ClassVar[bool] = True
    names: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class ApplyDeltasReq(Body):
    """p2pweights' ``POST /p2pw_apply_deltas`` (the session's owner; ``update(verify=True)`` with deltas):
    apply the session's deltas now, before the digests, instead of at ``end_weight_update``.
    ``manifests`` maps an engine rank (as a string) to what the owner wrote into its delta area
    (deltas/area.py ``Manifest``), or a list of them, one per writer (``parse_segments``: checked there)."""

    manifests: dict[str, dict | list] = field(default_factory=dict)


@dataclass
class RankApplyDeltasReq(Body):
    manifests: dict[str, dict | list] = field(default_factory=dict)


# ---- the bodies of a leader's calls to its other ranks (receiver.rank_server, EngineRank.call) -----

@dataclass
class RankBeginReq(Body):
    selector: str = field(default="all", metadata=_choices(SELECTORS))


@dataclass
class RankEndReq(Body):
    """A rank's end: the deltas of the session first, when the end carries them (``manifests``, as
    ``RankApplyDeltasReq``'s), then sglang's post-processing."""

    manifests: dict[str, dict | list] | None = None


@dataclass
class RankRevokeReq(Body):
    """A takeover: the rank moves its registrations to a new endpoint published under ``epoch``."""

    epoch: int


@dataclass
class RankCompareReq(Body):
    """The equality check on one rank: the update's ``random_checkpoint`` seed, names to skip, and
    the version of the seed's changed family (``changed_fraction`` with ``changed_steps``, or neither)."""

    hf_seed: int
    skip: list[str] = field(default_factory=list)
    changed_fraction: float | None = None
    changed_steps: int | None = None

    def __post_init__(self) -> None:
        _check_changed(self.changed_fraction, self.changed_steps)


def _check_changed(fraction: Any, steps: Any) -> None:
    """A version of a changed checkpoint family: a fraction in [0, 1] and steps >= 0, both or neither
    (their JSON types are checked first, where a body is decoded)."""
    if (fraction is None) != (steps is None):
        given, missing = ("changed_fraction", "changed_steps")[::1 if steps is None else -1]
        raise InvalidRequest(f"field {missing!r} is required with {given!r}")
    if fraction is not None and isinstance(fraction, (int, float)) and not 0.0 <= fraction <= 1.0:
        raise InvalidRequest(f"field 'changed_fraction' must be in [0, 1], got {fraction}")
    if steps is not None and isinstance(steps, int) and steps < 0:
        raise InvalidRequest(f"field 'changed_steps' must be >= 0, got {steps}")


@dataclass
class NoBody(Body):
    """A verb without arguments (what is sent anyway is ignored)."""


#: each rank verb -> its body class (checked by the rank's endpoint before the verb runs)
RANK_BODIES: dict[str, type] = {
    "begin": RankBeginReq, "end": RankEndReq, "compare": RankCompareReq, "checksum": NoBody,
    "digest": WeightsDigestReq, "init_group": InitWeightsUpdateGroupReq,
    "update_from_distributed": UpdateWeightsFromDistributedReq, "destroy_group": DestroyWeightsUpdateGroupReq,
    "ping": NoBody, "revoke": RankRevokeReq, "apply_deltas": RankApplyDeltasReq,
}


# ---- answer bodies ---------------------------------------------------------------------------


@dataclass
class Ack(Body):
    """sglang's answer to the update verbs and the broadcast routes."""

    success: bool = True
    message: str = "Success"


@dataclass
class GenerationAck(Body):
    """sglang's answer to pause_generation / continue_generation."""

    message: str
    status: str = "ok"


@dataclass
class WeightVersionAck(Body):
    message: str
    new_version: str
    success: bool = True


@dataclass
class TransferEngineInfo(Body):
    """One engine rank's publication: sglang's ``[session_id, {param: [ptr, numel, elem_size]}]``
    (or the NIXL form), plus extra publication keys served flat next to it."""

    rank: int
    remote_instance_transfer_engine_info: Any
    extra: dict = field(default_factory=dict, metadata={"extra": True})


def encode(body: Body) -> dict:
    """The JSON object of a body: its fields (``None`` left out: sglang's default for each is
    None), ``extra`` flattened. Checks the fields first, as :func:`decode` does on the other side."""
    _check(body)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(body):
        v = getattr(body, f.name)
        if f.metadata.get("extra"):
            out = {**v, **out}
        elif v is not None:
            out[f.name] = v
    return out


def decode(cls: type, obj: Mapping[str, Any]) -> Any:
    """A body of class ``cls`` from a JSON object: sglang's defaults for missing (or null) fields,
    unknown fields ignored (or kept in ``extra``). Raises InvalidRequest naming the field."""
    if not isinstance(obj, Mapping):
        raise InvalidRequest("the body must be a JSON object")
    kwargs: dict[str, Any] = {}
    known = {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        if f.metadata.get("extra"):
            kwargs[f.name] = {k: v for k, v in obj.items() if k not in known}
        elif obj.get(f.name) is not None:
            kwargs[f.name] = obj[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InvalidRequest(f"field {f.name!r} is required")
    for name, v in kwargs.items():
        _check_field(cls, name, v)
    return cls(**kwargs)


def _check(body: Body) -> None:
    for f in dataclasses.fields(body):
        v = getattr(body, f.name)
        if v is not None:
            _check_field(type(body), f.name, v)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A body class's field annotations, evaluated once (``get_type_hints`` evaluates every string
    annotation again on each call: hundreds of microseconds per body, on every control call)."""
    return typing.get_type_hints(cls)


def _check_field(cls: type, name: str, v: Any) -> None:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.metadata.get("extra"):  # unknown keys pass as they came; the known ones are typed
        for key, hint in f.metadata.get("typed", {}).items():
            if v.get(key) is not None:
                _check_value(key, hint, v[key])
        return
    _check_value(name, _hints(cls)[name], v)
    choices = f.metadata.get("choices")
    if choices is not None and v not in choices:
        raise InvalidRequest(f"field {name!r} must be one of {', '.join(choices)}, got {str(v)[:100]!r}")


_INT64 = 1 << 63
_JSON_KINDS = (str, bool, int, float, list, dict)


def _check_value(name: str, hint: Any, v: Any) -> None:
    """``v`` is the JSON value ``hint`` asks for, all the way down; InvalidRequest naming the field
    (``names[3]``, ``names[0][1]``) otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if v is None:
            return
        if len(args) == 1:
            return _check_value(name, args[0], v)
        return  # a union of several types: anything (none in use)
    kind = typing.get_origin(hint) or hint
    if kind not in _JSON_KINDS:
        return  # Any
    ok = isinstance(v, kind) and not (kind in (int, float) and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        ok = True
    if not ok:
        raise InvalidRequest(f"field {name!r} must be {kind.__name__}, got {type(v).__name__}")
    if kind is int and not -_INT64 <= v < _INT64:
        raise InvalidRequest(f"field {name!r} must be a 64-bit integer, got {str(v)[:40]}")
    if kind is float and not math.isfinite(v):
        raise InvalidRequest(f"field {name!r} must be a finite number, got {v}")
    if kind is list and args:
        for i, item in enumerate(v):
            _check_value(f"{name}[{i}]", args[0], item)
    if kind is dict and len(args) == 2:
        for key, item in v.items():
            _check_value(f"{name} key", args[0], key)
            _check_value(f"{name}[{key}]"[:200], args[1], item)


def _kind(hint: Any) -> type | None:
    """The JSON type a field's annotation asks for (``str | None`` -> str); None: anything."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind(inner[0]) if len(inner) == 1 else None
    origin = typing.get_origin(hint) or hint
    return origin if origin in (str, bool, int, float, list, dict) else None


def begin_pause(pause: Any) -> PauseGenerationReq | None:
    """The checked :data:`PAUSE_FIRST` of a begin_weight_update body (the pause to run first, in
    the same call), or None when the body has none."""
    if pause is None:
        return None
    if not isinstance(pause, dict):
        raise InvalidRequest(f"field {PAUSE_FIRST!r} must be an object with 'mode' (one of {', '.join(PAUSE_MODES)})")
    return decode(PauseGenerationReq, pause)


def end_then(then: Any) -> dict | None:
    """The checked :data:`END_THEN` of an end_weight_update body (``new_version``, ``continue``,
    ``torch_empty_cache``; the flags default to true), or None when the body has none."""
    if then is None:
        return None
    if not isinstance(then, dict) or not isinstance(then.get("new_version"), str):
        raise InvalidRequest(f"field {END_THEN!r} must be an object with 'new_version' (a string), "
                             f"'continue' and 'torch_empty_cache' (booleans)")
    flags = {k: then.get(k, True) for k in ("continue", "torch_empty_cache")}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise InvalidRequest(f"fields 'continue' and 'torch_empty_cache' of {END_THEN!r} must be booleans")
    return {"new_version": then["new_version"], **flags}
