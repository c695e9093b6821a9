"""Which trainer pipeline (PP) stage holds each HF tensor.

Decoder layers split as evenly as possible, the last stages taking one extra layer each
(sglang's and Megatron's even split); the embedding lives on the first stage; the final norm, the
LM head and any MTP layers (numbered after the decoder layers) on the last. The planner's cost
model and the sender's "which names must this stage push" both read it here.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from .shapes import PlanError

#: how a PP stage's senders share its writes (``WeightSender(split=...)``): whole engine ranks each,
#: or the stage's layers split over them (:func:`writer_of`)
SPLITS = ("engine_ranks", "layers")


def stage_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) decoder layers of each trainer pipeline stage."""
    if stages > layers:
        raise PlanError(
            f"--trainer: pp={stages} is more PP stages than the model's {layers} layers; use pp <= {layers}"
        )
    base, extra = divmod(layers, stages)
    bounds, start = [], 0
    for stage in range(stages):
        size = base + (1 if stage >= stages - extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def layer_of(hf_name: str) -> int | None:
    """The layer index in ``...layers.<i>....``, or None for a tensor outside the layers."""
    parts = hf_name.split(".")
    if "layers" in parts:
        i = parts.index("layers") + 1
        if i < len(parts) and parts[i].isdigit():
            return int(parts[i])
    return None


def stage_of(hf_name: str, num_layers: int, pp_size: int) -> int:
    """The PP stage (0 .. pp_size-1) holding an HF tensor."""
    return _stage(hf_name, num_layers, pp_size, stage_layers(num_layers, pp_size))


def stage_hf_names(hf_names: Iterable[str], num_layers: int, pp_stage: int, pp_size: int) -> list[str]:
    """The HF names a trainer PP stage holds, in the order given."""
    if pp_size == 1:
        return list(hf_names)
    bounds = stage_layers(num_layers, pp_size)
    return [n for n in hf_names if _stage(n, num_layers, pp_size, bounds) == pp_stage]


def _stage(hf_name: str, num_layers: int, pp_size: int, bounds: list[tuple[int, int]]) -> int:
    if hf_name.startswith("mtp."):  # Qwen3-Next style MTP layer (mtp.layers.0...): after the last layer
        return pp_size - 1
    layer = layer_of(hf_name)
    if layer is not None:
        if layer >= num_layers:  # MTP / NextN layers follow the last decoder layer
            return pp_size - 1
        return next(s for s, (a, b) in enumerate(bounds) if a <= layer < b)
    return 0 if "embed_tokens" in hf_name else pp_size - 1


def writer_layers(num_layers: int, pp_size: int, pp_stage: int, writers: int) -> list[tuple[int, int]]:
    """[start, end) decoder layers of each of a stage's ``writers`` senders when the stage's layers
    are split over them (``WeightSender(split="layers")``): the stage's layers split evenly as the
    stages are; a writer past the stage's layer count gets none ((end, end))."""
    a, b = stage_layers(num_layers, pp_size)[pp_stage]
    used = min(writers, b - a)
    bounds = [(a + x, a + y) for x, y in stage_layers(b - a, used)]
    return bounds + [(b, b)] * (writers - used)


def writer_of(hf_name: str, num_layers: int, pp_size: int, writers: int) -> tuple[int, int]:
    """(PP stage, writer in it) of an HF tensor when each stage's layers are split over its
    ``writers`` senders (at most one per layer: :func:`writer_layers`): a layer's tensors go with the
    layer, the embedding to the first writer of the first stage, the final norm, the LM head and MTP
    layers to the last writer that has layers of the last stage."""
    stage = stage_of(hf_name, num_layers, pp_size)
    layer = layer_of(hf_name)
    if layer is None or hf_name.startswith("mtp.") or layer >= num_layers:
        embedding = stage == 0 and layer is None and "embed_tokens" in hf_name and not hf_name.startswith("mtp.")
        return stage, (0 if embedding else layer_writers(num_layers, pp_size, stage, writers)[0] - 1)
    bounds = writer_layers(num_layers, pp_size, stage, writers)
    return stage, next(w for w, (a, b) in enumerate(bounds) if a <= layer < b)


def writers_of(hf_names: Iterable[str], num_layers: int, pp_size: int, writers: int) -> Iterator[tuple[str, tuple[int, int]]]:
    """(name, :func:`writer_of` it) for each name, in order: one look-up per decoder layer (an MoE
    layer has thousands of names)."""
    of_layer: dict[int, tuple[int, int]] = {}
    for n in hf_names:
        layer = layer_of(n)
        if layer is None or n.startswith("mtp."):
            yield n, writer_of(n, num_layers, pp_size, writers)
            continue
        if layer not in of_layer:
            of_layer[layer] = writer_of(n, num_layers, pp_size, writers)
        yield n, of_layer[layer]


def writer_hf_names(hf_names: Iterable[str], num_layers: int, pp_stage: int, pp_size: int, writer: int,
                    writers: int) -> list[str]:
    """The HF names writer ``writer`` of stage ``pp_stage``'s ``writers`` pushes with the stage's
    layers split over its senders (:func:`writer_of`), in the order given."""
    if writers == 1:
        return stage_hf_names(hf_names, num_layers, pp_stage, pp_size)
    return [n for n, w in writers_of(hf_names, num_layers, pp_size, writers) if w == (pp_stage, writer)]


def layer_writers(num_layers: int, pp_size: int, pp_stage: int, senders: int) -> tuple[int, int]:
    """(writers, groups) of a stage's ``senders`` with its layers split over them (split="layers"):
    ``writers`` = min(senders, the stage's layers) senders split the layers, and the senders form
    ``groups`` = senders // writers such sets, each writing the engine ranks the planner gives its
    group (``assign_engine_ranks(groups, ...)``): a stage with more senders than layers spreads its
    writes over engine ranks too instead of writing every rank from a few senders."""
    a, b = stage_layers(num_layers, pp_size)[pp_stage]
    writers = min(senders, b - a)
    return writers, senders // writers


def area_writer(num_layers: int, pp_size: int, pp_stage: int, writer: int, senders: int) -> tuple[int, int]:
    """(index, count) of writer ``writer`` of stage ``pp_stage`` among every writer of one engine
    rank's delta area when each stage's layers are split over its ``senders`` (each stage's
    :func:`layer_writers` in stage order): every sender computes the same parts of the area."""
    counts = [layer_writers(num_layers, pp_size, s, senders)[0] for s in range(pp_size)]
    return sum(counts[:pp_stage]) + writer, sum(counts)


def check_split(split: str, num_layers: int, sender_index: int, senders: int, pp_stage: int, pp_size: int) -> str:
    """``split`` if it is one of :data:`SPLITS` and, for "layers", this sender is one of the
    writers × groups of its stage (:func:`layer_writers`); ValueError naming the fix otherwise."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    if split == "layers":
        writers, groups = layer_writers(num_layers, pp_size, pp_stage, senders)
        if sender_index >= writers * groups:
            raise ValueError(
                f"split='layers': PP stage {pp_stage}'s layers go to {writers} writers in each of {groups} group(s) of "
                f"engine ranks, so its senders 0..{writers * groups - 1} write and sender {sender_index} of {senders} "
                f"would write nothing; make num_senders a multiple of {writers}, or make senders only on the "
                f"first {writers * groups} trainer ranks of the stage")
    return split
