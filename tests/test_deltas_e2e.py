"""Delta updates end to end: real engine processes (tiny qwen3, TP2), real transports, sglang's loaders.

Byte-exactness is proved against a second engine written in full by a sender without deltas: after
every step, every rank's checksum of every parameter, buffer and derived tensor is equal. The base
is proven: an engine another controller wrote refuses the claim and is written in full in the same
update; a delta area whose bytes are not what the owner wrote fails the end, leaving the engine torn
until the next (full) update heals it."""
from __future__ import annotations

import pytest
import torch

from p2pweights.control import SglangEngine
from p2pweights.errors import UpdateFailed
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import check_weights_equal, start_engine
from p2pweights.sender import WeightSender, delta_writes
from replica_configs import write_config


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):  # the BF16 model of the refusal and fault tests
    return write_config("qwen3", str(tmp_path_factory.mktemp("configs")))


def _change(items, fraction: float, gen: torch.Generator) -> None:
    for _, t in items:
        flat = t.view(-1)
        k = int(flat.numel() * fraction)
        if k:
            idx = torch.randint(0, flat.numel(), (k,), generator=gen)
            flat[idx] = torch.randn(k, generator=gen).to(flat.dtype)


def _push(sender, version, items, **kw):
    with sender.update(version, **kw) as u:
        for n, t in items:
            u.push(n, t)
    return u.report


def _checksums(url):
    return SglangEngine(url).weights_checker("checksum")["per_engine_checksum"]


#: (model, engine layout, transport, what the trainer pushes): BF16 dense over both transports, MoE with
#: EP, and an FP8 engine with a NEXTN draft role fed BF16 trainer tensors (quantized on send)
#: "index": the slots write index records (deltas/index_records.py), as GPU slots do, here on the CPU
CASES = [
    ("qwen3", "tp=2", "mooncake", "checkpoint", "runs"),
    ("qwen3", "tp=2", "nixl", "checkpoint", "runs"),
    ("qwen3", "tp=2", "nixl", "checkpoint", "index"),
    ("qwen3_moe", "tp=2,ep=2", "mooncake", "checkpoint", "runs"),
    ("deepseek-v3-fp8-tiny", "tp=2,speculative_algorithm=NEXTN", "mooncake", "trainer", "runs"),
    ("deepseek-v3-fp8-tiny", "tp=2,speculative_algorithm=NEXTN", "mooncake", "trainer", "index"),
]


@pytest.mark.parametrize("model, layout, transport, tensors, records", CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[4]}" for c in CASES])
def test_delta_updates_equal_full_updates_byte_for_byte(tmp_path_factory, monkeypatch, model, layout, transport,
                                                        tensors, records):
    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import trainer_tensors

    monkeypatch.setattr(delta_writes, "INDEX_RECORDS_ON_HOST", records == "index")

    cfg = resolve_model(model) if "-" in model else write_config(model, str(tmp_path_factory.mktemp("cfg")))
    specs = trainer_tensors(cfg) if tensors == "trainer" else checkpoint_tensors(cfg)
    a = start_engine(cfg, layout, transport=transport, name="delta")
    b = start_engine(cfg, layout, transport=transport, name="full")
    try:
        items = [(n, t.clone()) for n, t in random_checkpoint(specs, 3)]
        gen = torch.Generator().manual_seed(0)
        with WeightSender(cfg, transport=transport, buffer_size=1 << 20) as sa, \
                WeightSender(cfg, transport=transport, buffer_size=1 << 20, delta="off") as sb:
            sa.connect([a.url])
            sb.connect([b.url])
            from_inputs = 0
            for step, fraction in enumerate([None, 0.01, 0.0, 0.03, 1.0]):
                if fraction:
                    _change(items, fraction, gen)
                ra = _push(sa, f"v{step}", items)
                rb = _push(sb, f"v{step}", items)
                assert ra.bytes == rb.bytes == rb.bytes_written
                assert _checksums(a.url) == _checksums(b.url), f"step {step} (changed {fraction})"
                if fraction is None:
                    assert set(ra.delta_reason.values()) == {delta_writes.FIRST}
                    continue
                assert ra.delta_reason == {}, ra.delta_reason
                assert all(e.delta for e in ra.engines)
                from_inputs += ra.compared_from_inputs
                if fraction == 0.0:
                    assert ra.bytes_written == 0 and ra.changed_bytes == 0
                elif fraction == 0.01:  # FP8: a changed element may move its block's scale, and every byte with it
                    assert 0 < ra.bytes_written < (0.1 if tensors == "checkpoint" else 0.9) * ra.bytes
                elif fraction == 1.0:  # most elements new: dense records are the parameters' usual writes
                    assert 0.5 * ra.bytes < ra.bytes_written <= 1.05 * ra.bytes
                assert ra.bytes <= ra.base_bytes < 1.1 * ra.bytes  # one buffer per rank, parameters on 256 B
                # the sender's memory: its slots (a quarter more for the spare), the incomplete groups'
                # peak (no more than the checkpoint pushed), and the bases
                assert ra.slot_bytes == sa._buffers.total_bytes >= 2 * sa._buffers.slot_bytes
                assert 0 < ra.staged_peak_bytes <= sum(int(t.numel()) * t.element_size() for _, t in items)
                assert ra.to_dict()["memory_bytes"] == ra.slot_bytes + ra.staged_peak_bytes + ra.base_bytes
            assert "deltas:" in str(ra) and "sender memory" in str(ra)
            # host slots with codec records and no transform: replayed groups were compared straight from
            # the pushed tensors (delta_encode_program), never written into a slot unless a full write needed them
            fused = tensors == "checkpoint" and records == "runs"
            assert (from_inputs > 0) == fused, from_inputs
    finally:
        a.close()
        b.close()


def test_a_base_another_controller_changed_is_refused_and_written_in_full(cfg):
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="refuses")
    try:
        with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as mine, \
                WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as other:
            mine.connect([engine.url])
            other.connect([engine.url])
            items = list(random_checkpoint(checkpoint_tensors(cfg), 11))
            _push(mine, "11", items)
            assert _push(mine, "12", items).delta_reason == {}  # accepted (nothing changed)
            _push(other, "13", list(random_checkpoint(checkpoint_tensors(cfg), 13)))  # another controller
            report = _push(mine, "14", items)
            assert all("another update committed" in why for why in report.delta_reason.values()), report.delta_reason
            assert report.bytes_written == report.bytes
            assert check_weights_equal(engine.url, hf_seed=11)["success"]
            assert _push(mine, "15", items).delta_reason == {}  # its own commit again: deltas
            assert check_weights_equal(engine.url, hf_seed=11)["success"]
    finally:
        engine.close()


def test_an_area_whose_bytes_are_not_the_owners_fails_the_end_and_the_next_update_heals(cfg, monkeypatch):
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="torn")
    try:
        items = [(n, t.clone()) for n, t in random_checkpoint(checkpoint_tensors(cfg), 21)]
        with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as sender:
            sender.connect([engine.url])
            _push(sender, "1", items)
            _change(items, 0.05, torch.Generator().manual_seed(1))
            real = delta_writes.UpdateDeltas.manifests

            def forged(self, engines, every=()):  # as if a late writer had changed one byte of the area
                real(self, engines, every)
                for e in engines:
                    for m in e.end_extra.get("p2pw_delta", {}).values():
                        m["sha256"] = "0" * 64
            monkeypatch.setattr(delta_writes.UpdateDeltas, "manifests", forged)
            with pytest.raises(UpdateFailed, match="SHA-256"):
                _push(sender, "2", items)
            monkeypatch.setattr(delta_writes.UpdateDeltas, "manifests", real)
            state = SglangEngine(engine.url).server_info()["p2pw_weight_update"]["state"]
            assert state != "none"  # not committed: the session stays open (torn until a complete update)
            report = _push(sender, "3", list(random_checkpoint(checkpoint_tensors(cfg), 22)))
            assert len(report.delta_reason) == 2 and report.bytes_written == report.bytes  # full: the base is gone
            assert check_weights_equal(engine.url, hf_seed=22)["success"]
    finally:
        engine.close()


def test_verify_digests_what_the_deltas_made(cfg, monkeypatch):
    """verify=True with deltas: the engine applies them first (``/p2pw_apply_deltas``), then every rank
    digests what it holds against what the sender wrote; a bad area fails there, engines left paused."""
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="verified")
    try:
        items = [(n, t.clone()) for n, t in random_checkpoint(checkpoint_tensors(cfg), 41)]
        gen = torch.Generator().manual_seed(2)
        with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as sender:
            sender.connect([engine.url])
            _push(sender, "1", items, verify=True)
            _change(items, 0.02, gen)
            report = _push(sender, "2", items, verify=True)
            assert report.delta_reason == {} and report.bytes_written < 0.2 * report.bytes
            assert sender._update.verify_seconds > 0
            _change(items, 0.02, gen)
            real = delta_writes.UpdateDeltas.manifests

            def forged(self, engines, every=()):
                real(self, engines, every)
                for e in engines:
                    for m in e.end_extra.get("p2pw_delta", {}).values():
                        m["records"] += 1
            monkeypatch.setattr(delta_writes.UpdateDeltas, "manifests", forged)
            with pytest.raises(UpdateFailed, match="records"):
                _push(sender, "3", items, verify=True)
            assert SglangEngine(engine.url).weight_version() == "2"
    finally:
        engine.close()


@pytest.fixture(scope="module")
def wider(tmp_path_factory):  # 33 MB over 2 MiB slots: ~17 slots an update
    return write_config("qwen3", str(tmp_path_factory.mktemp("wider")), vocab_size=4096, hidden_size=512,
                        intermediate_size=1536, head_dim=128, num_hidden_layers=4)


@pytest.mark.parametrize("records", ["runs", "index"])
def test_a_fresh_checkpoint_stops_comparing_once_it_proves_dense_and_the_next_update_takes_deltas(
        wider, monkeypatch, records):
    cfg = wider
    # every element new: once a rank's compared bytes mostly changed, the rest of its update is
    # written in full without comparing (its bases still move on), and the next step goes as deltas
    monkeypatch.setattr(delta_writes, "INDEX_RECORDS_ON_HOST", records == "index")
    monkeypatch.setattr(delta_writes, "DENSE_AFTER", 1 << 12)
    compared: list[int] = []
    if records == "index":
        real = delta_writes.index_records.count_changes

        def counting(slot, base, params, unit, *a, **kw):
            compared.append(sum(n for _, _, n in params))
            return real(slot, base, params, unit, *a, **kw)

        monkeypatch.setattr(delta_writes.index_records, "count_changes", counting)
    else:
        real_encode = delta_writes.UpdateDeltas._encode

        def encoding(self, cur, base, unit, nbytes, *replayed):
            compared.append(nbytes)
            return real_encode(self, cur, base, unit, nbytes, *replayed)

        monkeypatch.setattr(delta_writes.UpdateDeltas, "_encode", encoding)
    a = start_engine(cfg, "tp=2", transport="mooncake", name="dense")
    b = start_engine(cfg, "tp=2", transport="mooncake", name="dense-full")
    try:
        # small slots: a GPU slot's records are counted when it closes, so the decision takes the next slots
        with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as sa, \
                WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, delta="off") as sb:
            sa.connect([a.url])
            sb.connect([b.url])
            first = [(n, t.clone()) for n, t in random_checkpoint(checkpoint_tensors(cfg), 21)]
            _push(sa, "v1", first)
            _push(sb, "v1", first)
            compared.clear()
            fresh = [(n, t.clone()) for n, t in random_checkpoint(checkpoint_tensors(cfg), 22)]
            ra = _push(sa, "v2", fresh)
            _push(sb, "v2", fresh)
            # written in full but for what was compared first and found equal (norms of ones)
            assert ra.delta_reason == {} and 0.95 * ra.bytes < ra.bytes_written <= ra.bytes
            assert 0 < sum(compared) < ra.bytes / 4, (sum(compared), ra.bytes, ra.slots)  # the rest was not compared
            assert _checksums(a.url) == _checksums(b.url)
            _change(fresh, 0.01, torch.Generator().manual_seed(5))
            rc = _push(sa, "v3", fresh)
            _push(sb, "v3", fresh)
            assert rc.delta_reason == {} and 0 < rc.bytes_written < rc.bytes / 4, rc.bytes_written
            assert _checksums(a.url) == _checksums(b.url)
    finally:
        a.close()
        b.close()
