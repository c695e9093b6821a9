"""``update(verify=True)`` (``P2PW_VERIFY=1``): are the bytes the engine ranks hold the bytes this
sender wrote?

While the writes are in flight the pipeline digests every parameter's bytes in the slot it was
loaded into (:meth:`WrittenDigests.add`; on the slot's device, no synchronization); once every write
returned, :func:`verify_written` asks each engine for its ranks' digests of the same parameters
(``POST /p2pw_weights_digest``, served by p2pweights receivers) and compares. A difference fails
the update naming the engine, the rank and the parameter, before any engine is told to end the
update: the engines stay paused with the old version. The digest is :mod:`p2pweights.control.weights_digest`'s.

sglang 0.5.23 has no such route, and its ``/weights_checker`` cannot answer the question: its
``checksum`` action hashes every tensor of the whole model after post-processing (a value the
sender cannot compute from the slots), and ``snapshot``/``compare`` compare the engine with its
own earlier state. With the p2pweights sglang plugin installed, an sglang server serves the route
itself (``sglang_plugin/digest.py``) and says so in ``/server_info`` (``p2pw_plugin.offers`` has
``"digest"``). :func:`check_engines_digest` refuses ``verify=True`` against an engine that serves
no digest, before the update pauses anything.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..control import bodies
from ..control import protocol as p
from ..control.engine_calls import call_engines
from ..control.weights_digest import digest_sums, digest_text
from ..errors import EngineError, P2PWeightsError, UpdateFailed
from .delta_verify import apply_for_verify

if TYPE_CHECKING:
    from ..control import SglangEngine
    from .prepared import PreparedRank

logger = logging.getLogger("p2pweights.sender")
_ROUTE = "p2pw_weights_digest"


class WrittenDigests:
    """The digest of every parameter this sender loaded into a slot, per prepared engine rank."""

    def __init__(self) -> None:
        self._sums: dict[tuple[int, str], Any] = {}   # (id(prepared rank), param) -> [S, R, C] on the slot's device

    def add(self, rank: "PreparedRank", regions: Iterable[Any], target: Any) -> None:
        """Digest the slot bytes each region (``param_name``, ``offset``, ``nbytes``) was loaded into."""
        for r in regions:
            self._sums[(id(rank), r.param_name)] = digest_sums(target[r.offset:r.offset + r.nbytes])

    def of(self, rank: "PreparedRank") -> dict[str, str]:
        """``{param: digest}`` of what was written for ``rank`` (synchronizes with the slots' devices)."""
        import torch

        mine = [(name, sums) for (rid, name), sums in self._sums.items() if rid == id(rank)]
        if not mine:
            return {}
        by_device: dict[Any, list[tuple[str, Any]]] = {}
        for name, sums in mine:
            by_device.setdefault(sums.device, []).append((name, sums))
        out = {}
        for items in by_device.values():  # one synchronization per device
            rows = torch.stack([s for _, s in items]).cpu().tolist()
            out.update({name: digest_text(row) for (name, _), row in zip(items, rows)})
        return out


def _ask(engine: "SglangEngine", names: dict[str, list[str]]) -> dict:
    # SglangEngine's one call path: its URL, timeouts, API key, typed errors and hints
    return engine._json(_ROUTE, body=bodies.WeightsDigestReq(names=names))


def check_engines_digest(engines: Sequence["SglangEngine"]) -> None:
    """Refuse verify=True, before anything is paused, when an engine does not serve the digest
    route (a plain sglang server: 404). An engine whose sglang plugin offers the digest (read from its
    ``/server_info`` at connect) serves it; every other engine is asked for no parameter at all.
    Raises EngineError naming each engine that cannot."""
    asked = call_engines([e for e in engines if p.PLUGIN_DIGEST not in e.plugin_offers], _ask, {})
    if not asked.errors:
        return
    lines = "; ".join(f"{name}: {e}" for name, e in asked.errors.items())
    first = next(iter(asked.errors))
    raise EngineError(f"verify=True needs every engine to digest the weights it holds (POST /{_ROUTE}, served by "
                      f"p2pweights receivers and by sglang servers with the p2pweights plugin); {lines}", engine=first,
                      hint="sglang 0.5.23 cannot by itself (its /weights_checker checksums the whole post-processed "
                           "model): install p2pweights in the engine's environment (its sglang plugin serves the "
                           "digest: docs/sglang.md), or update with verify=False (P2PW_VERIFY unset)")


def verify_written(ranks: Sequence["PreparedRank"], written: WrittenDigests, version: str) -> None:
    """Every engine rank written holds, for every parameter, the digest of what was written;
    otherwise UpdateFailed naming each engine rank, its first differing parameter and how many differ."""
    expected: dict[tuple[str, int], dict[str, str]] = {}
    asks: dict[str, dict[str, list[str]]] = {}
    engines: dict[str, "SglangEngine"] = {}
    for prepared in ranks:
        digests = written.of(prepared)
        for t in prepared.targets:
            expected[(t.engine.name, t.rank)] = digests
            asks.setdefault(t.engine.name, {})[str(t.rank)] = sorted(digests)
            engines[t.engine.name] = t.engine
    asked = call_engines(list(engines.values()), lambda e: _ask(e, asks[e.name]))
    failures: dict[str, str | BaseException] = {}
    for name, err in asked.errors.items():
        failures[name] = err
    for (name, rank), want in expected.items():
        if name not in asked.results:
            continue
        held = (asked.results[name].get("ranks") or {}).get(str(rank), {})
        differ = sorted(n for n, d in want.items() if held.get(n) != d)
        if differ:
            failures[f"{name}/rank{rank}"] = P2PWeightsError(
                f"{len(differ)} of {len(want)} parameter(s) differ from what was written, first {differ[0]!r} "
                f"(holds {held.get(differ[0], 'nothing')}, written {want[differ[0]]})",
                engine=name, rank=rank, parameter=differ[0],
                hint="the engine was not resumed: it stays paused with its old version; the next complete "
                     "update rewrites every byte")
    if failures:
        raise UpdateFailed(failures, what=f"verification of weight update {version}")


def verify_update(update: Any, rep: Any) -> dict[str, BaseException]:
    """verify=True and every write of ``update`` (an update.Update, which imports this module)
    returned: engine rank -> the error naming its first differing parameter; {} when equal, or not
    asked. Sets ``update.verify_seconds``."""
    if update._digests is None:
        return {}
    t0 = time.perf_counter()
    try:
        if update._deltas is not None:  # the digests see every sender's deltas applied (a group: all take part)
            refused = apply_for_verify(
                update._deltas, update._engines, update._ranks, owner=update._session is not None,
                me=update._group.index, size=update._group.size, failures=rep.failures, gather=update._gather,
                control=update._control)
            if refused:
                return refused
        if rep.failures:
            return {}
        verify_written(update._ranks, update._digests, update.version)
    except UpdateFailed as e:
        return {n: e.errors.get(n) or P2PWeightsError(why) for n, why in e.failures.items()}
    finally:
        update.verify_seconds = time.perf_counter() - t0
        logger.info("update %s: verified in %.3f s", update.version, update.verify_seconds)
    return {}
