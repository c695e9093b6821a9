"""Recorded copy plans (p2pweights.copyplans, sender/slot_producer.py): a group's second load replays its
plan without the loaders and the bytes equal the loaders' byte for byte; a loader that computes
keeps its group on the loader path; a new layout starts without plans; and a real engine updated
three times gets replayed bytes from the second update on. With background recording
(copyplans/background_recorder.py) nothing records on the update path, the recorder never runs a replica's
loaders beside an update, stops on close(), and a broken recorder leaves groups on the loaders.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time

import pytest
import torch

from conftest import shared_model
from p2pweights.control import SglangEngine
from p2pweights.copyplans import NotACopy, PlanRecorder, plan_memory, plans_of, record_group_plan
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.receiver import check_weights_equal, start_engine
from p2pweights.replica import ModelReplicas
from p2pweights.sender import WeightSender
from p2pweights.sender.report import UpdateTimes
from p2pweights.sender.slot_producer import SlotProducer
from replica_configs import write_config

ALIGN = 256
# every model of shared/models at tiny sizes: the architecture and its flags stay, the sizes shrink
_SHRINK = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "head_dim": 16, "vocab_size": 250, "num_experts": 8, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2, "topk_group": 1,
    "max_position_embeddings": 256,
}


def _shrunk(model: str, directory: str) -> str:
    with open(os.path.join(shared_model(model), "config.json")) as f:
        cfg = json.load(f)
    cfg.update({k: v for k, v in _SHRINK.items() if k in cfg})
    cfg["num_key_value_heads"] = 4 if "kv_lora_rank" in cfg else 2
    path = os.path.join(directory, model)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


class _Rank:
    """What the producer needs of a prepared engine rank."""

    def __init__(self, replica):
        self.replica = replica


def _placed(replica):
    placed, off = [], 0
    for g in replica.groups:
        placed.append((g, off))
        off = -(-(off + g.nbytes) // ALIGN) * ALIGN
    return placed, off


def _inputs(replica, seed):
    """This rank's HF inputs (other EP ranks' experts and skipped MTP layers left out)."""
    wanted = {n for g in replica.groups for n in g.hf_names}
    return {n: t for n, t in random_checkpoint(replica.hf_specs, seed) if n in wanted}


def _loader_bytes(replica, tensors):
    """{param: bytes} the replica's loaders make of ``tensors`` (the loader path, no plans)."""
    placed, total = _placed(replica)
    buf = torch.zeros(total, dtype=torch.uint8)
    regions = replica.load_groups(placed, tensors, buf)
    return {r.param_name: buf[r.offset:r.offset + r.nbytes].clone() for r in regions}


def _produce(producer, replica, tensors, stale=0xA5):
    """One update's production of every group into a slot that holds stale bytes."""
    placed, total = _placed(replica)
    slot = torch.full((total,), stale, dtype=torch.uint8)
    regions = producer(_Rank(replica), placed, tensors, slot)
    return {r.param_name: slot[r.offset:r.offset + r.nbytes].clone() for r in regions}


def _assert_equal(got, expected, where):
    assert got.keys() == expected.keys()
    wrong = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert not wrong, f"{where}: {len(wrong)} parameter(s) differ, e.g. {wrong[:3]}"


def _loaders_only_for(replica, allowed, monkeypatch):
    """Fail if the loaders run for a group outside ``allowed`` (group indices)."""
    load_groups = replica.load_groups

    def checked(placed, tensors, slot):
        replayable = [g.index for g, _ in placed if g.index not in allowed]
        assert not replayable, f"the loaders ran for groups {replayable}, which have a plan"
        return load_groups(placed, tensors, slot)

    monkeypatch.setattr(replica, "load_groups", checked)


def _converting(replica):
    """Groups with a parameter of a dtype none of its inputs has (GLM-4's float32 router gate
    loaded from bf16): their loaders convert, so they must stay on the loader path."""
    out = set()
    for g in replica.groups:
        inputs = {replica.hf_specs[n].dtype for n in g.hf_names}
        if any(replica.param_specs[p].dtype not in inputs for p in g.params):
            out.add(g.index)
    return out


CASES = [
    ("qwen3", "tp=2"),  # dense, tied embeddings, KV heads fewer than TP... at tp=4 below
    ("qwen2", "tp=4"),  # replicated KV heads, a vocab TP does not divide (padding rows)
    ("qwen3_moe", "tp=2,ep=2"),
    ("qwen3_moe", "tp=2"),  # experts sharded by TP: column shards of every expert's down_proj
    ("deepseek_v3", "tp=4,ep=4,dp_attention=2"),  # MLA, shared experts, dp attention, an MTP layer skipped
    ("deepseek_v3", "tp=2,enforce_shared_experts_fusion=true"),
    ("glm4_moe", "tp=2"),  # a float32 router gate from a bf16 checkpoint: that group stays on the loaders
    ("shared:qwen3-0.6b", "tp=2"),
    ("shared:qwen3-4b", "tp=2"),
    ("shared:qwen3-30b-a3b", "tp=2,ep=2"),
    ("shared:deepseek-v3", "tp=2,ep=2,dp_attention=2"),
]


@pytest.mark.parametrize("model, layout", CASES)
def test_a_replayed_group_equals_the_loaders_byte_for_byte(tmp_path, monkeypatch, model, layout):
    """First update: loaders + recording (every group of these models is a pure copy); second
    update with other values: every group replayed, no loader called, bytes equal the loaders'."""
    cfg = _shrunk(model[7:], str(tmp_path)) if model.startswith("shared:") else write_config(model, str(tmp_path))
    engine = EngineLayout.parse(layout)
    replicas = ModelReplicas()
    for rank in range(engine.world_size):
        replica = replicas.get(cfg, engine, rank)
        first = _inputs(replica, 1)
        second = _inputs(replica, 2)
        converting = _converting(replica)
        times = UpdateTimes()
        producer = SlotProducer(times)
        _assert_equal(_produce(producer, replica, first), _loader_bytes(replica, first), f"{layout} rank {rank} v1")
        groups = len(replica.groups)
        assert (times.loader_groups, times.recorded, times.replayed) == (groups, groups - len(converting), 0)
        assert set(plans_of(replica).refused) == converting
        expected = _loader_bytes(replica, second)
        with monkeypatch.context() as m:
            _loaders_only_for(replica, converting, m)
            got = _produce(producer, replica, second)
        _assert_equal(got, expected, f"{layout} rank {rank} v2 (replayed)")
        assert times.replayed == groups - len(converting)
        assert plan_memory([replica]) > 0


@pytest.mark.parametrize("compute, caught", [
    (lambda w: w * 2, "no input element"),  # the ids decode out of range while recording
    # a data-dependent permutation: the id-encoded inputs are already sorted, so the recorded plan
    # is a plain copy; only the first replay's byte check against the loaders catches it
    (lambda w: torch.sort(w).values, "first replay differs"),
])
def test_a_loader_that_computes_keeps_its_group_on_the_loader_path(tmp_path, compute, caught):
    """A norm whose loader computes: its group stays on the loader path with the bytes right,
    every other group is replayed."""
    cfg = write_config("qwen3", str(tmp_path))
    replica = ModelReplicas().get(cfg, EngineLayout.parse("tp=2"), 0)
    norm = replica.model.get_parameter("model.norm.weight")
    norm.weight_loader = lambda param, w: param.data.copy_(compute(w))
    doubled = replica.group_of("model.norm.weight").index
    times = UpdateTimes()
    producer = SlotProducer(times)
    for seed in (1, 2, 3):
        tensors = _inputs(replica, seed)
        got = _produce(producer, replica, tensors)
        expected = _loader_bytes(replica, tensors)
        _assert_equal(got, expected, f"update {seed}")
        assert torch.equal(got["model.norm.weight"].view(torch.bfloat16), compute(tensors["model.norm.weight"]))
    plans = plans_of(replica)
    assert set(plans.refused) == {doubled} and caught in plans.refused[doubled]
    assert doubled not in plans.plans
    assert times.loader_groups == len(replica.groups) + 2  # every group once, the doubled one every time
    assert times.replayed == 2 * (len(replica.groups) - 1)


def test_a_dtype_converting_engine_replays_nothing_and_its_bytes_stay_right(tmp_path):
    """An engine in float32 fed a bf16 checkpoint: every loader converts, every group is refused
    while recording (elements of another size), and the loaders keep producing the bytes."""
    cfg = write_config("qwen3", str(tmp_path))
    replica = ModelReplicas().get(cfg, EngineLayout.parse("tp=2,dtype=float32"), 1)
    tensors = _inputs(replica, 4)
    with pytest.raises(NotACopy, match="another size|no input element"):
        g = replica.groups[0]
        record_group_plan(replica, g, {n: tensors[n] for n in g.hf_names})
    times = UpdateTimes()
    producer = SlotProducer(times)
    for _ in range(2):
        _assert_equal(_produce(producer, replica, tensors), _loader_bytes(replica, tensors), "float32 engine")
    assert times.replayed == 0 and times.recorded == 0
    assert len(plans_of(replica).refused) == len(replica.groups)


def test_zero_padding_is_replayed_as_a_fill_not_left_stale(tmp_path):
    """qwen2's vocab (250) padded to a TP4 multiple: the padding rows are zeros in the loader path;
    a replay into a slot full of stale bytes zeroes them too."""
    cfg = write_config("qwen2", str(tmp_path))
    replica = ModelReplicas().get(cfg, EngineLayout.parse("tp=4"), 3)
    producer = SlotProducer(UpdateTimes())
    tensors = _inputs(replica, 5)
    _produce(producer, replica, tensors)
    plan = plans_of(replica).plans[replica.group_of("model.embed_tokens.weight").index]
    assert any(op[0] < 0 for op in plan.ops), "the padding rows are a zero fill"
    got = _produce(producer, replica, tensors, stale=0xFF)
    _assert_equal(got, _loader_bytes(replica, tensors), "padded embedding")


def test_a_new_layout_or_replica_starts_without_plans_and_other_inputs_record_again(tmp_path):
    cfg = write_config("qwen3", str(tmp_path))
    replicas = ModelReplicas()
    tp2 = replicas.get(cfg, EngineLayout.parse("tp=2"), 0)
    times = UpdateTimes()
    producer = SlotProducer(times)
    tensors = _inputs(tp2, 1)
    _produce(producer, tp2, tensors)
    assert len(plans_of(tp2).plans) == len(tp2.groups)
    tp4 = replicas.get(cfg, EngineLayout.parse("tp=4"), 0)
    assert not plans_of(tp4).plans  # another shard layout: its own plans, none yet
    _produce(producer, tp4, tensors)
    assert times.replayed == 0 and times.recorded == len(tp2.groups) + len(tp4.groups)
    replicas.clear()  # the replica is rebuilt: its plans went with the old one
    rebuilt = replicas.get(cfg, EngineLayout.parse("tp=2"), 0)
    assert rebuilt is not tp2 and not plans_of(rebuilt).plans
    # a transform that hands a group inputs of another dtype: the plan is dropped, the loaders run
    group = tp2.group_of("model.norm.weight")
    plan = plans_of(tp2).plans[group.index]
    assert plan.accepts(tensors) and not plan.accepts({**tensors, "model.norm.weight": tensors[
        "model.norm.weight"].float()})


def test_copy_plans_off_always_runs_the_loaders(tmp_path):
    cfg = write_config("qwen3", str(tmp_path))
    replica = ModelReplicas().get(cfg, EngineLayout.parse("tp=2"), 0)
    times = UpdateTimes()
    producer = SlotProducer(times, enabled=False)
    tensors = _inputs(replica, 1)
    for _ in range(2):
        _produce(producer, replica, tensors)
    assert times.replayed == 0 and times.recorded == 0 and times.loader_groups == 2 * len(replica.groups)
    assert not plans_of(replica).plans


@pytest.mark.parametrize("transport, model, layout", [("mooncake", "qwen3_moe", "tp=2,ep=2"),
                                                      ("nixl", "qwen3", "tp=2")])
def test_a_real_engine_gets_replayed_bytes_from_the_second_update_on(tmp_path, transport, model, layout):
    """WeightSender -> real receiver processes: update 1 loads and records, updates 2 and 3 replay
    every group; each time the engine's own check finds its weights equal sglang's load."""
    cfg = write_config(model, str(tmp_path))
    engine = start_engine(cfg, layout, transport=transport, name=f"replay-{transport}")
    try:
        specs = checkpoint_tensors(cfg)
        with WeightSender(cfg, transport=transport, buffer_size=1 << 20, replicas=ModelReplicas(),
                          copy_plans="on") as sender:
            sender.connect([SglangEngine(engine.url, name=engine.name)])
            assert sender.recorder is None  # "on": recorded on the update path, no background recorder
            groups = sum(len(p.replica.groups) for p in sender.prepared)
            for step in (1, 2, 3):
                with sender.update(f"v{step}") as u:
                    for name, t in random_checkpoint(specs, step):
                        u.push(name, t)
                r = u.report
                if step == 1:
                    assert (r.loader_groups, r.recorded_plans, r.replayed_groups) == (groups, groups, 0)
                else:
                    assert (r.loader_groups, r.recorded_plans, r.replayed_groups) == (0, 0, groups)
                assert r.plan_bytes > 0 and "copy plans:" in str(r)
                result = check_weights_equal(engine.url, hf_seed=step)
                assert result["success"], result["message"]
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["host", "gpu", "staged"])
def test_each_slot_filler_delivers_replayed_bytes_after_its_device_work(tmp_path, mode):
    """The three fillers with a producer (stand-in CUDA events on the CPU, as in
    test_sender_pipeline): update 1 loads and records, update 2 replays every group into slots
    that still hold update 1's bytes; the engine's bytes equal the loaders' of update 2's inputs
    and no slot reaches the writer before its device work."""
    from p2pweights import _native
    from p2pweights.sender.buffers import TransferBuffers, slot_size
    from p2pweights.sender.fillers import GpuSlotFiller, HostSlotFiller, SlotHandOver, StagedHostSlotFiller
    from p2pweights.sender.pipeline import SlotPipeline
    from p2pweights.sender.prepared import EngineTarget, PreparedRank
    from p2pweights.sender.stager import GroupStager
    from p2pweights.sender.transforms import GroupLoad
    from p2pweights.transport import params_table
    from p2pweights.transport.publication import EnginePublication
    from test_sender_pipeline import _CheckedWriter, _Event, _FakeStaging, _param_memory

    cfg = write_config("qwen3", str(tmp_path), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                       vocab_size=4096)
    layout = EngineLayout.parse("tp=2")
    replica = ModelReplicas().get(cfg, layout, 1)
    buffers = TransferBuffers(slot_size(1 << 20, replica.largest_group_nbytes), 2, pin="none")
    transport = _native.LoopbackTransport()
    transport.register_memory(buffers.address, buffers.total_bytes)
    writer = _CheckedWriter(transport, buffers, transfer_timeout=10)
    _, views = _param_memory(replica.param_specs)
    pub = EnginePublication.from_json(["loopback", params_table(views.items())])
    try:
        transport.connect(0, "loopback")
        writer.add_engine(0, "fake/rank1", pub.regions)
        target = EngineTarget(SglangEngine("http://fake:1", name="fake"), 1, 0, pub)
        stager = GroupStager([g.hf_names for g in replica.groups], replica.hf_specs)
        rank = PreparedRank(layout.key, 1, replica, stager, [target])
        staging = _FakeStaging(buffers.slot_bytes)
        for step in (1, 2):
            times = UpdateTimes()
            handover = SlotHandOver(writer, times)
            if mode == "host":
                filler = HostSlotFiller(handover)
            elif mode == "gpu":
                events = []
                filler = GpuSlotFiller(handover, record_event=lambda device: events.append(_Event()) or events[-1])
                writer.ready = lambda slot: events.pop(0).done
            else:
                filler = StagedHostSlotFiller(handover, lambda device: staging)
                writer.ready = lambda slot: all(e.host != buffers.slot_address(slot) for e in staging.stream.queued)
            filler.producer = SlotProducer(times)
            pipeline = SlotPipeline(handover, lambda inputs: filler, times)
            tensors = _inputs(replica, step)
            for g in replica.groups:
                pipeline.place(GroupLoad(rank, g, {n: tensors[n] for n in g.hf_names}))
            pipeline.drain()
            assert writer.finish().ok and times.slots > 2
            _assert_equal({n: views[n] for n in replica.param_specs}, _loader_bytes(replica, tensors), f"{mode} v{step}")
            assert times.replayed == (0 if step == 1 else len(replica.groups))
            assert times.loader_groups == (len(replica.groups) if step == 1 else 0)
    finally:
        writer.close()
        transport.close()
        buffers.close()


# -- byte copies and the replay paths (copyplans/program.py, replay.py) -----------------------------
def _reference_copy(ops, regions, itemsizes, inputs, nbytes):
    """Each op applied element by element with plain indexing: what every replay path must equal."""
    out = torch.full((nbytes,), 0xA5, dtype=torch.uint8)
    for inp, reg, d_off, s_off, sizes, d_str, s_str in ops:
        size = itemsizes[reg]
        dst = out[regions[reg].offset:regions[reg].offset + regions[reg].nbytes].view(-1, size)
        for idx in torch.cartesian_prod(*[torch.arange(n) for n in sizes]).view(-1, len(sizes)).tolist():
            d = d_off + sum(i * st for i, st in zip(idx, d_str))
            if inp < 0:
                dst[d] = 0
            else:
                s = s_off + sum(i * st for i, st in zip(idx, s_str))
                dst[d] = inputs[inp].reshape(-1).view(torch.uint8).view(-1, size)[s]
    return out


def test_byte_ops_fold_and_join_and_every_path_writes_the_element_copies():
    """bf16 ops as byte copies: a contiguous 2-D block becomes one 1-D copy, two ops that continue
    each other one copy, a column shard (rows of 8 elements out of 16) a 2-D copy, an odd run and a
    zero fill stay whole. Then every replay path, into a slot of stale bytes, writes what the
    element-by-element copies write; an input that starts 2 bytes into its buffer gets the same bytes."""
    from p2pweights.copyplans import GroupPlan, ReplayOrder, ReplayPath
    from p2pweights.copyplans.program import byte_ops
    from p2pweights.replica.groups import SlotRegion

    regions = (SlotRegion("a", 0, 256), SlotRegion("b", 256, 512), SlotRegion("c", 768, 64))
    itemsizes = (2, 2, 2)
    ops = [
        (0, 0, 0, 0, (4, 16), (16, 1), (16, 1)),  # rows 0-3 of input 0: contiguous
        (0, 0, 64, 64, (4, 16), (16, 1), (16, 1)),  # rows 4-7: continues the op before
        (1, 1, 0, 8, (16, 8), (8, 1), (16, 1)),  # a column shard of input 1
        (1, 1, 128, 3, (5,), (1,), (1,)),  # an odd run at an odd source offset
        (-1, 2, 0, 0, (32,), (1,), (0,)),  # zero fill
    ]
    assert [(op[0], op[4]) for op in byte_ops(ops, regions, itemsizes)] == [
        (0, (256,)), (1, (16, 16)), (1, (10,)), (-1, (64,))]
    inputs = [torch.randn(16, 16).to(torch.bfloat16), torch.randn(16, 16).to(torch.bfloat16)]
    expected = _reference_copy(ops, regions, itemsizes, inputs, 1024)
    shifted = [torch.cat([torch.zeros(1, dtype=torch.bfloat16), t.reshape(-1)])[1:].view(16, 16) for t in inputs]
    assert shifted[0].storage_offset() == 1
    plan = GroupPlan(0, ("x", "y"), tuple(((16, 16), "torch.bfloat16") for _ in inputs), regions, itemsizes, ops)
    views = ReplayPath.ELEMENT_VIEWS
    for order in (ReplayOrder(), ReplayOrder(host=(views,), gpu=(views,))):
        for given in (inputs, shifted):
            slot = torch.full((2048,), 0xA5, dtype=torch.uint8)
            order.replay(plan, dict(zip(plan.inputs, given)), slot, 512)
            assert torch.equal(slot[512:1536], expected), order.groups
            assert bool((slot[:512] == 0xA5).all()) and bool((slot[1536:] == 0xA5).all())


# -- plans on disk (copyplans/store.py) ---------------------------------------------------------
def _stored(tmp_path, layout="tp=2"):
    """A replica with a cache folder whose plans were recorded and saved; its config and the file."""
    from p2pweights.copyplans.store import plan_path

    cfg = write_config("qwen3", str(tmp_path))
    cache = str(tmp_path / "cache")
    replica = ModelReplicas(cache_dir=cache).get(cfg, EngineLayout.parse(layout), 0)
    _produce(SlotProducer(UpdateTimes()), replica, _inputs(replica, 1))
    path = plan_path(replica)
    assert os.path.exists(path)
    return cfg, cache, replica, path


def _fresh(cfg, cache, layout="tp=2"):
    """What a new process gets: another replica of the same key, read from the cache folder."""
    return ModelReplicas(cache_dir=cache).get(cfg, EngineLayout.parse(layout), 0)


def _edit(path, change):
    with open(path) as f:
        body = json.load(f)
    change(body)
    with open(path, "w") as f:
        json.dump(body, f)


def test_plans_saved_with_the_replica_are_checked_then_replayed_without_recording(tmp_path, monkeypatch):
    """A fresh replica of the same key reads the plans: its first update runs the loaders and checks
    each stored plan against them (no recording), its second replays every group."""
    cfg, cache, first, _ = _stored(tmp_path)
    replica = _fresh(cfg, cache)
    assert replica is not first
    plans = plans_of(replica)
    assert plans.loaded == len(replica.groups) and not plans.plans  # read, not trusted yet
    times = UpdateTimes()
    producer = SlotProducer(times)
    tensors = _inputs(replica, 2)
    _assert_equal(_produce(producer, replica, tensors), _loader_bytes(replica, tensors), "checked update")
    assert times.recorded == 0 and times.replayed == 0 and len(plans.plans) == len(replica.groups)
    tensors = _inputs(replica, 3)
    with monkeypatch.context() as m:
        _loaders_only_for(replica, set(), m)
        got = _produce(producer, replica, tensors)
    _assert_equal(got, _loader_bytes(replica, tensors), "replayed from stored plans")
    assert times.replayed == len(replica.groups)


@pytest.mark.parametrize("change", [
    lambda b: b.update(format=b["format"] + 1),  # another format version
    lambda b: b.update(replica="0" * 24),  # another replica's file (key digest)
    lambda b: [p["input_specs"][0][0].__setitem__(0, p["input_specs"][0][0][0] + 1) for p in b["plans"].values()],
])
def test_a_stored_plan_of_another_format_replica_or_input_spec_is_recorded_again(tmp_path, change):
    cfg, cache, _, path = _stored(tmp_path)
    _edit(path, change)
    replica = _fresh(cfg, cache)
    times = UpdateTimes()
    tensors = _inputs(replica, 2)
    _assert_equal(_produce(SlotProducer(times), replica, tensors), _loader_bytes(replica, tensors), "rebuilt")
    assert times.recorded == len(replica.groups)
    with open(path) as f:  # and the file is rewritten with the new plans
        from p2pweights.copyplans.store import PLAN_FORMAT
        body = json.load(f)
    assert body["format"] == PLAN_FORMAT and body["replica"] == replica.key.digest()


def test_another_layout_does_not_find_the_plans_of_this_one(tmp_path):
    from p2pweights.copyplans.store import plan_path

    cfg, cache, tp2, path = _stored(tmp_path)
    tp4 = ModelReplicas(cache_dir=cache).get(cfg, EngineLayout.parse("tp=4"), 0)
    assert plan_path(tp4) != path and plans_of(tp4).loaded == 0


def _shift_a_source(body):
    """Forge every plan: its first copy reads one element further on and one element shorter
    (still inside its region and its input)."""
    for p in body["plans"].values():
        op = next(op for op in p["ops"] if op[0] >= 0)
        op[3] += 1
        op[4][-1] -= 1


def _reach_outside(body):
    """Forge every plan: its first op writes far past its region."""
    for p in body["plans"].values():
        p["ops"][0][2] += 1 << 20


@pytest.mark.parametrize("forge, loaded", [(_shift_a_source, "some"), (_reach_outside, 0),
                                           (lambda b: b.update(plans="garbage"), 0)])
def test_a_forged_plan_file_cannot_make_the_sender_write_wrong_bytes(tmp_path, forge, loaded):
    """In-bounds forged ops fail their first check against the loaders and are recorded again;
    ops out of bounds or a malformed file are refused on reading. Every update's bytes are right."""
    cfg, cache, _, path = _stored(tmp_path)
    _edit(path, forge)
    replica = _fresh(cfg, cache)
    plans = plans_of(replica)
    assert (plans.loaded > 0) if loaded == "some" else plans.loaded == 0
    times = UpdateTimes()
    producer = SlotProducer(times)
    for seed in (2, 3):
        tensors = _inputs(replica, seed)
        _assert_equal(_produce(producer, replica, tensors), _loader_bytes(replica, tensors), f"update {seed}")
    assert plans.dropped == plans.loaded and times.recorded == len(replica.groups)
    assert times.replayed == len(replica.groups)


# -- recording in the background (copyplans/background_recorder.py) -------------------------------------------
def _qwen3_replica(tmp_path):
    cfg = write_config("qwen3", str(tmp_path))
    return ModelReplicas().get(cfg, EngineLayout.parse("tp=2"), 0)


def test_background_plans_are_checked_by_the_next_load_then_replayed_and_nothing_records_on_the_update_path(
        tmp_path, monkeypatch):
    replica = _qwen3_replica(tmp_path)
    groups = len(replica.groups)
    times = UpdateTimes()
    producer = SlotProducer(times, mode="background")
    tensors = _inputs(replica, 1)
    # before the recorder ran: the loaders only, nothing recorded on the update path
    _assert_equal(_produce(producer, replica, tensors), _loader_bytes(replica, tensors), "no plan yet")
    plans = plans_of(replica)
    assert (times.loader_groups, times.recorded, times.replayed) == (groups, 0, 0)
    assert not plans.plans and not plans.unverified
    recorder = PlanRecorder([_Rank(replica)], "cpu").start()
    assert recorder.wait(120) and recorder.error is None
    assert recorder.recorded == groups == len(plans.unverified) == plans.background and not plans.plans
    times = UpdateTimes()
    producer = SlotProducer(times, mode="background")
    tensors = _inputs(replica, 2)
    _assert_equal(_produce(producer, replica, tensors), _loader_bytes(replica, tensors), "checked")
    assert (times.loader_groups, times.recorded, times.replayed) == (groups, 0, 0)
    assert len(plans.plans) == groups and not plans.unverified  # every plan passed its check
    tensors = _inputs(replica, 3)
    with monkeypatch.context() as m:
        _loaders_only_for(replica, set(), m)
        got = _produce(producer, replica, tensors)
    _assert_equal(got, _loader_bytes(replica, tensors), "replayed")
    assert times.replayed == groups


def _start_update(replica, tensors) -> tuple[threading.Thread, dict]:
    """An update's slot production (background copy plans) on a thread of its own, started; what it
    produced lands in the dict."""
    got: dict = {}
    update = threading.Thread(target=lambda: got.update(_produce(SlotProducer(UpdateTimes(), mode="background"),
                                                                  replica, tensors)))
    update.start()
    return update, got


def test_the_recorder_and_an_update_never_run_one_replicas_loaders_at_once(tmp_path):
    """The recorder holds the replica's loaders lock while its loaders run; an update started then
    waits for that loader run only, both finish, and the update's bytes are the loaders'."""
    replica = _qwen3_replica(tmp_path)
    inside, release, recording = threading.Event(), threading.Event(), threading.Event()
    overlaps = []
    load_groups = replica.load_groups

    def watched(placed, tensors, slot):
        if threading.current_thread().name != "p2pw-plan-recorder":  # the update's loaders, not the recording's
            overlaps.append(recording.is_set())
            return load_groups(placed, tensors, slot)
        recording.set()
        inside.set()
        release.wait(30)
        try:
            return load_groups(placed, tensors, slot)
        finally:
            recording.clear()

    replica.load_groups = watched
    try:
        recorder = PlanRecorder([_Rank(replica)], "cpu").start()
        assert inside.wait(60)
        tensors = _inputs(replica, 4)
        update, got = _start_update(replica, tensors)
        update.join(0.5)
        assert update.is_alive()  # waiting for the recorder's loader run
        release.set()
        update.join(60)
        assert not update.is_alive() and recorder.wait(120)
        assert overlaps and not any(overlaps)
    finally:
        release.set()
        del replica.load_groups
    _assert_equal(got, _loader_bytes(replica, tensors), "update beside the recorder")
    assert recorder.recorded == len(replica.groups)


def test_an_update_mid_group_finds_the_loaders_free_and_the_recorder_waiting(tmp_path):
    """An update that begins while the recorder is inside a group (during the first of a two-pass
    group's loader runs) neither waits for the rest of that group nor runs beside it: the recorder
    holds the loaders lock only while its loaders run, runs none while the update is in flight, and
    goes on after it; its plans are then checked and replayed, bytes exact. (A recorder that held
    the lock for a whole group made a CPU sender's first update wait ~0.5 s at nice 19.)"""
    cfg = write_config("qwen3", str(tmp_path), vocab_size=4096)  # the embedding's 262,144 ids: two passes
    replica = ModelReplicas().get(cfg, EngineLayout.parse("tp=2"), 0)
    plans, first, groups = plans_of(replica), replica.groups[0].index, len(replica.groups)
    updating = threading.Event()
    runs, during = [], []  # groups of the recorder's loader runs; those run while an update was in flight
    load_groups = replica.load_groups

    def watched(placed, tensors, slot):
        if threading.current_thread().name != "p2pw-plan-recorder":
            return load_groups(placed, tensors, slot)
        runs.append(placed[0][0].index)
        if updating.is_set():
            during.append(placed[0][0].index)
        try:
            return load_groups(placed, tensors, slot)
        finally:
            if len(runs) == 1:
                updating.set()  # the update begins while the recorder's first loader run is under way

    replica.load_groups = watched
    try:
        recorder = PlanRecorder([_Rank(replica)], "cpu", busy=updating.is_set).start()
        assert updating.wait(60)
        tensors = _inputs(replica, 7)
        update, got = _start_update(replica, tensors)
        update.join(60)
        assert not update.is_alive()
        _assert_equal(got, _loader_bytes(replica, tensors), "the update beside a waiting recorder")
        assert not during, f"the recorder ran the loaders of groups {during} while an update was in flight"
        assert not plans.loaders.locked() and recorder.recorded == 0 and not recorder.finished.is_set()
        updating.clear()  # the update is done: the recorder goes on with its group
        assert recorder.wait(120) and recorder.error is None
    finally:
        updating.clear()
        del replica.load_groups
    assert runs[:3] == [first, first, first + 1]  # the first group took two loader runs: paused between them
    assert recorder.recorded == groups == len(plans.unverified)
    times = UpdateTimes()
    producer = SlotProducer(times, mode="background")
    for seed in (8, 9):  # checked, then replayed
        tensors = _inputs(replica, seed)
        _assert_equal(_produce(producer, replica, tensors), _loader_bytes(replica, tensors), f"update {seed}")
    assert (times.loader_groups, times.replayed) == (groups, groups)


def test_stop_ends_the_recorder_between_groups(tmp_path):
    replica = _qwen3_replica(tmp_path)
    seen = []

    def pause_after_two(rep, group):
        seen.append(group.index)
        while len(seen) > 2 and not recorder.stopped:
            time.sleep(0.01)

    recorder = PlanRecorder([_Rank(replica)], "cpu")
    recorder.before_group = pause_after_two
    recorder.start()
    deadline = time.monotonic() + 60
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    recorder.stop()
    assert recorder.finished.is_set() and not recorder._thread.is_alive()
    assert recorder.recorded == 2 == len(plans_of(replica).unverified)


def test_a_reconnect_does_not_wait_for_the_group_being_recorded(tmp_path):
    """WeightSender.connect stops the old recorder with timeout 0: it returns while a group is
    still being recorded, and the recorder ends after that group."""
    replica = _qwen3_replica(tmp_path)
    inside, release = threading.Event(), threading.Event()

    def block_in_first(rep, group):
        inside.set()
        release.wait(60)

    recorder = PlanRecorder([_Rank(replica)], "cpu")
    recorder.before_group = block_in_first
    recorder.start()
    assert inside.wait(60)
    t0 = time.monotonic()
    recorder.stop(timeout=0)
    assert time.monotonic() - t0 < 1.0 and recorder._thread.is_alive()
    release.set()
    recorder._thread.join(60)
    assert not recorder._thread.is_alive() and recorder.recorded <= 1


def _forged_record(rep, group, like, **how):
    """A recorder gone wrong: in-bounds plans that read one element off (like _shift_a_source)."""
    plan = record_group_plan(rep, group, like, **how)
    i = next(i for i, op in enumerate(plan.ops) if op[0] >= 0)
    inp, reg, d, src, n, ds, ss = plan.ops[i]
    ops = list(plan.ops)
    ops[i] = (inp, reg, d, src + 1, n[:-1] + (n[-1] - 1,), ds, ss) if n[-1] > 1 else (inp, reg, d, src + 1, n, ds, ss)
    return dataclasses.replace(plan, ops=ops, _program=None)  # a new plan: the recorded one is compiled


def _failing_record(rep, group, like, **how):
    raise RuntimeError("recorder broke")


@pytest.mark.parametrize("record", [_forged_record, _failing_record])
def test_a_forged_or_failing_recorder_leaves_its_groups_on_the_loader_path_with_right_bytes(
        tmp_path, caplog, record):
    replica = _qwen3_replica(tmp_path)
    groups = len(replica.groups)
    with caplog.at_level(logging.WARNING, logger="p2pweights.sender"):
        recorder = PlanRecorder([_Rank(replica)], "cpu", record=record).start()
        assert recorder.wait(120)
    plans = plans_of(replica)
    if record is _failing_record:
        assert recorder.failed == groups and "recorder broke" in recorder.error and not plans.unverified
        assert sum("background copy-plan recording failed" in r.message for r in caplog.records) == 1
    else:
        assert recorder.recorded == groups == len(plans.unverified)
    times = UpdateTimes()
    producer = SlotProducer(times, mode="background")
    for seed in (5, 6):
        tensors = _inputs(replica, seed)
        _assert_equal(_produce(producer, replica, tensors), _loader_bytes(replica, tensors), f"update {seed}")
    assert (times.replayed, times.recorded, times.loader_groups) == (0, 0, 2 * groups)
    assert not plans.plans


@pytest.mark.parametrize("pause_at", [None, "half"])
def test_a_real_engine_with_background_recording(tmp_path, pause_at):
    """WeightSender (P2PW_COPY_PLANS=background) -> a real engine over Mooncake. Recorder done
    before the first update: it loads + checks every group and records nothing; the second replays
    all. Recorder paused mid-way during the first update: both finish, the checked groups replay
    next, the rest after their own check. Every update byte-exact; close() stops the recorder."""
    cfg = write_config("qwen3", str(tmp_path))
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="background-plans")
    try:
        specs = checkpoint_tensors(cfg)
        with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, replicas=ModelReplicas(),
                          copy_plans="background") as sender:
            sender.connect([SglangEngine(engine.url, name=engine.name)])
            recorder, resume = sender.recorder, threading.Event()
            groups = sum(len(p.replica.groups) for p in sender.prepared)
            half = groups // 2

            def pause(rep, group):
                while pause_at and recorder.recorded >= half and not resume.wait(0.01) and not recorder.stopped:
                    pass

            recorder.before_group = pause
            if pause_at is None:
                assert recorder.wait(300)
            else:
                while recorder.recorded < half:
                    time.sleep(0.01)
            expected = {1: (groups, 0, 0, groups if pause_at is None else half)}
            for step in (1, 2, 3):
                with sender.update(f"v{step}") as u:
                    for name, t in random_checkpoint(specs, step):
                        u.push(name, t)
                r = u.report
                result = check_weights_equal(engine.url, hf_seed=step)
                assert result["success"], result["message"]
                assert r.recorded_plans == 0  # never on the update path
                if step == 1:
                    assert (r.loader_groups, r.replayed_groups, r.background_plans) == (groups, 0,
                                                                                      expected[1][3])
                    resume.set()
                    assert recorder.wait(300)
                    assert r.background_plans <= recorder.recorded == groups
                elif step == 2 and pause_at:
                    assert (r.replayed_groups, r.loader_groups) == (half, groups - half)
                else:
                    assert (r.replayed_groups, r.loader_groups) == (groups, 0)
                    assert "in the background" in str(r)
        assert not recorder._thread.is_alive() and sender.recorder is None
    finally:
        engine.close()


def test_background_plans_of_an_fp8_engine_are_recorded_for_the_quantized_checkpoint(monkeypatch):
    """From specs alone, an FP8 engine's plans are recorded for what QuantizeOnSend feeds the loaders
    (float8 weights, float32 scales): checked by the next load, then every group replays, bytes exact."""
    from p2pweights.models import resolve_model
    from p2pweights.models.quant import quant_scheme
    from p2pweights.models.registry import load_config

    tiny = resolve_model("deepseek-v3-fp8-tiny")
    replica = ModelReplicas().get(tiny, EngineLayout.parse("tp=2"), 0)
    recorder = PlanRecorder([_Rank(replica)], "cpu").start()
    assert recorder.wait(300) and recorder.recorded == len(replica.groups)
    wanted = {n for g in replica.groups for n in g.hf_names}
    producer = SlotProducer(UpdateTimes(), mode="background")
    for seed, replayed in ((1, False), (2, True)):
        tensors = {n: t for n, t in random_checkpoint(replica.hf_specs, seed, quant_scheme(load_config(tiny)))
                   if n in wanted}
        with monkeypatch.context() as m:
            if replayed:
                _loaders_only_for(replica, set(), m)
            got = _produce(producer, replica, tensors)
        _assert_equal(got, _loader_bytes(replica, tensors), f"fp8 update {seed}")
    assert producer.times.replayed == len(replica.groups) and producer.times.recorded == 0
