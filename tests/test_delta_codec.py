"""Delta records (csrc/buffers/delta_codec.h, p2pweights.deltas): exact round trips at every density
and unit, the mode picked, base := cur on the way, the same record for any thread count, and
records that arrive torn, corrupted or forged refused before a byte of dst changes. A pure-Python
reference of the format (hash, varints, parser) is the spec the native code is held to.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from p2pweights import _native, deltas
from p2pweights.deltas.codec import HEADER, HEADER_BYTES, MAGIC, UNITS
from p2pweights.errors import InvalidWrite, OutOfRegion

M64 = (1 << 64) - 1
P1, P2, P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
FRACTIONS = (0.0, 1e-4, 0.01, 0.03, 0.1, 0.5, 1.0)


# ---- the reference: the format as delta_codec.h writes it down -------------------------------

def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def _mix(acc: int, w: int) -> int:
    return _rotl((acc + w * P2) & M64, 31) * P1 & M64


def ref_hash(data: bytes, seed: int = 0) -> int:
    n, i = len(data), 0
    v = [(seed + P1 * (k + 1)) & M64 for k in range(4)]
    while i + 32 <= n:
        v = [_mix(v[k], int.from_bytes(data[i + 8 * k:i + 8 * k + 8], "little")) for k in range(4)]
        i += 32
    h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & M64
    h ^= n * P3 & M64
    while i < n:
        h = (_rotl(h ^ _mix(0, int.from_bytes(data[i:i + 8], "little")), 27) * P1 + P3) & M64
        i += 8
    h ^= h >> 33
    h = h * P2 & M64
    h ^= h >> 29
    h = h * P3 & M64
    return h ^ (h >> 32)


def varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def read_varint(buf: bytes, q: int) -> tuple[int, int] | None:
    r = 0
    for i in range(10):
        if q >= len(buf):
            return None
        b = buf[q]
        q += 1
        if i == 9 and b > 1:
            return None
        r |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return None if b == 0 and i > 0 else (r, q)
    return None


def seal(rec: bytearray) -> bytearray:
    """Rewrites the checksum of a record (of its header and as much of its payload as it holds)."""
    payload_bytes = HEADER.unpack(bytes(rec[:HEADER_BYTES]))[6]
    payload = bytes(rec[HEADER_BYTES:HEADER_BYTES + payload_bytes])
    rec[40:48] = ref_hash(payload, ref_hash(bytes(rec[:40]))).to_bytes(8, "little")
    return rec


def record(payload: bytes, *, slot: int, mode: int = 1, unit: int = 2, runs: int = 1, magic: bytes = MAGIC,
           version: int = 1, reserved: int = 0, payload_bytes: int | None = None) -> bytearray:
    pb = len(payload) if payload_bytes is None else payload_bytes
    return seal(bytearray(HEADER.pack(magic, version, mode, unit, reserved, slot, pb, runs, 0) + payload))


def runs_payload(runs) -> bytes:
    """(gap, length, value bytes) per run."""
    return b"".join(varint(g) + varint(n) + bytes(v) for g, n, v in runs)


def ref_apply(rec: bytes, dst: np.ndarray) -> np.ndarray | None:
    """dst after the record, or None where the format refuses it."""
    n = dst.nbytes
    if len(rec) < HEADER_BYTES:
        return None
    magic, version, mode, unit, reserved, slot, pb, rc, checksum = HEADER.unpack(rec[:HEADER_BYTES])
    if magic != MAGIC or version != 1 or mode > 2 or unit not in UNITS or reserved or slot != n:
        return None
    if pb > len(rec) - HEADER_BYTES:
        return None
    payload = rec[HEADER_BYTES:HEADER_BYTES + pb]
    if (mode == 0 and (pb or rc)) or (mode == 2 and (pb != n or rc != 1)) or (mode == 1 and not 0 < rc <= pb // 3):
        return None
    if ref_hash(payload, ref_hash(rec[:40])) != checksum:
        return None
    out = dst.copy()
    if mode == 2:
        out[:] = np.frombuffer(payload, np.uint8)
    if mode != 1:
        return out
    units, q, prev = -(-n // unit), 0, 0
    for i in range(rc):
        gap = read_varint(payload, q)
        length = gap and read_varint(payload, gap[1])
        if not gap or not length or length[0] == 0 or (i and gap[0] == 0):
            return None
        start, q = prev + gap[0], length[1]
        if start >= units or length[0] > units - start:
            return None
        b0, b1 = start * unit, min((start + length[0]) * unit, n)
        if q + b1 - b0 > len(payload):
            return None
        out[b0:b1] = np.frombuffer(payload[q:q + b1 - b0], np.uint8)
        q, prev = q + b1 - b0, start + length[0]
    return out if q == len(payload) else None


# ---- helpers -----------------------------------------------------------------------------------

def slot_pair(n: int, unit: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """(base, cur, changed units): one byte changed in each of round(fraction * units) units."""
    base = rng.integers(0, 256, n, dtype=np.uint8)
    cur = base.copy()
    units = -(-n // unit)
    k = 0 if fraction == 0 else max(1, round(fraction * units))
    idx = rng.choice(units, k, replace=False)
    off = np.minimum(idx * unit + rng.integers(0, unit, k), n - 1)
    cur[off] ^= rng.integers(1, 256, k, dtype=np.uint8)
    return base, cur, k


def expected_changed_bytes(base: np.ndarray, cur: np.ndarray, unit: int) -> int:
    n = base.nbytes
    pad = -n % unit
    diff = np.concatenate([base ^ cur, np.zeros(pad, np.uint8)]).reshape(-1, unit).any(axis=1)
    return int(diff.sum()) * unit - (pad if diff.size and diff[-1] else 0)


def assert_refused(rec, dst: np.ndarray, cls=InvalidWrite, match: str | None = None) -> None:
    before = dst.copy()
    rec = bytes(rec)
    with pytest.raises(cls, match=match):
        deltas.check(rec, dst.nbytes)
    with pytest.raises(cls, match=match):
        deltas.apply(rec, dst)
    assert np.array_equal(dst, before), "a refused record changed dst"


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_round_trip_is_exact_at_every_density(fraction, unit):
    rng = np.random.default_rng(int(fraction * 1e6) * 10 + unit)
    base, cur, k = slot_pair(100_003, unit, fraction, rng)
    rec = deltas.encode(cur, base, unit)
    dst = base.copy()
    deltas.apply(rec, dst)
    assert np.array_equal(dst, cur)
    assert np.array_equal(ref_apply(bytes(rec), base), cur)
    assert rec.stats.changed_bytes == expected_changed_bytes(base, cur, unit)
    if k == 0 or fraction == 1.0:
        assert rec.stats.mode == ("empty" if k == 0 else "dense")
    elif fraction <= 0.03:
        assert rec.stats.mode == "runs" and len(rec) < HEADER_BYTES + cur.nbytes
    else:  # runs only where smaller than the slot
        assert rec.stats.mode == "dense" or len(rec) < HEADER_BYTES + cur.nbytes
    assert deltas.header(rec).slot_nbytes == cur.nbytes and len(rec) == rec.stats.encoded_bytes


def test_no_change_is_an_empty_record_of_the_header_alone():
    base = np.arange(4099, dtype=np.uint8)
    rec = deltas.encode(base.copy(), base, 2)
    assert (rec.stats.mode, rec.stats.runs, len(rec), rec.stats.changed_bytes) == ("empty", 0, HEADER_BYTES, 0)


def test_a_slot_mostly_changed_is_dense_and_a_sparse_one_is_runs_smaller_than_the_slot():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, 65_537, dtype=np.uint8)
    cur = base ^ 0x01
    cur[::20] = base[::20]  # 90% of the units changed, the unchanged ones alone: one run would hold it all
    dense = deltas.encode(cur, base, 2)
    assert dense.stats.mode == "dense" and len(dense) == HEADER_BYTES + cur.nbytes and dense.stats.runs == 1
    base, cur, k = slot_pair(65_537, 2, 0.02, rng)
    sparse = deltas.encode(cur, base, 2)
    assert sparse.stats.mode == "runs" and len(sparse) < HEADER_BYTES + cur.nbytes
    assert 0 < sparse.stats.runs <= k


@pytest.mark.parametrize("unit", UNITS)
def test_changes_at_the_first_and_the_short_last_byte(unit):
    n = 8 * 1001 + 3  # the last unit is short for units 2, 4 and 8
    base = np.random.default_rng(unit).integers(0, 256, n, dtype=np.uint8)
    cur = base.copy()
    cur[0] ^= 0xFF
    cur[-1] ^= 0x01
    rec = deltas.encode(cur, base, unit)
    assert rec.stats.mode == "runs" and rec.stats.runs == 2
    assert rec.stats.changed_bytes == unit + (n % unit or unit)
    dst = base.copy()
    deltas.apply(rec, dst)
    assert np.array_equal(dst, cur)


def test_gaps_cheaper_than_a_run_header_are_written_as_one_run():
    base = np.zeros(1000, np.uint8)
    cur = base.copy()
    cur[[100, 102, 500]] = 1  # unit 1: a gap of one byte joins 100 and 102; 500 is a run of its own
    rec = deltas.encode(cur, base, 1)
    assert rec.stats.runs == 2 and rec.stats.changed_bytes == 3
    dst = base.copy()
    deltas.apply(rec, dst)
    assert np.array_equal(dst, cur)


@pytest.mark.parametrize("fraction", (0.0, 0.01, 0.5, 1.0))
def test_update_base_leaves_base_equal_to_cur(fraction):
    base, cur, _ = slot_pair(300_001, 2, fraction, np.random.default_rng(7))
    old = base.copy()
    rec = deltas.encode(cur, base, 2, update_base=True)
    assert np.array_equal(base, cur)
    deltas.apply(rec, old)
    assert np.array_equal(old, cur)


@pytest.mark.parametrize("fraction", (0.001, 0.2, 0.45, 1.0))
def test_the_record_is_the_same_for_any_thread_count(fraction):
    base, cur, _ = slot_pair((5 << 20) + 5, 2, fraction, np.random.default_rng(11))
    one = deltas.encode(cur, base, 2, threads=1)
    for threads in (2, 3, 4, 7):
        b = base.copy()
        many = deltas.encode(cur, b, 2, threads=threads, update_base=True)
        assert bytes(many) == bytes(one) and many.stats == one.stats, threads
        assert np.array_equal(b, cur)
    dst = base.copy()
    deltas.apply(one, dst)
    assert np.array_equal(dst, cur)


def test_runs_joined_across_thread_parts_match_one_scan():
    n = 4 << 20
    base = np.zeros(n, np.uint8)
    cur = base.copy()
    for part_edge in range(1 << 20, n, 1 << 20):  # changes on both sides of every part's edge
        cur[part_edge - 2:part_edge + 2] = 7
        cur[part_edge + 3] = 9
    one = deltas.encode(cur, base, 1, threads=1)
    assert bytes(deltas.encode(cur, base, 1, threads=4)) == bytes(one)
    dst = base.copy()
    deltas.apply(one, dst)
    assert np.array_equal(dst, cur)


def test_runs_that_would_outgrow_the_slot_are_dense_for_any_thread_count():
    n = (4 << 20) + 13
    base = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    cur = base ^ 0x11
    cur[(np.arange(n) % 16387) < 3] = base[(np.arange(n) % 16387) < 3]  # runs of 16384 (3-byte lengths), gaps of 3
    records = []
    for threads in (1, 4):
        b = base.copy()
        records.append(deltas.encode(cur, b, 1, threads=threads, update_base=True))
        assert np.array_equal(b, cur)
    assert bytes(records[0]) == bytes(records[1])
    assert records[0].stats.mode == "dense" and records[0].stats.changed_bytes == int((cur != base).sum())


def test_torch_bf16_tensors_encode_and_apply():
    torch = pytest.importorskip("torch")
    base = torch.randn(4097, dtype=torch.bfloat16)
    cur = base.clone()
    cur[::97] += 1.0
    rec = deltas.encode(cur, base, 2)
    dst = base.clone()
    deltas.apply(rec, dst)
    assert torch.equal(dst.view(torch.int16), cur.view(torch.int16))
    with pytest.raises(InvalidWrite, match="not contiguous"):
        deltas.encode(cur[::2], base[::2], 2)


def test_bad_encode_arguments_are_refused():
    a, b = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    with pytest.raises(InvalidWrite, match="unit 3"):
        deltas.encode(a, b, 3)
    with pytest.raises(InvalidWrite, match="needed"):
        deltas.encode(a, b, 2, out=np.zeros(100, np.uint8))
    with pytest.raises(InvalidWrite, match="64 bytes and base 32"):
        deltas.encode(a, b[:32], 2)
    b.flags.writeable = False
    with pytest.raises(InvalidWrite, match="read-only"):
        deltas.encode(a, b, 2, update_base=True)
    assert deltas.max_encoded(1000) == HEADER_BYTES + 1000


def test_the_native_hash_is_the_reference_hash():
    data = bytes(range(256)) * 3
    for n in (0, 1, 7, 8, 31, 32, 33, 100, 768):
        arr = np.frombuffer(data[:n] or b"\0", np.uint8)
        assert _native.delta_hash(arr.ctypes.data, n, 5) == ref_hash(data[:n], 5), n


# ---- hostile records ---------------------------------------------------------------------------

N = 1001  # the destination's bytes; unit 2: 501 units, the last one short


def good_runs_record() -> bytearray:
    return record(runs_payload([(3, 2, b"abcd"), (10, 1, b"xy")]), slot=N, runs=2)


def test_a_record_cut_anywhere_is_refused():
    rec = good_runs_record()
    dst = np.zeros(N, np.uint8)
    for cut in range(len(rec)):
        assert_refused(rec[:cut], dst)


def test_every_single_byte_corruption_is_refused():
    rec = good_runs_record()
    dst = np.zeros(N, np.uint8)
    for i in range(len(rec)):
        bad = bytearray(rec)
        bad[i] ^= 0x10
        before = dst.copy()
        with pytest.raises((InvalidWrite, OutOfRegion)):
            deltas.apply(bytes(bad), dst)
        assert np.array_equal(dst, before), i


@pytest.mark.parametrize("field, value, match", [
    ("magic", b"P2PX", "bad magic"),
    ("version", 2, "format version 2"),
    ("mode", 3, "unknown mode 3"),
    ("mode", 0xFFFF, "unknown mode"),
    ("unit", 0, "unit 0"),
    ("unit", 3, "unit 3"),
    ("unit", 16, "unit 16"),
    ("reserved", 1, "reserved"),
])
def test_bad_header_fields_are_refused_by_name(field, value, match):
    rec = record(runs_payload([(0, 1, b"ab")]), slot=N, **{field: value})
    assert_refused(rec, np.zeros(N, np.uint8), match=match)


def test_a_record_of_another_slot_size_is_out_of_region():
    rec = record(runs_payload([(0, 1, b"ab")]), slot=N + 1)
    assert_refused(rec, np.zeros(N, np.uint8), OutOfRegion, match="slot_nbytes 1002")


@pytest.mark.parametrize("runs, match", [
    ([(501, 1, b"ab")], "run 0 starts past"),  # unit 501 does not exist
    ([(500, 2, b"abc")], "run 0 .* ends past"),  # the short last unit, then one more
    ([(0, 1, b"ab"), (M64 - 3, 1, b"ab")], "run 1 starts past"),  # a gap that wraps: a run before the last
])
def test_runs_outside_the_slot_are_out_of_region(runs, match):
    assert_refused(record(runs_payload(runs), slot=N, runs=len(runs)), np.zeros(N, np.uint8), OutOfRegion, match)


@pytest.mark.parametrize("runs, match", [
    ([(0, 2, b"abcd"), (0, 1, b"ef")], "run 1 touches"),  # gap 0: joined or overlapping
    ([(0, 0, b""), (1, 1, b"ab")], "run 0 is empty"),
])
def test_touching_and_empty_runs_are_refused(runs, match):
    assert_refused(record(runs_payload(runs), slot=N, runs=len(runs)), np.zeros(N, np.uint8), InvalidWrite, match)


def test_the_short_last_unit_is_written_with_its_own_bytes_only():
    rec = record(runs_payload([(500, 1, b"z")]), slot=N)
    dst = np.zeros(N, np.uint8)
    deltas.apply(bytes(rec), dst)
    assert dst[-1] == ord("z") and not dst[:-1].any()


def test_payload_length_lies_are_refused():
    dst = np.zeros(N, np.uint8)
    good = runs_payload([(3, 2, b"abcd")])
    assert_refused(record(good, slot=N, payload_bytes=len(good) + 1), dst, match="pass the record")
    assert_refused(record(good[:-1], slot=N), dst, match="run 0 needs 4 bytes")
    assert_refused(record(good + b"zz", slot=N), dst, match="2 payload bytes after the last run")
    assert_refused(record(good, slot=N, runs=2), dst, match="run 1")
    assert_refused(record(b"ab", slot=N, mode=0, runs=0), dst, match="empty mode")
    assert_refused(record(bytes(N - 1), slot=N, mode=2), dst, match="dense mode")


def test_a_huge_run_count_is_refused_before_any_run_is_read():
    rec = record(runs_payload([(0, 1, b"ab")]), slot=N, runs=1 << 62)
    assert_refused(rec, np.zeros(N, np.uint8), match="run_count 4611686018427387904")


@pytest.mark.parametrize("raw, match", [
    (b"\x80\x00" + varint(1) + b"ab", "overlong"),  # 0 written in two bytes
    (b"\xff" * 9 + b"\x02" + varint(1) + b"ab", "longer than 64 bits"),
    (b"\xff" * 11 + b"ab", "longer than 10 bytes|longer than 64 bits"),
])
def test_malformed_varints_are_refused(raw, match):
    assert_refused(record(raw, slot=N), np.zeros(N, np.uint8), match=match)


def test_a_flipped_payload_byte_fails_the_checksum():
    rec = good_runs_record()
    rec[-1] ^= 1
    assert_refused(rec, np.zeros(N, np.uint8), match="checksum")


# ---- properties over many seeds ----------------------------------------------------------------

def random_change(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    base = rng.integers(0, 256, n, dtype=np.uint8)
    cur = base.copy()
    for _ in range(int(rng.integers(0, 6))):  # clusters of changes of any length, anywhere
        a = int(rng.integers(0, n))
        b = min(n, a + int(rng.integers(1, 40)))
        cur[a:b] = rng.integers(0, 256, b - a, dtype=np.uint8)
    k = int(rng.integers(0, max(1, n // 10)))  # and scattered bytes
    cur[rng.integers(0, n, k)] ^= 0x5A
    return base, cur, int(rng.choice(UNITS))


def test_native_apply_equals_the_reference_over_many_seeds():
    for seed in range(300):
        rng = np.random.default_rng(seed)
        base, cur, unit = random_change(rng, int(rng.integers(1, 3000)))
        rec = deltas.encode(cur, base, unit)
        dst = base.copy()
        deltas.apply(rec, dst)
        assert np.array_equal(dst, cur), seed
        assert np.array_equal(ref_apply(bytes(rec), base), cur), seed
        assert rec.stats.changed_bytes == expected_changed_bytes(base, cur, unit), seed


def test_mutated_records_are_refused_or_applied_exactly_as_the_reference_says():
    outcomes = {"refused": 0, "applied": 0}
    for seed in range(400):
        rng = np.random.default_rng(10_000 + seed)
        r = random.Random(seed)
        base, cur, unit = random_change(rng, int(rng.integers(1, 600)))
        rec = bytearray(bytes(deltas.encode(cur, base, unit)))
        how = r.randrange(5)
        if how == 0:  # torn
            rec = rec[:r.randrange(len(rec))]
        elif how in (1, 2):  # corrupted, then (2) resealed so the parser meets it
            rec[r.randrange(len(rec))] ^= 1 << r.randrange(8)
            if how == 2 and len(rec) >= HEADER_BYTES:
                seal(rec)
        elif how == 3:  # a header field forged to a nearby or hostile value, resealed
            at = r.choice((6, 8, 16, 24, 32))
            width = 2 if at == 6 else 4 if at == 8 else 8
            old = int.from_bytes(rec[at:at + width], "little")
            new = r.choice((old + 1, old - 1, 0, (1 << (8 * width)) - 1, 1 << (8 * width - 2))) % (1 << (8 * width))
            rec[at:at + width] = new.to_bytes(width, "little")
            seal(rec)
        else:  # random bytes spliced into the payload, payload_bytes kept honest, resealed
            at = r.randrange(HEADER_BYTES, len(rec) + 1)
            rec[at:at] = bytes(r.randrange(256) for _ in range(r.randrange(1, 6)))
            rec[24:32] = (len(rec) - HEADER_BYTES).to_bytes(8, "little")
            seal(rec)
        want = ref_apply(bytes(rec), base)
        dst = base.copy()
        if want is None:
            assert_refused(rec, dst, (InvalidWrite, OutOfRegion))
            outcomes["refused"] += 1
        else:
            deltas.apply(bytes(rec), dst)
            assert np.array_equal(dst, want), (seed, how)
            outcomes["applied"] += 1
    assert outcomes["refused"] > 100 and outcomes["applied"] > 10, outcomes


def _mutated(rec: bytearray, r: random.Random) -> bytearray:
    """The record torn, a bit flipped (left unsealed: a checked apply reads no checksum), or random
    bytes spliced into its payload with payload_bytes kept honest."""
    how = r.randrange(3)
    if how == 0:
        return rec[:r.randrange(len(rec))]
    if how == 1:
        rec[r.randrange(len(rec))] ^= 1 << r.randrange(8)
        return rec
    at = r.randrange(HEADER_BYTES, len(rec) + 1)
    rec[at:at] = bytes(r.randrange(256) for _ in range(r.randrange(1, 6)))
    rec[24:32] = (len(rec) - HEADER_BYTES).to_bytes(8, "little")
    return rec


def test_a_checked_apply_writes_what_the_apply_writes_and_never_outside_dst_when_the_bytes_changed_since():
    """delta_apply(checked=True) (a delta area's apply, after its check of the same bytes): one
    copying walk. On the record it checked it writes what the full apply writes; on bytes changed
    since (a racing writer) it may stop partway with an error, but never stores outside dst, and
    where it succeeds it wrote what the format says those bytes mean."""
    stats = {"same": 0, "changed ok": 0, "changed refused": 0}
    for seed in range(300):
        rng = np.random.default_rng(20_000 + seed)
        r = random.Random(seed)
        base, cur, unit = random_change(rng, int(rng.integers(1, 600)))
        rec = bytearray(bytes(deltas.encode(cur, base, unit)))
        if seed % 3:
            rec = _mutated(rec, r)
        raw = np.frombuffer(bytes(rec) or b"\0", np.uint8).copy()
        guard = rng.integers(0, 256, base.nbytes + 128, dtype=np.uint8)
        before = guard.copy()
        guard[64:64 + base.nbytes] = base
        dst = guard[64:64 + base.nbytes]
        code, message = _native.delta_apply(raw.ctypes.data, len(rec), dst.ctypes.data, dst.nbytes, checked=True)
        after = 64 + base.nbytes
        assert np.array_equal(guard[:64], before[:64]) and np.array_equal(guard[after:], before[after:]), seed
        want = ref_apply(bytes(seal(bytearray(rec))), base) if len(rec) >= HEADER_BYTES else None
        if seed % 3 == 0:
            assert code == int(_native.Code.OK) and np.array_equal(dst, cur), (seed, message)
            stats["same"] += 1
        elif code == int(_native.Code.OK):
            assert want is not None and np.array_equal(dst, want), seed
            stats["changed ok"] += 1
        else:
            assert want is None, (seed, message)
            stats["changed refused"] += 1
    assert min(stats.values()) > 10, stats
