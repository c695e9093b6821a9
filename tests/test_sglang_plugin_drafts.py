"""A REAL drafting sglang 0.5.23 server (``--speculative-algorithm NEXTN`` on a tiny Qwen3-MoE with an
MTP layer, tp=1, on the CPU through the ``p2pw_cpu`` platform, its weights published over Mooncake with
sglang's ``--remote-instance-weight-loader-start-seed-via-transfer-engine``) publishes both roles of its
rank in ONE weights table, the draft's parameters as ``draft.<name>`` under the target's session
(sglang_plugin/draft_roles.py; docs/sglang.md, "Drafting servers").

What the server holds is read through the plugin's digest route (each rank's digest of each parameter,
the draft's from the draft runner) and compared with sglang's own loaders of both roles, in this
process, over the same HF tensors (``replica.reference``, ``replica.role_check``).
"""
from __future__ import annotations

import re
import secrets
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import free_port, start_sglang_server

require_sglang()  # skips without sglang; fails in CI

from p2pweights.control import SglangEngine, http  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.control.weights_digest import digest  # noqa: E402
from p2pweights.errors import UpdateFailed  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.models.engine_layout import EngineLayout  # noqa: E402
from p2pweights.replica.reference import reference_model  # noqa: E402
from p2pweights.replica.role_check import reference_draft  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402
from p2pweights.sender import verify as update_module  # noqa: E402  # verify_update calls verify_written
from p2pweights.sglang_plugin import digest as plugin_digest  # noqa: E402
from p2pweights.transport.publication import EnginePublication  # noqa: E402

STARTUP_TIMEOUT_S = 900.0  # a shared 2-core host under other suites' load
MOONCAKE_ENV = {"MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1"}
# sglang's own drafting flags; the warm-up generate would run the drafting kernels, which this CPU
# platform does not provide (only the weights are under test)
DRAFTING = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "2", "--skip-server-warmup")
LAYOUT = "tp=1,speculative_algorithm=NEXTN"
DRAFT = "draft."
FRACTION = 0.03


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_drafts")
    model_dir = write_config("qwen3_moe_mtp", str(root))
    server = start_sglang_server(model_dir, str(root / "server.log"), tp=1, env=MOONCAKE_ENV,
                                 extra_args=(p.SEED_FLAG, "--engine-info-bootstrap-port", str(free_port()), *DRAFTING))
    sender = None
    try:
        server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        engine = SglangEngine(server.url, name="sglang-draft", timeout=120)
        sender = WeightSender(model_dir, transport="mooncake", buffer_size=1 << 20)
        sender.connect([engine])  # checks the publication against both roles' replicas, both ways
        yield SimpleNamespace(server=server, model_dir=model_dir, engine=engine, sender=sender)
    finally:
        if sender is not None:
            sender.close()
        server.stop()


_EXPECTED: dict = {}


def expected(model_dir: str, seed: int, changed: tuple[float, int] | None = None) -> dict[str, str]:
    """Each parameter's digest once sglang's own loaders of the target and the draft took
    ``random_checkpoint(.., seed, changed)``; the draft's embedding and head are the target's."""
    if (seed, changed) not in _EXPECTED:
        layout = EngineLayout.parse(LAYOUT)
        target = reference_model(model_dir, layout, 0, seed=seed, post_process=True, changed=changed)
        draft = reference_draft(model_dir, layout, 0, seed=seed, post_process=True, target=target, changed=changed)
        shared = {q.data_ptr() for q in target.parameters()}
        want = {n: digest(q) for n, q in target.named_parameters()}
        want.update({DRAFT + n: digest(q) for n, q in draft.named_parameters() if q.data_ptr() not in shared})
        _EXPECTED[seed, changed] = want
    return _EXPECTED[seed, changed]


def held(seeded, names) -> dict[str, str]:
    status, answer = http.request("POST", seeded.server.url, plugin_digest.PATH, body={"names": {"0": sorted(names)}},
                                  timeout=120)
    assert status == p.OK and answer["success"] is True, answer
    return answer["ranks"]["0"]


def differing(got: dict[str, str], want: dict[str, str]) -> list[str]:
    return sorted(n for n in want if got.get(n) != want[n])


def publication(seeded) -> EnginePublication:
    return EnginePublication.from_json(seeded.engine.transfer_engine_info(0))


def update(seeded, seed: int, changed: tuple[float, int] | None = None, verify: bool = False):
    with seeded.sender.update(f"seed{seed}" + (f"+{changed[1]}" if changed else ""), verify=verify) as u:
        for name, t in random_checkpoint(checkpoint_tensors(seeded.model_dir), seed, changed=changed):
            u.push(name, t)
    assert [e.state for e in u.report.engines] == ["ok"], u.report
    return u


def write_at(peer: str, address: int, nbytes: int = 1, value: int = 0x5A) -> int:
    """Mooncake's answer to a write of ``nbytes`` at ``address`` of ``peer``, as any process could."""
    from p2pweights.transport.mooncake import new_engine

    te, _ = new_engine("127.0.0.1")
    buf = np.full(max(nbytes, 1), value, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
    try:
        return te.transfer_sync_write(peer, buf.ctypes.data, address, nbytes)
    finally:
        te.unregister_memory(buf.ctypes.data)


def flip_one_byte(peer: str, address: int) -> None:
    from p2pweights.transport.mooncake import new_engine

    te, _ = new_engine("127.0.0.1")
    buf = np.zeros(8, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
    try:
        assert te.transfer_sync_read(peer, buf.ctypes.data, address, 1) == 0
        buf[0] ^= 0x10
        assert te.transfer_sync_write(peer, buf.ctypes.data, address, 1) == 0
    finally:
        te.unregister_memory(buf.ctypes.data)


def test_a_drafting_server_publishes_both_roles_in_one_table_under_the_targets_session(seeded):
    pub = publication(seeded)
    want = expected(seeded.model_dir, 1)
    drafted = sorted(n for n in want if n.startswith(DRAFT))
    assert drafted and len(drafted) < len(want), drafted
    assert set(pub.params) == set(want), (sorted(set(pub.params) ^ set(want))[:10])
    assert pub.epoch == 1 and pub.delta_area is not None, pub
    # every draft parameter lies in the rank's registered weights, apart from the area
    for name in drafted:
        t = pub.params[name]
        start, end = t.data_ptr, t.data_ptr + t.numel * t.element_size
        assert any(a <= start and end <= a + n for a, n in pub.regions), name
    # one Mooncake session published: the draft runner's own engine never reaches the bootstrap server
    with open(seeded.server.log_path, errors="replace") as f:
        log = f.read()
    assert set(re.findall(r"Registered transfer engine info for tp_rank=0, session_id=(\S+)", log)) == {pub.peer}
    assert "the draft's weights join the target's Mooncake engine" in log


def test_the_sender_writes_target_and_draft_byte_exact_then_deltas_cover_the_draft(seeded):
    want1 = expected(seeded.model_dir, 1)
    before = held(seeded, want1)
    assert any(n.startswith(DRAFT) for n in differing(before, want1)), "dummy weights: the check can fail"

    first = update(seeded, 1, verify=True)
    assert first.verify_seconds > 0
    assert differing(held(seeded, want1), want1) == []

    # deltas: the records of the draft's parameters land inside the rank's area's regions too
    want2 = expected(seeded.model_dir, 1, (FRACTION, 2))
    second = update(seeded, 1, (FRACTION, 2)).report
    assert second.delta_reason == {}, second.delta_reason
    assert 0 < second.bytes_written < second.bytes // 2, (second.bytes_written, second.bytes)
    got = held(seeded, want2)
    assert differing(got, want2) == [] and any(got[n] != want1[n] for n in want2 if n.startswith(DRAFT))


def test_verify_names_a_flipped_byte_in_a_draft_parameter(seeded, monkeypatch):
    pub = publication(seeded)
    flipped = sorted(n for n in pub.params if n.startswith(DRAFT) and ("down_proj" in n or "w2_weight" in n))[0]
    real_verify = update_module.verify_written

    def corrupt_then_verify(*args, **kwargs):  # after every write returned, before the digests
        flip_one_byte(pub.peer, pub.params[flipped].data_ptr)
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(update_module, "verify_written", corrupt_then_verify)
    with pytest.raises(UpdateFailed) as info:
        update(seeded, 3, verify=True)
    e = info.value
    assert (e.engine, e.rank, e.parameter) == ("sglang-draft", 0, flipped), (e.engine, e.rank, e.parameter, str(e))
    monkeypatch.setattr(update_module, "verify_written", real_verify)
    update(seeded, 3, verify=True)  # takes the open session over and heals it, both roles
    assert differing(held(seeded, expected(seeded.model_dir, 3)), expected(seeded.model_dir, 3)) == []


def test_a_takeover_moves_the_drafts_memory_to_the_new_epoch(seeded):
    old = publication(seeded)
    epoch = seeded.server.get_json("/server_info")["p2pw_weight_update"]["epoch"]
    assert old.epoch == epoch
    lost = {p.SESSION_OWNER_HEADER: secrets.token_urlsafe(32), p.SESSION_LEASE_HEADER: "1"}
    for verb in ("pause_generation", "begin_weight_update"):  # a begin needs a paused engine
        status, answer = http.request("POST", seeded.server.url, f"/{verb}", body={}, headers=lost, timeout=120)
        assert p.ok(status), answer
    deadline = time.monotonic() + 60
    while seeded.server.get_json("/server_info")["p2pw_weight_update"].get("state") != p.TORN:
        assert time.monotonic() < deadline, "the lost owner's 1 s lease never lapsed"
        time.sleep(0.5)

    update(seeded, 4)  # takes over: every rank moves both roles' memory to a new endpoint first
    now = publication(seeded)
    assert now.epoch == epoch + 1 and now.peer != old.peer, (old.peer, now.peer)
    assert set(now.params) == set(old.params)
    want = expected(seeded.model_dir, 4)
    assert differing(held(seeded, want), want) == []  # the draft's writes reached it through the new endpoint

    # the revoked endpoint holds none of the draft's memory any more: a write there fails, nothing lands
    name = sorted(n for n in old.params if n.startswith(DRAFT))[0]
    assert write_at(old.peer, old.params[name].data_ptr, 8) != 0
    assert differing(held(seeded, want), want) == []
