"""The engine core's rules for LoRA adapters: an adapter's slot is a target of its own.

An adapter update (``begin_weight_update`` with ``{"adapter": name}``) writes one adapter's slot
of the engine's LoRA pool, not the base weights, under the same session (owner, lease, epoch,
revocation). What differs, decided here once for every host (docs/lora.md, "Adapter updates"):

- **The slot is the engine's.** The adapter must be loaded once by the engine's own API
  (``load_lora_adapter``, pinned where the engine has pinning), which picks its slot; the begin asks
  the host where it is (``steps.AdapterSlot``) and answers it. Not loaded: refused before anything
  is paused or forgotten, naming the fix.
- **A base per adapter.** Deltas of an adapter are claimed against that adapter's last committed
  bytes; an adapter update never touches the base weights' identity, and a base-weights update
  never touches an adapter's. The engine's own load or unload of an adapter forgets its base.
- **A version per adapter**, given by the end (``adapter_version``), not the engine's weight version.
- **Torn adapters block generation.** When an adapter's session tears (a failed end, an expired
  lease, an owner's release, a takeover of its lost session), the adapter's slot may be half
  written: the engine stays paused (``continue_generation`` is refused, naming the adapter) until a
  complete update of that adapter, or its unload, whatever else completes in between. So no request
  is ever served with a half-written adapter under its version label.
"""
from __future__ import annotations

import re
import threading
from typing import Any

from ..deltas.committed import CommittedBase
from ..errors import InvalidRequest, TornWeights

#: the begin body's key naming the adapter; the end body's key giving its new version
ADAPTER_KEY, ADAPTER_VERSION_KEY = "adapter", "adapter_version"
LOAD_ADAPTER, UNLOAD_ADAPTER = "load_lora_adapter", "unload_lora_adapter"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}$")


def adapter_name(value: Any, verb: str) -> str:
    """An adapter name from a request body, checked (a name reaches logs, errors and the table)."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidRequest(f"{verb}: field {ADAPTER_KEY!r} must be an adapter name (letters, digits, ._:/+-; "
                             f"at most 128), got {str(value)[:80]!r}")
    return value


class AdapterTargets:
    """One engine's adapters as updates see them: committed base, version, torn reason (thread-safe)."""

    def __init__(self, engine: str = "engine"):
        self.engine = engine
        self._lock = threading.Lock()
        self._bases: dict[str, CommittedBase] = {}
        self.versions: dict[str, str] = {}
        self.torn: dict[str, str] = {}  # adapter -> why its slot may be half written

    def base(self, name: str) -> CommittedBase:
        with self._lock:
            if name not in self._bases:
                self._bases[name] = CommittedBase(self.engine)
            return self._bases[name]

    def lost(self, name: str, why: str) -> None:
        """The adapter's session tore or was lost: its slot may be half written."""
        self.base(name).forget(why)
        with self._lock:
            self.torn[name] = why

    def committed(self, name: str, version: str) -> None:
        with self._lock:
            self.versions[name] = version
            self.torn.pop(name, None)

    def loaded(self, name: str) -> None:
        """The engine's own load wrote the adapter's slot: no base, the version is the load's."""
        self.base(name).forget(f"LoRA adapter {name!r} was loaded by the engine's own API after the last commit")
        with self._lock:
            self.versions.pop(name, None)
            self.torn.pop(name, None)  # the engine's load rewrote every byte of the slot

    def unloaded(self, name: str) -> None:
        """Unloaded: nothing of it can be served any more, torn or not."""
        with self._lock:
            self._bases.pop(name, None)
            self.versions.pop(name, None)
            self.torn.pop(name, None)

    def check_continue(self, verb: str) -> None:
        """Generation may not continue while an adapter is torn (module docstring)."""
        with self._lock:
            torn = dict(self.torn)
        if torn:
            name, why = next(iter(torn.items()))
            raise TornWeights(f"{verb} refused: engine {self.engine}'s LoRA adapter {name!r} may be half written: "
                              f"{why}", engine=self.engine, parameter=name,
                              hint=f"run a complete update of adapter {name!r} (sender.update(step, adapter="
                                   f"{name!r})), or unload it (unload_lora_adapter)")

    def state(self) -> dict:
        with self._lock:
            names = sorted(set(self.versions) | set(self.torn))
            return {n: {"version": self.versions.get(n), "torn": self.torn.get(n)} for n in names}
