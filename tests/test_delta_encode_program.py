"""The fused compare (csrc/buffers/delta_codec.h, ``delta_encode_program``): a parameter's range of a
copy program compared with its base straight from the program's inputs gives the record, the stats
and the base that running the program into the slot and ``delta_encode`` (update_base) of the slot
give, byte for byte: over random programs of 1-D copies, strided 2-D rows (column shards, sources
read backwards or repeated), zero fills and several inputs, descriptors crossing the range's ends,
every unit and density, one and several threads. A range the program leaves a byte of unwritten is
refused (NOT_FOUND) with nothing read or written.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pweights import _native

OK = int(_native.Code.OK)
FRACTIONS = (0.0, 1e-4, 0.01, 0.2, 1.0)


def _inputs(rng: np.random.Generator, count: int, nbytes: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, int(rng.integers(nbytes // 2, nbytes + 1)), dtype=np.uint8) for _ in range(count)]


def _source(rng: np.random.Generator, size: int, row_bytes: int, rows: int) -> tuple[int, int]:
    """A source offset and pitch whose rows lie inside an input of ``size`` bytes: forwards, backwards
    or the same row repeated."""
    room = size - row_bytes
    if rows == 1:
        return int(rng.integers(0, room + 1)), 0
    kind = rng.integers(0, 3)
    if kind == 2 or row_bytes * (rows - 1) > room:
        return int(rng.integers(0, room + 1)), 0
    pitch = int(rng.integers(row_bytes, max(row_bytes, room // (rows - 1)) + 1))
    span = pitch * (rows - 1)
    if kind == 0:
        return int(rng.integers(0, room - span + 1)), pitch
    return int(rng.integers(span, room + 1)), -pitch


def random_program(rng: np.random.Generator, start: int, stop: int, inputs: list[np.ndarray],
                   big: bool = False) -> tuple[np.ndarray, int]:
    """Descriptors writing every byte of [start, end) once, in a random order, and that end (at or past
    ``stop``): 1-D copies, zero fills, blocks of strided 2-D rows split into column shards."""
    rows: list[list[int]] = []
    pos = start
    most = 400_000 if big else 3000
    while pos < stop:
        k = int(rng.integers(-1, len(inputs)))  # -1: a zero fill
        size = inputs[k].nbytes if k >= 0 else 1 << 40
        if rng.random() < 0.5:  # 1-D
            n = int(rng.integers(1, min(most, size) + 1))
            src, _ = _source(rng, size, n, 1) if k >= 0 else (0, 0)
            rows.append([k, pos, src, n, 1, 0, 0])
            pos += n
            continue
        nrows = int(rng.integers(2, 200 if big else 12))
        pitch = int(rng.integers(1, min(most // nrows, 256 if not big else 4096) + 2))
        cuts = sorted({0, pitch, *rng.integers(1, pitch + 1, size=int(rng.integers(0, 4))).tolist()})
        for a, b in zip(cuts, cuts[1:]):  # a column shard: bytes [a, b) of every row
            kk = int(rng.integers(-1, len(inputs)))
            if kk >= 0 and inputs[kk].nbytes < b - a:
                kk = -1
            src, sp = _source(rng, inputs[kk].nbytes, b - a, nrows) if kk >= 0 else (0, 0)
            rows.append([kk, pos + a, src, b - a, nrows, pitch, sp])
        pos += nrows * pitch
    order = rng.permutation(len(rows))
    return np.array([rows[i] for i in order], dtype=np.int64).reshape(-1, 7), pos


def _addrs(inputs: list[np.ndarray]) -> tuple[list[int], list[int]]:
    return [int(a.ctypes.data) for a in inputs], [int(a.nbytes) for a in inputs]


def _changed_base(rng: np.random.Generator, cur: np.ndarray, fraction: float) -> np.ndarray:
    base = cur.copy()
    if fraction >= 1.0:
        base[:] = rng.integers(0, 256, base.nbytes, dtype=np.uint8)
    elif fraction > 0:
        at = rng.choice(base.nbytes, max(1, int(base.nbytes * fraction)), replace=False)
        base[at] ^= rng.integers(1, 256, at.size, dtype=np.uint8)
    return base


def copy_then_encode(program, slot_bytes, inputs, offset, nbytes, base, unit, threads):
    """Today's path: the program into a slot (of garbage), then delta_encode of the range."""
    slot = np.random.default_rng(1).integers(0, 256, slot_bytes, dtype=np.uint8)
    addrs, sizes = _addrs(inputs)
    code, message = _native.run_copy_program_host(program, int(slot.ctypes.data), slot_bytes, addrs, sizes, threads)
    assert code == OK, message
    cur = slot[offset:offset + nbytes]
    need = int(_native.delta_max_encoded(nbytes))
    out = np.zeros(need, dtype=np.uint8)
    got = _native.delta_encode(int(cur.ctypes.data), int(base.ctypes.data), nbytes, unit, int(out.ctypes.data), need,
                               True, threads)
    return got, out[:got[2]].tobytes(), cur.copy()


def fused(program, slot_bytes, inputs, offset, nbytes, base, unit, threads):
    addrs, sizes = _addrs(inputs)
    need = int(_native.delta_max_encoded(nbytes))
    out = np.zeros(need, dtype=np.uint8)
    got = _native.delta_encode_program(program, slot_bytes, addrs, sizes, offset, nbytes, int(base.ctypes.data), unit,
                                       int(out.ctypes.data), need, threads)
    return got, out[:got[2]].tobytes() if got[0] == OK else b""


def _case(seed: int, fraction: float, unit: int, threads: int, big: bool = False):
    rng = np.random.default_rng(seed)
    inputs = _inputs(rng, int(rng.integers(1, 4)), 1 << 22 if big else 1 << 14)
    lead = int(rng.integers(0, 5000))
    span = int(rng.integers(2 << 20, 3 << 20)) if big else int(rng.integers(1, 200_000))
    program, stop = random_program(rng, 0, lead + span, inputs, big)
    # the range: from inside the tiling (descriptors may cross both its ends), a few bytes short of its end
    offset = int(rng.integers(0, lead + 1))
    nbytes = max(1, stop - offset - int(rng.integers(0, 300)))
    slot_bytes = stop + int(rng.integers(0, 1000))
    # the range's bytes as the program writes them, then a base that differs from them by `fraction`
    _, _, cur = copy_then_encode(program, slot_bytes, inputs, offset, nbytes, np.zeros(nbytes, np.uint8), unit, 1)
    base = _changed_base(rng, cur, fraction)
    want_base, got_base = base.copy(), base.copy()
    want, want_rec, _ = copy_then_encode(program, slot_bytes, inputs, offset, nbytes, want_base, unit, threads)
    got, got_rec = fused(program, slot_bytes, inputs, offset, nbytes, got_base, unit, threads)
    return want, want_rec, want_base, got, got_rec, got_base


@pytest.mark.parametrize("unit", (1, 2, 4, 8))
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_the_fused_compare_equals_copy_then_encode_byte_for_byte(unit, fraction):
    modes = set()
    for seed in range(12):
        want, want_rec, want_base, got, got_rec, got_base = _case(seed * 101 + unit, fraction, unit, 1)
        assert got == want, (seed, got, want)
        assert got_rec == want_rec, seed
        assert np.array_equal(got_base, want_base), seed
        modes.add(got[5])
    if fraction in (0.0, 1.0):
        assert modes == {"empty" if fraction == 0 else "dense"}


@pytest.mark.parametrize("unit", (1, 2, 4, 8))
@pytest.mark.parametrize("threads", (1, 2, 3))
@pytest.mark.parametrize("fraction", (0.0, 0.001, 0.05, 1.0))
def test_large_ranges_over_many_windows_and_threads_encode_the_same(unit, threads, fraction):
    want, want_rec, want_base, got, got_rec, got_base = _case(7 + unit * 13 + threads, fraction, unit, threads, big=True)
    assert got == want
    assert got_rec == want_rec
    assert np.array_equal(got_base, want_base)
    assert want[5] == ("empty" if fraction == 0 else "dense" if fraction == 1 else "runs")


def test_the_short_last_unit_and_a_range_that_is_one_descriptor_row():
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    for unit in (2, 4, 8):
        for nbytes in (1, 3, 7, 13, 515, 1027):
            program = np.array([[0, 10, 0, 9, 1, 0, 0], [-1, 19, 0, 1, 1, 0, 0], [0, 20, 100, nbytes, 1, 0, 0]],
                               dtype=np.int64)
            cur = src[100:100 + nbytes]
            base = cur.copy()
            base[-1] ^= 0xFF
            want_base, got_base = base.copy(), base.copy()
            want, want_rec, _ = copy_then_encode(program, 20 + nbytes, [src], 20, nbytes, want_base, unit, 1)
            got, got_rec = fused(program, 20 + nbytes, [src], 20, nbytes, got_base, unit, 1)
            assert (got, got_rec) == (want, want_rec)
            assert np.array_equal(got_base, cur)


def test_a_range_the_program_leaves_a_byte_of_unwritten_is_not_found_and_untouched():
    src = np.arange(256, dtype=np.uint8)
    program = np.array([[0, 0, 0, 100, 1, 0, 0], [0, 101, 0, 99, 1, 0, 0]], dtype=np.int64)  # byte 100 unwritten
    base = np.zeros(200, dtype=np.uint8)
    got, _ = fused(program, 200, [src], 0, 200, base, 1, 1)
    assert got[0] == int(_native.Code.NOT_FOUND) and "199 of the 200 bytes" in got[1]
    assert not base.any()
    got, _ = fused(program, 200, [src], 0, 100, base, 1, 1)  # the first descriptor's bytes alone: covered
    assert got[0] == OK and got[5] == "dense" and np.array_equal(base[:100], src[:100])
    # a strided block with a gap column
    program = np.array([[0, 0, 0, 3, 10, 4, 4]], dtype=np.int64)
    got, _ = fused(program, 40, [src], 0, 40, np.zeros(40, np.uint8), 1, 1)
    assert got[0] == int(_native.Code.NOT_FOUND)


def test_bad_programs_and_ranges_are_refused_before_anything_is_written():
    src = np.arange(256, dtype=np.uint8)
    base = np.zeros(64, dtype=np.uint8)
    overlapping = np.array([[0, 0, 0, 40, 1, 0, 0], [0, 30, 0, 34, 1, 0, 0]], dtype=np.int64)
    got, _ = fused(overlapping, 64, [src], 0, 64, base, 1, 1)
    assert got[0] == int(_native.Code.OUT_OF_REGION) and "overlapping" in got[1]
    program = np.array([[0, 0, 0, 64, 1, 0, 0]], dtype=np.int64)
    got, _ = fused(program, 64, [src], 32, 64, base, 1, 1)  # the range runs past the group
    assert got[0] == int(_native.Code.OUT_OF_REGION)
    past_input = np.array([[0, 0, 250, 64, 1, 0, 0]], dtype=np.int64)
    got, _ = fused(past_input, 64, [src], 0, 64, base, 1, 1)
    assert got[0] == int(_native.Code.OUT_OF_REGION)
    got, _ = fused(program, 64, [src], 0, 64, base, 3, 1)
    assert got[0] == int(_native.Code.INVALID_ARGUMENT)
    inside = src[:64]  # base is the program's own input
    got, _ = fused(program, 64, [src], 0, 64, inside, 1, 1)
    assert got[0] == int(_native.Code.INVALID_ARGUMENT) and "overlaps copy input" in got[1]
    assert not base.any() and np.array_equal(src, np.arange(256, dtype=np.uint8))


def _sharded(rng: np.random.Generator, rows: int, widths: list[int], inputs: list[np.ndarray]) -> np.ndarray:
    """A 2-D block of ``rows`` rows whose columns come from several inputs (a column-sharded weight),
    each input's rows strided twice as wide as the shard."""
    pitch, at, out = sum(widths), 0, []
    for k, w in enumerate(widths):
        out.append([k % len(inputs), at, int(rng.integers(0, 64)) * 8, w, rows, pitch, 2 * w])
        at += w
    return out


@pytest.mark.parametrize("unit", (1, 2, 4, 8))
@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("fraction", (0.0, 0.002, 0.3, 1.0))
def test_rows_read_in_place_and_rows_made_in_a_buffer_encode_the_same(unit, threads, fraction):
    """Column shards whose rows start and end on whole scan groups are compared in place from the
    inputs; a block whose rows do not (and zero fills) goes through the window buffer; both within
    one range, in either order."""
    rng = np.random.default_rng(unit * 10 + threads)
    inputs = _inputs(rng, 3, 1 << 23)
    aligned = _sharded(rng, 512, [1024, 2048], inputs)  # rows of 3 KiB: whole groups for every unit
    block = 512 * 3072
    odd = [[r[0], r[1] + block, r[2], r[3], r[4], r[5], r[6]] for r in _sharded(rng, 300, [1000, 77], inputs)]
    tail = block + 300 * 1077
    program = np.array(aligned + odd + [[-1, tail, 0, 5000, 1, 0, 0], [1, tail + 5000, 4096, 3 << 20, 1, 0, 0],
                                        *[[r[0], r[1] + tail + 5000 + (3 << 20), r[2], r[3], r[4], r[5], r[6]]
                                          for r in _sharded(rng, 200, [512, 1536], inputs)]], dtype=np.int64)
    slot_bytes = tail + 5000 + (3 << 20) + 200 * 2048
    for offset, nbytes in ((0, slot_bytes), (block - 4096, slot_bytes - block + 4096 - 13), (tail + 5000, 3 << 20)):
        _, _, cur = copy_then_encode(program, slot_bytes, inputs, offset, nbytes, np.zeros(nbytes, np.uint8), unit, 1)
        base = _changed_base(rng, cur, fraction)
        want_base, got_base = base.copy(), base.copy()
        want, want_rec, _ = copy_then_encode(program, slot_bytes, inputs, offset, nbytes, want_base, unit, threads)
        got, got_rec = fused(program, slot_bytes, inputs, offset, nbytes, got_base, unit, threads)
        assert got == want, (offset, got, want)
        assert got_rec == want_rec, offset
        assert np.array_equal(got_base, want_base), offset


def test_a_deferred_replay_compares_and_runs_each_parameter_as_the_whole_program_would():
    """copyplans.DeferredReplay: each parameter's range gets the descriptors writing into it (one may
    cross two parameters), its record equals the replayed slot's, ``run`` writes the range's bytes as
    the whole program does, and a range the program leaves unwritten is None (the caller's fallback)."""
    from types import SimpleNamespace

    from p2pweights.copyplans import DeferredReplay
    from p2pweights.copyplans.program import SlotProgram

    rng = np.random.default_rng(11)
    inputs = _inputs(rng, 3, 1 << 16)
    program = np.array([[0, 0, 0, 1200, 1, 0, 0],              # params 0 and 1: [0, 1200)
                        [1, 1200, 64, 256, 6, 512, 256],       # param 1: two column shards of 6 rows
                        [2, 1456, 4096, 256, 6, 512, 512],
                        [2, 1200 + 6 * 512, 100, 5000 - 1200 - 6 * 512, 1, 0, 0],
                        [-1, 5000, 0, 3000, 1, 0, 0],          # param 2: a zero fill, then a copy
                        [1, 8000, 9, 1000, 1, 0, 0]], dtype=np.int64)
    ranges = [(0, 1000), (1000, 4000), (5000, 4000), (9000, 100)]  # the last: nothing writes it
    slot_bytes = 9100
    slot = np.zeros(slot_bytes, dtype=np.uint8)
    addrs, sizes = _addrs(inputs)
    joined = SlotProgram((), program, ("a", "b", "c"))
    placed = [(SimpleNamespace(first_parameter="p0"), 0)]
    deferred = DeferredReplay(placed, joined, inputs, program, int(slot.ctypes.data), slot_bytes, addrs, sizes, 2)
    want_slot = np.zeros(slot_bytes, dtype=np.uint8)
    assert _native.run_copy_program_host(program, int(want_slot.ctypes.data), slot_bytes, addrs, sizes, 1)[0] == OK
    assert len(deferred.piece(0, 1000)[0]) == 1 and len(deferred.piece(1000, 4000)[0]) == 4
    for unit in (1, 2, 4, 8):
        for offset, nbytes in ranges[:3]:
            cur = want_slot[offset:offset + nbytes]
            base = _changed_base(rng, cur, 0.05)
            want_base, got_base = base.copy(), base.copy()
            need = int(_native.delta_max_encoded(nbytes))
            want_out, got_out = np.zeros(need, np.uint8), np.zeros(need, np.uint8)
            want = _native.delta_encode(int(cur.ctypes.data), int(want_base.ctypes.data), nbytes, unit,
                                        int(want_out.ctypes.data), need, True, 1)
            got = deferred.encode(offset, nbytes, got_base, unit, got_out, 2)
            assert got == tuple(want[2:]) and np.array_equal(got_base, want_base)
            assert got_out[:got[0]].tobytes() == want_out[:want[2]].tobytes()
    assert not slot.any()  # compared without writing the slot
    assert deferred.encode(9000, 100, np.zeros(100, np.uint8), 1, np.zeros(148, np.uint8), 1) is None
    for offset, nbytes in ranges[:3]:
        deferred.run(offset, nbytes)
        assert np.array_equal(slot[offset:offset + nbytes], want_slot[offset:offset + nbytes])
    assert (deferred.encoded, deferred.ran) == (12, 3)
