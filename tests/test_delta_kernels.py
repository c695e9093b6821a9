"""The GPU delta kernels (csrc/kernels/delta_find.cu via deltas/kernels.py) against the torch path
they replace (deltas/index_records.py): the same positions, values and count, the bases moved on
byte for byte, the same payload checksum. The engine side's (csrc/kernels/delta_apply.cu via
deltas/index_apply.py) against torch: the same weights after an area's apply, the same refusals
with nothing applied, and a GPU area read from the device twice whatever its records. The compare
needs a CUDA device and a native module built with nvcc (the H200 runs:
benchmarks/gpu/run_on_device.sh tests); the argument checks run anywhere."""
from __future__ import annotations

import pytest
import torch

from p2pweights import _native
from p2pweights.deltas import index_records as ir
from p2pweights.deltas import kernels
from p2pweights.errors import P2PWeightsError

GPU = torch.cuda.is_available() and _native.delta_kernels_embedded()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and the native module's delta kernels")


def test_a_unit_the_kernels_do_not_take_is_refused_before_any_launch():
    code, message = _native.delta_find_count(8, 1, 3, 8, 8, 1, 0)
    assert code == int(_native.Code.INVALID_ARGUMENT) and "unit" in message


def test_an_area_launch_without_records_is_refused_before_it_is_made():
    code, message = _native.delta_records_check(0, 0, 0, 1, 0)
    assert code == int(_native.Code.INVALID_ARGUMENT) and "no records" in message
    code, message = _native.delta_records_apply(0, 0, 0, 1, 0)
    assert code == int(_native.Code.INVALID_ARGUMENT) and "no records" in message


def test_cpu_tensors_never_take_the_kernels():
    t = torch.zeros(64, dtype=torch.uint8)
    assert not kernels.usable(t, t)


def _pair(words: list[int], fraction: float, unit: int, seed: int):
    """A slot and a base holding params of ``words`` 8-byte words each at 256-byte boundaries, the
    base differing in about ``fraction`` of the unit-sized elements; the params' (slot, base, bytes)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    params, at_slot, at_base = [], 512, 256  # offsets differ: the slot and base rows are not the same
    for w in words:
        params.append((at_slot, at_base, 8 * w))
        at_slot += -(-8 * w // 256) * 256 + 256
        at_base += -(-8 * w // 256) * 256
    slot = torch.randint(0, 256, (at_slot,), dtype=torch.uint8, device="cuda", generator=g)
    base = torch.zeros(at_base, dtype=torch.uint8, device="cuda")
    dt = ir._dtype(unit)
    for so, bo, n in params:
        base[bo:bo + n] = slot[so:so + n]
        elems = base[bo:bo + n].view(dt)
        flip = torch.rand(elems.numel(), device="cuda", generator=g) < fraction
        elems[flip] = elems[flip] ^ 1  # changes the element (the low bit of its first byte)
    return slot, base, params


def _find(slot, base, params, unit, limit, use_kernels, into=None):
    kernels.ENABLED = use_kernels
    try:
        b = base.clone()
        found = ir.find_changes(slot, b, params, unit, limit, into)
        torch.cuda.synchronize()
        return found, b
    finally:
        kernels.ENABLED = True


@needs_gpu
@pytest.mark.parametrize("unit", [1, 2, 4])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.3, 1.0])
def test_the_kernels_find_what_torch_finds(unit, fraction):
    words = [1, 31, 4095, 4096, 4097, 50_000, 3]  # partial, whole and several blocks per param
    slot, base, params = _pair(words, fraction, unit, seed=int(fraction * 1000) + unit)
    got, got_base = _find(slot, base, params, unit, None, True)
    want, want_base = _find(slot, base, params, unit, None, False)
    assert got.count == want.count and got.elements == want.elements
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.values, want.values)
    for so, bo, n in params:  # the bases moved on: every byte the slot's
        assert torch.equal(got_base[bo:bo + n], slot[so:so + n])
    assert torch.equal(got_base, want_base)
    if fraction == 0.0:
        assert got.count == 0
    elif fraction >= 0.3:
        assert got.count > 0


@needs_gpu
def test_more_changes_than_the_limit_copy_the_bases_whole():
    slot, base, params = _pair([5000, 7000], 0.2, 2, seed=3)
    got, got_base = _find(slot, base, params, 2, 10, True)
    assert got.positions is None and got.count > 10
    for so, bo, n in params:
        assert torch.equal(got_base[bo:bo + n], slot[so:so + n])


@needs_gpu
@pytest.mark.parametrize("words", [1, 255, 256, 257, 300_000])
def test_the_checksum_kernel_equals_the_torch_expression(words):
    payload = torch.randint(0, 256, (8 * words,), dtype=torch.uint8, device="cuda")
    got = int(kernels.checksum(payload))
    kernels.ENABLED = False
    try:
        want = int(ir.checksum(payload))
    finally:
        kernels.ENABLED = True
    assert got == want
    payload[8 * (words // 2)] ^= 1
    assert int(kernels.checksum(payload)) != got


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if GPU else []))
def test_bases_moved_on_in_full_take_every_byte_of_their_params_and_no_other(device):
    slot = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=device)
    base = torch.zeros(4096, dtype=torch.uint8, device=device)
    params = [(0, 1024, 256), (512, 0, 8), (2048, 2048, 1000), (3500, 3200, 0)]
    kernels.copy_spans(slot, base, params)
    want = torch.zeros_like(base)
    for so, bo, n in params:
        want[bo:bo + n] = slot[so:so + n]
    assert torch.equal(base, want)


@needs_gpu
@pytest.mark.parametrize("unit", [1, 2, 4])
def test_a_payload_gathered_in_place_is_the_payload_torch_writes(unit):
    slot, base, params = _pair([3, 4097, 700], 0.03, unit, seed=5 + unit)
    placed = []

    def into(count):
        out = torch.full((ir.payload_bytes(count, unit) + 8,), 0xAB, dtype=torch.uint8, device="cuda")[8:]
        placed.append(out)  # stale bytes in the padding: the gather must zero it
        return out

    got, _ = _find(slot, base, params, unit, None, True, into=into)
    want, _ = _find(slot, base, params, unit, None, False)
    assert placed and got.count == want.count > 0
    check = int(ir.write_payload(got, placed[0]))
    out = torch.empty(ir.payload_bytes(want.count, unit), dtype=torch.uint8, device="cuda")
    assert check == int(ir.write_payload(want, out))
    assert torch.equal(placed[0], out)


# -- the engine side: an area's index records checked and applied (delta_apply.cu, index_apply.py) --
class GpuRank:
    """An engine rank on the GPU: weights in ``regions`` tensors and a GPU delta area holding
    ``records`` index records written as a sender writes them (offsets in the manifest), each over
    three parameters spread across the regions, ``fraction`` of their elements changed."""

    def __init__(self, unit: int, fraction: float, records: int = 3, regions: int = 2, seed: int = 0,
                 edit=None, rows=None):
        import hashlib

        from p2pweights.deltas.area import PREFIX, DeltaArea

        g = torch.Generator(device="cuda").manual_seed(seed)
        size = max(1 << 20, 3 * records * (64 << 10))
        self.weights = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=g)
                        for _ in range(regions)]
        self.want = [w.clone() for w in self.weights]
        self.area = DeltaArea(8 << 20, device="cuda")
        digest, checks, self.offsets, cursor = hashlib.sha256(), [], [], 0
        for r in range(records):
            places = [(k % regions, (3 * r + k) * (64 << 10), n) for k, n in enumerate((65536, 296, 20008))]
            new = torch.cat([self.want[reg][o:o + n] for reg, o, n in places])
            old = new.clone()
            elems = old.view(ir._dtype(unit))
            flip = torch.rand(elems.numel(), device="cuda", generator=g) < fraction
            elems[flip] ^= 1
            for (reg, o, n), at in zip(places, _starts(places)):
                self.weights[reg][o:o + n] = old[at:at + n]
            found = ir.find_changes(new, old, [(at, at, n) for (_, _, n), at in zip(places, _starts(places))], unit)
            table = [(at // unit, n // unit, self.weights[reg].data_ptr() + o)
                     for (reg, o, n), at in zip(places, _starts(places))]
            if rows is not None:
                table = rows(r, table, self.weights)
            nrec = ir.record_bytes(len(table), found.count, unit)
            head = PREFIX.pack(0, nrec) + ir.header_and_table(found, table)
            self.area.tensor[cursor:cursor + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).cuda()
            payload = self.area.tensor[cursor + len(head):cursor + PREFIX.size + nrec]
            check = ir.write_payload(found, payload)
            if edit is not None and edit(r, found.count, payload):
                check = ir.checksum(payload)  # the owner's own bytes, broken: its word matches them
            digest.update(head)
            checks.append(check)
            self.offsets.append(cursor)
            cursor += PREFIX.size + nrec
        self.before = [w.clone() for w in self.weights]
        digest.update(ir.checksum_words(checks))
        self.digest, self.bytes, self.records = digest.hexdigest(), cursor, records

    def apply(self, use_kernels: bool, offsets: bool = True) -> dict:
        from p2pweights.deltas.area import Manifest

        for w, b in zip(self.weights, self.before):
            w.copy_(b)
        kernels.ENABLED = use_kernels
        try:
            manifest = Manifest(self.bytes, self.records, self.digest, tuple(self.offsets) if offsets else None)
            return self.area.apply(manifest, [(w.data_ptr(), w.numel()) for w in self.weights], self.weights)
        finally:
            kernels.ENABLED = True


def _starts(places):
    out, at = [], 0
    for _, _, n in places:
        out.append(at)
        at += n
    return out


APPLY_GPU = GPU and _native.delta_apply_kernels_embedded()
needs_apply_kernels = pytest.mark.skipif(not APPLY_GPU, reason="needs a CUDA device and the engine-side kernels")


@needs_apply_kernels
@pytest.mark.parametrize("unit", [1, 2, 4])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.03, 0.6, 1.0])
def test_the_area_kernels_apply_what_torch_applies(unit, fraction):
    rank = GpuRank(unit, fraction, records=4, seed=int(fraction * 100) + unit)
    got = rank.apply(True)
    by_kernels = [w.clone() for w in rank.weights]
    again = rank.apply(False)
    assert got["index_path"] == "kernels" and again["index_path"] == "torch"
    for k, (a, b, want) in enumerate(zip(by_kernels, rank.weights, rank.want)):
        assert torch.equal(a, want), f"kernels: region {k}"
        assert torch.equal(b, want), f"torch: region {k}"


@needs_apply_kernels
@pytest.mark.parametrize("records", [1, 24])
def test_a_gpu_area_is_read_from_the_device_twice_whatever_its_records(records):
    rank = GpuRank(2, 0.01, records=records, regions=1, seed=records)
    for use_kernels in (True, False):
        assert rank.apply(use_kernels)["device_reads"] == 2  # every window, then every verdict
        assert all(torch.equal(w, want) for w, want in zip(rank.weights, rank.want))
    walked = rank.apply(True, offsets=False)  # an owner that names no offsets: one read per record more
    assert walked["device_reads"] == records + 2
    assert all(torch.equal(w, want) for w, want in zip(rank.weights, rank.want))


def _swap(r, count, payload):
    if r != 1:
        return False
    pos = payload[:4 * count].view(torch.int32)
    pos[0], pos[1] = int(pos[1]), int(pos[0])
    return True


def _past(r, count, payload):
    if r == 2:
        payload[:4 * count].view(torch.int32)[-1] = (65536 + 296 + 20008) // 2
    return r == 2


def _negative(r, count, payload):
    if r == 0:
        payload[:4 * count].view(torch.int32)[0] = -1
    return r == 0


def _outside(r, table, weights):
    past = max(w.data_ptr() + w.numel() for w in weights)  # the regions may lie side by side: past them all
    return table if r != 1 else table[:2] + [(table[2][0], table[2][1], past)]


def _misaligned(r, table, weights):
    return table if r != 2 else [(table[0][0], table[0][1], table[0][2] + 1)] + table[1:]


@needs_apply_kernels
@pytest.mark.parametrize("fault", ["swap", "past", "negative", "late write", "outside", "misaligned"])
def test_the_kernels_refuse_what_torch_refuses_and_apply_nothing(fault):
    edit = {"swap": _swap, "past": _past, "negative": _negative}.get(fault)
    rows = {"outside": _outside, "misaligned": _misaligned}.get(fault)
    rank = GpuRank(2, 0.02, records=3, seed=9, edit=edit, rows=rows)
    if fault == "late write":  # a payload byte changed after the owner's word: its checksum differs
        rank.area.tensor[rank.offsets[1] + 200] ^= 1
    refusals = []
    for use_kernels in (True, False):
        with pytest.raises(P2PWeightsError) as e:
            rank.apply(use_kernels)
        refusals.append((type(e.value), str(e.value)))
        assert all(torch.equal(w, b) for w, b in zip(rank.weights, rank.before)), "a refused area changed the weights"
    assert refusals[0] == refusals[1]
