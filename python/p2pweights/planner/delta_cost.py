"""Predicted delta updates (issue "Delta updates"): the full update's cost (cost.py) with the bytes on
the wire scaled by the codec's expected ratio (deltas/expected.py), and what a delta adds.

Per changed fraction F (the share of elements that differ from the previous version, uniformly
spread, as RL steps do), against the full update's stages:

- *engine NIC*, *sender NIC*: the bytes on the wire. Each parameter goes as its delta record into
  the engine rank's delta area while the records fit there (the area: ``area_fraction`` of the
  rank's bytes, deltas/area.py's default an eighth; and a slot's spare bytes, a quarter of the slot,
  sender/delta_writes.py), the rest as full writes; a DENSE record goes as a full write. So with
  r = expected_ratio(F) and c = min(area, spare): wire / full = r when r <= c, else c + (1 - c / r).
- *sender host<->device copy*, *sender production*, *trainer gather*: unchanged. A sender finds what
  changed by comparing the engine-format bytes it is about to write with its base, so it still
  gathers, produces and (host slots) copies every byte.
- *sender change detection* (new, in the pipeline): every prepared byte compared with its base, at
  ``detect_gbps``.
- *engine apply*: the bytes the rank's records cover, at ``apply_gbps``. Beside the writes (the
  default, ``P2PW_DELTA_APPLY_BESIDE=1``, sender/apply_beside.py) it is one more pipeline stage: a
  slot's records are applied once its writes returned, while later slots are written, and only the
  last slot's are left after the last write (``slot_bytes`` of covered bytes at most). At the end
  (``apply_beside=False``, ``--apply-at-end``) it runs in series after every write.

``p2p_seconds`` = the slowest pipeline stage + the apply left after the last write. The first update after connect is always
full (the sender has no base): the full update's figures. Memory: a delta sender keeps a host copy
of every byte it prepares (its bases: one per engine rank it prepares, shared by the engines it
writes it to), and each engine rank its delta area.

The default rates are today's host codec, measured at 1% changed (benchmarks/RESULTS.md, "Delta
codec"): the encode falls about 3x and the apply about 4x from 1% to 10% changed on the CPU VM, so
times at F above 1% with the defaults are optimistic; pass the rates measured at that F.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..deltas.expected import expected_record
from ..models.shapes import DTYPE_BYTES, ModelShape, PlanError
from .assign import Plan
from .cost import ENGINE_NIC, GB, SENDER_NIC, Cost, Links

# GB/s of prepared bytes the sender's change detection reaches: the host codec's encode, one thread
# (as the sender runs it), unit 2 at 1% changed, measured on the H200 host
DETECT_GBPS = 3.4
# GB/s of covered bytes an engine rank's check + apply reaches: the host codec, one thread, unit 2 at
# 1% changed, measured on the CPU VM (not on the H200 host yet)
APPLY_GBPS = 6.4
AREA_FRACTION = 1 / 8  # deltas/area.py: an engine rank's delta area, an eighth of its bytes by default
SPARE_FRACTION = 1 / 4  # sender/delta_writes.py: a slot's spare bytes for its records, a quarter of it
SENDER_DETECT = "sender change detection"
ENGINE_APPLY = "engine apply (after the writes)"
APPLY_BESIDE = "engine apply (beside the writes)"
APPLY_TAIL = "engine apply (the last slot's, after)"
SLOT_BYTES = 512 << 20  # P2PW_BUFFER_SIZE's default: one slot
FIRST_FULL = "the first update after connect is always full (the sender has no base): the full update's figures"


@dataclass(frozen=True)
class DeltaRates:
    """The rates and the area size that only delta updates meet."""

    detect_gbps: float = DETECT_GBPS
    apply_gbps: float = APPLY_GBPS
    area_fraction: float = AREA_FRACTION
    apply_beside: bool = True  # each slot's records applied as its writes return (else all after the last write)
    slot_bytes: int = SLOT_BYTES  # the sender's slot: what is left to apply after the last write

    def __post_init__(self) -> None:
        for flag, v in (("--detect-gbps", self.detect_gbps), ("--apply-gbps", self.apply_gbps),
                        ("--delta-area", self.area_fraction)):
            if not v > 0:
                raise PlanError(f"{flag}: {v:g}; must be positive")

    @property
    def measured_at_one_percent(self) -> bool:
        """True while a rate is the default measured at 1% changed."""
        return self.detect_gbps == DETECT_GBPS or self.apply_gbps == APPLY_GBPS

    def as_json(self) -> dict:
        return {"detect_gbps": self.detect_gbps, "apply_gbps": self.apply_gbps, "area_fraction": self.area_fraction,
                "apply_beside": self.apply_beside, "slot_bytes": self.slot_bytes}


@dataclass(frozen=True)
class DeltaCost:
    """One delta update at ``changed_fraction``; bytes as in :class:`~.cost.Cost` (per PP stage for
    senders, whole for engine ranks)."""

    changed_fraction: float
    codec_ratio: float  # expected record bytes / a parameter's bytes
    delta_share: float  # share of the bytes that go as records (the rest: full writes)
    wire_ratio: float  # bytes on the wire / a full update's
    bytes_per_engine_rank_max: int
    bytes_per_sender_max: int
    p2p_seconds: float
    apply_seconds: float  # the whole apply (beside the writes or not)
    bottleneck: str
    seconds_by_link: tuple[tuple[str, float], ...]
    apply_after_writes_seconds: float = 0.0  # what of it is left after the last write

    def as_json(self) -> dict:
        return {"changed_fraction": self.changed_fraction, "codec_ratio": self.codec_ratio,
                "delta_share": self.delta_share, "wire_ratio": self.wire_ratio,
                "bytes_per_engine_rank_max": self.bytes_per_engine_rank_max,
                "bytes_per_sender_max": self.bytes_per_sender_max, "p2p_seconds": self.p2p_seconds,
                "apply_seconds": self.apply_seconds, "apply_after_writes_seconds": self.apply_after_writes_seconds,
                "bottleneck": self.bottleneck,
                "seconds_by_stage": dict(self.seconds_by_link)}


@dataclass(frozen=True)
class DeltaPlan:
    """Delta updates at several changed fractions, next to the full update they follow."""

    unit: int
    rates: DeltaRates
    full: Cost
    base_bytes_per_sender_max: int  # the sender's host copy of what it prepares
    area_bytes_per_engine_rank_max: int
    updates: tuple[DeltaCost, ...]
    not_built: tuple[str, ...] = ()  # what this plan assumes that the sender does not do yet

    def as_json(self) -> dict:
        return {"first_update": FIRST_FULL, "not_built": list(self.not_built), "unit": self.unit, **self.rates.as_json(),
                "full_p2p_seconds": self.full.p2p_seconds,
                "base_bytes_per_sender_max": self.base_bytes_per_sender_max,
                "area_bytes_per_engine_rank_max": self.area_bytes_per_engine_rank_max,
                "updates": [u.as_json() for u in self.updates]}


def delta_unit(shape: ModelShape, dtype: str) -> int:
    """Bytes the codec compares as one: the element size (an FP8 config's bulk is 1-byte weights;
    its float32 scales and BF16 rest are counted in the same unit)."""
    return 1 if shape.fp8 is not None else DTYPE_BYTES[dtype]


def wire_share(codec_ratio: float, mode: str, room: float) -> tuple[float, float]:
    """(share of the bytes sent as records, bytes on the wire / full) when records may take
    ``room`` of the bytes (see the module). EMPTY records are not written; DENSE ones go in full."""
    if mode == "empty":
        return 0.0, 0.0
    if mode == "dense":
        return 0.0, 1.0
    share = min(1.0, room / codec_ratio) if codec_ratio > 0 else 1.0
    return share, share * codec_ratio + (1.0 - share)


def not_built_yet(plan: Plan, links: Links) -> tuple[str, ...]:
    """What a delta update of this plan needs that is not built yet (docs/deltas.md: such updates
    are written in full today). PP stages take deltas: each writes its own part of every engine
    rank's area (docs/deltas.md, "Several writers of one rank")."""
    return ("sglang servers: their ranks publish a delta area only with the p2pweights sglang plugin",)


def predict_deltas(full: Cost, fractions: Sequence[float], unit: int, rates: DeltaRates = DeltaRates(),
                   not_built: Sequence[str] = ()) -> DeltaPlan:
    """The delta updates after ``full`` (predict's cost of the same plan) at each changed fraction;
    ``not_built``: :func:`not_built_yet` of the plan, carried into the output."""
    room = min(rates.area_fraction, SPARE_FRACTION)
    updates = []
    for f in fractions:
        rec = expected_record(f, unit)
        share, wire = wire_share(rec.ratio, rec.mode, room)
        stages = []
        for link, seconds in full.seconds_by_link:
            stages.append((link, seconds * wire if link in (ENGINE_NIC, SENDER_NIC) else seconds))
        stages.append((SENDER_DETECT, full.bytes_prepared_per_sender_max / (rates.detect_gbps * GB)))
        apply_s = share * full.bytes_per_engine_rank_max / (rates.apply_gbps * GB)
        if rates.apply_beside:  # a pipeline stage; the last slot's records are left after the last write
            after = share * min(rates.slot_bytes, full.bytes_per_engine_rank_max) / (rates.apply_gbps * GB)
            stages.append((APPLY_BESIDE, apply_s))
            slowest, pipeline = max(stages, key=lambda kv: kv[1])  # first listed wins a tie
            bottleneck, timed = slowest, tuple(stages) + ((APPLY_TAIL, after),)
        else:
            after = apply_s
            slowest, pipeline = max(stages, key=lambda kv: kv[1])
            bottleneck = ENGINE_APPLY if apply_s > pipeline else slowest
            timed = tuple(stages) + ((ENGINE_APPLY, apply_s),)
        updates.append(DeltaCost(
            changed_fraction=f, codec_ratio=rec.ratio, delta_share=share, wire_ratio=wire,
            bytes_per_engine_rank_max=round(full.bytes_per_engine_rank_max * wire),
            bytes_per_sender_max=round(full.bytes_per_sender_max * wire),
            p2p_seconds=pipeline + after, apply_seconds=apply_s, bottleneck=bottleneck,
            seconds_by_link=timed, apply_after_writes_seconds=after))
    return DeltaPlan(unit=unit, rates=rates, full=full, base_bytes_per_sender_max=full.bytes_prepared_per_sender_max,
                     area_bytes_per_engine_rank_max=round(full.bytes_per_engine_rank_max * rates.area_fraction),
                     updates=tuple(updates), not_built=tuple(not_built))


def parse_fractions(values: Sequence[str]) -> list[float]:
    """``--changed-fraction`` values (each one or a comma list) -> fractions in [0, 1], in order."""
    out: list[float] = []
    for text in values:
        for item in filter(None, (s.strip() for s in text.split(","))):
            try:
                f = float(item)
            except ValueError:
                raise PlanError(f"--changed-fraction: {item!r} is not a number; write e.g. 0.01,0.03,0.1") from None
            if not 0.0 <= f <= 1.0:
                raise PlanError(f"--changed-fraction: {item} is outside [0, 1]; it is the share of elements "
                                "that changed, e.g. 0.01")
            out.append(f)
    if values and not out:
        raise PlanError("--changed-fraction: no fraction given; write e.g. 0.01,0.03,0.1")
    return out
