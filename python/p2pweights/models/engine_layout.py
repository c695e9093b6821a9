"""The shard layout of an sglang engine: the server args that decide which bytes each rank holds.

An :class:`EngineLayout` is built from what the engine itself reports (``GET /server_info``) or
from the CLI's ``tp=2,ep=2,dp_attention=2,<server arg>=<value>`` spelling. It keeps only the
server args that change parameter bytes; two engines with equal layouts (and the same model)
hold the same bytes on the same rank, so they share one replica (DESIGN.md, invariant 7).

It is the one layout type: the planner, its cost model, the replica, the sender and every
command use it, and :func:`parse_layout_spec` is the one parser of the CLI's ``--engine``. A key
a command cannot honour is an error naming the key and the command, never dropped.

This module imports neither torch nor sglang: the planner and the demo use it too.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Container, Mapping

from ..errors import LayoutSpecError, UnsupportedLayout
from .layout_refusals import SPECULATIVE_KEYS, check_parallelism, check_speculative

# Server args that decide a rank's parameter bytes, with sglang 0.5.23's defaults. The replica is
# built from these and nothing else, so what is not listed here cannot leak into its bytes.
LAYOUT_ARGS: dict[str, Any] = {
    # parallelism
    "tp_size": 1,
    "pp_size": 1,
    "attn_dp_size": 1,
    "attn_cp_size": 1,
    "moe_dp_size": 1,
    "dcp_size": 1,
    "ep_size": 1,
    "moe_dense_tp_size": None,
    "enable_dp_lm_head": False,
    "enable_shared_experts_attn_tp": False,
    "shared_experts_tp_size": None,
    "enable_dense_mlp_attn_tp": False,
    # numerics and kernels whose weight layout differs
    "dtype": "auto",
    "quantization": None,
    "moe_runner_backend": "auto",
    "moe_a2a_backend": "none",
    "fp8_gemm_runner_backend": "auto",
    "fp4_gemm_runner_backend": "auto",
    "bf16_gemm_backend": "auto",
    "enable_fp32_lm_head": False,
    "disable_shared_experts_fusion": False,
    "enforce_shared_experts_fusion": False,
    "json_model_override_args": "{}",
    "enable_w4a4_mxfp4_megamoe": False,
    # a draft model (NEXTN / EAGLE): a second role with weights of its own on every rank (roles.py)
    "speculative_algorithm": None,
}

# The engine's GPU architecture, when it changes a rank's bytes: not a server arg (sglang reads it from
# the GPU). Absent (None) or sm90: a Hopper engine, the replica's default; sm100: a Blackwell engine,
# whose FP8 post-processing the replica replays (replica/sglang_ue8m0.py). In a layout's args only
# when it is sm100, so every other layout keeps its args, hash and cache key.
DEVICE_ARGS: dict[str, Any] = {"gpu_arch": None}
_GPU_ARCHS = {"sm90": None, "sm100": "sm100"}

# Server args a replica cannot reproduce: (arg, value that is fine, why). Anything else rejects.
_REJECTED_UNLESS: tuple[tuple[str, Any, str], ...] = (
    ("ep_num_redundant_experts", 0, "redundant experts place extra expert copies by load"),
    ("init_expert_location", "trivial", "a non-trivial expert placement is not the checkpoint order"),
    ("enable_eplb", False, "EPLB moves experts between ranks while the engine runs"),
    ("elastic_ep_backend", None, "elastic EP changes the expert layout while the engine runs"),
    ("enable_elastic_expert_backup", False, "elastic EP keeps expert backups outside the layout"),
    ("ep_join_rank_offset", 0, "an elastic EP joiner's ranks are not the launch layout"),
    ("dwdp_size", 1, "DWDP prefetches expert weights from peers instead of holding a fixed shard"),
    ("kt_weight_path", None, "KTransformers keeps experts in CPU memory outside the engine's parameters"),
    ("cpu_offload_gb", 0, "offloaded parameters are not in the engine's published memory"),
    ("enable_paged_experts", False, "paged experts are not resident parameters"),
)

# CLI spellings of server args. ``dp`` is sglang's ``--dp N --enable-dp-attention`` (attention DP),
# as `plan` has always read it; sglang's plain ``dp_size`` (data-parallel replicas) is refused.
_ALIASES = {
    "tp": "tp_size",
    "pp": "pp_size",
    "ep": "ep_size",
    "dp": "attn_dp_size",
    "dp_attention": "attn_dp_size",
    "attn_dp": "attn_dp_size",
    "cp": "attn_cp_size",
    "dp_lm_head": "enable_dp_lm_head",
}
# ``fused_shared_experts=1|0``: sglang's --enforce- / --disable-shared-experts-fusion.
_FUSED = "fused_shared_experts"

#: server args the replica (check-layout, demo, the receiver) honours: the byte-deciding ones, the
#: ones it checks and rejects, and the deprecated DP-attention spelling it normalizes
REPLICA_KEYS = frozenset(LAYOUT_ARGS) | frozenset(DEVICE_ARGS) | SPECULATIVE_KEYS | {name for name, _, _ in _REJECTED_UNLESS} | {
    "max_ep_size", "enable_dp_attention", "dp_size"}


# parallel sizes: whole numbers
_SIZES = ("tp_size", "pp_size", "ep_size", "attn_dp_size", "attn_cp_size", "moe_dp_size", "dcp_size", "dp_size")
_SHORT = {"tp_size": "tp", "pp_size": "pp", "ep_size": "ep", "attn_dp_size": "dp"}


def _is_whole(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return int(value) == float(value)
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class EngineLayout:
    """The byte-deciding server args of one engine (every rank of it). Hashable: a cache key."""

    args: tuple[tuple[str, Any], ...]
    # server args outside LAYOUT_ARGS that the engine reported; kept for rejections and messages
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # the planner compares and reads layouts per engine rank (10,000s per plan): keep the args as a
    # dict and the hash, instead of rebuilding them on every lookup
    _values: dict[str, Any] = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)
    _hash: int = field(default=0, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_values", dict(self.args))
        object.__setattr__(self, "_hash", hash(self.args))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineLayout):
            return NotImplemented
        return self is other or (self._hash == other._hash and self.args == other.args)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None = None, **kwargs: Any) -> "EngineLayout":
        """From server args by their sglang names (missing ones take sglang's defaults)."""
        given = dict(args or {}, **kwargs)
        given = _normalize_dp_attention(given)
        for name in ("ep_size", "attn_dp_size"):  # ``ep=tp``: as many as TP ranks
            if given.get(name) == "tp":
                given[name] = given.get("tp_size", LAYOUT_ARGS["tp_size"])
        for name in _SIZES:
            if name in given and not _is_whole(given[name]):
                raise LayoutSpecError(f"{_SHORT.get(name, name)}={given[name]!r} is not a whole number")
        values = {name: given.get(name, default) for name, default in LAYOUT_ARGS.items()}
        values["json_model_override_args"] = _canonical_json(values["json_model_override_args"])
        arch = _gpu_arch(given.get("gpu_arch"))
        if arch is not None:
            values["gpu_arch"] = arch
        extra = {k: v for k, v in given.items() if k not in LAYOUT_ARGS and k not in DEVICE_ARGS}
        layout = cls(args=tuple(sorted(values.items())), extra=extra)
        layout.check_supported()
        if extra:
            return layout
        # equal layouts without extra args are one object: a plan over 10,000 engines then finds
        # each layout by identity, without comparing 24 args per lookup
        return _INTERNED.setdefault(layout.args, layout)

    @classmethod
    def from_server_info(cls, server_info: Mapping[str, Any]) -> "EngineLayout":
        """From the JSON body of the engine's ``GET /server_info`` (resolved server args)."""
        return cls.from_args(dict(server_info))

    @classmethod
    def parse(cls, spec: str, *, command: str = "engine spec") -> "EngineLayout":
        """From ``tp=2,ep=2,dp_attention=2,<server arg>=<value>`` (the CLI's ``--engine``), as the
        replica honours it (:data:`REPLICA_KEYS`); ``command`` names the caller in errors."""
        return cls.from_args(parse_layout_spec(spec, command=command))

    # -- reading ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, self.extra.get(name, default))

    @property
    def tp_size(self) -> int:
        return int(self["tp_size"])

    @property
    def pp_size(self) -> int:
        return int(self["pp_size"])

    tp = tp_size
    pp = pp_size

    @property
    def ep(self) -> int:
        return int(self["ep_size"])

    @property
    def attn_dp(self) -> int:
        """Attention DP size (sglang's --dp with --enable-dp-attention)."""
        return int(self["attn_dp_size"])

    @property
    def attn_tp(self) -> int:
        """Attention TP size: tp / attention DP."""
        return self.tp // self.attn_dp

    @property
    def moe_tp(self) -> int:
        """TP size inside each expert: tp / ep."""
        return self.tp // self.ep

    @property
    def dp_lm_head(self) -> bool:
        return bool(self["enable_dp_lm_head"])

    @property
    def shared_experts_fusion(self) -> bool | None:
        """True / False when the engine forces shared-expert fusion on / off; None when it follows
        sglang's default for the model (see models.shapes.fuses_shared_experts)."""
        if self["enforce_shared_experts_fusion"]:
            return True
        if self["disable_shared_experts_fusion"]:
            return False
        return None

    @property
    def gpu_arch(self) -> str | None:
        """``sm100`` for a layout of a Blackwell engine; None for the replica's default (Hopper)."""
        return self._values.get("gpu_arch")

    @property
    def world_size(self) -> int:
        """Engine ranks in one engine (its WORLD): tp × pp."""
        return self.tp_size * self.pp_size

    @property
    def key(self) -> str:
        """A short stable hash of the layout, for logs and on-disk cache names."""
        return hashlib.sha256(json.dumps(self.args, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def server_args(self) -> dict[str, Any]:
        """Keyword arguments for sglang's ``ServerArgs`` (only the byte-deciding ones)."""
        return {k: v for k, v in self.args if k in LAYOUT_ARGS and v != LAYOUT_ARGS[k]}

    def describe(self) -> str:
        """``tp=8,ep=8,dp_attention=8,...``: the non-default args, short names first."""
        short = {v: k for k, v in _ALIASES.items() if k not in ("attn_dp", "cp")}
        first = ["tp_size", "pp_size", "ep_size", "attn_dp_size"]
        args = {"tp_size": self.tp_size, **self.server_args()}
        names = [n for n in first if n in args] + [n for n in args if n not in first]
        arch = [f"gpu_arch={self.gpu_arch}"] if self.gpu_arch else []
        return ",".join([f"{short.get(n, n)}={args[n]}" for n in names] + arch)

    # -- rejections ---------------------------------------------------------------------------
    def check_supported(self) -> None:
        """Raise :class:`UnsupportedLayout` naming the flag for layouts a replica cannot reproduce."""
        merged = {**self.extra, **dict(self.args)}
        for name, fine, why in _REJECTED_UNLESS:
            value = merged.get(name, fine)
            if fine is None and value in (None, "", "null", "none", "None"):
                continue
            if value != fine:
                raise UnsupportedLayout(f"engine flag {name}={value!r} is not supported: {why}")
        quantization = merged.get("quantization")
        if quantization not in (None, "", "null", "none", "None", "fp8"):
            # "fp8" must match an FP8 block-quantized checkpoint: checked with the config, at build
            # (replica/fp8_engine.py); other methods post-process in ways not reproduced
            raise UnsupportedLayout(f"engine flag quantization={quantization!r} is not supported: only FP8 "
                                    "block-quantized checkpoints (quantization fp8 or none) are reproduced")
        max_ep = merged.get("max_ep_size")
        if max_ep not in (None, 0) and int(max_ep) != int(merged["tp_size"]) * int(merged.get("pp_size", 1)):
            raise UnsupportedLayout(
                f"engine flag max_ep_size={max_ep!r} is not supported: elastic EP scale-up changes the expert layout"
            )
        check_parallelism(merged)  # pp, moe_dp, attn_cp, dcp: layout_refusals.py says what sglang does and why
        check_speculative(merged)  # an engine running a draft is never treated as target-only
        if merged.get("gpu_arch") and merged.get("speculative_algorithm") not in (None, "", "none", "None", "null"):
            raise UnsupportedLayout(
                f"engine gpu_arch={merged['gpu_arch']} with speculative_algorithm={merged['speculative_algorithm']!r} "
                "is not supported yet: the draft role's Blackwell post-processing is not replayed",
                parameter="gpu_arch", hint="serve the draft on Hopper (sm90), or without --speculative-algorithm")
        tp = int(merged["tp_size"])
        if tp < 1:
            raise LayoutSpecError(f"tp={tp}; an engine needs at least one GPU")
        for name, short in (("ep_size", "ep"), ("attn_dp_size", "dp")):
            value = int(merged[name])
            if value < 1 or tp % value:
                raise LayoutSpecError(f"{short}={value} must divide tp={tp}; pick a divisor of tp")


_INTERNED: dict[tuple[tuple[str, Any], ...], EngineLayout] = {}


def parse_engine_spec(spec: str) -> dict[str, Any]:
    """``"tp=2,ep=2,dp_attention=2,moe_runner_backend=triton"`` → server args by sglang name.

    Values are read as JSON where they parse (ints, true/false, null), else kept as strings.
    Dashes in names become underscores, so ``disable-shared-experts-fusion=true`` works too.
    No key is refused here: see :func:`parse_layout_spec`.
    """
    return {name: value for _, name, value in _spec_items(spec)}


def parse_layout_spec(spec: str, *, command: str, honours: Container[str] | None = None,
                      why: str | None = None) -> dict[str, Any]:
    """The one parser of ``--engine``: server args by sglang name, refusing (with
    :class:`LayoutSpecError` naming the key and ``command``) every key outside ``honours``
    (default: :data:`REPLICA_KEYS`, what a replica reproduces) and sglang's plain ``dp_size``.
    ``why`` says, in the refusal, what the command does honour."""
    honoured = REPLICA_KEYS if honours is None else honours
    items = _spec_items(spec)
    given = {name for _, name, _ in items}
    for key, name, value in items:
        if name == "dp_size" and "enable_dp_attention" not in given:
            raise LayoutSpecError(
                f"--engine {key}={value}: {command} cannot honour it: it is sglang's plain data "
                "parallelism (replicas with identical ranks), not a shard layout; write dp_attention=N "
                "for attention DP, or start more engines"
            )
        if name not in honoured:
            reason = why or ("it does not change which bytes an engine rank holds, so the replica "
                             "ignores it; drop it")
            raise LayoutSpecError(f"--engine {key}={value}: {command} cannot honour it: {reason}")
    return {name: value for _, name, value in items}


def _spec_items(spec: str) -> list[tuple[str, str, Any]]:
    """(key as written, sglang server arg name, value) per ``key=value`` part of a spec."""
    items: list[tuple[str, str, Any]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise LayoutSpecError(f"engine spec part {part!r} is not NAME=VALUE (in {spec!r})")
        key, raw = (s.strip() for s in part.split("=", 1))
        name = key.replace("-", "_")
        value = _parse_value(raw)
        if name == _FUSED:
            name = "enforce_shared_experts_fusion" if value else "disable_shared_experts_fusion"
            value = True
        items.append((key, _ALIASES.get(name, name), value))
    return items


def _parse_value(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false", "null", "none"):
        return {"true": True, "false": False}.get(lowered)
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _normalize_dp_attention(args: dict[str, Any]) -> dict[str, Any]:
    """The deprecated ``--dp-size N --enable-dp-attention`` means ``attn_dp_size = N``."""
    args = dict(args)
    if args.get("enable_dp_attention") and int(args.get("attn_dp_size", 1)) == 1:
        args["attn_dp_size"] = int(args.get("dp_size", 1))
    # Plain DP replicas are separate engines with identical ranks: not part of a rank's layout.
    args.pop("dp_size", None)
    args.pop("enable_dp_attention", None)
    return args


def _gpu_arch(value: Any) -> str | None:
    """``gpu_arch`` of a layout: None for absent or Hopper, ``sm100`` for Blackwell (``sm_100a``,
    ``10.0``, ``100`` too); anything else is refused (the replica reproduces those two)."""
    if value in (None, "", "none", "None", "null"):
        return None
    text = str(value).strip().lower().replace("_", "").rstrip("af")
    text = {"9.0": "sm90", "90": "sm90", "10.0": "sm100", "100": "sm100"}.get(text, text)
    if text not in _GPU_ARCHS:
        raise UnsupportedLayout(f"engine gpu_arch={value!r} is not supported: the replica reproduces Hopper (sm90) "
                                "and Blackwell (sm100) engines", parameter="gpu_arch")
    return _GPU_ARCHS[text]


def _canonical_json(value: Any) -> str:
    if isinstance(value, str):
        value = json.loads(value or "{}")
    return json.dumps(value or {}, sort_keys=True)
