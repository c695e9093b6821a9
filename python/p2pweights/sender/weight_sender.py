"""WeightSender: the trainer's API. connect(engines) once, then per training step::

    with sender.update(version=step) as update:
        for hf_name, tensor in trainer_state_dict_in_hf_names():
            update.push(hf_name, tensor)
    print(update.report)

Each PP stage (and each data replica, ``sender_index`` of ``num_senders``) runs its own sender; the
planner's rule (:func:`p2pweights.planner.assign.assign_engine_ranks`) picks the engine ranks it prepares
and the engines it writes them to. An update runs the slot pipeline (update.py): a parameter group
is staged until complete, transformed (transforms.py), loaded by the replica's own sglang loaders
into a transfer slot (fillers.py, pipeline.py), and full slots go to the native writer while the
next one fills. Engines are told to end the update and bump their version only after every write
succeeded.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

from .. import transport as transports
from ..control import SglangEngine
from ..errors import P2PWeightsError
from ..models.stages import stage_hf_names
from ..planner.assign import Engine as PlanEngine
from ..planner.assign import assign_engine_ranks
from ..settings import Settings, settings
from ..transport.publication import EnginePublication
from .buffers import TransferBuffers, slot_size
from .gpu_staging import GpuStaging
from .prepared import EngineTarget, PreparedRank
from .stager import GroupStager
from .transforms import GroupTransform
from .update import Update
from .writer import PipelinedWriter


class WeightSender:
    """Writes a trainer rank's weights into the engine ranks the planner gives it.

    model: the HF config (directory, config.json path or dict) the engines serve.
    sender_index / num_senders: this rank among the data replicas of its PP stage.
    pp_stage / pp_size: the trainer's pipeline stage; the sender pushes only that stage's tensors.
    replicas: the ModelReplicas to take replicas from (default: the process-wide one, so every
    sender of the process shares one replica per shard layout).
    transforms: GroupTransforms run, in order, on every complete parameter group before its
    loaders (default none: the loaders get the pushed tensors).
    Other keywords override P2PW_ settings (see p2pweights.settings), transport options included.
    """

    def __init__(self, model: Any, *, sender_index: int = 0, num_senders: int = 1, pp_stage: int = 0,
                 pp_size: int = 1, replicas: Any = None, transforms: Sequence[GroupTransform] = (),
                 **overrides: Any):
        from ..models.checkpoint import load_config
        from ..replica import model_replicas

        if not 0 <= sender_index < num_senders:
            raise ValueError(f"sender_index {sender_index} is not in [0, num_senders={num_senders})")
        if not 0 <= pp_stage < pp_size:
            raise ValueError(f"pp_stage {pp_stage} is not in [0, pp_size={pp_size})")
        self.model = model
        self.config = load_config(model)
        self.sender_index, self.num_senders = sender_index, num_senders
        self.pp_stage, self.pp_size = pp_stage, pp_size
        self.settings: Settings = settings(**overrides)
        self.replicas = replicas if replicas is not None else model_replicas()
        self.transforms: tuple[GroupTransform, ...] = tuple(transforms)
        self._transport = None
        self._buffers: TransferBuffers | None = None
        self._writer: PipelinedWriter | None = None
        self._staging: GpuStaging | None = None  # for host slots fed from GPU tensors (made on first use)
        self._ranks: list[PreparedRank] = []
        self._engines: list[SglangEngine] = []
        self._next_writer_id = 0
        self._closed = False

    # -- connect ---------------------------------------------------------------------------------
    @property
    def engines(self) -> list[SglangEngine]:
        return list(self._engines)

    @property
    def prepared(self) -> list[PreparedRank]:
        """The engine ranks this sender prepares, each with its replica and the targets it writes."""
        return list(self._ranks)

    def _client(self, engine: SglangEngine | str) -> SglangEngine:
        if isinstance(engine, SglangEngine):
            return engine
        return SglangEngine(engine, timeout=self.settings.engine_timeout,
                            connect_timeout=self.settings.engine_connect_timeout)

    def connect(self, engines: Sequence[SglangEngine | str]) -> None:
        """Plan, build (or reuse) replicas, connect every target engine rank. Call again with a new
        engine list (or after an engine restarted): replicas are reused, connections rebuilt.

        Every engine's layout and publication is checked before the current connections are
        touched: a connect that fails there leaves the sender as it was. One that fails while
        attaching detaches what it attached and leaves the sender disconnected. Both re-raise."""
        if self._closed:
            raise P2PWeightsError("WeightSender is closed")
        from ..replica.layout import EngineLayout

        clients = [self._client(e) for e in engines]
        layouts = [EngineLayout.from_server_info(c.server_info()) for c in clients]
        plan = assign_engine_ranks(self.num_senders, [PlanEngine(lay.world_size, lay.key) for lay in layouts])
        mine = [p for p in plan if p.sender == self.sender_index]
        ranks = [self._prepare(layouts[entry.engines[0]], entry.engine_rank) for entry in mine]
        publications: list[tuple[PreparedRank, SglangEngine, EnginePublication]] = []
        for p, entry in zip(ranks, mine):
            for e in entry.engines:
                client = clients[e]
                pub = EnginePublication.from_json(client.transfer_engine_info(entry.engine_rank))
                self._check_publication(p, client, pub)
                publications.append((p, client, pub))
        self._disconnect_all()
        attached: list[EngineTarget] = []
        try:
            self._ensure_buffers(max((max((g.nbytes for g in p.replica.groups), default=0) for p in ranks), default=0))
            for p, client, pub in publications:
                target = EngineTarget(client, p.rank, self._next_writer_id, pub)
                self._next_writer_id += 1
                transports.attach_engine(self._transport, self._writer, target.writer_id, target.name, pub)
                attached.append(target)
                p.targets.append(target)
            for transform in self.transforms:
                transform.connect(ranks)
        except BaseException:
            self._detach(attached)
            raise
        self._ranks = ranks
        self._engines = clients

    def _prepare(self, layout: Any, rank: int) -> PreparedRank:
        replica = self.replicas.get(self.model, layout, rank)
        expected = stage_hf_names(replica.hf_specs, int(self.config["num_hidden_layers"]), self.pp_stage, self.pp_size)
        stager = GroupStager([g.hf_names for g in replica.groups], replica.hf_specs, expected,
                             where=f"{layout.describe()} rank {rank}")
        return PreparedRank(layout.key, rank, replica, stager)

    def _check_publication(self, p: PreparedRank, client: SglangEngine, pub: EnginePublication) -> None:
        """Invariant 1, both ways: the engine rank published exactly the replica's parameters, each
        with the replica's byte count, for this sender's transport."""
        pub.check_transport(self.settings.transport, engine=client.name)
        pub.check_params({n: s.nbytes for n, s in p.replica.param_specs.items()},
                         engine=f"{client.name} rank {p.rank}",
                         hint=f"is it serving the same model and flags ({client.base_url})?")

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
            self._transport = transports.make_sender_transport(self.settings.transport,
                                                               **self.settings.transport_options())
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

    def _detach(self, targets: Sequence[EngineTarget]) -> None:
        for t in targets:
            try:
                transports.detach_engine(self._transport, self._writer, t.writer_id)
            except P2PWeightsError:
                pass  # already gone

    def _disconnect_all(self) -> None:
        self._detach([t for p in self._ranks for t in p.targets])
        self._ranks, self._engines = [], []

    # -- update ----------------------------------------------------------------------------------
    def update(self, version: Any, *, control: bool = True) -> Update:
        """An update as a context manager. control=True drives the engines' update session
        (pause, begin; end, version, continue on success) — leave it to one coordinator when
        several senders write to the same engines (control=False on the others)."""
        if not self._ranks:
            raise P2PWeightsError("connect(engines) before update()")
        return Update(self._ranks, self._engines, self._writer, version, control=control,
                      transforms=self.transforms, staging_for=self._staging_for)

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


__all__ = ["WeightSender", "stage_hf_names"]
