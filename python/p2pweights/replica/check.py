"""Prove the replica path produces sglang's exact bytes: the engine of ``p2pweights check-layout``.

For each engine rank: random HF tensors for the config go (a) through the replica path — probe,
parameter groups, one slot, the replica's loaders — and (b) through sglang's own
``load_weights`` into a fully materialized CPU model of that rank (the reference model of
:mod:`p2pweights.replica.reference`, which the receiver's equality check uses too). Every
parameter's bytes are compared. Inputs are made per HF name from a seed, so neither path holds the
whole checkpoint. For an FP8 block-quantized config both paths read the same FP8 checkpoint:
seeded random BF16 trainer tensors quantized with the sender's formula (``RandomCheckpoint``); the
result counts the parameters checked per dtype, so the FP8 weights and their float32 scales are
seen to be compared. Parameters only post-processing sets (FP8 attention ``k_scale``/``v_scale``)
are not written by any group and are listed, not compared. For a Blackwell layout
(``gpu_arch=sm100``) the replica's slot holds the post-processed bytes sglang's engine keeps
(``sglang_ue8m0.py``), so the reference is post-processed too (``end_weight_update``'s
``postprocess_weights``, under that engine's answers) and each parameter is compared as its bytes lie
in memory (DeepGEMM's packed scales are MN-major).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from ..models import load_config
from ..models.checkpoint import RandomCheckpoint, checkpoint_tensors
from ..models.engine_layout import EngineLayout
from ..models.quant import quant_scheme
from . import reference
from .model_replica import ModelReplica, ModelReplicas
from .sglang_ue8m0 import memory_bytes

if TYPE_CHECKING:
    import torch


@dataclass
class RankCheck:
    rank: int
    params_checked: int = 0
    bytes_checked: int = 0
    groups: int = 0
    largest_group_bytes: int = 0
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype name -> parameters compared
    post_processed: list[str] = field(default_factory=list)  # set at end_weight_update, never written

    @property
    def equal(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "equal": self.equal,
            "params_checked": self.params_checked,
            "dtypes": dict(sorted(self.dtypes.items())),
            "post_processed": list(self.post_processed),
            "bytes_checked": self.bytes_checked,
            "groups": self.groups,
            "largest_group_bytes": self.largest_group_bytes,
            "mismatches": self.mismatches,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class LayoutCheck:
    engine: EngineLayout
    ranks: list[RankCheck]

    @property
    def equal(self) -> bool:
        return all(r.equal for r in self.ranks)

    @property
    def params_checked(self) -> int:
        return sum(r.params_checked for r in self.ranks)

    @property
    def mismatches(self) -> list[str]:
        return [f"rank {r.rank}: {m}" for r in self.ranks for m in r.mismatches]

    @property
    def dtypes(self) -> dict[str, int]:
        return merged_dtypes(self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "params_checked": self.params_checked,
            "dtypes": self.dtypes,
            "ranks": [r.to_json() for r in self.ranks],
            "mismatches": self.mismatches,
            "engine": self.engine.describe(),
        }


def merged_dtypes(ranks: Iterable[RankCheck]) -> dict[str, int]:
    """dtype name -> parameters compared, over several ranks."""
    total: dict[str, int] = {}
    for r in ranks:
        for dtype, n in getattr(r, "dtypes", {}).items():  # a result from before dtypes were counted
            total[dtype] = total.get(dtype, 0) + n
    return dict(sorted(total.items()))


def check_rank(config: Any, engine: EngineLayout, rank: int, *, seed: int = 0,
               replicas: ModelReplicas | None = None) -> RankCheck:
    """Compare the replica path with sglang's loader for one engine rank, byte for byte."""
    t0 = time.perf_counter()
    specs = checkpoint_tensors(config)
    replica = (replicas or ModelReplicas(cache_dir="")).get(config, engine, rank, hf_specs=specs)
    # the receiver's equality check's, too; a Blackwell engine's slot bytes are post-processed ones
    model = reference.reference_model(config, engine, rank, seed=seed, post_process=engine.gpu_arch is not None)
    result = compare_with_reference(replica, model, seed=seed, config=config)
    result.seconds = time.perf_counter() - t0
    return result


def compare_with_reference(replica: ModelReplica, reference: "torch.nn.Module", *, seed: int = 0,
                           config: Any = None) -> RankCheck:
    """Every group through the replica path into one reused slot; each region against the
    reference model's parameter bytes. Also reports parameters no group writes. ``config`` (default:
    the replica's) decides the FP8 scheme of the random inputs, as in the reference model."""
    import torch

    result = RankCheck(replica.rank, groups=len(replica.groups), largest_group_bytes=replica.largest_group_nbytes,
                       post_processed=list(replica.mapping.derived))
    source = RandomCheckpoint(replica.mapping.hf_specs, seed,
                              quant_scheme(load_config(replica.config_dir if config is None else config)))
    expected = dict(reference.named_parameters())
    slot = torch.full((replica.largest_group_nbytes,), 0xAB, dtype=torch.uint8)  # stale bytes must never leak
    covered: set[str] = set()
    for group in replica.groups:
        inputs = {n: source.tensor(n) for n in group.hf_names}
        for region in replica.load_group(group, inputs, slot):
            covered.add(region.param_name)
            want = expected.get(region.param_name)
            if want is None:
                result.mismatches.append(f"{region.param_name}: the engine rank holds no such parameter")
                continue
            got = slot[region.offset:region.offset + region.nbytes]
            want_bytes = memory_bytes(want)  # as the engine publishes it: numel x size bytes from its address
            result.params_checked += 1
            result.bytes_checked += region.nbytes
            dtype = str(want.dtype).removeprefix("torch.")
            result.dtypes[dtype] = result.dtypes.get(dtype, 0) + 1
            if want_bytes.numel() != region.nbytes:
                result.mismatches.append(
                    f"{region.param_name}: {region.nbytes} bytes in the slot, engine holds {want_bytes.numel()}")
            elif not torch.equal(got, want_bytes):
                differing = int((got != want_bytes).sum())
                result.mismatches.append(f"{region.param_name}: {differing} of {region.nbytes} bytes differ")
    for name in expected:
        if name not in covered and name not in result.post_processed:
            result.mismatches.append(f"{name}: no parameter group writes it")
    return result


def check_byte_exact(config: Any, engine: EngineLayout, ranks: Iterable[int] | None = None, *, seed: int = 0,
                 replicas: ModelReplicas | None = None) -> LayoutCheck:
    """:func:`check_rank` for every rank of the engine (or the given ones)."""
    replicas = replicas or ModelReplicas(cache_dir="")
    chosen = list(range(engine.world_size)) if ranks is None else list(ranks)
    return LayoutCheck(engine, [check_rank(config, engine, r, seed=seed, replicas=replicas) for r in chosen])
