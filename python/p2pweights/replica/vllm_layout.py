"""The shard layout of a vLLM 0.33 engine, and the layouts whose post-processing rewrites the bytes.

A :class:`VllmLayout` keeps what decides which bytes a vLLM engine rank holds after
``process_weights_after_loading``: TP, DP, expert parallelism, the MoE backend, the dtype, and two
facts about the engine's host that vLLM's kernel oracles read (``VLLM_USE_DEEP_GEMM``, and whether
FlashInfer's kernels are installed: ``flashinfer-python`` is a dependency of vLLM's CUDA wheel).
The engine is a Hopper (sm90) rank: the architecture the stand-in platform reproduces.
``spec`` is the speculative method: "mtp" gives every rank a second role, the draft built from
the checkpoint's own MTP layer (:mod:`.vllm_draft`); drafts from a separate checkpoint are refused.

vLLM's ranks: engine rank = DP rank x TP + TP rank. Attention is TP-sharded inside each DP rank
(a DP rank's attention bytes equal the other DP ranks'); with ``enable_expert_parallel`` the
experts are spread over EP = DP x TP ranks (vLLM has no separate EP size).

:func:`refusal` says, before anything is built, whether vLLM's post-processing on such an engine
would rewrite bytes a sender writes in a way the sender does not replay (most MoE repacks), and
what to start the engine with instead. Two rewrites of vLLM's default Hopper configuration are
replayed on send, not refused (:mod:`.vllm_replay`): DeepGEMM's E8M0 requantization of FP8 block
linears and FlashInfer CUTLASS's w13 swap of FP8 block experts. It imports neither torch nor vLLM.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..errors import LayoutSpecError, UnsupportedLayout
from ..models.engine_layout import parse_layout_spec

#: MoE backends (vLLM's ``--moe-backend``) whose post-processing keeps the loaded expert bytes
KEEPING_MOE_BACKENDS = ("auto", "triton")

# --engine keys for a vLLM engine, as parse_layout_spec names them (tp -> tp_size, ep -> ep_size,
# dp -> attn_dp_size: vLLM's data_parallel_size, which with EP is its attention-DP layout)
_KEYS = {
    "tp_size": "tp", "attn_dp_size": "dp", "data_parallel_size": "dp", "ep_size": "ep",
    "enable_expert_parallel": "expert_parallel", "moe_backend": "moe_backend", "dtype": "dtype",
    "use_deep_gemm": "deep_gemm", "deep_gemm": "deep_gemm", "vllm_use_deep_gemm": "deep_gemm",
    "flashinfer": "flashinfer",
    "spec": "spec", "speculative": "spec", "speculative_method": "spec",
}

#: speculative methods (vLLM's ``--speculative-config '{"method": ...}'``) and what the replica does
#: with them: "mtp" is the target checkpoint's own MTP layer (a draft role, :mod:`.vllm_draft`);
#: "ngram", "ngram_gpu" and "suffix" have no weights (no draft role); "deepseek_mtp" is vLLM's
#: deprecated name of "mtp"; the others load a separate draft checkpoint
_SPEC_METHODS = {"": "", "none": "", "ngram": "", "ngram_gpu": "", "suffix": "", "mtp": "mtp", "deepseek_mtp": "mtp"}
_SEPARATE_DRAFTS = ("eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash", "dspark")
#: target architectures whose vLLM MTP draft the replica builds (from the same checkpoint)
MTP_ARCHITECTURES = {"DeepseekV3ForCausalLM": "DeepSeekMTPModel"}


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    raise LayoutSpecError(f"--engine {name}={value!r}: expected true/false or 1/0")


@dataclass(frozen=True)
class VllmLayout:
    """The byte-deciding settings of one vLLM engine (every rank of it). Hashable: a cache key."""

    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    moe_backend: str = "auto"
    dtype: str = "auto"
    deep_gemm: bool = True  # VLLM_USE_DEEP_GEMM on the engine (vLLM's default 1; DeepGEMM ships in the wheel)
    flashinfer: bool = True  # FlashInfer kernels usable on the engine (vLLM's CUDA wheel depends on it)
    spec: str = ""  # speculative method: "" (no draft) or "mtp" (the checkpoint's own MTP layer: a draft role)

    kind = "vllm"

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise LayoutSpecError(f"{name}={getattr(self, name)!r} must be a whole number >= 1")
        object.__setattr__(self, "spec", _spec_method(self.spec))

    @classmethod
    def parse(cls, spec: str, *, command: str = "check-layout") -> "VllmLayout":
        """From ``tp=2,dp=2,ep=4,moe_backend=triton,deep_gemm=0``. ``ep`` is vLLM's
        ``--enable-expert-parallel``: ``ep=tp*dp`` (or ``ep=true``) turns it on, ``ep=1`` leaves it off."""
        why = ("a vLLM engine's layout is tp, dp, ep, moe_backend, dtype, deep_gemm (VLLM_USE_DEEP_GEMM), "
               "flashinfer (FlashInfer kernels installed on the engine) and spec (the speculative method)")
        given = parse_layout_spec(spec, command=f"{command} --engine-kind vllm", honours=_KEYS, why=why)
        values: dict[str, Any] = {}
        for name, value in given.items():
            values[_KEYS[name]] = value
        tp, dp = int(values.pop("tp", 1)), int(values.pop("dp", 1))
        ep = values.pop("ep", None)
        expert_parallel = _flag("enable_expert_parallel", values.pop("expert_parallel", False))
        if ep is not None:
            if isinstance(ep, bool):
                expert_parallel = expert_parallel or ep
            elif ep == "tp" or int(ep) == tp * dp and tp * dp > 1:
                expert_parallel = True
            elif int(ep) != 1:
                raise LayoutSpecError(
                    f"--engine ep={ep}: vLLM's expert parallelism spans every rank (EP = dp x tp = {tp * dp}); "
                    f"write ep={tp * dp}, or ep=1 for none")
        for name in ("deep_gemm", "flashinfer"):
            if name in values:
                values[name] = _flag(name, values[name])
        for name in ("moe_backend", "dtype", "spec"):
            if name in values:
                values[name] = str(values[name]).lower().replace("-", "_")
        return cls(tp=tp, dp=dp, expert_parallel=expert_parallel, **values)

    # -- reading ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Engine ranks: dp x tp (each DP rank is a TP group of its own)."""
        return self.tp * self.dp

    @property
    def ep(self) -> int:
        """Experts are spread over this many ranks (1: every rank holds every expert, TP-sharded)."""
        return self.world_size if self.expert_parallel else 1

    @property
    def args(self) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(asdict(self).items()))

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.args).encode()).hexdigest()[:16]

    def describe(self) -> str:
        """``vllm:tp=2,dp=2,ep=4,...``: the non-default settings."""
        parts = [f"tp={self.tp}"] + ([f"dp={self.dp}"] if self.dp > 1 else []) + (
            [f"ep={self.ep}"] if self.expert_parallel else [])
        defaults = VllmLayout()
        for name in ("moe_backend", "dtype", "deep_gemm", "flashinfer", "spec"):
            if getattr(self, name) != getattr(defaults, name):
                value = getattr(self, name)
                parts.append(f"{name}={int(value) if isinstance(value, bool) else value}")
        return "vllm:" + ",".join(parts)

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of vLLM's ``EngineArgs`` for this layout."""
        args: dict[str, Any] = {"tensor_parallel_size": self.tp, "data_parallel_size": self.dp,
                                "enable_expert_parallel": self.expert_parallel, "moe_backend": self.moe_backend,
                                "dtype": self.dtype}
        if self.spec:  # the draft's layout is the target's; one token is enough to build it
            args["speculative_config"] = {"method": self.spec, "num_speculative_tokens": 1}
        return args

    @property
    def roles(self) -> tuple[str, ...]:
        """The models every rank holds: ("target",), or ("target", "draft") with an MTP draft."""
        return ("target", "draft") if self.spec else ("target",)

    def rank_of(self, rank: int) -> tuple[int, int]:
        """(DP rank, TP rank) of engine rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"engine rank {rank} is not a rank of {self.describe()} ({self.world_size} ranks)")
        return divmod(rank, self.tp)

    def check_supported(self) -> None:
        """What the layout alone rules out (the model's part: :func:`refusal`)."""
        if self.moe_backend not in KEEPING_MOE_BACKENDS and self.moe_backend not in _REPACKING_MOE_BACKENDS:
            raise LayoutSpecError(f"moe_backend={self.moe_backend!r} is not a vLLM 0.33 MoE backend "
                                  f"({', '.join(KEEPING_MOE_BACKENDS + tuple(_REPACKING_MOE_BACKENDS))})")


# vLLM 0.33 MoE backends that repack (or may repack) expert weights in process_weights_after_loading
_REPACKING_MOE_BACKENDS = {
    "deep_gemm": "DeepGEMM re-lays out FP8 expert scales (and requantizes to UE8M0)",
    "flashinfer_cutlass": "FlashInfer CUTLASS swaps the w13 halves to [w3; w1] and repacks FP8 scales",
    "flashinfer_trtllm": "FlashInfer TRT-LLM shuffles the experts into its block layout",
    "cutlass": "vLLM's CUTLASS MoE transposes and repacks FP8 experts",
    "marlin": "Marlin repacks the weights into its tile layout",
    "humming": "Humming converts the experts to its kernel format",
    "aiter": "AITER (ROCm) shuffles the experts",
    "hpc": "the HPC backend converts the experts to its format",
}


def _spec_method(value: Any) -> str:
    """The layout's ``spec`` from a method name: "" or "mtp"; LayoutSpecError for a draft the
    trainer's checkpoint does not hold."""
    method = "" if value in (None, False) else str(value).strip().lower()
    if method in _SPEC_METHODS:
        return _SPEC_METHODS[method]
    if method in _SEPARATE_DRAFTS:
        raise LayoutSpecError(
            f"--engine spec={method}: a vLLM {method} draft is a separate draft checkpoint the trainer does not "
            "produce, so no sender can keep it current; start the engine with --speculative-config "
            "'{\"method\": \"mtp\"}' (the checkpoint's own MTP layer), method ngram, or none")
    raise LayoutSpecError(f"--engine spec={method}: not a vLLM 0.33 speculative method the replica knows; "
                          "write spec=mtp (the checkpoint's own MTP layer), spec=ngram or leave it out")


def refusal(config: Mapping[str, Any], layout: VllmLayout) -> str | None:
    """Why a Hopper vLLM 0.33 engine of ``layout`` serving ``config`` post-processes the loaded bytes
    into others the sender cannot produce (so one-sided writes would be wrong, or undone), and what
    to start the engine with instead; None when post-processing keeps every byte a sender writes or
    is replayed by the sender (DeepGEMM E8M0 of FP8 block linears, FlashInfer CUTLASS's w13 swap of
    FP8 block experts: :mod:`.vllm_replay`).

    The rules follow vLLM's own kernel oracles for sm90 (vllm/model_executor/kernels/linear/__init__.py
    ``_POSSIBLE_FP8_BLOCK_KERNELS``; layers/fused_moe/oracle/fp8.py ``_get_priority_backends``;
    oracle/unquantized.py); the built replica's chosen kernels are checked against them
    (``vllm_env.check_kernels``).
    """
    why = draft_refusal(config, layout)
    if why:
        return why
    qc = config.get("quantization_config") or {}
    fp8_block = str(qc.get("quant_method", "")).lower() == "fp8" and bool(qc.get("weight_block_size"))
    moe = any(k in config for k in ("num_experts", "n_routed_experts"))
    # FP8 block experts with FlashInfer CUTLASS: the sender replays its w13 swap (replica/vllm_replay.py)
    replayed_moe = fp8_block and layout.moe_backend == "flashinfer_cutlass" and layout.flashinfer
    if layout.moe_backend in _REPACKING_MOE_BACKENDS and moe and not replayed_moe:
        why = _REPACKING_MOE_BACKENDS[layout.moe_backend]
        if layout.moe_backend == "flashinfer_cutlass":
            why += (" (replayed on send for FP8 128x128 block experts, but flashinfer=0 says the engine has no "
                    "FlashInfer to run it)" if fp8_block else
                    " (p2pweights replays it on send for FP8 128x128 block experts only; these experts are not)")
        return (f"moe_backend={layout.moe_backend}: {why} in process_weights_after_loading; start the engine "
                "with --moe-backend triton")
    if fp8_block and moe and layout.expert_parallel and layout.moe_backend == "auto" and layout.deep_gemm \
            and not layout.flashinfer:
        return ("FP8 block-quantized experts under expert parallelism on Hopper without FlashInfer use DeepGEMM's "
                "MoE (vLLM's oracle takes it after FlashInfer): prepare_fp8_moe_layer_for_deepgemm requantizes "
                "the experts to UE8M0 scales, which p2pweights does not replay for experts yet (it does for "
                "linears); start the engine with --moe-backend triton (and say moe_backend=triton), or "
                "VLLM_USE_DEEP_GEMM=0 (deep_gemm=0)")
    return None


def draft_refusal(config: Mapping[str, Any], layout: VllmLayout) -> str | None:
    """Why the replica cannot build the draft of ``layout`` for ``config``; None without a draft or
    for an MTP draft it builds (DeepSeek-V3 with at least one MTP layer in the checkpoint)."""
    if not layout.spec:
        return None
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in MTP_ARCHITECTURES:
        return (f"spec={layout.spec}: vLLM's MTP draft of {arch} is not built by the replica (it builds "
                f"the MTP drafts of {', '.join(MTP_ARCHITECTURES)}); start the engine without "
                "--speculative-config, or use method ngram (no draft weights)")
    layers = int(config.get("num_nextn_predict_layers") or 0)
    if layers < 1:
        return (f"spec={layout.spec}: the {arch} checkpoint has no MTP layer (num_nextn_predict_layers="
                f"{layers}), so vLLM has no draft to load from it; start the engine without --speculative-config")
    return None


def check_refusal(config: Mapping[str, Any], layout: VllmLayout) -> None:
    """Raise :class:`UnsupportedLayout` with :func:`refusal`'s reason, if any."""
    layout.check_supported()
    why = refusal(config, layout)
    if why:
        raise UnsupportedLayout(f"vLLM engine {layout.describe()}: {why}")
