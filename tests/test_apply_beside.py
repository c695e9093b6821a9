"""Deltas applied beside the writes (sender/apply_beside.py): real engine processes (tiny qwen3, TP2,
~17 slots an update), Mooncake over loopback, sglang's loaders.

The sender seals each slot's records and has the engine apply them once that slot's writes returned,
while later slots are written; the end applies the rest. Proved byte-exact against an engine written
in full, with and without the applies beside; a forged segment applied beside the writes tears that
engine (named in the update's failure, never ended) and the next update heals it in full."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from p2pweights.control import SglangEngine
from p2pweights.errors import UpdateFailed
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import check_weights_equal, start_engine
from p2pweights.sender import WeightSender, apply_beside, delta_writes
from replica_configs import write_config
from test_deltas_e2e import _change, _checksums


@pytest.fixture(scope="module")
def wider(tmp_path_factory):  # 33 MB over 1 MiB slots: many slots an update
    return write_config("qwen3", str(tmp_path_factory.mktemp("wider")), vocab_size=4096, hidden_size=512,
                        intermediate_size=1536, head_dim=128, num_hidden_layers=4)


def _push(sender, version, items):
    with sender.update(version) as u:
        u.push_many(items)
    return u.report


@pytest.mark.parametrize("records", ["runs", "index"])
def test_deltas_applied_beside_the_writes_equal_full_updates_byte_for_byte(wider, monkeypatch, records):
    monkeypatch.setattr(delta_writes, "INDEX_RECORDS_ON_HOST", records == "index")
    a = start_engine(wider, "tp=2", transport="mooncake", name="beside")
    b = start_engine(wider, "tp=2", transport="mooncake", name="beside-full")
    try:
        items = [(n, t.clone()) for n, t in random_checkpoint(checkpoint_tensors(wider), 3)]
        gen = torch.Generator().manual_seed(0)
        with WeightSender(wider, transport="mooncake", buffer_size=1 << 20) as sa, \
                WeightSender(wider, transport="mooncake", buffer_size=1 << 20, delta="off") as sb:
            sa.connect([a.url])
            sb.connect([b.url])
            for step, (fraction, beside) in enumerate([(None, "1"), (0.01, "1"), (0.03, "1"), (0.01, "0")]):
                monkeypatch.setenv("P2PW_DELTA_APPLY_BESIDE", beside)
                if fraction:
                    _change(items, fraction, gen)
                ra = _push(sa, f"v{step}", items)
                _push(sb, f"v{step}", items)
                assert _checksums(a.url) == _checksums(b.url), f"step {step} (changed {fraction})"
                if fraction is None:  # the first update is full: nothing to apply
                    assert ra.apply_calls_beside == 0
                    continue
                assert ra.delta_reason == {} and 0 < ra.bytes_written < ra.bytes / 4
                if beside == "1":  # several slots' records applied while later slots were written
                    assert ra.slots > 4 and ra.apply_calls_beside >= 1 and ra.segments_applied_beside >= 2, ra
                    assert "applied beside the writes" in str(ra)
                    assert ra.to_dict()["segments_applied_beside"] == ra.segments_applied_beside
                else:
                    assert ra.apply_calls_beside == ra.segments_applied_beside == 0
            info = SglangEngine(a.url).server_info()["p2pw_weight_update"]
            assert info["state"] == "none", info
    finally:
        a.close()
        b.close()


def test_a_forged_segment_applied_beside_the_writes_tears_that_engine_and_the_next_update_heals(wider, monkeypatch):
    engine = start_engine(wider, "tp=2", transport="mooncake", name="beside-forged")
    try:
        items = [(n, t.clone()) for n, t in random_checkpoint(checkpoint_tensors(wider), 21)]
        with WeightSender(wider, transport="mooncake", buffer_size=1 << 20) as sender:
            sender.connect([engine.url])
            _push(sender, "1", items)
            _change(items, 0.02, torch.Generator().manual_seed(1))
            real = apply_beside.returned
            forged: list = []

            def forging(targets, done, busy=()):  # as if a late writer had changed a byte of a sealed segment
                out = real(targets, done, busy)
                for ranks in out.values():
                    for rank, manifests in ranks.items():
                        ranks[rank] = [dataclasses.replace(m, sha256="0" * 64) for m in manifests]
                        forged.append(rank)
                return out

            monkeypatch.setattr(apply_beside, "returned", forging)
            with pytest.raises(UpdateFailed, match="beside the writes failed.*SHA-256"):
                _push(sender, "2", items)
            assert forged  # the forgery reached an apply beside the writes
            monkeypatch.setattr(apply_beside, "returned", real)
            info = SglangEngine(engine.url).server_info()["p2pw_weight_update"]
            assert info["state"] == "torn" and SglangEngine(engine.url).weight_version() == "1", info
            report = _push(sender, "3", list(random_checkpoint(checkpoint_tensors(wider), 22)))
            assert len(report.delta_reason) == 2 and report.bytes_written == report.bytes  # full: the base is gone
            assert check_weights_equal(engine.url, hf_seed=22)["success"]
    finally:
        engine.close()


class _Pub:
    delta_area = [1 << 20, 1 << 16]


class _Target:
    publication = _Pub()


def test_a_targets_records_are_sealed_per_slot_taken_once_returned_and_the_rest_go_to_the_end():
    """A target's segments: sealed per slot only when it holds records, taken oldest first only once
    submitted and returned, the rest (sealed, then open) for the end; each segment's manifest names
    exactly its own records, chained from its start."""
    from p2pweights.deltas.area import MAX_SEGMENTS
    from p2pweights.sender.delta_targets import DeltaTarget

    x = DeltaTarget(_Target())
    assert [m.manifest().to_dict() for m in x.rest()] == [{"bytes": 0, "records": 0, "sha256": x.open.manifest().sha256,
                                                           "offsets": []}]  # nothing written: the end says so
    x.seal(0, 256)
    assert x.sealed == []  # an empty segment is not sealed
    x.add(24, b"a" * 16, body=b"b" * 8)
    x.add(32, b"c" * 16, body=b"d" * 16)
    x.seal(0, 256)
    x.add(40, b"e" * 16, body=b"f" * 24)
    x.seal(1, 256)
    x.add(16, b"g" * 16)
    first, second = x.sealed
    assert (first.start, first.end, first.offsets, second.start, second.offsets) == (0, 56, [0, 24], 56, [56])
    assert x.take(lambda slot: True) == []  # not submitted yet
    x.submitted(0)
    x.submitted(1)
    assert x.take(lambda slot: slot == 1) == []  # slot 0's writes not returned: nothing after it either
    assert x.take(lambda slot: slot == 0) == [first] and x.sent == 1
    m = first.manifest()
    import hashlib
    assert m.sha256 == hashlib.sha256(b"a" * 16 + b"b" * 8 + b"c" * 16 + b"d" * 16).hexdigest()
    assert (m.start, m.bytes, m.records, m.offsets) == (0, 56, 2, (0, 24))
    rest = [s.manifest() for s in x.rest()]
    assert [(r.start, r.bytes, r.records) for r in rest] == [(56, 40, 1), (96, 16, 1)] and x.cursor == 112
    many = DeltaTarget(_Target(), writer=0, writers=MAX_SEGMENTS // 4)  # many writers: few sealed each
    for k in range(10):
        many.add(8, b"h" * 8)
        many.seal(k % 2, 256)  # two slots, each used again
    assert len(many.sealed) == 3 and many.open.records == 7  # (1024 // 256 - 1) sealed, the rest grows on
    for k in range(3):  # capped: the open segment spans both slots, each use of them submitted in turn
        many.submitted(k % 2)
    many.add(8, b"i" * 8)
    many.seal(1, 256)  # slot 1 used again: that use not submitted yet
    assert many.open.slots == {0: True, 1: False}
    assert not many.open.returned(lambda slot: True)  # one of its slots' writes not even handed over
    many.submitted(1)
    assert many.open.returned(lambda slot: True) and not many.open.returned(lambda slot: slot == 1)
