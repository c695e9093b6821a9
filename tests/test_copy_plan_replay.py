"""Replaying recorded copy plans (p2pweights.copyplans: program.py, replay.py; csrc/buffers/
copy_program.cpp): every path of a replay order writes the loaders' bytes, for real groups and for
3-D/4-D ops and zero fills, with one thread or several; the native core's one check refuses a plan
reaching past its group or an input, or writing one byte twice, before any byte is written; a path
that fails at the driver turns off for its order alone and the next path writes the slot.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from p2pweights import _native
from p2pweights.copyplans import GroupPlan, PlanRefused, ReplayOrder, ReplayPath, cuda_copies_available, plans_of
from p2pweights.copyplans import program as program_module
from p2pweights.copyplans import replay as replay_module
from p2pweights.errors import LayoutMismatch
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.replica import ModelReplicas
from p2pweights.replica.groups import SlotRegion
from p2pweights.sender.report import UpdateTimes
from p2pweights.sender.slot_producer import SlotProducer
from test_copy_plan import _inputs, _loader_bytes, _produce, _reference_copy, _shrunk

STALE = 0xA5
VIEWS = ReplayPath.ELEMENT_VIEWS


def _host(threads: int = 2) -> ReplayOrder:
    return ReplayOrder(host=(ReplayPath.NATIVE_HOST, VIEWS), threads=threads)


def _views() -> ReplayOrder:
    return ReplayOrder(host=(VIEWS,), gpu=(VIEWS,))


@pytest.mark.parametrize("model, layout", [("qwen3-4b", "tp=2"), ("qwen3-30b-a3b", "tp=2,ep=2")])
def test_native_host_replay_equals_the_element_views_and_the_loaders(tmp_path, model, layout):
    """Every recorded group of a real model's ranks (shared/models, shrunk): the native program
    (run for every group, not the fallback) writes the bytes the element views and the loaders
    write, and nothing outside the group."""
    cfg = _shrunk(model, str(tmp_path))
    engine = EngineLayout.parse(layout)
    for rank in range(engine.world_size):
        replica = ModelReplicas().get(cfg, engine, rank)
        _produce(SlotProducer(UpdateTimes()), replica, _inputs(replica, 1))  # records the plans
        plans = plans_of(replica).plans
        assert len(plans) == len(replica.groups)
        tensors = _inputs(replica, 2)
        expected = _loader_bytes(replica, tensors)
        native_order, views_order = _host(), _views()
        for plan in plans.values():
            size = plan.group_bytes
            native = torch.full((size + 512,), STALE, dtype=torch.uint8)
            views = native.clone()
            native_order.replay(plan, tensors, native, 256)
            views_order.replay(plan, tensors, views, 256)
            assert torch.equal(native, views), f"group {plan.group_index}"
            assert bool((native[:256] == STALE).all()) and bool((native[256 + size:] == STALE).all())
            for r in plan.regions:
                assert torch.equal(native[256 + r.offset:256 + r.offset + r.nbytes], expected[r.param_name]), r.param_name
        assert native_order.groups == {ReplayPath.NATIVE_HOST: len(plans)} and not native_order.off
        # the producer's replay takes the native path for host slots
        order = ReplayOrder()
        _produce(SlotProducer(UpdateTimes(), order), replica, tensors)
        assert order.groups == {ReplayPath.NATIVE_HOST: len(plans)}


def _synthetic(nbytes_scale: int = 1):
    """A plan of 3-D and 4-D ops (bf16), a column shard, an fp8 (1-byte) op strided innermost, zero
    fills of a 2-D block and a 1-D run, and a long contiguous copy; its inputs."""
    n = 64 * nbytes_scale
    regions = (SlotRegion("a", 0, 2 * 4 * 6 * 8 * 2), SlotRegion("b", 1024, 2 * n * 16),
               SlotRegion("c", 1024 + 2 * n * 16, 400), SlotRegion("d", 2048 + 2 * n * 16, 2 * n * 64))
    itemsizes = (2, 2, 1, 2)
    ops = [
        (0, 0, 0, 5, (2, 4, 6, 8), (192, 48, 8, 1), (700, 100, 11, 1)),  # 4-D: nothing folds
        (1, 1, 0, 3, (n, 8), (16, 1), (32, 1)),  # a column shard: 2-D
        (-1, 1, 8, 0, (n, 8), (16, 1), (0, 0)),  # the other half of each row: a 2-D zero fill
        (2, 2, 0, 1, (5, 4, 7), (64, 16, 2), (80, 20, 3)),  # 3-D fp8, strided innermost on both sides
        (-1, 2, 1, 0, (100,), (2,), (0,)),  # a strided 1-byte zero fill (the odd bytes)
        (3, 3, 0, 0, (n * 64,), (1,), (1,)),  # one long contiguous copy
    ]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(-2**15, 2**15, (shape,), dtype=torch.int16, generator=gen).view(torch.bfloat16)
              for shape in (1400, n * 32 + 8)]
    inputs += [torch.randint(0, 256, (400,), dtype=torch.uint8, generator=gen),
               torch.randint(-2**15, 2**15, (n * 64,), dtype=torch.int16, generator=gen).view(torch.bfloat16)]
    plan = GroupPlan(7, ("w0", "w1", "w2", "w3"), tuple(((t.numel(),), str(t.dtype)) for t in inputs), regions,
                     itemsizes, ops)
    return plan, inputs


def test_3d_4d_ops_and_zero_fills_replay_natively_as_element_copies():
    """The ops are enumerated into 2-D descriptors (the 4-D op into 2·4 of 6 rows, the fp8 op into
    rows of one byte) and write what element-by-element indexing writes; the zero fills overwrite
    stale bytes."""
    plan, inputs = _synthetic()
    program = program_module.program_of(plan)
    assert program.shape[1] == 7
    four_d = program[program[:, 0] == 0]
    assert len(four_d) == 8 and set(four_d[:, 4]) == {6} and set(four_d[:, 3]) == {16}
    fp8 = program[program[:, 0] == 2]
    assert len(fp8) == 5 * 4 and set(fp8[:, 3]) == {1} and set(fp8[:, 4]) == {7}
    expected = _reference_copy(plan.ops, plan.regions, plan.itemsizes, inputs, plan.group_bytes)
    for order in (_host(threads=1), _views()):
        slot = torch.full((plan.group_bytes + 256,), STALE, dtype=torch.uint8)
        order.replay(plan, dict(zip(plan.inputs, inputs)), slot, 256)
        assert torch.equal(slot[256:], expected), order.groups
        assert bool((slot[:256] == STALE).all())


def test_one_thread_and_four_threads_write_the_same_bytes():
    """A group well over the inline size (4 MiB) is split across threads by bytes; the bytes do not
    depend on the thread count and equal the element views."""
    plan, inputs = _synthetic(nbytes_scale=600)  # ~5 MiB of copies
    assert plan.group_bytes > 4 << 20
    tensors = dict(zip(plan.inputs, inputs))
    slots = {}
    for name, order in (("1", _host(threads=1)), ("4", _host(threads=4)), ("views", _views())):
        slots[name] = torch.full((plan.group_bytes,), STALE, dtype=torch.uint8)
        order.replay(plan, tensors, slots[name], 0)
    assert torch.equal(slots["1"], slots["4"]) and torch.equal(slots["1"], slots["views"])


@pytest.mark.parametrize("forge, names", [
    (lambda ops: ops.append((-1, 3, 64 * 64, 0, (1,), (1,), (0,))), "writes up to byte"),  # past the group's end
    (lambda ops: ops.append((3, 0, 0, 64 * 64 - 2, (4,), (1,), (1,))), "reads bytes"),  # past input 3's end
])
@pytest.mark.parametrize("order", [_host, _views], ids=["native", "element views"])
def test_a_plan_reaching_past_its_group_or_an_input_is_refused_and_writes_nothing(forge, names, order):
    """A plan from disk is untrusted: one bad op after good ones -> LayoutMismatch naming the group
    and the parameter, on every path (the native check runs when the plan is compiled, before any
    path), and not a byte of the slot changed."""
    plan, inputs = _synthetic()
    forge(plan.ops)
    slot = torch.full((plan.group_bytes + 4096,), STALE, dtype=torch.uint8)
    with pytest.raises(LayoutMismatch, match=f"group 7 .*{names}") as e:
        order().replay(plan, dict(zip(plan.inputs, inputs)), slot, 0)
    assert e.value.parameter == "a"
    assert bool((slot == STALE).all())


@pytest.mark.parametrize("extra, ok", [
    ((0, 3, 10, 0, (4,), (1,), (1,)), False),  # rewrites 8 bytes of the long contiguous copy
    ((-1, 1, 0, 0, (1,), (1,), (0,)), False),  # a zero fill over the column shard's first element
    ((-1, 2, 3, 0, (1,), (1,), (0,)), False),  # a zero fill over an odd byte the strided zero fill wrote
    ((-1, 2, 399, 0, (1,), (1,), (0,)), True),  # a byte nobody writes, between written ones
])
def test_two_ops_writing_one_byte_are_refused_by_the_native_check(extra, ok):
    """Plans load from disk and the batched kernel runs copies side by side: two descriptors
    writing one byte would race. The native check refuses such a plan when it is compiled, naming
    the group; interleaved rows that do not touch (the column shard and its zero-filled other half,
    the fp8 op's even bytes and the zero fill's odd ones) pass."""
    plan, inputs = _synthetic()
    plan.ops.append(extra)
    if ok:
        program_module.program_of(plan)
        return
    with pytest.raises(PlanRefused, match="group 7"):
        program_module.program_of(plan)
    with pytest.raises(LayoutMismatch, match="group 7"):
        _views().replay(plan, dict(zip(plan.inputs, inputs)), torch.zeros(plan.group_bytes, dtype=torch.uint8), 0)


@pytest.mark.parametrize("row", [
    [0, 0, 0, 8, -1, 8, 8],  # negative rows
    [0, 0, 0, 8, 1 << 62, 8, 8],  # a row count whose extent overflows 64 bits
    [0, 0, 0, 8, 3, 8, -(1 << 61)],  # a source pitch wrapping below the input
    [0, 0, 0, 8, 2, 4, 8],  # overlapping destination rows
    [1, 0, 0, 8, 1, 8, 8],  # an input that does not exist
    [-2, 0, 0, 8, 1, 8, 8],
])
def test_malformed_descriptors_return_a_status_not_a_crash(row):
    src = torch.arange(64, dtype=torch.uint8)
    slot = torch.full((64,), STALE, dtype=torch.uint8)
    program = np.array([row], dtype=np.int64)
    code, message = _native.run_copy_program_host(program, slot.data_ptr(), 64, [src.data_ptr()], [64], 2)
    assert code < 0 and "copy descriptor 0" in message
    assert bool((slot == STALE).all())
    code, message = _native.run_copy_program_host(np.zeros((1, 6), dtype=np.int64), slot.data_ptr(), 64, [], [], 1)
    assert code < 0 and "(n, 7)" in message


class _OnCuda:
    """A host tensor that says it lives on cuda:0 (this machine has no GPU): what the CUDA branch
    of the native replay reads of a slot or an input."""

    def __init__(self, t):
        self._t, self.device, self.dtype = t, torch.device("cuda", 0), t.dtype

    def __getattr__(self, name):
        return getattr(self._t, name)


def test_without_a_cuda_driver_both_native_gpu_paths_turn_off_for_that_order_and_views_write(monkeypatch):
    """No libcuda here: the native CUDA call reports it (no crash), the order turns the kernel and
    the driver copies off (asked once), the element views write the slot; another order (another
    sender) is not affected."""
    assert _native.cuda_driver_info()["loaded"] is False
    code, message, calls = _native.run_copy_program_cuda(np.zeros((0, 7), dtype=np.int64), 1, 0, [], [], 0, "each")
    assert (code, calls) == (int(_native.Code.NOT_FOUND), 0) and "no CUDA driver" in message
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    asked, viewed = [], []
    real = _native.run_copy_program_cuda
    monkeypatch.setattr(_native, "run_copy_program_cuda", lambda *a: asked.append(a) or real(*a))
    monkeypatch.setattr(replay_module, "run_element_ops", lambda *a: viewed.append(a))
    monkeypatch.setattr(_OnCuda, "__getitem__", lambda self, key: self._t[key], raising=False)
    plan, inputs = _synthetic()
    slot = _OnCuda(torch.full((plan.group_bytes,), STALE, dtype=torch.uint8))
    tensors = dict(zip(plan.inputs, (_OnCuda(t) for t in inputs)))
    order = ReplayOrder()
    order.replay(plan, tensors, slot, 0)
    assert set(order.off) == {ReplayPath.KERNEL, ReplayPath.DRIVER_COPIES}
    assert all("no CUDA driver" in why for why in order.off.values())
    assert len(asked) == 1 and len(viewed) == 1 and order.groups == {VIEWS: 1}
    order.replay(plan, tensors, slot, 0)
    assert len(asked) == 1 and len(viewed) == 2  # not asked again
    assert ReplayOrder().paths(torch.device("cuda", 0))[0] is ReplayPath.KERNEL  # another order: its own state
    assert cuda_copies_available()[0] is False
    assert bool((slot._t == STALE).all())  # neither the failed call nor the stand-in views wrote


def test_a_strided_input_takes_the_element_views_and_a_too_fragmented_plan_is_refused(monkeypatch):
    """A strided view as an input: the native program reads an input's bytes from its first
    element, so that slot goes to the element views (which read it contiguous), with the right
    bytes. A plan past MAX_DESCRIPTORS copies is refused when compiled (the native check cannot
    vouch for it): its group stays on the loaders."""
    plan, inputs = _synthetic()
    expected = _reference_copy(plan.ops, plan.regions, plan.itemsizes, inputs, plan.group_bytes)
    strided = torch.stack([inputs[2], inputs[2] + 1], 1)[:, 0]
    assert not strided.is_contiguous() and torch.equal(strided, inputs[2])
    order = _host()
    slot = torch.full((plan.group_bytes,), STALE, dtype=torch.uint8)
    order.replay(plan, dict(zip(plan.inputs, [inputs[0], inputs[1], strided, inputs[3]])), slot, 0)
    assert torch.equal(slot, expected) and order.groups == {VIEWS: 1} and not order.off
    monkeypatch.setattr(program_module, "MAX_DESCRIPTORS", 8)
    plan._program = None
    with pytest.raises(PlanRefused, match="more than 8 copies"):
        program_module.program_of(plan)


def test_a_slot_of_replayed_groups_is_one_native_call_with_the_loaders_bytes(tmp_path, monkeypatch):
    """The producer joins the programs of a slot's replayed groups: one native call fills the slot
    (per-group calls cost Python per group, the bound of a GPU slot), byte-equal to the loaders."""
    from test_copy_plan import _assert_equal

    cfg = _shrunk("qwen3-30b-a3b", str(tmp_path))
    replica = ModelReplicas().get(cfg, EngineLayout.parse("tp=2,ep=2"), 1)
    _produce(SlotProducer(UpdateTimes()), replica, _inputs(replica, 1))  # records the plans
    tensors = _inputs(replica, 3)
    calls = []
    real = _native.run_copy_program_host
    monkeypatch.setattr(_native, "run_copy_program_host",
                        lambda program, *rest: calls.append(len(program)) or real(program, *rest))
    times, order = UpdateTimes(), ReplayOrder()
    _assert_equal(_produce(SlotProducer(times, order), replica, tensors), _loader_bytes(replica, tensors), "joined slot")
    assert times.replayed == len(replica.groups) > 1
    assert len(calls) == 1 and calls[0] == sum(len(program_module.program_of(p)) for p in plans_of(replica).plans.values())
    _produce(SlotProducer(UpdateTimes(), order), replica, tensors)  # the joined program is cached per placement
    assert len(calls) == 2 and len(order.programs) == 1


def test_a_joined_slot_with_an_input_it_cannot_read_goes_to_the_element_views():
    """One strided input, or one on another device, among the slot's inputs: the native copies
    cannot take the slot, nothing turns off, and the element views write the right bytes."""
    plan, inputs = _synthetic()
    tensors = {n: t for n, t in zip(plan.inputs, inputs)}
    expected = _reference_copy(plan.ops, plan.regions, plan.itemsizes, inputs, plan.group_bytes)
    strided = dict(tensors, w2=torch.stack([inputs[2], inputs[2]], 1)[:, 0])
    assert not strided["w2"].is_contiguous()
    order = _host()
    for given in (strided, tensors):
        slot = torch.full((plan.group_bytes,), STALE, dtype=torch.uint8)
        order.replay_slot([(plan, 0)], given, slot)
        assert torch.equal(slot, expected)
    assert order.groups == {VIEWS: 1, ReplayPath.NATIVE_HOST: 1} and not order.off


def test_a_replay_order_must_end_with_the_element_views():
    with pytest.raises(ValueError, match="ends with the element views"):
        ReplayOrder(host=(ReplayPath.NATIVE_HOST,))
    with pytest.raises(ValueError, match="GPU paths"):
        ReplayOrder(gpu=(ReplayPath.NATIVE_HOST, VIEWS))
