"""The report of one finished update, from the writer's account, the update's times and its deltas."""
from __future__ import annotations

from typing import Any, Sequence

from ..copyplans import background_recorded, plan_memory
from .report import EngineRankReport, UpdateReport, UpdateTimes
from .writer import WriteReport


def build_report(version: str, ranks: Sequence[Any], rep: WriteReport, times: UpdateTimes, *, seconds: float,
                 data_seconds: float, senders: int, validate_seconds: float, pause_seconds: float,
                 skipped: list[str], verbs: dict[str, float], deltas: Any = None,
                 buffers: Any = None, beside: Any = None) -> UpdateReport:
    """``bytes``: what a full update writes (with ``deltas``: each target's parameters' bytes);
    ``bytes_written``: what crossed the transport (the writer's bytes, delta records included);
    ``buffers``: the sender's transfer slots (the report's sender memory); ``beside``: the applies beside
    the writes (apply_beside.py)."""
    by_id = {e.engine: e for e in rep.engines}
    reasons = deltas.reasons() if deltas is not None else {}
    engines = []
    for p in ranks:
        for t in p.targets:
            e = by_id[t.writer_id]
            full = deltas.full_bytes[t.name] if deltas is not None else e.bytes
            engines.append(EngineRankReport(t.engine.name, t.rank, full, e.seconds, e.gbps, e.state, e.error,
                                            bytes_written=e.bytes, delta=bool(deltas) and not reasons.get(t.name, "x"),
                                            delta_reason=reasons.get(t.name, "")))
    cpu, caller_cpu = times.cpu_used()
    replicas = [p.replica for p in ranks]
    return UpdateReport(version, seconds, sum(e.bytes for e in engines), times.groups, times.slots, times.staging,
                        times.loading, max((e.seconds for e in rep.engines), default=0.0), times.waiting,
                        times.control, engines, data_seconds, validate_seconds, pause_seconds, senders, skipped,
                        verbs, times.replayed, times.loader_groups, times.recorded, plan_memory(replicas),
                        background_recorded(replicas), cpu_seconds=cpu, caller_cpu_seconds=caller_cpu,
                        bytes_written=rep.bytes, base_bytes=deltas.bases.nbytes if deltas is not None else 0,
                        changed_bytes=deltas.changed if deltas is not None else 0,
                        compared_from_inputs=deltas.from_inputs if deltas is not None else 0,
                        **(beside.figures() if beside is not None else {}),
                        slot_bytes=int(buffers.total_bytes) if buffers is not None else 0,
                        slot_location=str(buffers.location) if buffers is not None else "",
                        staged_peak_bytes=max((p.stager.peak_held_bytes for p in ranks), default=0))
