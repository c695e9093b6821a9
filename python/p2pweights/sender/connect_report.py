"""Where a `WeightSender.connect` spends its time, phase by phase, and what it built or registered.

The sender fills one :class:`ConnectPhases` per connect (``sender.connect_phases``): a lap timer
(each :meth:`lap` charges the seconds since the previous one to a phase, so the calls sit between
the existing steps without wrapping them) and counts of the costly things done -- replicas built,
replicas read from the disk cache, transport agents created, memory registrations, peer connects.
A warm connect shows none but the peer connects (every connect re-attaches its engine ranks: an
engine restarted behind the same URL must not be written through a stale connection; ~0.2 ms per
rank on loopback). A cold connect's agent (and GPU slots) are made beside the replicas
(early_slots.py): their own seconds are ``overlapped_seconds``, and the main thread's wait for them
is the phase "waiting for early slots". A sender made with ``prepare=True`` (warmup.py) started the
sglang import and the agent at construction: the connect's wait for what is left of that import is
"waiting for warm-up". ``benchmarks/profile_connect.py`` prints all of it.
"""
from __future__ import annotations

import time
from typing import Any

# The phases in the order a cold connect meets them (a connect charges only those it runs).
PHASES = (
    "http server_info",
    "identity + plan",
    "waiting for warm-up",
    "replicas",
    "publication fetch",
    "publication checks",
    "detach",
    "waiting for early slots",
    "transport agent",
    "buffer allocation + pinning",
    "registration",
    "peer connect",
    "transforms",
    "delta bases",
)
COUNTS = ("replicas built", "replica disk hits", "agents created", "registrations", "peer connects")


class ConnectPhases:
    """Seconds per phase and counts of one connect. ``replicas``: the sender's ModelReplicas, whose
    build and disk-cache counters and seconds the connect's share is taken from."""

    def __init__(self, replicas: Any = None):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self.overlapped_seconds: dict[str, float] = {}  # early_slots.py: ran beside the replicas
        self._replicas = replicas
        self._replica_start = _replica_state(replicas)
        self._start = self._last = time.perf_counter()
        self.total_seconds = 0.0

    def lap(self, phase: str) -> None:
        """Charge the seconds since the previous lap (or the start) to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def overlapped(self, seconds: dict[str, float]) -> None:
        """The early agent and slots (early_slots.py) were taken: charge the wait, keep their own
        seconds apart (they ran beside the replicas), count the agent and the registration."""
        self.lap("waiting for early slots")
        self.overlapped_seconds = dict(seconds)
        self.count("agents created")
        if "registration" in seconds:  # GPU slots too
            self.count("registrations")

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def done(self) -> "ConnectPhases":
        """Close the connect: total seconds, and the replicas' builds/disk hits during it."""
        self.total_seconds = time.perf_counter() - self._start
        end = _replica_state(self._replicas)
        start = self._replica_start
        self.counts["replicas built"] = end["builds"] - start["builds"]
        self.counts["replica disk hits"] = end["disk_hits"] - start["disk_hits"]
        # the replica phase split into the replicas' own timings (model build on meta, loader probe, ...)
        self.replica_seconds = {k: v - start["seconds"].get(k, 0.0) for k, v in end["seconds"].items()
                                if v - start["seconds"].get(k, 0.0) > 0}
        return self

    def as_json(self) -> dict:
        return {"total_s": self.total_seconds, "phases_s": dict(self.seconds),
                "overlapped_s": dict(self.overlapped_seconds),
                "replica_s": dict(getattr(self, "replica_seconds", {})), "counts": dict(self.counts)}


def _replica_state(replicas: Any) -> dict:
    return {"builds": getattr(replicas, "builds", 0), "disk_hits": getattr(replicas, "disk_hits", 0),
            "seconds": dict(getattr(replicas, "seconds", {}))}
