"""The engine side of delta updates, without a sender: the committed base and the delta area.

Every host of an engine rank runs these two modules (deltas/committed.py, deltas/area.py); here
each way a base can differ is refused, and each way an area can be wrong is refused before a
byte of the weights changes."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from p2pweights.deltas import codec
from p2pweights.deltas.area import PREFIX, DeltaArea, Manifest, parse_segments, record_span, writer_part
from p2pweights.deltas.committed import CommittedBase
from p2pweights.errors import InvalidWrite, OutOfRegion


def test_a_claim_is_accepted_only_against_the_last_commit_of_this_epoch():
    base = CommittedBase("e")
    assert base.open({"epoch": 1, "token": "x"}, 1)["reason"].startswith("no update has committed")
    ident = base.commit(1)
    assert base.open(dict(ident), 1) == {"accepted": True, "reason": ""} and base.accepted
    # that begin forgot it: a second claim of the same identity (the session may have written) fails
    assert not base.open(dict(ident), 1)["accepted"]
    ident = base.commit(1)
    other = base.commit(1)  # another controller committed after it
    assert "another update committed" in base.open(dict(ident), 1)["reason"]
    other = base.commit(1)
    assert "epoch" in base.open(dict(other), 2)["reason"]  # a takeover moved the epoch
    other = base.commit(2)
    assert base.open(dict(other), 2, unsupported="no area")["reason"] == "no area"
    other = base.commit(2)
    base.forget("an end failed")
    assert base.open(dict(other), 2)["reason"] == "an end failed"
    assert base.open(None, 2)["reason"] == "the sender asked for none"
    assert "claim is not" in base.open({"epoch": "2", "token": 5}, 2)["reason"]


def _area_with(weights: np.ndarray, changes: np.ndarray) -> tuple[DeltaArea, Manifest, np.ndarray]:
    """An area holding one record that turns ``weights`` into ``changes`` (its manifest too)."""
    area = DeltaArea(1 << 20, rank=0, engine="e")
    rec = codec.encode(changes, weights.copy(), unit=2)
    n = len(rec)
    body = PREFIX.pack(int(weights.ctypes.data), n) + bytes(rec) + bytes(record_span(n) - PREFIX.size - n)
    area.array[:len(body)] = np.frombuffer(body, dtype=np.uint8)
    return area, Manifest(len(body), 1, hashlib.sha256(body).hexdigest()), changes


@pytest.mark.parametrize("offsets", [(0,), None])  # as senders send it, and as an owner that names none
def test_an_area_applies_its_records_exactly(offsets):
    rng = np.random.default_rng(0)
    weights = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    new = weights.copy()
    new[rng.integers(0, new.size, 600)] ^= 0x5A
    area, manifest, _ = _area_with(weights, new)
    manifest = Manifest(manifest.bytes, 1, manifest.sha256, offsets)
    stats = area.apply(manifest, [(int(weights.ctypes.data), weights.nbytes)])
    assert stats["records"] == 1 and np.array_equal(weights, new)
    area.close()


@pytest.mark.parametrize("fault", ["digest", "records", "bytes", "outside", "corrupt", "offset", "past the last"])
def test_a_wrong_area_is_refused_before_any_byte_of_the_weights_changes(fault):
    rng = np.random.default_rng(1)
    weights = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    new = weights.copy()
    new[::97] ^= 0xFF
    area, manifest, _ = _area_with(weights, new)
    regions = [(int(weights.ctypes.data), weights.nbytes)]
    if fault == "digest":  # a late or foreign writer's bytes: not what the owner says it wrote
        area.array[PREFIX.size + 60] ^= 1
    elif fault == "records":
        manifest = Manifest(manifest.bytes, 2, manifest.sha256)
    elif fault == "bytes":
        manifest = Manifest(area.nbytes + 8, 1, manifest.sha256)
    elif fault == "outside":  # the record's destination is not this rank's weights
        regions = [(int(weights.ctypes.data) + 4096, weights.nbytes - 4096)]
    elif fault == "offset":  # a forged offset: the record does not begin there
        manifest = Manifest(manifest.bytes, 1, manifest.sha256, (8,))
    elif fault == "past the last":  # bytes after the last record that no record spans (the digest skips none)
        area.array[manifest.bytes:manifest.bytes + 8] = 0
        manifest = Manifest(manifest.bytes + 8, 1, hashlib.sha256(area.array[:manifest.bytes + 8]).hexdigest(), (0,))
    elif fault == "corrupt":  # the owner's own bytes, broken (its digest matches them)
        area.array[PREFIX.size + codec.HEADER_BYTES + 3] ^= 0xFF
        manifest = Manifest(manifest.bytes, 1, hashlib.sha256(area.array[:manifest.bytes]).hexdigest())
    before = weights.copy()
    with pytest.raises((InvalidWrite, OutOfRegion)):
        area.apply(manifest, regions)
    assert np.array_equal(weights, before)
    area.close()


def test_a_manifest_from_the_network_is_type_checked():
    for bad in ([], {"bytes": -1, "records": 0, "sha256": "0" * 64}, {"bytes": 1, "records": True, "sha256": "0" * 64},
                {"bytes": 1, "records": 1, "sha256": "XYZ"}):
        with pytest.raises(InvalidWrite):
            Manifest.parse(bad, "test")


def test_a_manifest_names_where_each_record_begins_and_one_without_still_parses():
    m = Manifest.parse({"bytes": 128, "records": 2, "sha256": "0" * 64, "offsets": [0, 64]}, "test")
    assert m.offsets == (0, 64) and Manifest.parse(m.to_dict(), "test") == m
    older = Manifest.parse({"bytes": 128, "records": 2, "sha256": "0" * 64}, "test")
    assert older.offsets is None and "offsets" not in older.to_dict()
    for bad in ([0], [0, 64, 128], [0, -8], [0, True], "0,64", [0, 64.0], {"0": 0}):
        with pytest.raises(InvalidWrite, match="offsets"):
            Manifest.parse({"bytes": 128, "records": 2, "sha256": "0" * 64, "offsets": bad}, "test")


def _segment(area: DeltaArea, start: int, weights: np.ndarray, changes: np.ndarray) -> Manifest:
    """One writer's segment at ``start`` of ``area``: one record turning ``weights`` into ``changes``."""
    rec = codec.encode(changes, weights.copy(), unit=2)
    body = PREFIX.pack(int(weights.ctypes.data), len(rec)) + bytes(rec) + bytes(record_span(len(rec)) - PREFIX.size
                                                                            - len(rec))
    area.array[start:start + len(body)] = np.frombuffer(body, dtype=np.uint8)
    return Manifest(len(body), 1, hashlib.sha256(body).hexdigest(), (start,), start)


def _two_writers(seed: int) -> tuple[DeltaArea, list, list, list]:
    """An area two writers (PP stages) wrote, each into its part, each changing its own weights."""
    rng = np.random.default_rng(seed)
    area = DeltaArea(1 << 20, rank=3, engine="e")
    weights = [rng.integers(0, 256, 1 << 15, dtype=np.uint8) for _ in range(2)]
    new = [w.copy() for w in weights]
    for w in new:
        w[rng.integers(0, w.size, 300)] ^= 0x3C
    segments = [_segment(area, writer_part(area.nbytes, k, 2)[0], weights[k], new[k]) for k in range(2)]
    return area, weights, new, segments


def test_each_writers_segment_is_applied_from_its_own_part_of_the_area():
    area, weights, new, segments = _two_writers(5)
    assert segments[1].start == area.nbytes // 2 and parse_segments([m.to_dict() for m in segments], "t") == tuple(segments)
    stats = area.apply(segments, [(int(w.ctypes.data), w.nbytes) for w in weights])
    assert stats["segments"] == 2 and stats["records"] == 2
    assert all(np.array_equal(w, n) for w, n in zip(weights, new))
    area.close()


@pytest.mark.parametrize("fault", ["second's digest", "second outside", "overlap", "past the area"])
def test_one_bad_segment_refuses_every_segment_before_a_byte_of_the_weights_changes(fault):
    """The checks of every segment come before the first apply of any: the first writer's sound
    records stay unapplied when the second writer's are wrong."""
    area, weights, _, segments = _two_writers(6)
    regions = [(int(w.ctypes.data), w.nbytes) for w in weights]
    first, second = segments
    if fault == "second's digest":
        area.array[second.start + PREFIX.size + 40] ^= 1
    elif fault == "second outside":
        regions = regions[:1]
    elif fault == "overlap":  # the second names bytes of the first's segment as its own
        second = Manifest(second.bytes + second.start - 8, 1, second.sha256, (8,), 8)
    elif fault == "past the area":
        second = Manifest(area.nbytes, 1, second.sha256, second.offsets, second.start)
    before = [w.copy() for w in weights]
    with pytest.raises((InvalidWrite, OutOfRegion)):
        area.apply([first, second], regions)
    assert all(np.array_equal(w, b) for w, b in zip(weights, before))
    area.close()


def test_writer_parts_tile_the_area_aligned_and_segments_parse_only_ascending_and_disjoint():
    for nbytes, writers in ((1 << 20, 3), (4104, 4), (4096, 1)):
        parts = [writer_part(nbytes, k, writers) for k in range(writers)]
        assert parts[0][0] == 0 and parts[-1][1] == nbytes and all(a % 8 == 0 for a, _ in parts)
        assert all(parts[k][1] == parts[k + 1][0] for k in range(writers - 1))
    with pytest.raises(ValueError):
        writer_part(4096, 2, 2)
    one = {"bytes": 64, "records": 0, "sha256": "0" * 64}
    assert parse_segments(one, "t") == (Manifest(64, 0, "0" * 64),)
    for bad in ([], [one, one], [{**one, "start": 12}], [{**one, "start": -8}], [one] * 1025, [{**one, "start": True}]):
        with pytest.raises(InvalidWrite):
            parse_segments(bad, "t")
    assert len(parse_segments([one, {**one, "start": 64}], "t")) == 2
