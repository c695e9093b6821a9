"""``sender.update(step, adapter="name")``: one LoRA adapter written one-sided into the slot its engine gave it.

The trainer pushes the adapter's PEFT tensors (``base_model.model....q_proj.lora_A.weight``, as PEFT
saves them) and gives ``adapter_config`` (PEFT's ``LoraConfig``, ``adapter_config.json``'s path, or
it as a dict: ``r``, ``lora_alpha``, ``target_modules``) once; later updates of the same adapter reuse
it. On finish, before anything is paused:

1. every engine rank's slot bytes are produced by sglang's own adapter load run on this host
   (``replica.lora_pool``: stacking, TP slicing, padding, the cast to the pool dtype), refusing an
   adapter the engine's pool cannot hold (rank, modules) or a tensor that is not finite, by name;
2. the session opens on every engine the sender writes (pause, begin with ``{"adapter": name}``):
   each engine answers the slot its own registry gave the adapter (it must be loaded there once,
   pinned) and whether this sender's delta claim on the adapter holds (engine/adapters.py);
3. each rank's slot entries (``lora.{A|B}.{module}.L{layer}@{slot}`` in the rank's published table)
   are written through the sender's pipelined writer: whole, or with the claim accepted, only the
   4 KiB blocks that differ from the bytes this sender last committed there; the writes are fenced
   by each engine's lease, and a takeover's new epoch is followed before any write, as for weights;
4. ``verify``: each rank digests the slot entries it holds and they must equal what was written;
5. the end carries the adapter's new version (the engine's weight version is untouched), and
   generation continues. A failure after the first write leaves the engines paused, the adapter
   marked torn by the engine until a complete update of it.

docs/lora.md, "Adapter updates".
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from ..control.update_session import UpdateSession
from ..control.weights_digest import digest
from ..deltas.committed import BASE_KEY, DELTA_KEY
from ..engine.adapters import ADAPTER_KEY, ADAPTER_VERSION_KEY
from ..errors import LayoutMismatch, NonFiniteTensor, P2PWeightsError, SenderGroupError, UpdateFailed
from ..models.engine_layout import EngineLayout
from .adapter_bytes import adapter_setting, slot_bytes
from .verify import _ask
from .write_fence import fence_engine, follow_epochs

if TYPE_CHECKING:
    import torch

    from ..replica.lora_layout import LoRASetting

logger = logging.getLogger(__name__)

BLOCK = 4096  # a delta's granularity: a changed block is rewritten whole


@dataclasses.dataclass
class AdapterReport:
    """What one adapter update did: per engine its slot, whether it took a delta (and why not)."""

    version: str
    adapter: str
    slots: dict[str, int]
    delta: dict[str, bool]
    delta_reason: dict[str, str]
    bytes: int               # the adapter's slot bytes over every rank written
    bytes_written: int       # of which written (a delta writes the changed blocks)
    seconds: float           # pause to continue
    verify_seconds: float = 0.0

    def __str__(self) -> str:
        per = ", ".join(f"{e}: slot {s}, {'delta' if self.delta.get(e) else 'full'}" for e, s in sorted(self.slots.items()))
        return (f"adapter {self.adapter!r} version {self.version}: {self.bytes_written:,} of {self.bytes:,} slot bytes "
                f"written in {self.seconds:.3f} s ({per})")


class SenderAdapters:
    """A sender's adapters: each one's ``adapter_config``, its bases, and each engine's LoRA setting."""

    def __init__(self) -> None:
        self.configs: dict[str, dict] = {}
        self.bases = AdapterBases()
        self._settings: dict[str, tuple["LoRASetting", EngineLayout]] = {}

    def setting(self, engine: Any) -> tuple["LoRASetting", EngineLayout]:
        if engine.name not in self._settings:
            self._settings[engine.name] = adapter_setting(engine)
        return self._settings[engine.name]

    def update(self, sender: Any, version: Any, adapter: str, adapter_config: Mapping[str, Any] | None,
               **kwargs: Any) -> "AdapterUpdate":
        if not sender._ranks:
            raise P2PWeightsError("connect(engines) before update()")
        if sender.num_senders * sender.pp_size > 1:  # each would write only its share, in its own session
            raise SenderGroupError(
                f"adapter {adapter!r}: an adapter update runs from one sender, which writes every engine rank (this "
                f"one is sender {sender.sender_index} of {sender.num_senders}, PP stage {sender.pp_stage} of "
                f"{sender.pp_size})", parameter=adapter,
                hint="gather the adapter's tensors on one trainer rank and update it there with a WeightSender "
                     "made without group= (an adapter is small: docs/lora.md)")
        return AdapterUpdate(sender, version, adapter, adapter_config, **kwargs)


class AdapterBases:
    """What this sender last committed of each adapter on each engine: the engine's identity of it
    (deltas/committed.py) and every rank's slot bytes, to compute the next delta against."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[dict, dict[int, dict[str, np.ndarray]]]] = {}

    def claim(self, engine: str, adapter: str) -> dict | None:
        held = self._held.get((engine, adapter))
        return held[0] if held else None

    def bytes_of(self, engine: str, adapter: str, rank: int) -> dict[str, np.ndarray] | None:
        held = self._held.get((engine, adapter))
        return held[1].get(rank) if held else None

    def keep(self, engine: str, adapter: str, identity: Any, ranks: dict[int, dict[str, np.ndarray]]) -> None:
        if isinstance(identity, dict):
            self._held[(engine, adapter)] = (identity, ranks)
        else:
            self.forget(engine, adapter)

    def forget(self, engine: str, adapter: str) -> None:
        self._held.pop((engine, adapter), None)


def adapter_config_dict(config: Any, adapter: str) -> dict:
    """``adapter_config.json`` as a dict from what a trainer holds: the dict itself, PEFT's
    ``LoraConfig`` (``peft_model.peft_config["default"]``: its ``to_dict()``, ``target_modules`` a
    set), or the path of the file or of the adapter's folder. Sets become sorted lists (JSON)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "adapter_config.json") if os.path.isdir(config) else os.fspath(config)
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise P2PWeightsError(f"adapter {adapter!r}: cannot read adapter_config from {path}: {e}",
                                  parameter="adapter_config") from None
    elif not isinstance(config, Mapping) and callable(getattr(config, "to_dict", None)):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise P2PWeightsError(f"adapter {adapter!r}: adapter_config is a {type(config).__name__}, not a dict, "
                              f"PEFT's LoraConfig or a path", parameter="adapter_config",
                              hint="pass peft_model.peft_config[name], its adapter_config.json, or that as a dict")
    out = {str(k): (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in config.items()}
    if "r" not in out or "target_modules" not in out:
        raise P2PWeightsError(f"adapter {adapter!r}: adapter_config has no {'r' if 'r' not in out else 'target_modules'}",
                              parameter="adapter_config", hint="pass the adapter's full adapter_config.json")
    return out


def changed_runs(new: np.ndarray, old: np.ndarray | None) -> list[tuple[int, int]]:
    """(offset, length) runs of :data:`BLOCK`-byte blocks where ``new`` differs from ``old`` (all of
    ``new`` when there is no ``old`` of its size)."""
    n = new.size
    if old is None or old.size != n:
        return [(0, n)] if n else []
    blocks = -(-n // BLOCK)
    pad = blocks * BLOCK - n
    a = np.concatenate([new, np.zeros(pad, np.uint8)]) if pad else new
    b = np.concatenate([old, np.zeros(pad, np.uint8)]) if pad else old
    differ = np.any(a.reshape(blocks, BLOCK) != b.reshape(blocks, BLOCK), axis=1)
    runs, i = [], 0
    idx = np.flatnonzero(differ)
    while i < idx.size:
        j = i
        while j + 1 < idx.size and idx[j + 1] == idx[j] + 1:
            j += 1
        start, end = int(idx[i]) * BLOCK, min(n, (int(idx[j]) + 1) * BLOCK)
        runs.append((start, end - start))
        i = j + 1
    return runs


class AdapterUpdate:
    """One adapter update (module docstring); made by ``WeightSender.update(step, adapter=...)``."""

    def __init__(self, sender: Any, version: Any, adapter: str, adapter_config: Mapping[str, Any] | None, *,
                 verify: bool, delta: bool | str, check_finite: bool, pause_mode: str, on_failure: Any):
        if not isinstance(adapter, str) or not adapter:
            raise ValueError(f"adapter must be the adapter's name (as loaded on the engines), got {adapter!r}")
        configs = sender.adapters.configs
        if adapter_config is not None:
            configs[adapter] = adapter_config_dict(adapter_config, adapter)
        if adapter not in configs:
            raise P2PWeightsError(f"adapter {adapter!r}: no adapter_config given yet", parameter=adapter,
                                  hint="pass adapter_config= (PEFT's LoraConfig, adapter_config.json's path or "
                                       "its dict: r, lora_alpha, target_modules) to its first update")
        self.sender, self.version, self.adapter = sender, str(version), adapter
        self.adapter_config = configs[adapter]
        self.verify, self.delta, self.check_finite = bool(verify), delta, bool(check_finite)
        self.pause_mode, self.on_failure = pause_mode, on_failure
        self.tensors: dict[str, "torch.Tensor"] = {}
        self.report: AdapterReport | None = None

    # -- the trainer's calls ----------------------------------------------------------------------
    def push(self, name: str, tensor: "torch.Tensor") -> None:
        """One PEFT tensor of the adapter (its PEFT name), any device; copied to host memory here."""
        if ".lora_A." not in name and ".lora_B." not in name:
            raise LayoutMismatch(f"adapter {self.adapter!r}: {name!r} is not a PEFT LoRA tensor name "
                                 f"(...<module>.lora_A.weight / .lora_B.weight)", parameter=name,
                                 hint="push the adapter's tensors as PEFT names them (get_peft_model_state_dict)")
        t = tensor.detach()
        if self.check_finite and t.is_floating_point() and not bool(t.isfinite().all()):
            raise NonFiniteTensor(f"adapter {self.adapter!r}: tensor {name!r} holds NaN or Inf; nothing was "
                                  f"paused or written", parameter=name,
                                  hint="skip this step's adapter update (the engines keep the last one)")
        self.tensors[name] = t.to("cpu", copy=True)

    def push_many(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        for name, t in items:
            self.push(name, t)

    def __enter__(self) -> "AdapterUpdate":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()

    # -- finishing --------------------------------------------------------------------------------
    def finish(self) -> AdapterReport:
        if not self.tensors:
            raise P2PWeightsError(f"adapter {self.adapter!r}: no tensor was pushed", parameter=self.adapter)
        sender = self.sender
        targets = [t for p in sender._ranks for t in p.targets]
        produced = self._slot_bytes(targets)  # the engine's own load, before anything is paused
        engines = list({t.engine.name: t.engine for t in targets}.values())
        bases: AdapterBases = sender.adapters.bases
        for e in engines:
            claim = bases.claim(e.name, self.adapter) if self.delta else None
            e.begin_extra = {ADAPTER_KEY: self.adapter, **({DELTA_KEY: claim} if claim else {})}
        session = UpdateSession(engines, self.version, pause_mode=self.pause_mode, owner=sender.owner,
                                on_failure=self.on_failure)
        session.bump_version = False
        try:
            session.open()
        finally:
            for e in engines:
                e.begin_extra = {}
        t0, written = session.paused_at or time.perf_counter(), False
        try:
            follow_epochs(session.epochs, sender._follow_epochs, sender._writer, sender._ranks, session,
                          session.instances)
            targets = [t for p in sender._ranks for t in p.targets]
            for e in engines:
                fence_engine(sender._writer, sender._ranks, e.name, session.lease_deadline(e.name))
            session.renewer.on_deadline = lambda name, deadline: fence_engine(sender._writer, sender._ranks, name,
                                                                              deadline)
            slots, accepted, reasons = self._answers(session, engines)
            written = True
            total, sent, entries = self._write(targets, produced, slots, accepted)
            verify_s = self._verify(targets, entries) if self.verify else 0.0
        except BaseException as e:
            session.abort(f"{type(e).__name__}: {e}", written=written)
            for eng in engines:
                bases.forget(eng.name, self.adapter)
            raise
        for e in engines:
            if e.name not in session.folds:
                e.end_extra = {ADAPTER_VERSION_KEY: self.version}
        try:
            session.commit()
        finally:
            for e in engines:
                e.end_extra = {}
        for e in engines:
            ranks = {t.rank: dict(produced[_key(t)]) for t in targets if t.engine.name == e.name}
            answer = session.answers.get(e.name)
            bases.keep(e.name, self.adapter, answer.get(BASE_KEY) if isinstance(answer, dict) else None, ranks)
        self.report = AdapterReport(self.version, self.adapter, slots, accepted, reasons, total, sent,
                                    time.perf_counter() - t0, verify_s)
        logger.info("%s", self.report)
        return self.report

    def _slot_bytes(self, targets: list) -> dict[tuple, dict[str, np.ndarray]]:
        """Per engine rank written: every adapter buffer's slot bytes, by the engine's own adapter load
        run here (adapter_bytes.py), before anything is paused."""
        out: dict[tuple, dict[str, np.ndarray]] = {}
        for t in targets:
            if _key(t) not in out:
                out[_key(t)] = slot_bytes(self.sender, t.engine, t.rank, self.adapter_config, self.tensors,
                                          self.adapter)
        return out

    def _answers(self, session: UpdateSession, engines: list) -> tuple[dict, dict, dict]:
        slots, accepted, reasons = {}, {}, {}
        for e in engines:
            answer = session.answers.get(e.name) or {}
            said = answer.get(ADAPTER_KEY) if isinstance(answer, dict) else None
            if not isinstance(said, dict) or not isinstance(said.get("slot"), int):
                raise LayoutMismatch(f"engine {e.name}: its begin did not answer the slot of adapter "
                                     f"{self.adapter!r}: it does not run p2pweights' engine core with adapters",
                                     engine=e.name, parameter=self.adapter)
            slots[e.name] = said["slot"]
            delta = answer.get(DELTA_KEY) if isinstance(answer.get(DELTA_KEY), dict) else {}
            accepted[e.name] = bool(delta.get("accepted"))
            reasons[e.name] = "" if accepted[e.name] else str(delta.get("reason") or "no claim: the first update")
        return slots, accepted, reasons

    def _write(self, targets: list, produced: dict, slots: dict, accepted: dict) -> tuple[int, int, dict]:
        """Every target's slot entries, whole or their changed blocks, through the pipelined writer."""
        writer, buffers = self.sender._writer, self.sender._buffers
        rows_for: list[tuple[Any, int, np.ndarray, int]] = []  # (target, remote addr, bytes, writer id)
        entries: dict[tuple[str, int], dict[str, np.ndarray]] = {}
        total = sent = 0
        for t in targets:
            slot = slots[t.engine.name]
            base = self.sender.adapters.bases.bytes_of(t.engine.name, self.adapter, t.rank) \
                if accepted[t.engine.name] else None
            mine = entries.setdefault((t.engine.name, t.rank), {})
            published = {n for n in t.publication.params if n.startswith("lora.") and n.endswith(f"@{slot}")}
            extra = sorted(published - {f"{b}@{slot}" for b in produced[_key(t)]})
            if extra:  # both ways: the engine's pool has buffers the sender's replica of it lacks
                raise LayoutMismatch(f"engine {t.engine.name} rank {t.rank} publishes adapter slot entries the "
                                     f"sender's replica of its LoRA pool lacks, first {extra[0]!r} ({len(extra)})",
                                     engine=t.engine.name, rank=t.rank, parameter=extra[0],
                                     hint="the engine's LoRA setting differs from its /server_info")
            for buffer, data in produced[_key(t)].items():
                name = f"{buffer}@{slot}"
                where = t.publication.params.get(name)
                if where is None or where.nbytes != data.size:
                    raise LayoutMismatch(
                        f"engine {t.engine.name} rank {t.rank} publishes {'no' if where is None else 'another size of'} "
                        f"adapter slot entry {name!r} ({data.size} bytes expected)", engine=t.engine.name,
                        rank=t.rank, parameter=name, hint="start the engine with the LoRA setting its /server_info "
                                                          "reports (--enable-lora ...), with p2pweights' adapter pool")
                mine[name] = data
                total += data.size
                for off, n in changed_runs(data, base.get(buffer) if base else None):
                    rows_for.append((t, where.data_ptr + off, data[off:off + n], t.writer_id))
                    sent += n
        slot_size = buffers.slot_bytes
        i = 0
        while i < len(rows_for):  # pack rows into slots; a row larger than a slot goes in pieces
            slot = writer.acquire(timeout=writer.transfer_timeout)
            view, used, rows = buffers.slot_tensor(slot), 0, []
            while i < len(rows_for) and used < slot_size:
                t, remote, data, wid = rows_for[i]
                n = min(data.size, slot_size - used)
                view[used:used + n].copy_(_tensor(data[:n]))
                rows.append((used, n, wid, remote))
                used += n
                if n < data.size:
                    rows_for[i] = (t, remote + n, data[n:], wid)
                else:
                    i += 1
            writer.submit(slot, rows)
        writer.finish()
        return total, sent, entries

    def _verify(self, targets: list, entries: dict) -> float:
        t0 = time.perf_counter()
        asks: dict[str, dict[str, list[str]]] = {}
        engines = {}
        for (engine, rank), named in entries.items():
            asks.setdefault(engine, {})[str(rank)] = sorted(named)
        for t in targets:
            engines[t.engine.name] = t.engine
        failures: dict[str, Any] = {}
        for name, engine in engines.items():
            held = (_ask(engine, asks[name]).get("ranks") or {})
            for rank_s, names in asks[name].items():
                got = held.get(rank_s, {})
                differ = [n for n in names if got.get(n) != digest(_tensor(entries[(name, int(rank_s))][n]))]
                if differ:
                    failures[f"{name}/rank{rank_s}"] = P2PWeightsError(
                        f"{len(differ)} adapter slot entr(ies) differ from what was written, first {differ[0]!r}",
                        engine=name, rank=int(rank_s), parameter=differ[0],
                        hint="the engine stays paused; the next complete update of the adapter rewrites it")
        if failures:
            raise UpdateFailed(failures, what=f"verification of adapter {self.adapter!r} update {self.version}")
        return time.perf_counter() - t0


def _key(t: Any) -> tuple:
    return (t.engine.name, t.rank)


def _tensor(a: np.ndarray) -> "torch.Tensor":
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))
