"""A rank's registration with its leader (receiver/registration.py, docs/security.md): the leader
calls a rank, and sends it the engine's key, only at the control URL the launcher gave it; what a
rank registers must be what the rank process itself publishes there (its registered memory
included). A key holder's re-registration can neither point rank 1 at a listener of its own nor
forge rank 1's publication. Unit checks of RankEndpoints, then a real keyed engine of two ranks."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from p2pweights.control import SglangEngine
from p2pweights.control import protocol as p
from p2pweights.control.http import request
from p2pweights.errors import InvalidRequest
from p2pweights.receiver import start_engine
from p2pweights.receiver.registration import RankEndpoints, check_claim, control_url, parse_rank_ports
from replica_configs import write_config

KEY = "registration-key"


# ---- the rules, without an engine ------------------------------------------------------------------


def test_only_the_url_the_launcher_gave_a_rank_is_admitted():
    given = parse_rank_ports("41001,41002", "127.0.0.1")
    assert given == {1: "http://127.0.0.1:41001", 2: "http://127.0.0.1:41002"} == {
        r: control_url("127.0.0.1", 41000 + r) for r in (1, 2)}
    ends = RankEndpoints(given, "127.0.0.1")
    assert ends.admit(1, "http://127.0.0.1:41001") == "http://127.0.0.1:41001"
    for forged in ("http://127.0.0.1:41002", "http://127.0.0.1:9", "http://10.66.66.66:41001", "", None, 5):
        with pytest.raises(InvalidRequest) as info:
            ends.admit(1, forged)
        assert info.value.rank == 1
    with pytest.raises(InvalidRequest, match="not 'http://127.0.0.1:41001' \\(the launcher gave it\\)"):
        ends.admit(1, "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="--rank-ports"):
        parse_rank_ports("41001,x", "127.0.0.1")
    for stranger in (0, 3, 7):  # no rank the launcher started: refused whatever its URL
        with pytest.raises(InvalidRequest, match=f"rank {stranger} is not a rank >= 1 of this engine"):
            ends.admit(stranger, "http://127.0.0.1:41001")
    with pytest.raises(InvalidRequest, match="rank 2 is not"):
        RankEndpoints(None, "127.0.0.1", world=2).admit(2, "http://127.0.0.1:41001")


def test_without_the_launchers_ports_a_rank_keeps_the_url_it_first_registered_on_the_leaders_host():
    ends = RankEndpoints(None, "127.0.0.1")
    with pytest.raises(InvalidRequest, match="not on the leader's host"):
        ends.admit(1, "http://192.0.2.1:41001")  # TEST-NET-1: never this machine
    for malformed in ("https://127.0.0.1:1", "http://127.0.0.1", "http://u:p@127.0.0.1:1", "http://127.0.0.1:1/x"):
        with pytest.raises(InvalidRequest, match="not http://HOST:PORT"):
            ends.admit(1, malformed)
    url = ends.admit(1, "http://127.0.0.1:41001")
    ends.bind(1, url)
    with pytest.raises(InvalidRequest, match="\\(it first registered\\)"):
        ends.admit(1, "http://127.0.0.1:41002")  # moved after the fact: refused
    with pytest.raises(InvalidRequest):
        ends.bind(1, "http://127.0.0.1:41002")


def test_a_claim_must_equal_what_the_rank_publishes():
    own = {"peer": "127.0.0.1:15000", "table": {"w": [4096, 8, 2]}, "extra": {"registered_memory": [[4096, 4096]]}}
    claim = {"session_id": "127.0.0.1:15000", "weights_info_dict": {"w": [4096, 8, 2]},
             "registered_memory": [[4096, 4096]], "p2pw_control_url": "http://127.0.0.1:1", "registered_from": "x"}
    check_claim(1, claim, own)
    with pytest.raises(InvalidRequest, match="differs from what the rank process publishes.*registered_memory"):
        check_claim(1, {**claim, "registered_memory": [[0, 1 << 63]]}, own)
    with pytest.raises(InvalidRequest, match="weights_info_dict"):
        check_claim(1, {**claim, "weights_info_dict": {"w": [8192, 8, 2]}}, own)
    with pytest.raises(InvalidRequest, match="agent_metadata"):
        check_claim(1, {**claim, "agent_metadata": "Zm9yZ2Vk"}, own)


# ---- a real keyed engine -----------------------------------------------------------------------------


class _Listener:
    """An HTTP listener of the attacker's: records every request it gets (path, Authorization)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                seen.append((self.path, self.headers.get("Authorization", "")))
                body = json.dumps({"ok": True, "result": {"rank": 1}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = write_config("qwen3", str(tmp_path_factory.mktemp("cfg")))
    e = start_engine(cfg, "tp=2", transport="mooncake", name="registration", api_key=KEY)
    yield e
    e.close()


def _registration(info: dict, control: str, **changes) -> dict:
    """Rank 1's registration body from what the leader serves for it, with ``changes``."""
    session, table = info["remote_instance_transfer_engine_info"]
    extra = {k: v for k, v in info.items() if k not in ("rank", "remote_instance_transfer_engine_info",
                                                         "registered_from")}
    return {"tp_rank": 1, "transfer_engine_info": {"session_id": session, "weights_info_dict": table, **extra,
                                                   "p2pw_control_url": control, **changes}}


def _fan_out(engine) -> dict:
    """A verb the leader runs on every rank (over rank 1's control URL)."""
    status, answer = request("POST", engine.url, "/weights_checker", body={"action": "checksum"}, api_key=KEY)
    assert status == p.OK and answer["success"], answer
    return answer


def test_the_launcher_gives_each_rank_its_control_url_and_a_genuine_re_registration_is_accepted(engine):
    assert engine.ready[1]["control_url"] == control_url(engine.host, engine.rank_ports[1])
    info = SglangEngine(engine.url, api_key=KEY).transfer_engine_info(1)
    status, answer = request("PUT", engine.url, "/register_transfer_engine_info",
                             body=_registration(info, engine.ready[1]["control_url"]), api_key=KEY)
    assert status == p.OK, answer  # what the rank itself publishes, at its own URL: a retry, fine
    assert _fan_out(engine)["ranks"] == [0, 1]


def test_a_keyed_re_registration_cannot_point_a_rank_at_another_listener(engine):
    client = SglangEngine(engine.url, api_key=KEY)
    info = client.transfer_engine_info(1)
    listener = _Listener()
    try:
        status, answer = request("PUT", engine.url, "/register_transfer_engine_info",
                                 body=_registration(info, listener.url), api_key=KEY)
        assert status == p.BAD_REQUEST, answer
        message = json.dumps(answer)
        assert "rank 1 registered the control URL" in message and listener.url in message
        assert "the launcher gave it" in message
        stranger = _registration(info, listener.url)
        stranger["tp_rank"] = 5  # a rank the engine does not have: no URL of it is ever called either
        status, answer = request("PUT", engine.url, "/register_transfer_engine_info", body=stranger, api_key=KEY)
        assert status == p.BAD_REQUEST and "rank 5 is not a rank >= 1" in json.dumps(answer), answer
        _fan_out(engine)  # the leader still calls rank 1 where it always did
        _fan_out(engine)
        assert listener.requests == []  # never called, so never sent the key
    finally:
        listener.close()
    assert client.transfer_engine_info(1) == info


def test_a_keyed_re_registration_cannot_forge_a_ranks_registered_memory(engine):
    client = SglangEngine(engine.url, api_key=KEY)
    info = client.transfer_engine_info(1)
    control = engine.ready[1]["control_url"]
    for forged in ({"registered_memory": [[0, 1 << 63]]},
                   {"weights_info_dict": {n: [0x1000, *row[1:]] for n, row in
                                          info["remote_instance_transfer_engine_info"][1].items()}},
                   {"session_id": "127.0.0.1:1"}):
        status, answer = request("PUT", engine.url, "/register_transfer_engine_info",
                                 body=_registration(info, control, **forged), api_key=KEY)
        assert status == p.BAD_REQUEST, answer
        assert "differs from what the rank process publishes" in json.dumps(answer) and next(iter(forged)) in \
            json.dumps(answer)
    assert client.transfer_engine_info(1) == info  # what the leader serves is still rank 1's own
    leader = client.transfer_engine_info(0)  # rank 0, the leader's own, cannot be re-registered over HTTP either
    body = _registration(leader, "", registered_memory=[[0, 1 << 63]])
    body["tp_rank"] = 0
    status, answer = request("PUT", engine.url, "/register_transfer_engine_info", body=body, api_key=KEY)
    assert status == p.BAD_REQUEST and "rank 0's registration differs" in json.dumps(answer), answer
    assert client.transfer_engine_info(0) == leader


def test_a_ranks_picked_control_port_taken_before_it_binds_is_picked_again(engine, monkeypatch):
    import socket

    from p2pweights.receiver import local

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # another process got rank 1's port between the pick and the rank's bind
    picks = iter([None, taken.getsockname()[1]])  # the leader's pick, then rank 1's
    real = local.free_port
    monkeypatch.setattr(local, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    try:
        e = local.start_engine(engine.model, "tp=2", transport="mooncake", name="rank-port-race", api_key=KEY)
        try:
            assert e.rank_ports[1] != taken.getsockname()[1]
            assert e.ready[1]["control_url"] == control_url(e.host, e.rank_ports[1])
            assert _fan_out(e)["ranks"] == [0, 1]
        finally:
            e.close()
    finally:
        taken.close()
