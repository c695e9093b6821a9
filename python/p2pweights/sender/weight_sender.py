"""WeightSender: the trainer's API. connect(engines) once, then per training step::

    with sender.update(version=step) as update:
        for hf_name, tensor in trainer_state_dict_in_hf_names():
            update.push(hf_name, tensor)
    print(update.report)

Each PP stage (and each data replica, ``sender_index`` of ``num_senders``) runs its own sender; the
planner's rule (:func:`p2pweights.planner.assign.assign_engine_ranks`) picks the engine ranks it prepares
and the engines it writes them to. A parameter group is loaded, by the replica's own sglang
loaders, into a transfer slot as soon as all its HF inputs arrived; full slots go to the native
writer while the next one fills. Engines are told to end the update and bump their version only
after every write succeeded.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .. import transport as transports
from .buffers import TransferBuffers, slot_size
from ..settings import Settings, format_size, settings
from ..control import SglangEngine, UpdateSession
from ..errors import LayoutMismatch, P2PWeightsError, UpdateFailed
from ..planner.assign import Engine as PlanEngine
from ..planner.assign import assign_engine_ranks, stage_layers
from .stager import GroupStager
from .gpu_staging import GpuStaging
from ..transport.publication import EnginePublication
from .writer import PipelinedWriter, WriteReport


@dataclass
class _Target:
    """One engine rank this sender writes: which engine, which writer id, what it published."""

    engine: SglangEngine
    rank: int
    writer_id: int
    publication: EnginePublication

    @property
    def name(self) -> str:
        return f"{self.engine.name}/rank{self.rank}"


@dataclass
class _Prepared:
    """One engine rank this sender prepares (loads once) and the engines it writes those bytes to."""

    layout_key: str
    rank: int
    replica: Any
    stager: GroupStager
    targets: list[_Target] = field(default_factory=list)


@dataclass
class EngineRankReport:
    engine: str
    rank: int
    bytes: int
    seconds: float
    gbps: float
    state: str
    error: str = ""


@dataclass
class UpdateReport:
    version: str
    seconds: float  # from pause returning (or update start without control) to the update returning
    bytes: int
    groups: int
    slots: int
    staging_seconds: float  # in push(), outside the loaders: checks and staging
    loading_seconds: float  # the replica's loaders filling slots
    writing_seconds: float  # longest engine's first post to last completion
    waiting_seconds: float  # blocked on a free slot or on the last writes
    control_seconds: float  # engine control plane (begin/end/version/continue), outside `seconds`'s writes
    engines: list[EngineRankReport]
    data_seconds: float = 0.0  # from the same start to the last write completed (before end_weight_update)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        lines = [
            f"update {self.version}: {format_size(self.bytes)} in {self.seconds:.3f} s ({self.gbps:.2f} GB/s; "
            f"every write done at {self.data_seconds:.3f} s); "
            f"{self.groups} groups in {self.slots} slots; loading {self.loading_seconds:.3f} s, writing "
            f"{self.writing_seconds:.3f} s, waiting {self.waiting_seconds:.3f} s, staging {self.staging_seconds:.3f} s"
        ]
        for e in self.engines:
            lines.append(f"  {e.engine} rank {e.rank}: {format_size(e.bytes)} {e.seconds:.3f} s {e.gbps:.2f} GB/s {e.state}"
                         + (f" ({e.error})" if e.error else ""))
        return "\n".join(lines)


def stage_hf_names(hf_names: Iterable[str], num_layers: int, pp_stage: int, pp_size: int) -> list[str]:
    """The HF names a trainer PP stage holds: its decoder layers; embeddings on the first stage;
    the final norm, lm_head and any MTP layers (index >= num_layers) on the last."""
    if pp_size == 1:
        return list(hf_names)
    start, end = stage_layers(num_layers, pp_size)[pp_stage]
    out = []
    for name in hf_names:
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts) and parts[parts.index("layers") + 1].isdigit():
            i = int(parts[parts.index("layers") + 1])
            stage = pp_size - 1 if i >= num_layers else next(s for s, (a, b) in enumerate(stage_layers(num_layers, pp_size)) if a <= i < b)
            if stage == pp_stage:
                out.append(name)
        elif "embed_tokens" in name:
            if pp_stage == 0:
                out.append(name)
        elif pp_stage == pp_size - 1:
            out.append(name)
    return out


class WeightSender:
    """Writes a trainer rank's weights into the engine ranks the planner gives it.

    model: the HF config (directory, config.json path or dict) the engines serve.
    sender_index / num_senders: this rank among the data replicas of its PP stage.
    pp_stage / pp_size: the trainer's pipeline stage; the sender pushes only that stage's tensors.
    Other keywords override P2PW_ settings (see p2pweights.settings).
    """

    def __init__(self, model: Any, *, sender_index: int = 0, num_senders: int = 1, pp_stage: int = 0,
                 pp_size: int = 1, replicas: Any = None, **overrides: Any):
        from ..replica import ModelReplicas
        from ..models.checkpoint import load_config

        if not 0 <= sender_index < num_senders:
            raise ValueError(f"sender_index {sender_index} is not in [0, num_senders={num_senders})")
        if not 0 <= pp_stage < pp_size:
            raise ValueError(f"pp_stage {pp_stage} is not in [0, pp_size={pp_size})")
        self.model = model
        self.config = load_config(model)
        self.sender_index, self.num_senders = sender_index, num_senders
        self.pp_stage, self.pp_size = pp_stage, pp_size
        self.settings: Settings = settings(**overrides)
        self.replicas = replicas if replicas is not None else ModelReplicas()
        self._transport = None
        self._buffers: TransferBuffers | None = None
        self._writer: PipelinedWriter | None = None
        self._staging: GpuStaging | None = None  # for host slots fed from GPU tensors (made on first use)
        self._prepared: list[_Prepared] = []
        self._engines: list[SglangEngine] = []
        self._next_writer_id = 0
        self._closed = False

    # -- connect ---------------------------------------------------------------------------------
    @property
    def engines(self) -> list[SglangEngine]:
        return list(self._engines)

    def connect(self, engines: Sequence[SglangEngine | str]) -> None:
        """Plan, build (or reuse) replicas, connect every target engine rank. Call again with a new
        engine list (or after an engine restarted): replicas are reused, connections rebuilt."""
        if self._closed:
            raise P2PWeightsError("WeightSender is closed")
        clients = [e if isinstance(e, SglangEngine) else SglangEngine(e) for e in engines]
        from ..replica.layout import EngineLayout

        layouts = [EngineLayout.from_server_info(c.server_info()) for c in clients]
        plan = assign_engine_ranks(self.num_senders, [PlanEngine(l.world_size, l.key) for l in layouts])
        mine = [p for p in plan if p.sender == self.sender_index]
        self._disconnect_all()
        prepared: list[_Prepared] = []
        for entry in mine:
            layout = layouts[entry.engines[0]]
            replica = self.replicas.get(self.model, layout, entry.engine_rank)
            expected = stage_hf_names(replica.hf_specs, int(self.config["num_hidden_layers"]), self.pp_stage, self.pp_size)
            stager = GroupStager([g.hf_names for g in replica.groups], replica.hf_specs, expected,
                                 where=f"{layout.describe()} rank {entry.engine_rank}")
            prepared.append(_Prepared(layout.key, entry.engine_rank, replica, stager))
        largest = max((max((g.nbytes for g in p.replica.groups), default=0) for p in prepared), default=0)
        self._ensure_buffers(largest)
        for p, entry in zip(prepared, mine):
            for e in entry.engines:
                client = clients[e]
                pub = EnginePublication.from_json(client.transfer_engine_info(entry.engine_rank))
                self._check_publication(p, client, pub)
                target = _Target(client, entry.engine_rank, self._next_writer_id, pub)
                self._next_writer_id += 1
                transports.attach_engine(self._transport, self._writer, target.writer_id, target.name, pub)
                p.targets.append(target)
        self._prepared = prepared
        self._engines = clients

    def _check_publication(self, p: _Prepared, client: SglangEngine, pub: EnginePublication) -> None:
        pub.check_transport(self.settings.transport, engine=client.name)
        missing = [n for n in p.replica.param_specs if n not in pub.params]
        if missing:
            raise LayoutMismatch(
                f"engine '{client.name}' rank {p.rank} published no region for {len(missing)} parameter(s) of its "
                f"layout, e.g. {missing[0]!r}; is it serving the same model and flags ({client.base_url})?")
        for name, spec in p.replica.param_specs.items():
            pub.target(name, spec.nbytes, engine=f"{client.name} rank {p.rank}")

    def _ensure_buffers(self, largest_group: int) -> None:
        need = slot_size(self.settings.buffer_size, largest_group)
        if self._buffers is not None and self._buffers.slot_bytes >= need:
            return
        if self._buffers is not None:
            # Slots must grow: this only happens when a new, larger layout joins.
            self._writer.close()
            self._transport.deregister_memory(self._buffers.address)
            self._buffers.close()
        if self._transport is None:
            self._transport = transports.make_sender_transport(self.settings.transport)
        self._buffers = TransferBuffers(need, self.settings.num_slots, pin=self.settings.pin,
                                        device=self.settings.buffer_device)
        self._transport.register_memory(self._buffers.address, self._buffers.total_bytes, self._buffers.location)
        self._writer = PipelinedWriter(self._transport, self._buffers, transfer_timeout=self.settings.transfer_timeout)

    def _staging_for(self, device: Any) -> GpuStaging:
        if self._staging is None or not self._staging.fits(self._buffers.slot_bytes, device):
            if self._staging is not None:
                self._staging.synchronize()
            self._staging = GpuStaging(self._buffers.slot_bytes, device)
        return self._staging

    def _disconnect_all(self) -> None:
        for p in self._prepared:
            for t in p.targets:
                try:
                    transports.detach_engine(self._transport, self._writer, t.writer_id)
                except P2PWeightsError:
                    pass  # already gone
        self._prepared = []

    # -- update ----------------------------------------------------------------------------------
    def update(self, version: Any, *, control: bool = True) -> "Update":
        """An update as a context manager. control=True drives the engines' update session
        (pause, begin; end, version, continue on success) — leave it to one coordinator when
        several senders write to the same engines (control=False on the others)."""
        if not self._prepared:
            raise P2PWeightsError("connect(engines) before update()")
        return Update(self, version, control)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._disconnect_all()
        if self._writer is not None:
            self._writer.close()
        if self._transport is not None:
            self._transport.close()
        if self._buffers is not None:
            self._buffers.close()
        self._staging = None

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("WeightSender was not closed; call close()", ResourceWarning, stacklevel=2)


class Update:
    """One weight update in flight: push() every HF tensor of this sender's stage, then finish()."""

    def __init__(self, sender: WeightSender, version: Any, control: bool):
        self._s = sender
        self.version = str(version)
        self._control = control
        self._session: UpdateSession | None = None
        self.report: UpdateReport | None = None
        # the slot being filled: a host or GPU transfer slot, or (host slots fed from GPU tensors)
        # a GPU staging buffer that gets a host slot only when it is copied out
        self._open = False
        self._staged = False
        self._slot: int | None = None  # the transfer slot, when not staged
        self._target = None  # the tensor this slot's loaders write into
        self._cursor = 0
        self._rows: list[tuple[int, int, int, int]] = []
        self._placed: list[tuple[_Prepared, Any, int, dict[str, Any]]] = []  # groups placed, not yet loaded
        self._placed_input_bytes = 0  # each placed HF tensor once, however many engine ranks read it
        self._placed_inputs: set[int] = set()
        self._staged_extent = 0  # bytes of the staging buffer loaded so far
        self._copied = 0  # of which queued for copy-out into the host slot
        self._last_copy = None  # the event of the slot's latest copy-out
        # (slot, writes, CUDA event): a complete slot whose device work is still in flight
        self._pending: tuple[int, list, Any] | None = None
        self._groups = self._slots = 0
        self._t_stage = self._t_load = self._t_wait = self._t_control = 0.0
        self._finished = False
        for p in sender._prepared:
            p.stager.reset()
        if control:
            t0 = time.perf_counter()
            self._session = UpdateSession(sender.engines, self.version)
            self._session.open()  # pause + begin
            self._t_control += time.perf_counter() - t0
        # The time users care about runs from pause_generation returning to the update returning.
        self._t0 = self._session.paused_at if self._session is not None else time.perf_counter()

    def __enter__(self) -> "Update":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        elif not self._finished:
            self._abort(f"{exc_type.__name__}: {exc}")

    def push(self, hf_name: str, tensor: Any) -> None:
        """Stage one full HF tensor (CPU or GPU, any order); complete groups are loaded at once."""
        t0 = time.perf_counter()
        completed = []
        for p in self._s._prepared:
            done = p.stager.push(hf_name, tensor)
            if done is not None:
                completed.append((p, done))
        self._t_stage += time.perf_counter() - t0
        for p, (group_index, tensors) in completed:
            self._load(p, p.replica.groups[group_index], tensors)

    def push_many(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        for name, t in named_tensors:
            self.push(name, t)

    def _load(self, p: _Prepared, group: Any, tensors: dict[str, Any]) -> None:
        """Place a complete group in the current slot. Its loaders run later, together with the
        slot's other groups (one load_weights call per batch: sglang's loaders pay a fixed cost
        per call); a batch is loaded when the slot is full or its HF inputs reach a slot's size."""
        w = self._s._writer
        if self._open and self._cursor + group.nbytes > w.buffers.slot_bytes:
            self._submit()
        if not self._open:
            self._open_slot(tensors)
        self._placed.append((p, group, self._cursor, tensors))
        for t in tensors.values():
            if id(t) not in self._placed_inputs:
                self._placed_inputs.add(id(t))
                self._placed_input_bytes += int(t.numel()) * t.element_size()
        self._cursor = -(-(self._cursor + group.nbytes) // 256) * 256
        self._groups += 1
        # staged slots load (and copy out) in quarters, so the D2H of one batch overlaps the next
        if self._placed_input_bytes >= (w.buffers.slot_bytes // 4 if self._staged else w.buffers.slot_bytes):
            self._load_placed()

    def _open_slot(self, some_inputs: dict[str, Any]) -> None:
        """Pick where this slot's loaders write: the transfer slot itself, or, for host slots fed
        from GPU tensors, a GPU staging buffer (staging.py) copied out asynchronously."""
        s = self._s
        w = s._writer
        first = next(iter(some_inputs.values()))
        self._staged = w.buffers.device == "cpu" and bool(getattr(first, "is_cuda", False))
        t0 = time.perf_counter()
        if self._staged:
            self._target = s._staging_for(first.device).target()
            self._t_load += time.perf_counter() - t0
        else:
            if self._pending is not None and w.buffers.num_slots < 2:
                self._flush_pending()  # one slot only: the pending slot holds it
                t0 = time.perf_counter()
            self._slot = w.acquire()
            self._t_wait += time.perf_counter() - t0
            self._target = w.buffers.slot_tensor(self._slot)
        self._open, self._cursor, self._staged_extent, self._copied = True, 0, 0, 0

    def _load_placed(self) -> None:
        """Run the loaders of every placed group (one call per prepared engine rank) and queue
        their writes to every engine of that rank."""
        if not self._placed:
            return
        if self._pending is not None and self._pending[2].query():
            self._flush_pending()  # its device work is done: the writer may start on it
        t0 = time.perf_counter()
        by_rank: dict[int, tuple[_Prepared, list, dict]] = {}
        for p, group, offset, tensors in self._placed:
            entry = by_rank.setdefault(id(p), (p, [], {}))
            entry[1].append((group, offset))
            entry[2].update(tensors)
        loaded = [(p, p.replica.load_groups(placed, tensors, self._target)) for p, placed, tensors in by_rank.values()]
        self._staged_extent = max(self._staged_extent, max(r.offset + r.nbytes for _, regs in loaded for r in regs))
        self._t_load += time.perf_counter() - t0
        t0 = time.perf_counter()
        for p, regions in loaded:
            entries = [(r.param_name, r.offset, r.nbytes) for r in regions]
            for t in p.targets:
                self._rows += transports.param_writes(t.publication, t.writer_id, t.name, entries)
        self._placed, self._placed_input_bytes, self._placed_inputs = [], 0, set()
        self._t_stage += time.perf_counter() - t0
        if self._staged:
            self._copy_out_staged()

    def _copy_out_staged(self) -> None:
        """Queue the D2H of what the loaders just wrote into the staging buffer; the host slot is
        taken at the slot's first copy. A staged slot whose copies landed goes to the writer now."""
        w = self._s._writer
        if self._slot is None:
            if self._pending is not None and w.buffers.num_slots < 2:
                self._flush_pending()  # one slot only: the pending copy holds it
            t0 = time.perf_counter()
            self._slot = w.acquire()
            self._t_wait += time.perf_counter() - t0
        t0 = time.perf_counter()
        self._last_copy = self._s._staging.copy_out(w.buffers.slot_tensor(self._slot), self._copied, self._staged_extent)
        self._copied = self._staged_extent
        self._t_load += time.perf_counter() - t0

    def _submit(self) -> None:
        """Close the current slot: load what is placed, hand the slot to the writer (staged: queue
        its D2H and hand over the previous staged slot, whose copy ran during this slot's loaders)."""
        if not self._open:
            return
        self._load_placed()
        w = self._s._writer
        rows, self._rows = self._rows, []
        if self._staged:
            self._s._staging.advance()
            if self._slot is not None:
                self._flush_pending()  # the previous staged slot's copies ran during this slot's loaders
                if rows:
                    self._pending = (self._slot, rows, self._last_copy)
                else:
                    self._last_copy.synchronize()
                    w.release_slot(self._slot)
        elif self._target is not None and self._target.is_cuda and rows:
            # GPU slot: the NIC may read it once the loaders' kernels ran; hand it over when they
            # did (checked at the next load), not by blocking now, so the next slot's loaders
            # (Python on the CPU) overlap this slot's copies on the GPU
            import torch

            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self._target.device))
            self._flush_pending()
            self._pending = (self._slot, rows, done)
        elif rows:
            w.submit(self._slot, rows)
            self._slots += 1
        else:
            w.release_slot(self._slot)
        self._open, self._staged, self._slot, self._target, self._last_copy = False, False, None, None, None

    def _flush_pending(self) -> None:
        """Hand the slot whose device work (staged D2H, or the loaders' kernels into a GPU slot)
        is in flight to the writer, once it is done."""
        if self._pending is None:
            return
        slot, rows, done = self._pending
        self._pending = None
        t0 = time.perf_counter()
        try:
            done.synchronize()
        except BaseException:
            self._s._writer.release_slot(slot)
            raise
        self._t_load += time.perf_counter() - t0
        self._s._writer.submit(slot, rows)
        self._slots += 1

    def finish(self) -> UpdateReport:
        """Waits for every write; then (with control) ends the update and bumps the version on every
        engine. Raises MissingTensors or UpdateFailed (naming each failed engine) otherwise."""
        if self._finished:
            if self.report is None:
                raise P2PWeightsError("this update already failed")
            return self.report
        w = self._s._writer
        try:
            for p in self._s._prepared:
                p.stager.check_complete()
            self._submit()
            self._flush_pending()
        except BaseException as e:
            self._abort(str(e))
            raise
        t0 = time.perf_counter()
        rep: WriteReport = w.finish(raise_on_failure=False)
        self._t_wait += time.perf_counter() - t0
        if rep.failures:
            self._abort("; ".join(f"{n}: {why}" for n, why in rep.failures.items()))
            raise UpdateFailed(rep.failures, rep)
        write_seconds = max((e.seconds for e in rep.engines), default=0.0)
        data_seconds = time.perf_counter() - self._t0
        if self._session is not None:
            t0 = time.perf_counter()
            self._session.commit()  # end_weight_update, update_weight_version, continue_generation
            self._t_control += time.perf_counter() - t0
        seconds = time.perf_counter() - self._t0
        self._finished = True
        by_id = {e.engine: e for e in rep.engines}
        engines = []
        for p in self._s._prepared:
            for t in p.targets:
                e = by_id[t.writer_id]
                engines.append(EngineRankReport(t.engine.name, t.rank, e.bytes, e.seconds, e.gbps, e.state, e.error))
        self.report = UpdateReport(self.version, seconds, rep.bytes, self._groups, self._slots, self._t_stage,
                                   self._t_load, write_seconds, self._t_wait, self._t_control, engines,
                                   data_seconds)
        return self.report

    def _abort(self, reason: str) -> None:
        self._finished = True
        w = self._s._writer
        self._placed, self._placed_input_bytes, self._placed_inputs = [], 0, set()
        if self._open and self._slot is not None:
            if self._last_copy is not None:
                self._last_copy.synchronize()  # a queued D2H must land before the slot is reused
            w.release_slot(self._slot)
        self._open, self._slot, self._last_copy = False, None, None
        if self._pending is not None:
            slot, _, done = self._pending
            self._pending = None
            try:
                done.synchronize()  # the D2H must not land in a slot the writer hands out again
            finally:
                w.release_slot(slot)
        w.finish(raise_on_failure=False)  # every write returned before the slots are reused
        if self._session is not None:
            self._session.abort(reason)
