"""The one registry of ``P2PW_`` settings: every variable is declared once here (name, type, default,
one-line doc) and read only through this module.

Rules (as in sglang's ``Envs``): a module never calls ``os.environ.get("P2PW_...")``; it asks
:func:`value` for a declared setting, or takes a :class:`Settings` (the sender's knobs) built by
:func:`settings`, where a keyword argument wins over the environment, which wins over the default.
``p2pweights doctor`` prints :func:`describe` (every setting, its value and where it came from) and
exits non-zero when one is invalid. The README's settings table is checked against
:data:`REGISTRY` by a test.

Each setting has a ``scope`` (who reads it): ``sender`` settings are exactly the keywords of
``WeightSender`` (the :class:`Settings` fields are derived from them, so a new sender setting is a
keyword without further code); ``engine`` settings are read by receiver processes, ``process`` ones
once per process (at native load or sglang import, so a keyword could not change them), ``baseline``
by the broadcast baseline (its own keyword), ``script`` ones only by scripts/ and the GPU bundle's
stubs (declared so that doctor knows them). Every boolean, variable or keyword, is read by
:func:`parse_bool`.
"""
from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, make_dataclass
from typing import Any, Callable

from .errors import P2PWeightsError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: str | int) -> int:
    """'512MiB' -> 536870912; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; use bytes or a unit such as 64MiB, 1GiB, 500MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{int(n)} B"


TRANSPORTS = ("mooncake", "nixl")


class SettingError(P2PWeightsError, ValueError):
    """A setting (keyword or ``P2PW_`` variable) has a value that cannot be used."""


# -- value checkers: each takes the parsed value and raises ValueError with the fix -------------------
def _positive(v: float) -> float:
    if not v > 0:
        raise ValueError("must be positive")
    return v


def _non_negative(v: int) -> int:
    if v < 0:
        raise ValueError("must be >= 0")
    return v


def _at_least_one(v: int) -> int:
    if v < 1:
        raise ValueError("must be at least 1")
    return v


def _one_of(*choices: str) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return v
    return check


def _device(v: str) -> str:
    if v not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", v):
        raise ValueError("must be cpu or cuda[:N]")
    return v


def _gpu_list(v: str) -> str:
    if v and not re.fullmatch(r"\d+(,\d+)*", v):
        raise ValueError("must be a comma-separated list of GPU numbers, e.g. 1,2,3,4")
    return v


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def parse_bool(v: Any) -> bool:
    """The one boolean reader of p2pweights: a bool, 0/1, or (any case) 1/true/yes/on, 0/false/no/off;
    empty is false. Anything else is refused rather than read as false."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError("must be a boolean: 1/true/yes/on or 0/false/no/off")


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TypeError(f"must be an integer, not {type(v).__name__}")
    return int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError(f"must be a number, not {type(v).__name__}")
    return float(v)


def _size(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TypeError(f"must be a size (bytes, or a string such as 64MiB), not {type(v).__name__}")
    return parse_size(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"must be a string, not {type(v).__name__}")
    return v.strip()


def _path(v: Any) -> str:
    if not isinstance(v, (str, os.PathLike)):
        raise TypeError(f"must be a path (str or os.PathLike), not {type(v).__name__}")
    return os.fspath(v).strip()


def _log_level(v: str) -> str:
    if v.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return v.upper()


SCOPES = ("sender", "engine", "process", "baseline", "script")


@dataclass(frozen=True)
class Setting:
    """One ``P2PW_`` variable. ``default`` None means "unset" (the user of the value decides);
    ``also``: other variables honoured when this one is unset (sglang's or the vendor's own);
    ``scope``: who reads it (see the module; only ``sender`` settings are WeightSender keywords)."""

    env: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    check: Callable[[Any], Any] | None = None
    also: tuple[str, ...] = ()
    secret: bool = False
    default_text: str = ""  # how the README spells a computed default
    scope: str = "sender"

    @property
    def key(self) -> str:
        """The keyword argument spelling: P2PW_BUFFER_SIZE -> buffer_size."""
        return self.env.removeprefix("P2PW_").lower()

    def coerce(self, raw: Any, where: str) -> Any:
        """The parsed, checked value of ``raw`` (a variable's text or a keyword's value): the parser
        also checks a keyword's type, so ``num_slots=2.5`` fails naming the setting."""
        try:
            v = self.parse(raw)
            return self.check(v) if self.check is not None else v
        except (TypeError, ValueError) as e:
            raise SettingError(f"{where}={raw!r}: {e} ({self.doc})") from None


REGISTRY: dict[str, Setting] = {s.env: s for s in (
    # the sender and its slots
    Setting("P2PW_BUFFER_SIZE", _size, 512 << 20, "bytes per transfer slot; raised to the largest parameter "
            "group, rounded up to 2 MiB", _positive, default_text="512MiB"),
    Setting("P2PW_NUM_SLOTS", _int, None, "transfer slots (2 = double buffering); unset: 2 host slots, 4 GPU slots "
            "(a GPU's refill waits out a slot's writes less: docs/sender.md)", _at_least_one,
            default_text="2 (host), 4 (GPU)"),
    Setting("P2PW_TRANSFER_TIMEOUT", _float, 30.0, "seconds a write may run before it is cancelled and the update "
            "fails naming the engine", _positive, default_text="30"),
    Setting("P2PW_TRANSPORT", _str, "auto", "`auto`, `nixl` or `mooncake`; `auto`: a sender takes the transport its "
            "engines publish for, else (and `serve`, `demo`, the receiver) nixl where NIXL's native C-API path loads, "
            "else mooncake (Mooncake listens on every interface: docs/security.md)", _one_of(*TRANSPORTS, "auto")),
    Setting("P2PW_BUFFER_DEVICE", _str, "cpu", "where slots live: `cpu` (pinned host) or `cuda[:N]`", _device),
    Setting("P2PW_PIN", _str, "auto", "host slot pinning: `auto` (CUDA host registration, else mlock), `cuda`, "
            "`mlock`, `none`", _one_of("auto", "cuda", "mlock", "none")),
    Setting("P2PW_COPY_PLANS", _str, "background", "`background`: record copy plans in a thread after connect, "
            "check each against the loaders at its group's next load, then replay it instead of sglang's loaders; "
            "`on`: record on a group's first load; `off`: always the loaders",
            _one_of("on", "background", "off")),
    Setting("P2PW_DELTA", _str, "auto", "`auto`: after the first update, write only the bytes that changed to "
            "engines that prove they hold this sender's last commit (docs/deltas.md; host slots with CPU inputs; "
            "the sender keeps a host copy of every byte it writes); `off`: every update in full, no copy",
            _one_of("auto", "off")),
    Setting("P2PW_DELTA_APPLY_BESIDE", parse_bool, True, "`1`: the sender holding the session has each engine apply "
            "a slot's delta records as soon as that slot's writes returned, while later slots are written (one "
            "`p2pw_apply_deltas` call per engine at a time; the end applies the rest); `0`: every record at the end",
            default_text="1"),
    Setting("P2PW_PREPARE", parse_bool, False, "`1`: a WeightSender starts, at construction, on a thread, what its "
            "first connect would import (sglang, the model's module) and its transport agent; connect waits for "
            "what is not done", default_text="0"),
    Setting("P2PW_COPY_THREADS", _int, min(4, os.cpu_count() or 1), "threads of a replayed copy plan's native "
            "host copies (a group under 4 MiB runs on one) and of a host slot's delta compare (parts of >= 1 MiB)",
            _at_least_one, default_text="min(4, cores)"),
    Setting("P2PW_COPY_LANES", _int, 8, "CUDA streams a GPU slot's replayed copies are spread over (a GPU runs "
            "one stream's small copies one after another); 1: the caller's stream only", _at_least_one),
    Setting("P2PW_CUDA_RUNTIME", _path, None, "path or soname of `libcudart` to dlopen (read by the native core)",
            default_text="(search)", scope="process"),
    # transports
    Setting("P2PW_NIXL_BACKEND", _str, "UCX", "NIXL plugin; `SGLANG_REMOTE_INSTANCE_NIXL_BACKEND` is honoured too",
            also=("SGLANG_REMOTE_INSTANCE_NIXL_BACKEND",)),
    Setting("P2PW_NIXL_PROGRESS_DELAY_US", _int, 1000, "NIXL agent progress-thread sleep (NIXL's default 0 spins a "
            "core)", _non_negative),
    Setting("P2PW_NIXL_API", _str, "auto", "sender's NIXL data path: `auto` (NIXL's C API without the GIL when the "
            "wheel ships it, else Python), `native`, `python`", _one_of("auto", "native", "python")),
    Setting("P2PW_MOONCAKE_PROTOCOL", _str, None, "Mooncake protocol (`MOONCAKE_PROTOCOL` honoured)",
            also=("MOONCAKE_PROTOCOL",), default_text="`rdma` if an RDMA device exists, else `tcp`"),
    Setting("P2PW_MOONCAKE_DEVICE", _str, None, "Mooncake RDMA device list (`MOONCAKE_DEVICE` honoured)",
            also=("MOONCAKE_DEVICE",), default_text="all"),
    Setting("P2PW_HOSTNAME", _str, None, "address a transfer engine advertises",
            default_text="`127.0.0.1` without RDMA, else this host's IP"),
    # the replica
    Setting("P2PW_REPLICA_CACHE_DIR", _path, None, "on-disk cache of each replica's loader mapping "
            "(`replica-KEY.json`) and copy plans (`plans-vN-KEY.json`); KEY digests the model config, layout, rank, "
            "role, sglang and p2pweights versions, so a change of any makes new files; a plan file of another format "
            "or failing its checks is recorded again", default_text="off"),
    Setting("P2PW_VLLM_SITE", _path, None, "folder holding vLLM (`vllm/__init__.py`) for the vLLM commands "
            "(`check-layout`/`demo --engine-kind vllm`) where this Python cannot import it; unset: `.vllm_site` in "
            "the current directory or a parent, else beside the source checkout (scripts/setup.sh installs it "
            "there); put on sys.path ahead of site-packages and at the end of the command's children's PYTHONPATH",
            default_text="unset", scope="process"),
    Setting("P2PW_SGLANG_IMPORT_AS_CPU", parse_bool, False, "`1`: import sglang as on a host without CUDA (the "
            "byte-exact CPU path) on a GPU host without sgl_kernel", default_text="unset", scope="process"),
    # the control plane
    Setting("P2PW_ENGINE_TIMEOUT", _float, 300.0, "seconds for an engine control-plane HTTP call", _positive,
            default_text="300"),
    Setting("P2PW_ENGINE_CONNECT_TIMEOUT", _float, 3.0, "seconds to connect to an engine's HTTP server", _positive,
            default_text="3"),
    Setting("P2PW_API_KEY", _str, None, "bearer key: receivers (`serve --api-key`) require it on every route but "
            "health; senders send it (`Authorization: Bearer KEY`), as sglang's `--api-key`", secret=True,
            default_text="unset"),
    Setting("P2PW_SESSION_LEASE", _float, 30.0, "seconds an update session lives without its owner renewing it; "
            "then it expires (torn if it received writes). On an engine: the longest lease it grants (a longer "
            "or infinite ask is capped); on a sender: the lease it asks for", _positive, default_text="30"),
    Setting("P2PW_OPEN_BESIDE_SLOTS", parse_bool, False, "`1`: a sender alone pauses the engines at its first push, "
            "then opens their session (begin) on a thread while it fills the first slots; the first write waits "
            "for every session", default_text="0"),
    # trust in what is written
    Setting("P2PW_CHECK_FINITE", parse_bool, False, "`1`: refuse NaN/Inf in pushed tensors, naming the tensor, "
            "before any write", default_text="unset"),
    Setting("P2PW_ENGINE_DOWN", _str, "fail", "an engine that does not answer at an update's start: `fail` the update, "
            "naming it; `skip` it and commit the others (`report.engines_skipped` says why; it is written in full when "
            "back; docs/sender.md, \"The engine set\")", _one_of("fail", "skip")),
    Setting("P2PW_VERIFY", parse_bool, False, "`1`: `update(verify=True)` by default: engine ranks digest what they "
            "hold and the sender compares before the engines resume", default_text="unset"),
    # the broadcast baseline
    Setting("P2PW_BROADCAST_BUCKET", _size, 256 << 20, "bucket size of the broadcast baseline", _positive,
            default_text="256MiB", scope="baseline"),
    # the receiver
    Setting("P2PW_RECEIVER_LAUNCH", _str, "fork", "receiver ranks: forked from one launcher that imported sglang "
            "once, or `spawn`", _one_of("fork", "spawn"), scope="engine"),
    Setting("P2PW_LOG_LEVEL", _str, "WARNING", "receiver processes' log level", _log_level, scope="engine"),
    Setting("P2PW_RECEIVER_DEVICE", _str, "cpu", "where receiver engine ranks keep their parameters: `cpu` or "
            "`cuda[:N]` (VRAM registration)", _device, scope="engine"),
    Setting("P2PW_DELTA_AREA", _size, None, "bytes of each engine rank's delta area (what one update's "
            "encoded deltas may take; a sender writes the rest in full). A rank whose weights are on a GPU (any "
            "host: receiver, sglang plugin, vLLM backend) opens one there only when this (or vLLM's "
            "init_info.area_bytes) is set", _positive,
            default_text="an eighth of the rank's weights, at least 4MiB", scope="engine"),
    Setting("P2PW_RECEIVER_CONTROL", _str, "folded", "a receiver's session verbs: `folded` (the owner's pause rides on "
            "its begin, each rank acknowledges begin and end in their own round trip, the end carries the deltas, "
            "sglang's update hooks are skipped once proven no-ops) or `separate` (each apart, hooks always run: the "
            "path to measure against, benchmarks/bench_control_cost.py)", _one_of("folded", "separate"), scope="engine"),
    Setting("P2PW_REVOKE_TIMEOUT", _float, 10.0, "seconds an engine rank gives a takeover's revocation to unregister "
            "the old epoch's memory and cut its connections (a write mid-flight included); past it, or when either "
            "fails, the begin fails and the engine stays torn (docs/security.md, \"Epochs\")", _positive,
            default_text="10", scope="engine"),
    Setting("P2PW_RECEIVER_GPUS", _str, "", "`1,2,3,4`: receiver engine rank r keeps its parameters on GPU number "
            "r of this list", _gpu_list, default_text="unset", scope="engine"),
    # scripts/gpu_env.sh and the GPU bundle's sgl_kernel stub (scripts/gpu_bundle.sh); the package never reads them
    Setting("P2PW_GPU_SITE", _path, "/tmp/p2pw-gpu", "where scripts/gpu_env.sh unpacks the GPU bundles "
            "(`.carry/gpu-NAME/site.tar.xz`)", scope="script"),
    Setting("P2PW_NO_SGL_KERNEL_STUB", parse_bool, False, "`1`: the GPU bundle's `sgl_kernel` stub raises "
            "ImportError instead of standing in for the missing wheel (scripts/gpu_bundle.sh)", default_text="unset",
            scope="script"),
)}


def _setting(name: str) -> Setting:
    s = REGISTRY.get(name) or REGISTRY.get("P2PW_" + name.upper())
    if s is None:
        raise KeyError(f"{name!r} is not a declared p2pweights setting (see p2pweights.settings.REGISTRY)")
    return s


def lookup(name: str, override: Any = None) -> tuple[Any, str]:
    """(value, source) of one setting: the keyword ``override`` when not None, else its variable
    (or one it honours), else the default. Raises :class:`SettingError` naming the variable."""
    s = _setting(name)
    if override is not None:
        return s.coerce(override, f"keyword {s.key}"), "keyword"
    for env in (s.env, *s.also):
        raw = os.environ.get(env)
        if raw:
            return s.coerce(raw, env), env
    return s.default, "default"


def value(name: str, override: Any = None) -> Any:
    """The value of one setting (``"P2PW_ENGINE_TIMEOUT"`` or ``"engine_timeout"``)."""
    return lookup(name, override)[0]


def describe() -> list[dict[str, Any]]:
    """Every setting with its value and source; invalid ones carry ``error``. Secrets are masked."""
    rows = []
    for s in REGISTRY.values():
        row: dict[str, Any] = {"env": s.env, "doc": s.doc}
        try:
            v, src = lookup(s.env)
            row.update(value=("***" if s.secret and v else v), source=src)
        except SettingError as e:
            row.update(value=os.environ.get(s.env), source=s.env, error=str(e))
        rows.append(row)
    undeclared = sorted(k for k in os.environ if k.startswith("P2PW_") and k not in REGISTRY)
    for k in undeclared:
        rows.append({"env": k, "doc": "", "value": os.environ[k], "source": k,
                     "error": f"{k} is not a p2pweights setting (a typo?); declared: see `p2pweights doctor`"})
    return rows


def _transport_options(self: Any, transport: str | None = None) -> dict[str, Any]:
    """Keyword arguments for the chosen transport's backend (only those that are set); ``transport``:
    the one ``auto`` resolved to (``transport.resolve_transport``; default: this setting's, which must
    then name one)."""
    transport = transport or self.transport
    if transport == "auto":
        raise ValueError("transport_options() of transport 'auto': pass the transport it resolved to, "
                         "s.transport_options(p2pweights.transport.resolve_transport(s.transport)[0])")
    if transport == "nixl":
        opts = {"backend": self.nixl_backend, "progress_delay": self.nixl_progress_delay_us}
    else:
        opts = {"protocol": self.mooncake_protocol, "device": self.mooncake_device, "hostname": self.hostname}
    return {k: v for k, v in opts.items() if v is not None}


SENDER_KEYWORDS: tuple[str, ...] = tuple(s.key for s in REGISTRY.values() if s.scope == "sender")

# The sender's knobs: one frozen field per ``sender`` setting of REGISTRY (derived, so that a new
# sender setting is a WeightSender keyword with no other edit), each a keyword and a P2PW_ variable.
Settings = make_dataclass(
    "Settings", [(k, Any) for k in SENDER_KEYWORDS], frozen=True,
    namespace={"transport_options": _transport_options,
               "__doc__": "The sender's knobs: each ``sender`` setting of REGISTRY, a keyword of WeightSender "
                          "and a P2PW_ variable."})
Settings.__module__ = __name__


def settings(**overrides: Any) -> Any:
    """The sender's :class:`Settings`: keyword arguments win over environment variables, which win
    over defaults; None = unset. A keyword that is not a sender setting is a TypeError saying what it
    is (a receiver's, a per-process one, ...) or listing the known ones."""
    unknown = sorted(set(overrides) - set(SENDER_KEYWORDS))
    if unknown:
        other = {s.key: s for s in REGISTRY.values()}
        why = [f"{k} (P2PW_{k.upper()}) is a{'n' if other[k].scope == 'engine' else ''} {other[k].scope} "
               f"setting: set the variable" for k in unknown if k in other]
        typos = [k for k in unknown if k not in other]
        if typos:
            why.append(f"unknown setting(s): {', '.join(typos)}; known: {', '.join(sorted(SENDER_KEYWORDS))}")
        raise TypeError("; ".join(why))
    return Settings(**{k: value(k, overrides.get(k)) for k in SENDER_KEYWORDS})


def sender_signature(init: Callable[..., Any]) -> inspect.Signature:
    """``init``'s signature with its ``**overrides`` spelled out as one keyword (default None: the
    variable, else the default) per sender setting, for help() and editors."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in SENDER_KEYWORDS]
    return sig.replace(parameters=params)
