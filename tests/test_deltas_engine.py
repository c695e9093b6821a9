"""The engine side of delta updates, without a sender: the committed base and the delta area.

Every host of an engine rank runs these two modules (deltas/committed.py, deltas/area.py); here
each way a base can differ is refused, and each way an area can be wrong is refused before a
byte of the weights changes."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from p2pweights.deltas import codec
from p2pweights.deltas.area import PREFIX, DeltaArea, Manifest, record_span
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
