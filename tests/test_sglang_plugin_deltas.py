"""Delta updates (docs/deltas.md) into a REAL sglang 0.5.23 server with the plugin
(``python -m sglang.launch_server``, tp=1, a tiny Qwen3 on the CPU through the ``p2pw_cpu`` platform,
its weights published over Mooncake with sglang's
``--remote-instance-weight-loader-start-seed-via-transfer-engine``): the rank opens a delta area beside
its weights and publishes it (sglang_plugin/rank_deltas.py), the plugin's session gate answers the
base claim and has the rank's scheduler apply the manifest before sglang's end
(sglang_plugin/deltas.py, sessions.py).

What the server holds afterwards is read with sglang's own ``/weights_checker`` (action ``checksum``:
SHA-256 of each parameter's bytes, its first 8 bytes in hex) and compared with what sglang's own
loader makes, in this process, of the same HF tensors (``replica.reference``).
"""
from __future__ import annotations

import hashlib
import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import free_port, start_sglang_server

require_sglang()  # skips without sglang; fails in CI

import torch  # noqa: E402

from p2pweights.control import SglangEngine, http  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.models.engine_layout import EngineLayout  # noqa: E402
from p2pweights.replica.reference import reference_model  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402
from p2pweights.transport.publication import EnginePublication  # noqa: E402

STARTUP_TIMEOUT_S = 900.0  # a shared 2-core host under other suites' load
MOONCAKE_ENV = {"MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1"}
SEED = 7
FRACTION = 0.03  # of every tensor's elements changed per version


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_deltas")
    model_dir = write_config("qwen3", str(root))
    server = start_sglang_server(model_dir, str(root / "server.log"), tp=1, env=MOONCAKE_ENV,
                                 extra_args=(p.SEED_FLAG, "--engine-info-bootstrap-port", str(free_port())))
    sender = None
    try:
        server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        engine = SglangEngine(server.url, name="sglang-deltas", timeout=120)
        sender = WeightSender(model_dir, transport="mooncake", buffer_size=1 << 20)
        sender.connect([engine])
        yield SimpleNamespace(server=server, model_dir=model_dir, engine=engine, sender=sender)
    finally:
        if sender is not None:
            sender.close()
        server.stop()


def tensor_digest(t: torch.Tensor) -> str:
    """What sglang's checksum says of a CPU tensor: SHA-256 of its bytes, the first 8 bytes in hex."""
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()[:16]


def expected(model_dir: str, step: int) -> dict[str, str]:
    """Each parameter's digest after sglang's own loader took version ``step`` of the changed family."""
    model = reference_model(model_dir, EngineLayout.parse("tp=1"), 0, seed=SEED, post_process=True,
                            changed=(FRACTION, step))
    return {name: tensor_digest(param) for name, param in model.named_parameters()}


def held(engine: SglangEngine) -> dict[str, str]:
    answer = engine.weights_checker(action="checksum")
    assert answer["success"] is True and len(answer["ranks"]) == 1, answer
    return answer["ranks"][0]["checksums"]


def update(seeded, step: int, verify: bool = False):
    with seeded.sender.update(f"v{step}", verify=verify) as u:
        for name, t in random_checkpoint(checkpoint_tensors(seeded.model_dir), SEED, changed=(FRACTION, step)):
            u.push(name, t)
    assert [e.state for e in u.report.engines] == ["ok"], u.report
    return u.report


def session_state(seeded) -> dict:
    return seeded.server.get_json("/server_info")["p2pw_weight_update"]


def corrupt_area_before_end(engine: SglangEngine, monkeypatch) -> None:
    """Once the sender wrote (its end call), overwrite the first record's destination in the rank's
    area through Mooncake, as any process that reaches the rank could: no real address is all 0xA5."""
    from p2pweights.transport.mooncake import new_engine

    pub = EnginePublication.from_json(engine.transfer_engine_info(0))
    end = engine.end_weight_update

    def corrupting_end(*args, **kwargs):
        te, _ = new_engine("127.0.0.1")
        buf = np.full(8, 0xA5, dtype=np.uint8)
        assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
        try:
            assert te.transfer_sync_write(pub.peer, buf.ctypes.data, pub.delta_area[0], 8) == 0
        finally:
            te.unregister_memory(buf.ctypes.data)
        return end(*args, **kwargs)

    monkeypatch.setattr(engine, "end_weight_update", corrupting_end)


def test_the_plugin_offers_deltas_and_the_rank_publishes_its_area(seeded):
    info = seeded.engine.server_info()["p2pw_plugin"]
    assert p.PLUGIN_DELTAS in info["offers"] and "error" not in info, info
    pub = EnginePublication.from_json(seeded.engine.transfer_engine_info(0))
    assert pub.delta_area is not None and pub.delta_area[1] >= 4 << 20, pub.delta_area
    a, n = pub.delta_area
    assert all(s + m <= a or a + n <= s for s, m in pub.regions)  # apart from every weight


def test_a_full_update_then_deltas_byte_exact_then_refusals(seeded, monkeypatch):
    want1 = expected(seeded.model_dir, 1)
    assert held(seeded.engine) != want1  # sglang's dummy weights: the check can fail

    first = update(seeded, 1)
    assert first.delta_reason, "the first update has no base: a full write"
    assert held(seeded.engine) == want1

    want2 = expected(seeded.model_dir, 2)
    second = update(seeded, 2)
    assert second.delta_reason == {}, second.delta_reason
    assert 0 < second.bytes_written < second.bytes // 4, (second.bytes_written, second.bytes)
    got = held(seeded.engine)
    assert got != want1 and got == want2

    # another controller's session in between: the sender's base is refused, a full write heals
    other = {p.SESSION_OWNER_HEADER: secrets.token_urlsafe(32)}
    for verb in ("pause_generation", "begin_weight_update", "end_weight_update", "continue_generation"):
        status, answer = http.request("POST", seeded.server.url, f"/{verb}", body={}, headers=other, timeout=120)
        assert p.ok(status), answer
    third = update(seeded, 3)
    (why,) = third.delta_reason.values()
    assert "refused the base" in why and third.bytes_written >= third.bytes, third.delta_reason
    assert held(seeded.engine) == expected(seeded.model_dir, 3)

    # deltas again; then an area changed after the sender wrote: the apply is refused, the engine torn
    assert update(seeded, 4).delta_reason == {}
    corrupt_area_before_end(seeded.engine, monkeypatch)
    with pytest.raises(Exception) as failed:
        update(seeded, 5)
    monkeypatch.undo()
    assert "delta" in str(failed.value), failed.value
    state = session_state(seeded)
    assert state["state"] == p.TORN and "refused" in state["torn"], state
    assert held(seeded.engine) == expected(seeded.model_dir, 4)  # nothing applied: the refusal is whole

    healed = update(seeded, 6)  # takes the torn session over, in full (the identity went with the failure)
    assert healed.delta_reason and session_state(seeded)["state"] == "none"
    assert held(seeded.engine) == expected(seeded.model_dir, 6)
    assert update(seeded, 7).delta_reason == {}
    assert held(seeded.engine) == expected(seeded.model_dir, 7)
    # verify=True: the ranks apply through /p2pw_apply_deltas before the digests, then the end commits
    assert update(seeded, 8, verify=True).delta_reason == {}
    assert held(seeded.engine) == expected(seeded.model_dir, 8)
    assert update(seeded, 9).delta_reason == {}  # the verified update committed a base too
    assert held(seeded.engine) == expected(seeded.model_dir, 9)


def test_two_pp_stages_write_deltas_into_the_real_servers_rank_each_into_its_own_part(seeded):
    """Two PP stages, each its own sender process in one gloo group, write the real server's rank:
    each stage its records into its own part of the rank's area, the plugin's scheduler applies both
    segments (the engine core's one parse, engine/rank_area.py's one apply) before sglang's end."""
    from test_senders_group import Senders

    senders = Senders(seeded.model_dir, [SimpleNamespace(url=seeded.server.url, name="sglang-deltas")], split="pp")
    try:
        for step in range(3):
            senders.update(f"pp{step}", SEED, how=(f"changed:{step}",) * 2)
            _, r0 = senders.expect(0, "done")
            _, r1 = senders.expect(1, "done")
            model = reference_model(seeded.model_dir, EngineLayout.parse("tp=1"), 0, seed=SEED, post_process=True,
                                    changed=(0.01, step))
            assert held(seeded.engine) == {n: tensor_digest(t) for n, t in model.named_parameters()}
            if step:  # both stages' writes took deltas
                for r in (r0, r1):
                    assert r["delta_reason"] == {} and 0 < r["bytes_written"] < r["bytes"] // 4, r
    finally:
        senders.close()


# -- the publication's hooks, in this process ------------------------------------------------------
def _session_request(self, method, url, params=None, data=None, headers=None, cookies=None, files=None, auth=None,
                     timeout=None, allow_redirects=True, proxies=None, hooks=None, stream=None, verify=None, cert=None,
                     json=None):
    return json  # requests' Session.request signature: what would be sent


def test_only_the_ranks_registration_put_carries_the_area(monkeypatch):
    from p2pweights.sglang_plugin import bootstrap_requests, rank_deltas

    put = rank_deltas.REGISTER_PATH
    assert bootstrap_requests.around_session_request(_session_request, None, "PUT", f"http://h{put}", json={"a": 1}) == {"a": 1}
    token = rank_deltas._PUBLISHING.set([4096, 8192])
    try:
        assert bootstrap_requests.around_session_request(_session_request, None, method="PUT", url=f"http://h{put}",
                                                  json={"a": 1}) == {"a": 1, "delta_area": [4096, 8192]}
        assert bootstrap_requests.around_session_request(_session_request, None, "GET", "http://h/other", json={"a": 1}) == {
            "a": 1}
    finally:
        rank_deltas._PUBLISHING.reset(token)


def test_the_bootstrap_server_keeps_an_accepted_area_and_serves_it(monkeypatch):
    import asyncio
    import json

    from p2pweights.sglang_plugin import delta_updates

    monkeypatch.setattr(delta_updates, "AREAS", {})
    statuses = {"PUT": 200}

    async def sglang_app(scope, receive, send):  # the bootstrap server: accepts the PUT, answers the GET
        await receive()
        status = statuses.get(scope["method"], 200)
        body = json.dumps({"rank": 0, "remote_instance_transfer_engine_info": ["peer", {}]}).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"1")]})
        await send({"type": "http.response.body", "body": body})

    def call(method, path, body=b""):
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "query_string": b"rank=0"}
        asyncio.run(delta_updates.AreaBook(sglang_app)(scope, receive, send))
        return sent[0]["status"], json.loads(sent[1]["body"])

    put = json.dumps({"tp_rank": 0, "transfer_engine_info": {}, "delta_area": [4096, 8192]}).encode()
    statuses["PUT"] = 400  # sglang refused the PUT: nothing kept
    call("PUT", delta_updates.rank_deltas.REGISTER_PATH, put)
    assert delta_updates.AREAS == {} and "delta_area" not in call("GET", delta_updates.GET_PATH)[1]
    statuses["PUT"] = 200
    call("PUT", delta_updates.rank_deltas.REGISTER_PATH, put)
    status, answer = call("GET", delta_updates.GET_PATH)
    assert status == 200 and answer["delta_area"] == [4096, 8192] and answer["rank"] == 0
