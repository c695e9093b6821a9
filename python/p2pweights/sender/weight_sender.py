"""WeightSender: the trainer's API. connect(engines) once, then per training step
``with sender.update(version=step) as update: update.push(hf_name, tensor) ...; print(update.report)``.
Each PP stage and data replica runs its own sender; the senders of one trainer share its group
(``group=``): sender 0 drives the session, the version is bumped after every sender's writes
(group.py). The planner's rule picks the engine ranks it writes. An update runs the slot pipeline
(update.py); a LoRA adapter's update is adapter_update.py's. Engines end the update and bump their
version only after every write succeeded.
"""
from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Sequence

from .. import transport as transports
from ..control import FailurePolicy, SglangEngine
from ..control.lease import new_owner_id
from ..copyplans import PlanRecorder, ReplayOrder
from ..errors import P2PWeightsError, SenderGroupError
from ..models.checkpoint import load_config
from ..models.registry import architecture_of, model_spec
from ..models.stages import check_split, layer_writers, writer_hf_names
from ..settings import Settings, sender_signature, settings
from .adapter_update import AdapterUpdate, SenderAdapters
from .buffers import TransferBuffers, slot_count, slot_size
from .connect_report import ConnectPhases
from .delta_bases import DeltaBases, spare_bytes
from .delta_policy import update_deltas
from .early_slots import EarlySlots
from .gpu_staging import GpuStaging
from .group import SenderGroup
from .inputs import TrainerInputs
from .metrics import metrics_for
from .prepared import EngineTarget, PreparedRank
from .quantize import with_quantize_on_send
from .stager import GroupStager
from .transforms import GroupTransform
from .update import Update
from .verify import check_engines_digest
from .warmup import Warmup
from .writer import PipelinedWriter

if TYPE_CHECKING:
    from .engine_set import EngineMember
    from .join import Join

logger = logging.getLogger(__name__)


class WeightSender:
    """Writes a trainer rank's weights into the engine ranks the planner gives it.

    model: the HF config (directory, config.json path or dict) the engines serve.
    group: the trainer's torch.distributed process group of every sender (gloo or NCCL): sender 0
    of it controls the engines' session, each update waits for every sender's writes before the
    version is bumped, and a failure anywhere fails every sender. Needed with several senders.
    sender_index / num_senders: this rank among the data replicas of its PP stage (default: its
    rank and size in ``group`` when pp_size is 1, else 0 of 1).
    pp_stage / pp_size: the trainer's pipeline stage; the sender pushes only that stage's tensors.
    split: how a stage's senders share the writes: "engine_ranks" (default; each writes whole engine
    ranks, so each is pushed the whole stage) or "layers" (the stage's layers split over them,
    models/stages.py ``writer_of``: each is pushed its layers only and writes them to every engine rank).
    replicas: the ModelReplicas to take replicas from (default: the process-wide one, shared).
    transforms: GroupTransforms run, in order, on every complete parameter group before its loaders
    (an FP8 block-quantized config adds quantize-on-send last, sender/quantize.py).
    metrics: a prometheus_client registry (True: the default one) for update seconds, bytes and
    failures per engine (sender/metrics.py); without prometheus_client, nothing.
    Every other keyword is a ``sender`` setting of p2pweights.settings.REGISTRY (its P2PW_ variable,
    lower case, no prefix: ``copy_threads=2``); ``prepare=True`` (P2PW_PREPARE=1) starts the first
    connect's imports and agent at construction (warmup.py): construct early, connect later.
    """

    def __init__(self, model: Any, *, sender_index: int | None = None, num_senders: int | None = None,
                 pp_stage: int = 0, pp_size: int = 1, replicas: Any = None,
                 transforms: Sequence[GroupTransform] = (), group: Any = None, metrics: Any = None,
                 split: str = "engine_ranks", **overrides: Any):
        from ..replica import model_replicas  # replica/ (~0.1 s of modules) loads here, not at `import p2pweights`

        self.group = SenderGroup(group)
        from_group = group is not None and pp_size == 1
        if sender_index is None:
            sender_index = self.group.index if from_group else 0
        if num_senders is None:
            num_senders = self.group.size if from_group else 1
        if not 0 <= sender_index < num_senders:
            raise ValueError(f"sender_index {sender_index} is not in [0, num_senders={num_senders})")
        if not 0 <= pp_stage < pp_size:
            raise ValueError(f"pp_stage {pp_stage} is not in [0, pp_size={pp_size})")
        self.model = model
        self.config = load_config(model)
        self.split = check_split(split, int(self.config["num_hidden_layers"]), sender_index, num_senders, pp_stage,
                                 pp_size)
        self.sender_index, self.num_senders = sender_index, num_senders
        self.pp_stage, self.pp_size = pp_stage, pp_size
        self.settings: Settings = settings(**overrides)
        self.replicas = replicas if replicas is not None else model_replicas()
        # an FP8 block-quantized config: quantize on send (quantize.py), after the given transforms
        self.transforms: tuple[GroupTransform, ...] = with_quantize_on_send(transforms, self.config)
        self._transport = None
        # the transport the agent is (or is being) made for, and why: an explicit one from the start;
        # ``auto`` resolved at connect, to the one the engines publish for (transport_for_engines)
        self.transport: str | None = None if self.settings.transport == "auto" else self.settings.transport
        self.transport_why = ""
        self._buffers: TransferBuffers | None = None
        self._writer: PipelinedWriter | None = None
        self._staging: GpuStaging | None = None  # for host slots fed from GPU tensors (made on first use)
        self.connect_phases = ConnectPhases()  # seconds per phase and counts of the last connect
        self._early: EarlySlots | None = None  # a cold connect's agent and slots, made while replicas build
        self._ranks: list[PreparedRank] = []
        self._engines: list[SglangEngine] = []  # the engines attached (ready or down), in plan order
        self._members: dict[str, "EngineMember"] = {}  # every engine of the set by name (engine_set.py)
        self._join: "Join | None" = None  # add_engines(wait=False) in progress (join.py)
        self._next_writer_id = 0
        self._closed = False
        self._metrics = metrics_for(metrics)
        self._update: Update | None = None  # the update in flight
        self.recorder: PlanRecorder | None = None  # copy plans recorded off the update path (copyplans)
        # delta="auto": host copies of what this sender wrote, and its engines' commits (delta_writes.py)
        self._bases: DeltaBases | None = DeltaBases() if self.settings.delta != "off" else None
        # how this sender's slots replay copy plans; a path that fails at the driver stays off for it
        self.replay_order = ReplayOrder(threads=self.settings.copy_threads, lanes=self.settings.copy_lanes)
        self.last_version: str | None = None  # of this sender's last complete update
        self.adapters = SenderAdapters()  # LoRA adapters: configs, bases, engines' settings (adapter_update.py)
        self.owner = new_owner_id()  # the owner token (a secret) of every session this sender opens
        # prepare=True: sglang and the model's module imported, the agent made, from now on (warmup.py)
        self._warmup = Warmup(self.config) if self.settings.prepare else None
        if self._warmup is not None:
            if self.transport is None:  # auto, no engine known yet: the local rule (connect may replace it)
                self.transport, self.transport_why = transports.resolve_transport("auto")
            self._early = self._early_slots()

    # -- connect ---------------------------------------------------------------------------------
    @property
    def engines(self) -> list["EngineMember"]:
        """Every engine of the set with its state (``joining``, ``ready``, ``down``, ``failed``; see
        sender/engine_set.py), the last version this sender committed there and why it is down."""
        return list(self._members.values())

    @property
    def prepared(self) -> list[PreparedRank]:
        """The engine ranks this sender prepares, each with its replica and the targets it writes."""
        return list(self._ranks)

    def _client(self, engine: SglangEngine | str) -> SglangEngine:
        if isinstance(engine, SglangEngine):
            if engine.api_key is None:  # a client made without a key gets the sender's (api_key=)
                engine.api_key = self.settings.api_key
            return engine
        return SglangEngine(engine, timeout=self.settings.engine_timeout,
                            connect_timeout=self.settings.engine_connect_timeout, api_key=self.settings.api_key)

    def connect(self, engines: Sequence[SglangEngine | str]) -> None:
        """Plan, build (or reuse) replicas, connect every target engine rank. Call again with a new
        engine list (or after an engine restarted): replicas are reused, connections rebuilt. To
        change the set between updates without touching the engines kept, use :meth:`add_engines`
        and :meth:`remove_engines`.

        Every engine's layout and publication is checked before the current connections are
        touched: a connect that fails there leaves the sender as it was. One that fails while
        attaching detaches what it attached and leaves the sender disconnected. Both re-raise."""
        if self._closed:
            raise P2PWeightsError("WeightSender is closed")
        self._check_between_updates("connect")
        from . import engine_set  # replica/ (engine_identity, vLLM's layouts), not at `import p2pweights`

        self.connect_phases = ConnectPhases(self.replicas)
        if self.transport is not None and self._transport is None and self._early is None:
            self._early = self._early_slots()  # cold: agent (GPU slots) beside the replicas
        surveys, transport, why = engine_set.survey_engines(self, [self._client(e) for e in engines])
        if self.transport is None:  # cold auto sender: the agent for the engines' transport
            self.transport, self.transport_why = transport, why
            self._early = self._early_slots()
        before, self._members = self._members, {}
        try:
            engine_set.apply_engine_set(self, surveys, transport, why, incremental=False)
        except BaseException:
            if self._engines:  # refused before anything was touched: the set as it was
                self._members = before
            raise
        self._start_recorder()
        self.connect_phases.done()

    def add_engines(self, engines: Sequence[SglangEngine | str], *, wait: bool = True) -> None:
        """Engines join between updates; those kept stay attached (their deltas go on), each new one's
        first update writes it in full. ``wait=False``: read, check and plan them on a thread while
        updates go on (``joining``); the first update after that attaches them (with a group: once
        every sender has them ready; each adds the same engines in the same order). A refused join
        raises here (``wait``) or leaves the engine ``failed`` with the reason (``sender.engines``)."""
        self._check_between_updates("add_engines")
        from . import engine_set
        from .join import Join, prepare_join

        clients = [self._client(e) for e in engines]
        taken = [c.name for c in clients if c.name in self._members and self._members[c.name].state != engine_set.FAILED]
        if taken or len({c.name for c in clients}) != len(clients):
            raise ValueError(f"add_engines: engine name(s) {taken or [c.name for c in clients]} already in the set "
                             f"or repeated; each engine needs its own name (SglangEngine(url, name=...))")
        if not self._engines:
            raise P2PWeightsError("connect(engines) before add_engines()")
        joining = [engine_set.EngineMember(c) for c in clients]
        for m in joining:
            self._members[m.name] = m
        if wait:
            try:
                prepare_join(self, joining)
                surveys = [m.survey for m in self._members.values()
                           if m.survey is not None and m.state != engine_set.FAILED]
                engine_set.apply_engine_set(self, surveys, self.transport, self.transport_why, incremental=True)
            except BaseException:
                for m in joining:
                    self._members.pop(m.name, None)
                raise
            self._start_recorder()
            return
        if self._join is not None and not self._join.done():
            self._join.wait()  # one join at a time: the earlier one's engines first
        self._join = Join(self, joining)

    def remove_engines(self, engines: Sequence[SglangEngine | str]) -> None:
        """Engines leave the set between updates: their ranks are detached and the plan recomputed
        for the rest (a rank newly given to this sender is attached; the others stay attached).
        Every sender of a group removes the same engines."""
        self._check_between_updates("remove_engines")
        from . import engine_set

        names = {e.name if isinstance(e, SglangEngine) else self._client(e).name for e in engines}
        unknown = names - set(self._members)
        if unknown:
            raise ValueError(f"remove_engines: no engine named {sorted(unknown)} in the set "
                             f"({', '.join(self._members) or 'none'})")
        gone = [self._members.pop(n) for n in names]
        surveys = [m.survey for m in self._members.values()
                   if m.state in (engine_set.READY, engine_set.DOWN) and m.survey is not None]
        if not surveys:
            self._disconnect_all()
            return
        try:
            engine_set.apply_engine_set(self, surveys, self.transport, self.transport_why, incremental=True)
        except BaseException:
            for m in gone:
                self._members[m.name] = m
            raise
        self._start_recorder()

    def _check_between_updates(self, what: str) -> None:
        if self._updating():
            raise P2PWeightsError(f"{what}() while update {self._update.version} is in flight; finish it first")

    def _start_recorder(self) -> None:
        if self.settings.copy_plans == "background" and self._ranks:
            if self.recorder is not None:
                self.recorder.stop(timeout=0)
            self.recorder = PlanRecorder(self._ranks, self.settings.buffer_device, busy=self._updating).start()

    def _prepare(self, layout: Any, rank: int) -> PreparedRank:
        from .engine_kinds import rank_replica_of

        # an engine running a draft: its target and draft roles joined (replica/roles.py), so every
        # weight each role's loader loads goes to that role's published regions ("draft." names)
        replica = rank_replica_of(self.replicas, self.model, layout, rank)  # a vLLM engine's: VllmReplicas
        expected = writer_hf_names(replica.hf_specs, int(self.config["num_hidden_layers"]), self.pp_stage, self.pp_size,
                                   *self.writer_in_stage())
        stager = GroupStager([g.hf_names for g in replica.groups], replica.hf_specs, expected,
                             where=f"{layout.describe()} rank {rank}")
        return PreparedRank(layout.key, rank, replica, stager)

    def _ensure_buffers(self, largest_group: int) -> None:
        need = slot_size(self.settings.buffer_size, largest_group)
        if self._early is not None:  # made while the replicas built (early_slots.py)
            early, self._early = self._early, None
            self._transport, self._buffers = early.take()
            if self._buffers is not None:
                self._writer = PipelinedWriter(self._transport, self._buffers,
                                               transfer_timeout=self.settings.transfer_timeout)
            self.connect_phases.overlapped(early.seconds)
        spare = spare_bytes(need, self._bases)
        if self._buffers is not None and self._buffers.slot_bytes >= need and self._buffers.spare_bytes >= spare:
            return
        if self._buffers is not None:
            # Slots must grow: this only happens when a new, larger layout joins.
            self._writer.close()
            self._transport.deregister_memory(self._buffers.address)
            self._buffers.close()
        phases = self.connect_phases
        if self._transport is None:
            self._transport = self._make_transport()
            phases.count("agents created")
        phases.lap("transport agent")
        self._buffers = TransferBuffers(need, slot_count(self.settings), pin=self.settings.pin,
                                        device=self.settings.buffer_device, spare_bytes=spare)
        phases.lap("buffer allocation + pinning")
        self._transport.register_memory(self._buffers.address, self._buffers.total_bytes, self._buffers.location)
        phases.count("registrations")
        phases.lap("registration")
        self._writer = PipelinedWriter(self._transport, self._buffers, transfer_timeout=self.settings.transfer_timeout)

    def _wait_for_warmup(self, layouts: list[Any], mine: list[Any]) -> None:
        """prepare=True (warmup.py): a connect that builds a replica waits for the warm-up's import
        and raises its failure; one whose replicas are all cached (process or disk) needs no sglang
        and waits only for a warm-up already done (its failure raised), else leaves it running."""
        warmup = self._warmup
        if warmup is None or all(getattr(layouts[e.engines[0]], "kind", "") == "vllm" for e in mine):
            return  # none, or vLLM replicas only: they need none of sglang's imports (a later connect may)
        from ..replica.roles import roles_of

        cached = getattr(self.replicas, "cached", None)
        builds = cached is None or not all(cached(self.model, layouts[e.engines[0]], e.engine_rank, role)
                                           for e in mine for role in roles_of(self.model, layouts[e.engines[0]]))
        if builds or warmup.done():
            self._warmup = None
            warmup.wait()
            self.connect_phases.lap("waiting for warm-up")

    def _early_slots(self) -> EarlySlots:
        need = slot_size(self.settings.buffer_size)
        return EarlySlots(self._make_transport, need, slot_count(self.settings), pin=self.settings.pin,
                          device=self.settings.buffer_device, spare_bytes=spare_bytes(need, self._bases))

    def _make_transport(self) -> Any:
        return transports.make_sender_transport(self.transport, nixl_api=self.settings.nixl_api,
                                                **self.settings.transport_options(self.transport))

    def _drop_transport(self) -> None:
        """Close the agent, the slots and the writer (an auto sender moving to engines of the other
        transport); the next _ensure_buffers makes them again. Called with no engine attached."""
        if self._early is not None:
            self._early.discard()
            self._early = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._transport is not None:
            if self._buffers is not None:
                self._transport.deregister_memory(self._buffers.address)
            self._transport.close()
            self._transport = None
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None

    def _staging_for(self, device: Any) -> GpuStaging:
        if self._staging is None or not self._staging.fits(self._buffers.slot_bytes, device):
            if self._staging is not None:
                self._staging.synchronize()
            self._staging = GpuStaging(self._buffers.slot_bytes, device)
        return self._staging

    def _detach(self, targets: Sequence[EngineTarget]) -> None:
        for t in targets:
            try:
                transports.detach_engine(self._transport, self._writer, t.writer_id)
            except P2PWeightsError:
                pass  # already gone

    def _updating(self) -> bool:
        return self._update is not None and self._update._phase in ("new", "opening", "open")

    def _disconnect_all(self, wait: bool = True) -> None:
        if self.recorder is not None:
            # a reconnect does not wait for the group being recorded (seconds for a large one on
            # a CPU): the old recorder ends after it; its plan is the replica's, still valid
            self.recorder.stop(timeout=60.0 if wait else 0)
            self.recorder = None
        self._detach([t for p in self._ranks for t in p.targets])
        self._ranks, self._engines = [], []

    # -- update ----------------------------------------------------------------------------------
    def update(self, version: Any, *, control: bool = True, pause_mode: str = "abort",
               on_failure: str | FailurePolicy = FailurePolicy.RESUME_IF_UNWRITTEN, force: bool = False, cast: bool = False,
               check_finite: bool | None = None, verify: bool | None = None, delta: bool | str = "auto",
               on_engine_down: str | None = None, adapter: str | None = None,
               adapter_config: Any = None) -> Update | AdapterUpdate:
        """An update as a context manager.

        control: drive the engines' session (pause, begin; end, version, continue on success); with
        ``group=``, sender 0 drives it for all (several senders need ``group=``, or control=False).
        pause_mode: sglang's ``pause_generation`` mode (abort, retract, in_place).
        on_failure: a ``control.FailurePolicy`` or its value: "resume_if_unwritten" (default: a failure before
        any write ends the session, no bump, engines resumed) or "leave_paused"; after a write, paused either way.
        force: set ``version`` even if it does not come after this sender's last one and the
        engines' current one (numerically when both are numbers, else it must differ).
        cast: cast pushed tensors of another float dtype to the checkpoint's dtype.
        check_finite: refuse NaN/Inf naming the tensor (default: ``P2PW_CHECK_FINITE``).
        verify: before the session ends, every engine rank written digests what it holds and a
        difference fails the update naming rank and parameter, engines left paused (default:
        ``P2PW_VERIFY``; refused here, before any pause, against engines without the digest route).
        delta: "auto" (default) writes only what changed to engines that prove they hold this sender's
        last commit, the others in full (``report.delta_reason`` says why); False writes everything
        (the sender's bases are still kept). Without bases (``P2PW_DELTA=off``) every update is full.
        on_engine_down: "fail" (an engine that does not answer fails the update, named) or "skip" (it is
        left out, the others commit, ``report.engines_skipped`` names it; default ``P2PW_ENGINE_DOWN``).
        Engines joined by ``add_engines(wait=False)`` and ready are attached here (engine_set.py).
        adapter: a LoRA adapter's name: push its PEFT tensors, written into the slot each engine gave it
        (``adapter_config``: PEFT's LoraConfig, its adapter_config.json or that dict, once; docs/lora.md).

        The version is checked here, before anything else; names, shapes, dtypes, tied names and
        NaN at each push; the engines are paused only at the first push that passed them.
        """
        if not self._engines:
            raise P2PWeightsError("connect(engines) before update()")
        if adapter is not None:  # an adapter is small: NaN is always checked unless turned off here
            return self.adapters.update(self, version, adapter, adapter_config, delta=delta, on_failure=on_failure,
                                        verify=self.settings.verify if verify is None else bool(verify),
                                        check_finite=check_finite is not False, pause_mode=pause_mode)
        if control and self.group.size == 1 and self.num_senders * self.pp_size > 1:
            raise SenderGroupError(
                f"{self.num_senders} sender(s) x {self.pp_size} PP stage(s) with control=True and no group: each "
                f"sender would end the update and bump the version while another still writes",
                hint="pass the trainer's process group: WeightSender(..., group=torch.distributed.group.WORLD) "
                     "(or a coordinator's UpdateSession and update(..., control=False))")
        if self._update is not None and self._update._phase in ("new", "opening", "open"):
            raise P2PWeightsError(f"update {self._update.version} of this sender is still in flight; finish it "
                                  f"(or leave its with-block) before update({version!r})")
        from .join import check_engine_down, update_set

        verify = self.settings.verify if verify is None else bool(verify)
        check_finite = self.settings.check_finite if check_finite is None else check_finite
        down = check_engine_down(self.settings.engine_down if on_engine_down is None else on_engine_down)
        ranks, engines, skipped = update_set(self, down if control else "fail")
        if verify:
            check_engines_digest(engines)
        specs = {n: s for p in ranks for n, s in p.replica.hf_specs.items()}
        tied = model_spec(architecture_of(self.config)).tied_names(self.config) if self._has_spec() else {}
        inputs = TrainerInputs(specs, tied, cast=cast, check_finite=check_finite,
                               where=f"sender {self.sender_index}")
        self._update = Update(ranks, engines, self._writer, version, control=control,
                              transforms=self.transforms, staging_for=self._staging_for, group=self.group,
                              inputs=inputs, pause_mode=pause_mode, on_failure=on_failure,
                              previous_version=self.last_version, force=force, metrics=self._metrics,
                              on_success=self._updated, verify=verify, owner=self.owner,
                              lease=self.settings.session_lease, copy_plans=self.settings.copy_plans,
                              open_beside_slots=self.settings.open_beside_slots, replay_order=self.replay_order,
                              follow_epochs=self._follow_epochs, deltas=update_deltas(self, delta, control, ranks))
        self._update.engines_skipped, self._update.isolate_failed = skipped, down == "skip" and control
        return self._update

    def writer_in_stage(self) -> tuple[int, int]:
        """(this sender, writers) among the senders splitting its stage's layers for its engine ranks
        (split="layers": models/stages.py ``layer_writers``), else (0, 1): it writes whole engine ranks."""
        if self.split != "layers":
            return 0, 1
        writers, _ = layer_writers(int(self.config["num_hidden_layers"]), self.pp_size, self.pp_stage, self.num_senders)
        return self.sender_index % writers, writers

    def _follow_epochs(self, epochs: dict[str, int], instances: dict[str, str]) -> list[str]:
        from .engine_set import follow_engines

        return follow_engines(self, epochs, instances)

    def _updated(self, update: Update) -> None:
        self.last_version = update.version
        skipped = getattr(update, "engines_skipped", {})
        if update.report is not None:
            update.report.engines_skipped = dict(skipped)
        for e in update._engines:
            if e.name in self._members:
                self._members[e.name].version = update.version
        for name, why in skipped.items():  # left out mid-update (isolate.py): down until it answers again
            if name in self._members:
                self._members[name].state, self._members[name].reason = "down", why

    def _has_spec(self) -> bool:
        try:
            model_spec(architecture_of(self.config))
        except P2PWeightsError:
            return False
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._early is not None:
            self._early.discard()
            self._early = None
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


# help(WeightSender) and editors list every sender setting as a keyword (derived from the registry)
WeightSender.__init__.__signature__ = sender_signature(WeightSender.__init__)  # type: ignore[attr-defined]


__all__ = ["WeightSender"]
