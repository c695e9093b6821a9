"""Native replay of recorded copy plans (replica/native_copies.py, csrc/buffers/copy_program.cpp):
host slots get the same bytes as the wide torch copies and the loaders, for real groups and for
3-D/4-D ops and zero fills, with one thread or several; a descriptor reaching past the group or an
input is refused before any byte is written; on a machine without a CUDA driver the CUDA path says
so and GPU slots fall back to the torch views.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from p2pweights import _native
from p2pweights.errors import LayoutMismatch
from p2pweights.replica import EngineLayout, ModelReplicas, native_copies
from p2pweights.replica.copy_plan import GroupPlan, run_wide_ops
from p2pweights.replica.groups import SlotRegion
from p2pweights.sender.replay import SlotProducer, plans_of
from p2pweights.sender.report import UpdateTimes
from test_copy_plan import _inputs, _loader_bytes, _produce, _reference_copy, _shrunk

STALE = 0xA5


@pytest.mark.parametrize("model, layout", [("qwen3-4b", "tp=2"), ("qwen3-30b-a3b", "tp=2,ep=2")])
def test_native_host_replay_equals_the_wide_copies_and_the_loaders(tmp_path, model, layout):
    """Every recorded group of a real model's ranks (shared/models, shrunk): the native program
    (run for every group, not the torch fallback) writes the bytes the wide copies and the loaders
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
        for plan in plans.values():
            inputs = [tensors[n] for n in plan.inputs]
            size = plan.group_bytes
            native = torch.full((size + 512,), STALE, dtype=torch.uint8)
            wide = native.clone()
            assert native_copies.replay_natively(plan, inputs, native, 256)
            run_wide_ops(plan.wide_ops, inputs, wide, 256)
            assert torch.equal(native, wide), f"group {plan.group_index}"
            assert bool((native[:256] == STALE).all()) and bool((native[256 + size:] == STALE).all())
            for r in plan.regions:
                assert torch.equal(native[256 + r.offset:256 + r.offset + r.nbytes], expected[r.param_name]), r.param_name
        # the producer's replay (GroupPlan.replay) takes the native path for host slots
        before = native_copies.state.host_groups
        _produce(SlotProducer(UpdateTimes()), replica, tensors)
        assert native_copies.state.host_groups - before == len(plans)


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
    program = native_copies.program_of(plan)
    assert program is not None and program.shape[1] == 7
    four_d = program[program[:, 0] == 0]
    assert len(four_d) == 8 and set(four_d[:, 4]) == {6} and set(four_d[:, 3]) == {16}
    fp8 = program[program[:, 0] == 2]
    assert len(fp8) == 5 * 4 and set(fp8[:, 3]) == {1} and set(fp8[:, 4]) == {7}
    expected = _reference_copy(plan.ops, plan.regions, plan.itemsizes, inputs, plan.group_bytes)
    slot = torch.full((plan.group_bytes + 256,), STALE, dtype=torch.uint8)
    assert native_copies.replay_natively(plan, inputs, slot, 256, threads=1)
    assert torch.equal(slot[256:], expected)
    assert bool((slot[:256] == STALE).all())


def test_one_thread_and_four_threads_write_the_same_bytes():
    """A group well over the inline size (4 MiB) is split across threads by bytes; the bytes do not
    depend on the thread count and equal the wide copies."""
    plan, inputs = _synthetic(nbytes_scale=600)  # ~5 MiB of copies
    assert plan.group_bytes > _native_inline_bytes()
    slots = {}
    for threads in (1, 4):
        slots[threads] = torch.full((plan.group_bytes,), STALE, dtype=torch.uint8)
        assert native_copies.replay_natively(plan, inputs, slots[threads], 0, threads=threads)
    wide = torch.full((plan.group_bytes,), STALE, dtype=torch.uint8)
    run_wide_ops(plan.wide_ops, inputs, wide, 0)
    assert torch.equal(slots[1], slots[4]) and torch.equal(slots[1], wide)


def _native_inline_bytes():
    return 4 << 20


@pytest.mark.parametrize("forge, names", [
    (lambda ops: ops.append((-1, 3, 64 * 64, 0, (1,), (1,), (0,))), "writes up to byte"),  # past the group's end
    (lambda ops: ops.append((3, 0, 0, 64 * 64 - 2, (4,), (1,), (1,))), "reads bytes"),  # past input 3's end
])
def test_a_descriptor_reaching_past_the_group_or_an_input_is_refused_and_writes_nothing(forge, names):
    """A plan from disk is untrusted: one bad descriptor after good ones -> LayoutMismatch naming
    the group and the parameter, and not a byte of the slot changed (all are checked first)."""
    plan, inputs = _synthetic()
    forge(plan.ops)
    slot = torch.full((plan.group_bytes + 4096,), STALE, dtype=torch.uint8)
    with pytest.raises(LayoutMismatch, match=f"group 7 .*{names}") as e:
        native_copies.replay_natively(plan, inputs, slot, 0, threads=4)
    assert e.value.parameter == "a"
    assert bool((slot == STALE).all())


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


def test_without_a_cuda_driver_the_cuda_path_says_so_and_gpu_slots_fall_back(monkeypatch):
    """No libcuda here: the native CUDA call reports it (no crash), the replay returns False for
    the torch views to run, and native CUDA copies stay off for the process (asked once)."""
    assert _native.cuda_driver_info()["loaded"] is False
    code, message, calls = _native.run_copy_program_cuda(np.zeros((0, 7), dtype=np.int64), 1, 0, [], [], 0, "each")
    assert (code, calls) == (-6, 0) and "no CUDA driver" in message
    monkeypatch.setattr(native_copies, "state", native_copies.NativeCopyState())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    asked = []
    real = _native.run_copy_program_cuda
    monkeypatch.setattr(_native, "run_copy_program_cuda", lambda *a: asked.append(a) or real(*a))
    plan, inputs = _synthetic()
    slot = _OnCuda(torch.full((plan.group_bytes,), STALE, dtype=torch.uint8))
    on_gpu = [_OnCuda(t) for t in inputs]
    assert native_copies.replay_natively(plan, on_gpu, slot, 0) is False
    assert "no CUDA driver" in native_copies.state.cuda_off
    assert native_copies.replay_natively(plan, on_gpu, slot, 0) is False
    assert len(asked) == 1
    assert native_copies.cuda_available() == (False, native_copies.state.cuda_off)
    assert bool((slot._t == STALE).all())


def test_a_strided_input_is_read_as_its_elements_and_a_too_fragmented_plan_keeps_the_torch_path(monkeypatch):
    """A strided view as an input (the torch views index an input's storage as if contiguous, the
    native program its bytes from the first element): the replay copies it contiguous first, then
    runs natively, and the bytes are right. A plan past MAX_DESCRIPTORS copies is not compiled
    and its group is replayed by the torch views, with the same bytes."""
    plan, inputs = _synthetic()
    expected = _reference_copy(plan.ops, plan.regions, plan.itemsizes, inputs, plan.group_bytes)
    strided = torch.stack([inputs[2], inputs[2] + 1], 1)[:, 0]
    assert not strided.is_contiguous() and torch.equal(strided, inputs[2])
    before = native_copies.state.host_groups
    slot = torch.full((plan.group_bytes,), STALE, dtype=torch.uint8)
    plan.replay(dict(zip(plan.inputs, [inputs[0], inputs[1], strided, inputs[3]])), slot, 0)
    assert torch.equal(slot, expected) and native_copies.state.host_groups == before + 1
    monkeypatch.setattr(native_copies, "MAX_DESCRIPTORS", 8)
    plan._program = None
    assert native_copies.program_of(plan) is None
    slot.fill_(STALE)
    plan.replay(dict(zip(plan.inputs, [inputs[0], inputs[1], strided, inputs[3]])), slot, 0)
    assert torch.equal(slot, expected) and native_copies.state.host_groups == before + 1


def test_a_slot_of_replayed_groups_is_one_native_call_with_the_loaders_bytes(tmp_path, monkeypatch):
    """The producer joins the programs of a slot's replayed groups: one native call fills the slot
    (per-group calls cost Python per group, the bound of a GPU slot), byte-equal to the loaders."""
    from test_copy_plan import _assert_equal

    cfg = _shrunk("qwen3-30b-a3b", str(tmp_path))
    replica = ModelReplicas().get(cfg, EngineLayout.parse("tp=2,ep=2"), 1)
    _produce(SlotProducer(UpdateTimes()), replica, _inputs(replica, 1))  # records the plans
    tensors = _inputs(replica, 3)
    calls = []
    real = native_copies._run
    monkeypatch.setattr(native_copies, "_run",
                        lambda native, args, *rest: calls.append(len(args[0])) or real(native, args, *rest))
    times = UpdateTimes()
    _assert_equal(_produce(SlotProducer(times), replica, tensors), _loader_bytes(replica, tensors), "joined slot")
    assert times.replayed == len(replica.groups) > 1
    assert len(calls) == 1 and calls[0] == sum(len(native_copies.program_of(p)) for p in plans_of(replica).plans.values())
    _produce(SlotProducer(UpdateTimes()), replica, tensors)  # the joined program is cached per placement
    assert len(calls) == 2 and len(native_copies._slot_programs) >= 1


def test_a_joined_plan_writing_past_its_own_group_is_refused_before_any_byte(tmp_path):
    """A plan (from disk: untrusted) whose descriptor stays inside the slot but reaches into the
    next group's bytes: refused when the slot's program is joined, naming the group; nothing written."""
    plan, inputs = _synthetic()
    other, _ = _synthetic()
    plan.ops.append((-1, 3, 64 * 64, 0, (1,), (1,), (0,)))  # one element past the group's end
    tensors = {n: t for n, t in zip(plan.inputs, inputs)}
    slot = torch.full((2 * plan.group_bytes + 4096,), STALE, dtype=torch.uint8)
    with pytest.raises(LayoutMismatch, match="group 7 writes outside"):
        native_copies.replay_slot([(plan, 0), (other, plan.group_bytes + 256 & ~255)], tensors, slot)
    assert bool((slot == STALE).all())


def test_a_joined_slot_with_an_input_it_cannot_read_is_left_to_the_per_group_path():
    """One strided input, or one on another device, among the slot's inputs: replay_slot writes
    nothing and says so (the producer then replays group by group, making inputs contiguous)."""
    plan, inputs = _synthetic()
    tensors = {n: t for n, t in zip(plan.inputs, inputs)}
    slot = torch.full((plan.group_bytes,), STALE, dtype=torch.uint8)
    strided = dict(tensors, w2=torch.stack([inputs[2], inputs[2]], 1)[:, 0])
    assert not strided["w2"].is_contiguous()
    assert not native_copies.replay_slot([(plan, 0)], strided, slot)
    assert not native_copies.replay_slot([(plan, 0)], dict(tensors, w1=inputs[1].to("meta")), slot)
    assert bool((slot == STALE).all())
    assert native_copies.replay_slot([(plan, 0)], tensors, slot)
    expected = _reference_copy(plan.ops, plan.regions, plan.itemsizes, inputs, plan.group_bytes)
    assert torch.equal(slot, expected)
