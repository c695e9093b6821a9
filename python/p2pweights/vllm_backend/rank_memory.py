"""One vLLM worker's weight memory as p2pweights publishes it: the parameters of the models it serves
(:class:`ServedModels`: the target and, with speculative decoding, the draft) where vLLM put them
(never moved: CUDA graphs and kernels hold their addresses), registered with Mooncake or NIXL
through the receiver's :class:`~p2pweights.transport.revocation.RevocableRegions` (one
implementation: a takeover revokes them per epoch, as on a receiver), a delta area beside the
weights, in host memory or on their GPU (``deltas.area.DeltaArea``; a GPU area takes index records),
and the publication a sender reads.

The regions registered are the parameters' byte ranges merged where they touch
(``transport.publication.merge_regions``): the ranges a sender checks its writes against. vLLM
allocates each parameter on its own, so a rank registers several ranges, each holding parameters.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator

from ..deltas.area import DeltaArea, open_rank_area
from ..deltas.weight_views import weights_device
from ..engine.rank_area import RankDeltas
from ..errors import LayoutMismatch
from ..receiver.build_report import device_arch
from ..replica.lora_layout import base_name
from ..replica.vllm_replay import replayed_already
from ..transport import resolve_transport
from ..transport.publication import merge_regions, params_table
from ..transport.revocation import RevocableRegions

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


#: prefix of the draft's parameter names in the table (vLLM's own spelling: gpu_worker ``_get_sleep_parameters``)
DRAFT_PREFIX = "draft."


class ServedModels:
    """The models one worker serves, as one set of named parameters: the target's by name, then the
    speculative draft's own as ``draft.<name>``. A draft parameter that IS a target parameter (vLLM's
    MTP drafter takes the target's embedding and LM head, ``llm_base_proposer._maybe_share_*``) is the
    target's only: published and written once."""

    def __init__(self, target: "torch.nn.Module", target_config: Any, draft: "torch.nn.Module | None" = None,
                 draft_config: Any = None):
        self.target, self.target_config = target, target_config
        self.draft, self.draft_config = draft, draft_config

    def named_parameters(self) -> Iterator[tuple[str, "torch.nn.Parameter"]]:
        target = [(base_name(n), p) for n, p in self.target.named_parameters()]
        yield from target
        if self.draft is not None:
            shared = {id(p) for _, p in target}
            yield from ((DRAFT_PREFIX + n, p) for n, p in self.draft.named_parameters() if id(p) not in shared)

    def parameters(self) -> Iterator["torch.nn.Parameter"]:
        return (p for _, p in self.named_parameters())

    def post_process(self, device: Any) -> None:
        """vLLM's ``process_weights_after_loading`` (the model loader's) for every model served, as a
        load runs it: after one-sided writes, derived tensors (MLA's ``W_UV``) follow the new bytes."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        # The modules whose post-processing the sender replayed (DeepGEMM E8M0, FlashInfer CUTLASS's w13
        # swap: replica/vllm_replay.py) already hold post-processed bytes: run again, the swap would swap
        # back. They run as vLLM's own weight-cache loader has them run, under weights_already_processed
        # (kernel state rebuilt, no tensor transformed); every other module is post-processed as before.
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        with replayed_already(models):
            process_weights_after_loading(self.target, self.target_config, device)
            if self.draft is not None:
                process_weights_after_loading(self.draft, self.draft_config, device)
        if self.draft is not None:
            # copies vLLM derives from the target's LM head for the drafter (none unless
            # draft_lm_head_quantization); vLLM itself refreshes them only after a draft session
            from vllm.model_executor.layers.quantization.online.lm_head import refresh_quantized_lm_heads

            refresh_quantized_lm_heads(self.draft)


def owned_parameters(named: Any) -> list[tuple[str, "torch.nn.Parameter"]]:
    """``named`` less the parameters vLLM's post-processing derived as views of one storage: a
    parameter whose bytes lie inside another's, and a strided (non-contiguous) parameter sharing its
    storage with another. vLLM's loaders write contiguous parameters; MLA's ``W_UV`` and ``W_UK_T``
    are transposed slices of an unquantized ``kv_b_proj``'s weight, or (FP8 block) of its
    dequantized copy, the two interleaved in one storage. They follow every write into that weight
    (the finish derives them again, in place) and are never written themselves; published, they
    would overlap (which senders refuse). A parameter that only partly overlaps another stays (the
    sender refuses that table)."""
    items = list(named)
    spans = [(n, p.untyped_storage().data_ptr(), int(p.data_ptr()), int(p.numel()) * p.element_size(),
              p.is_contiguous()) for n, p in items]
    by_storage: dict[int, list[tuple[str, int, int, bool]]] = {}
    for name, storage, start, nbytes, contiguous in spans:
        by_storage.setdefault(storage, []).append((name, start, nbytes, contiguous))
    inside: set[str] = set()
    for group in by_storage.values():
        if len(group) < 2:
            continue
        inside.update(n for n, _, _, contiguous in group if not contiguous)
        whole = [g for g in group if g[3]]
        if whole:
            name0, start0, nbytes0, _ = max(whole, key=lambda g: g[2])  # the largest: the weight the others view
            inside.update(n for n, a, b, _ in group if n != name0 and start0 <= a and a + b <= start0 + nbytes0)
    return [(n, p) for n, p in items if n not in inside]


def open_area(weight_bytes: int, nbytes: int | None, rank: int, engine: str, device: str) -> DeltaArea | None:
    """The rank's delta area (``deltas.area.open_rank_area``: the one policy), sized by ``nbytes``
    (``init_info.area_bytes``) where given."""
    return open_rank_area(weight_bytes, device, rank, engine, nbytes,
                          "init_info.area_bytes or P2PW_DELTA_AREA (or lower vLLM's --gpu-memory-utilization)")


class RankMemory:
    """The worker's registrations (``transport``: mooncake, nixl or auto) and publication for
    ``rank``; ``deltas``: open a delta area of ``area`` bytes (None: ``P2PW_DELTA_AREA``, else an
    eighth of the weights) beside the weights, on their device; ``adapters``: the rank's LoRA slots
    (``rank_lora.AdapterSlots``), registered and published with the weights (no delta area: an
    adapter's deltas are written in place)."""

    def __init__(self, model: "ServedModels | torch.nn.Module", transport: str, rank: int, engine: str = "vllm", *,
                 deltas: bool = True, area: int | None = None, build: dict[str, str] | None = None,
                 adapters: Any = None):
        self.model, self.rank, self.engine, self.adapters = model, int(rank), engine, adapters
        self.transport = resolve_transport(transport)[0]
        self.device = weights_device(model.parameters())
        owned = owned_parameters(model.named_parameters())
        self.table = params_table(owned)
        self.regions = merge_regions((ptr, numel * size) for ptr, numel, size in self.table.values())
        self.build = dict(build or {})
        # the delta area and where its records may write (engine/rank_area.py: the one apply of every host)
        self.deltas = RankDeltas(open_area(sum(n for _, n in self.regions), area, self.rank, engine, self.device)
                                 if deltas else None, self.rank, engine, self.device)
        self.deltas.cover(self.regions, named=owned)
        self.area = self.deltas.area
        arch = device_arch(self.device)
        published_area = self.area.published() if self.area is not None else None

        def decorate(publication: Any) -> None:
            publication.device_arch = arch
            publication.delta_area = tuple(published_area) if published_area else None

        registered = merge_regions([*self.regions, *(adapters.regions() if adapters is not None else [])])
        regions = [(a, n, self.device) for a, n in registered] + ([self.area.region()] if self.area else [])
        published = {**self.table, **(params_table(adapters.published()) if adapters is not None else {})}
        try:
            self.registrations = RevocableRegions(self.transport, regions, published, self.rank, decorate=decorate)
        except BaseException:
            self.deltas.close()
            raise

    @property
    def epoch(self) -> int:
        return self.registrations.epoch

    def publication(self) -> dict:
        """What the gate serves at ``/remote_instance_transfer_engine_info?rank=R``: the receiver's
        publication (table, peer, ``registered_memory``, ``epoch``, ``device_arch``, ``delta_area``)
        plus this worker's build (``vllm_version``)."""
        return {**self.registrations.publication.to_dict(), **self.build}

    def revoke(self, epoch: int) -> dict:
        """A takeover: the same memory under a new endpoint and ``epoch``, the old one closed."""
        self.registrations.revoke(int(epoch))
        return self.publication()

    def check_in_place(self) -> None:
        """Refuse (LayoutMismatch) when a parameter no longer lies where it was published: vLLM's
        post-processing replaced its storage, so one-sided writes would miss it."""
        now = params_table(owned_parameters(self.model.named_parameters()))
        moved = sorted(n for n, row in self.table.items() if now.get(n) != row)
        moved += sorted(n for n in now if n not in self.table)
        if moved:
            raise LayoutMismatch(f"{len(moved)} parameter(s) no longer lie where this rank published them (vLLM's "
                                 f"post-processing replaced or added them): {', '.join(moved[:4])}; one-sided writes "
                                 f"would miss them", rank=self.rank, parameter=moved[0],
                                 hint="this layout cannot take p2pweights' one-sided writes: use vLLM's nccl backend")

    def apply_deltas(self, manifests: dict) -> dict:
        """This rank's manifest in ``manifests`` (``{rank: manifest}``; none: nothing), checked whole
        against what the area holds, then applied into the weights (deltas/area.py)."""
        return self.deltas.apply(manifests)

    def close(self) -> None:
        try:
            self.registrations.close()
        finally:
            self.deltas.close()
