"""Optional Prometheus metrics of the sender, with ``prometheus_client`` when it is importable.

Opt in with ``WeightSender(..., metrics=registry)`` (a ``prometheus_client.CollectorRegistry``) or
``metrics=True`` (the default registry), or process-wide with :func:`enable`. Without
``prometheus_client`` every call here is a no-op: metrics never make an update fail.

- ``p2pw_update_seconds`` (histogram): pause returned -> update returned, per successful update
- ``p2pw_update_bytes_total`` (counter, label ``engine``): bytes written into each engine
- ``p2pw_update_failures_total`` (counter, label ``engine``): failed updates naming the engine
  (``sender N`` when a sender failed before naming an engine)
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import split_target

_default: Any = None  # the registry enable() chose, or None
_by_registry: dict[int, "SenderMetrics"] = {}


def enable(registry: Any = True) -> None:
    """Every WeightSender of this process reports to ``registry`` (True: prometheus' default)."""
    global _default
    _default = registry


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class SenderMetrics:
    """The three metrics on one registry (made once per registry: Prometheus refuses duplicates)."""

    def __init__(self, registry: Any):
        import prometheus_client as pc

        kw = {} if registry is True else {"registry": registry}
        self.seconds = pc.Histogram("p2pw_update_seconds", "weight update seconds, pause returned to update returned",
                                    **kw)
        self.bytes = pc.Counter("p2pw_update_bytes_total", "bytes written into each engine", ["engine"], **kw)
        self.failures = pc.Counter("p2pw_update_failures_total", "failed weight updates, by the engine named",
                                   ["engine"], **kw)

    def succeeded(self, seconds: float, bytes_by_engine: Mapping[str, int]) -> None:
        self.seconds.observe(seconds)
        for engine, n in bytes_by_engine.items():
            self.bytes.labels(engine=engine).inc(n)

    def failed(self, targets: Any) -> None:
        for engine in sorted({split_target(t)[0] for t in targets}):
            self.failures.labels(engine=engine).inc()


def metrics_for(registry: Any = None) -> SenderMetrics | None:
    """The metrics of ``registry`` (None: the one :func:`enable` chose, if any); None when off or
    when prometheus_client is not installed."""
    registry = _default if registry is None else registry
    if registry is None or registry is False or not available():
        return None
    key = id(registry) if registry is not True else 0
    if key not in _by_registry:
        _by_registry[key] = SenderMetrics(registry)
    return _by_registry[key]
