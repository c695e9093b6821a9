"""The sender's slot pipeline in one process: each slot filler, the transform hook, the two-way
publication check, one replica per shard layout for every sender of a process, and a failed
connect that leaves nothing behind.

The fillers run against the loopback transport (the engine's memory is a local tensor); the
WeightSender tests against in-process engines whose ranks publish real Mooncake regions on
127.0.0.1. Every byte an engine rank receives is compared with what the replica's own loaders
make of the same HF tensors (tests/test_e2e.py compares that with sglang's own load).
"""
from __future__ import annotations

import pytest
import torch

from p2pweights import _native
from p2pweights.control import SglangEngine
from p2pweights.errors import LayoutMismatch, P2PWeightsError
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.replica import EngineLayout, model_replicas, parse_engine_spec
from p2pweights.sender import WeightSender
from p2pweights.sender.buffers import TransferBuffers, slot_size
from p2pweights.sender.fillers import GpuSlotFiller, HostSlotFiller, SlotHandOver, StagedHostSlotFiller
from p2pweights.sender.pipeline import SlotPipeline
from p2pweights.sender.prepared import EngineTarget, PreparedRank
from p2pweights.sender.report import UpdateTimes
from p2pweights.sender.stager import GroupStager
from p2pweights.sender.transforms import GroupLoad, GroupTransform
from p2pweights.sender.writer import PipelinedWriter
from p2pweights.transport import make_receiver_endpoint, params_table
from p2pweights.transport.publication import EnginePublication
from replica_configs import write_config

ALIGN = 256


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    # slots of 2 MiB; one engine rank of tp=2 holds about 7 MiB: several slots per update
    return write_config("qwen3", str(tmp_path_factory.mktemp("pipeline")), hidden_size=256, intermediate_size=768,
                        num_hidden_layers=8, vocab_size=4096)


def _param_memory(specs):
    """One zeroed uint8 region holding every parameter at 256-byte aligned offsets, and the views."""
    offsets, total = {}, 0
    for name, spec in specs.items():
        offsets[name] = total
        total = -(-(total + spec.nbytes) // ALIGN) * ALIGN
    region = torch.zeros(max(total, 1), dtype=torch.uint8)
    views = {n: region[o:o + specs[n].nbytes] for n, o in offsets.items()}
    return region, views


def _reference(replica, tensors):
    """{param: bytes} the replica's loaders make of ``tensors`` (every group in one buffer)."""
    placed, off = [], 0
    for g in replica.groups:
        placed.append((g, off))
        off = -(-(off + g.nbytes) // ALIGN) * ALIGN
    buf = torch.zeros(off, dtype=torch.uint8)
    regions = replica.load_groups(placed, {n: tensors[n] for g in replica.groups for n in g.hf_names}, buf)
    return {r.param_name: buf[r.offset:r.offset + r.nbytes].clone() for r in regions}


def _assert_bytes_equal(views, expected, where):
    wrong = [n for n, b in expected.items() if not torch.equal(views[n], b)]
    assert not wrong, f"{where}: {len(wrong)} parameter(s) differ, e.g. {wrong[:3]}"


# -- fillers, against the loopback transport ---------------------------------------------------------
class _Event:
    """A stand-in CUDA event: not done until synchronized; ``work`` runs then (stream order)."""

    def __init__(self, stream=None, work=None):
        self.done, self._stream, self._work = False, stream, work

    def query(self):
        return self.done

    def synchronize(self):
        if self._stream is not None:
            self._stream.run_until(self)
        self.done = True


class _FakeStream:
    def __init__(self):
        self.queued = []

    def run_until(self, event):
        while self.queued:
            e = self.queued.pop(0)
            e._work()
            e.done = True
            if e is event:
                return


class _FakeStaging:
    """GpuStaging's contract on the CPU: a D2H copy queued by copy_out lands only when its event
    (or a later one) is synchronized, so a slot handed to the writer too early carries stale bytes."""

    def __init__(self, nbytes, depth=2):
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(depth)]
        self.stream = _FakeStream()
        self._copies = [None] * depth
        self._next = 0

    def target(self):
        if self._copies[self._next] is not None:
            self._copies[self._next].synchronize()
            self._copies[self._next] = None
        return self.buffers[self._next]

    def copy_out(self, host, start, end):
        buf = self.buffers[self._next]

        def work():
            host[start:end].copy_(buf[start:end])

        done = _Event(self.stream, work)
        done.host = host.data_ptr()
        self.stream.queued.append(done)
        self._copies[self._next] = done
        return done

    def advance(self):
        self._next = (self._next + 1) % len(self.buffers)


class _CheckedWriter(PipelinedWriter):
    """A writer that asserts a slot's device work was done before the slot was submitted."""

    ready = staticmethod(lambda slot: True)

    def submit(self, slot, writes):
        assert self.ready(slot), f"slot {slot} reached the writer before its device work was done"
        super().submit(slot, writes)


@pytest.mark.parametrize("num_slots", [2, 1])
@pytest.mark.parametrize("mode", ["host", "gpu", "staged"])
def test_each_slot_filler_delivers_the_loaders_bytes_after_its_device_work(cfg, mode, num_slots):
    """Host, GPU (CUDA-event hand-over) and staged (D2H copy-out) fillers, with stand-in events on
    the CPU: every engine byte equals the loaders' output, no slot reaches the writer before its
    event fired, and one slot does not deadlock."""
    layout = EngineLayout.parse("tp=2")
    replica = model_replicas().get(cfg, layout, 0)
    tensors = dict(random_checkpoint(replica.hf_specs, 7))
    buffers = TransferBuffers(slot_size(1 << 20, replica.largest_group_nbytes), num_slots, pin="none")
    transport = _native.LoopbackTransport()
    transport.register_memory(buffers.address, buffers.total_bytes)
    writer = _CheckedWriter(transport, buffers, transfer_timeout=10)
    region, views = _param_memory(replica.param_specs)
    pub = EnginePublication.from_json(["loopback", params_table(views.items())])
    try:
        transport.connect(0, "loopback")
        writer.add_engine(0, "fake/rank0", pub.regions)
        target = EngineTarget(SglangEngine("http://fake:1", name="fake"), 0, 0, pub)
        stager = GroupStager([g.hf_names for g in replica.groups], replica.hf_specs)
        rank = PreparedRank(layout.key, 0, replica, stager, [target])
        times = UpdateTimes()
        handover = SlotHandOver(writer, times)

        if mode == "host":
            filler = HostSlotFiller(handover)
        elif mode == "gpu":
            events = []  # one per closed slot, in the order the slots reach the writer
            filler = GpuSlotFiller(handover, record_event=lambda device: events.append(_Event()) or events[-1])
            writer.ready = lambda slot: events.pop(0).done
        else:
            staging = _FakeStaging(buffers.slot_bytes)
            filler = StagedHostSlotFiller(handover, lambda device: staging)
            writer.ready = lambda slot: all(e.host != buffers.slot_address(slot) for e in staging.stream.queued)
        pipeline = SlotPipeline(handover, lambda inputs: filler, times)
        for g in replica.groups:
            pipeline.place(GroupLoad(rank, g, {n: tensors[n] for n in g.hf_names}))
        pipeline.drain()
        report = writer.finish()
        assert report.ok and times.slots > 2 and times.groups == len(replica.groups)
        _assert_bytes_equal(views, _reference(replica, tensors), mode)
    finally:
        writer.close()
        transport.close()
        buffers.close()


# -- WeightSender against in-process engines -------------------------------------------------------
class InProcessEngine(SglangEngine):
    """An engine whose ranks hold their parameters in this process and publish them through real
    Mooncake endpoints; ``doctor`` rewrites what a rank publishes."""

    def __init__(self, cfg, spec, name):
        super().__init__(f"http://{name}.invalid:1", name=name)
        self.layout = EngineLayout.parse(spec)
        import importlib.metadata

        # a real engine reports its sglang build; this one is "the same build" as the sender's replicas
        self._server_info = {**parse_engine_spec(spec), "version": importlib.metadata.version("sglang")}
        self.views, self._regions, self._endpoints, self.doctors = [], [], [], {}
        from p2pweights.replica import ModelReplicas

        engine_side = ModelReplicas()  # the engine's own model, not the sender's replicas
        for rank in range(self.layout.world_size):
            region, views = _param_memory(engine_side.get(cfg, self.layout, rank).param_specs)
            ep = make_receiver_endpoint("mooncake")
            ep.register(region.data_ptr(), region.numel(), "cpu")
            self._regions.append(region)
            self.views.append(views)
            self._endpoints.append(ep)

    def server_info(self):
        return dict(self._server_info)

    def transfer_engine_info(self, rank=0):
        views = self.views[rank]
        d = self._endpoints[rank].publication(params_table(views.items()), rank=rank).to_dict()
        if rank in self.doctors:
            self.doctors[rank](d["remote_instance_transfer_engine_info"][1])
        return d

    def close(self):
        for ep in self._endpoints:
            ep.close()


@pytest.fixture
def engines(cfg):
    made = []

    def make(spec="tp=2", name=None, config=None):
        made.append(InProcessEngine(config or cfg, spec, name or f"engine{len(made)}"))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _update(sender, tensors, version="v1"):
    with sender.update(version, control=False) as u:
        for name, t in tensors.items():
            u.push(name, t)
    return u.report


def _check_engine(engine, cfg, tensors):
    for rank in range(engine.layout.world_size):
        expected = _reference(model_replicas().get(cfg, engine.layout, rank), tensors)
        _assert_bytes_equal(engine.views[rank], expected, f"{engine.name} rank {rank}")


class CountGroups(GroupTransform):
    def __init__(self):
        self.seen = []

    def __call__(self, load):
        self.seen.append((load.rank.rank, load.group.index))
        return (load,)


class NormToOnes(GroupTransform):
    """Rewrites one HF tensor: the engine must receive what the loaders make of the new value."""

    def __call__(self, load):
        if "model.norm.weight" in load.tensors:
            load = GroupLoad(load.rank, load.group, {**load.tensors, "model.norm.weight":
                                                     torch.ones_like(load.tensors["model.norm.weight"])})
        return (load,)


class FanOutToRank1(GroupTransform):
    """Feeds engine rank 1 from rank 0's staged groups (as a draft role will be fed): one staged
    group becomes two (replica, targets) work items; rank 1's own staged groups are dropped."""

    def connect(self, ranks):
        self.rank1 = next(p for p in ranks if p.rank == 1)

    def __call__(self, load):
        if load.rank is self.rank1:
            return ()
        group1 = self.rank1.replica.group_of(next(iter(load.tensors)))
        return (load, GroupLoad(self.rank1, group1, {n: load.tensors[n] for n in group1.hf_names}))


def test_a_transform_sees_every_group_and_the_engine_gets_what_it_made(cfg, engines):
    engine = engines()
    tensors = dict(random_checkpoint(checkpoint_tensors(cfg), 3))
    count = CountGroups()
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, transforms=[count, NormToOnes()]) as sender:
        sender.connect([engine])
        report = _update(sender, tensors)
        assert report.groups == len(count.seen)
        assert sorted(count.seen) == sorted((p.rank, g.index) for p in sender.prepared for g in p.replica.groups)
    rewritten = {**tensors, "model.norm.weight": torch.ones_like(tensors["model.norm.weight"])}
    _check_engine(engine, cfg, rewritten)
    norm = engine.views[0]["model.norm.weight"].view(torch.bfloat16)
    assert torch.equal(norm, torch.ones_like(norm))


def test_a_transform_can_fan_one_staged_group_out_to_another_replica(cfg, engines):
    engine = engines()
    tensors = dict(random_checkpoint(checkpoint_tensors(cfg), 4))
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, transforms=[FanOutToRank1()]) as sender:
        sender.connect([engine])
        _update(sender, tensors)
    _check_engine(engine, cfg, tensors)


# -- defect c: the publication check is two-way --------------------------------------------------
@pytest.mark.parametrize("doctor, match", [
    (lambda table: table.__setitem__("model.layers.0.mlp.extra.weight", [1 << 20, 8, 2]), "no such parameter"),
    (lambda table: table["model.norm.weight"].__setitem__(1, table["model.norm.weight"][1] // 2), "model.norm.weight"),
    (lambda table: table.pop("model.norm.weight"), "not published"),
])
def test_connect_refuses_a_publication_that_differs_from_the_replica_either_way(cfg, engines, doctor, match):
    engine = engines()
    engine.doctors[1] = doctor
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as sender:
        with pytest.raises(LayoutMismatch, match=match) as info:
            sender.connect([engine])
        assert f"{engine.name} rank 1" in str(info.value)


# -- defect d: one replica per shard layout per process --------------------------------------------
def test_two_senders_in_one_process_build_each_replica_once(tmp_path, engines):
    cfg2 = write_config("qwen3", str(tmp_path), vocab_size=320)  # a model no other test built
    engine = engines("tp=2", config=cfg2)
    before = model_replicas().builds
    senders = [WeightSender(cfg2, transport="mooncake", buffer_size=1 << 20) for _ in range(2)]
    try:
        for s in senders:
            s.connect([engine])
        assert model_replicas().builds - before == 2  # engine ranks 0 and 1, once each
        assert all(a.replica is b.replica for a, b in zip(senders[0].prepared, senders[1].prepared))
    finally:
        for s in senders:
            s.close()


# -- defect e: a failed connect leaves nothing behind -----------------------------------------------
def _attached(sender):
    writer_engines = dict(sender._writer._engines) if sender._writer is not None else {}
    peers = dict(sender._transport.backend._peers) if sender._transport is not None else {}
    return writer_engines, peers


def test_a_bad_engine_fails_connect_and_leaves_the_sender_as_it_was(cfg, engines):
    good, bad = engines("tp=2"), engines("tp=2")
    bad.doctors[0] = lambda table: table.__setitem__("model.extra.weight", [1 << 20, 4, 2])
    tensors = dict(random_checkpoint(checkpoint_tensors(cfg), 5))
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as sender:
        with pytest.raises(LayoutMismatch, match="model.extra.weight"):
            sender.connect([good, bad])
        assert _attached(sender) == ({}, {})  # no orphan target, no orphan connection
        sender.connect([good])
        before = _attached(sender)
        with pytest.raises(LayoutMismatch, match="model.extra.weight"):
            sender.connect([good, bad])
        assert _attached(sender) == before and [m.client for m in sender.engines] == [good]  # connected as before
        _update(sender, tensors)
    _check_engine(good, cfg, tensors)


def test_a_connect_that_fails_while_attaching_detaches_what_it_attached(cfg, engines, monkeypatch):
    from p2pweights import transport as transports

    first, second = engines("tp=2"), engines("tp=2")
    real_attach, calls = transports.attach_engine, []

    def attach(*args):
        calls.append(args)
        if len(calls) == 3:
            raise P2PWeightsError("engine rank could not be reached")
        return real_attach(*args)

    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as sender:
        sender.connect([first])
        monkeypatch.setattr(transports, "attach_engine", attach)
        calls.clear()
        with pytest.raises(P2PWeightsError, match="could not be reached"):
            sender.connect([first, second])
        assert _attached(sender) == ({}, {}) and sender.engines == []
        with pytest.raises(P2PWeightsError, match="connect"):
            sender.update("v1")
        monkeypatch.setattr(transports, "attach_engine", real_attach)
        sender.connect([first, second])
        tensors = dict(random_checkpoint(checkpoint_tensors(cfg), 6))
        _update(sender, tensors)
    _check_engine(first, cfg, tensors)
    _check_engine(second, cfg, tensors)


# -- settings reach the transport and the engine clients ------------------------------------------
def test_transport_options_and_engine_timeouts_come_from_the_sender_settings(cfg, engines, monkeypatch):
    from p2pweights import transport as transports

    seen = {}
    real = transports.make_sender_transport

    def make(name=None, **opts):
        seen.update(opts, name=name)
        return real(name, **opts)

    monkeypatch.setattr(transports, "make_sender_transport", make)
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, hostname="127.0.0.1",
                      mooncake_protocol="tcp", engine_timeout=7, engine_connect_timeout=2) as sender:
        sender.connect([engines()])
        assert seen == {"name": "mooncake", "hostname": "127.0.0.1", "protocol": "tcp", "nixl_api": "auto"}
        client = sender._client("http://127.0.0.1:30000")
        assert (client.timeout, client.connect_timeout) == (7, 2)
