"""The shard layout of an sglang engine: the server args that decide which bytes each rank holds.

An :class:`EngineLayout` is built from what the engine itself reports (``GET /server_info``) or
from the CLI's ``tp=2,ep=2,dp_attention=2,<server arg>=<value>`` spelling. It keeps only the
server args that change parameter bytes; two engines with equal layouts (and the same model)
hold the same bytes on the same rank, so they share one replica (DESIGN.md, invariant 7).

This module imports neither torch nor sglang: the planner and the demo use it too.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import UnsupportedLayout

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
}

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
    ("quantization", None, "quantized layouts post-process on the GPU; not reproduced yet"),
    ("enable_multi_layer_eagle", False, "multi-layer EAGLE drafts are not supported"),
)

# CLI spellings of the parallel sizes.
_ALIASES = {
    "tp": "tp_size",
    "pp": "pp_size",
    "ep": "ep_size",
    "dp": "dp_size",
    "dp_attention": "attn_dp_size",
    "attn_dp": "attn_dp_size",
    "cp": "attn_cp_size",
}


@dataclass(frozen=True)
class EngineLayout:
    """The byte-deciding server args of one engine (every rank of it). Hashable: a cache key."""

    args: tuple[tuple[str, Any], ...]
    # server args outside LAYOUT_ARGS that the engine reported; kept for rejections and messages
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None = None, **kwargs: Any) -> "EngineLayout":
        """From server args by their sglang names (missing ones take sglang's defaults)."""
        given = dict(args or {}, **kwargs)
        given = _normalize_dp_attention(given)
        values = {name: given.get(name, default) for name, default in LAYOUT_ARGS.items()}
        values["json_model_override_args"] = _canonical_json(values["json_model_override_args"])
        extra = {k: v for k, v in given.items() if k not in LAYOUT_ARGS}
        layout = cls(args=tuple(sorted(values.items())), extra=extra)
        layout.check_supported()
        return layout

    @classmethod
    def from_server_info(cls, server_info: Mapping[str, Any]) -> "EngineLayout":
        """From the JSON body of the engine's ``GET /server_info`` (resolved server args)."""
        return cls.from_args(dict(server_info))

    @classmethod
    def parse(cls, spec: str) -> "EngineLayout":
        """From ``tp=2,ep=2,dp_attention=2,<server arg>=<value>`` (the CLI's ``--engine``)."""
        return cls.from_args(parse_engine_spec(spec))

    # -- reading ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return dict(self.args)[name]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.args).get(name, self.extra.get(name, default))

    @property
    def tp_size(self) -> int:
        return int(self["tp_size"])

    @property
    def pp_size(self) -> int:
        return int(self["pp_size"])

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
        return {k: v for k, v in self.args if v != LAYOUT_ARGS[k]}

    def describe(self) -> str:
        """``tp=8,ep=8,dp_attention=8,...``: the non-default args, short names first."""
        short = {v: k for k, v in _ALIASES.items() if k not in ("attn_dp", "cp")}
        first = ["tp_size", "pp_size", "ep_size", "attn_dp_size"]
        args = {"tp_size": self.tp_size, **self.server_args()}
        names = [n for n in first if n in args] + [n for n in args if n not in first]
        return ",".join(f"{short.get(n, n)}={args[n]}" for n in names)

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
        max_ep = merged.get("max_ep_size")
        if max_ep not in (None, 0) and int(max_ep) != int(merged["tp_size"]) * int(merged.get("pp_size", 1)):
            raise UnsupportedLayout(
                f"engine flag max_ep_size={max_ep!r} is not supported: elastic EP scale-up changes the expert layout"
            )
        if int(merged.get("pp_size", 1)) != 1:
            raise UnsupportedLayout("engine flag pp_size>1 is not supported yet: replicas are built per TP rank")
        for name in ("attn_cp_size", "dcp_size", "moe_dp_size"):
            if int(merged.get(name, 1)) != 1:
                raise UnsupportedLayout(f"engine flag {name}={merged[name]} is not supported yet")
        tp = int(merged["tp_size"])
        for name in ("ep_size", "attn_dp_size"):
            if tp % int(merged[name]):
                raise UnsupportedLayout(f"engine flag {name}={merged[name]} does not divide tp_size={tp}")


def parse_engine_spec(spec: str) -> dict[str, Any]:
    """``"tp=2,ep=2,dp_attention=2,moe_runner_backend=triton"`` → server args by sglang name.

    Values are read as JSON where they parse (ints, true/false, null), else kept as strings.
    Dashes in names become underscores, so ``disable-shared-experts-fusion=true`` works too.
    """
    args: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise ValueError(f"engine spec part {part!r} is not NAME=VALUE (in {spec!r})")
        name, raw = (s.strip() for s in part.split("=", 1))
        name = name.replace("-", "_")
        name = _ALIASES.get(name, name)
        args[name] = _parse_value(raw)
    return args


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


def _canonical_json(value: Any) -> str:
    if isinstance(value, str):
        value = json.loads(value or "{}")
    return json.dumps(value or {}, sort_keys=True)
