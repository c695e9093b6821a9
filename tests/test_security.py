"""Authentication and HTTP hygiene of the receiver (docs/security.md).

- The key: every route of ``routes.ROUTES`` but the health routes answers 401 without
  ``Authorization: Bearer KEY`` or with a wrong one, and runs nothing; the right key works end to
  end (a real engine of rank processes, real Mooncake on 127.0.0.1, WeightSender(api_key=...));
  a rank's weight table cannot be re-registered without the key; the ranks' internal endpoints
  require it too; the key never appears on a command line.
- Hygiene: a body over the limit is 413 unread, a truncated or stalled body is refused (400/408)
  and never executed, malformed JSON and wrong types are 400, never 500.
- Mooncake's listeners: where they bind, as docs/security.md says (the vendor binds the wildcard;
  MC_MIN_RPC_PORT/MC_MAX_RPC_PORT confine the ports a firewall rule names).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import typing

import pytest

from p2pweights.control import SglangEngine, bodies, error_answers, routes
from p2pweights.control import protocol as p
from p2pweights.control.http import request
from p2pweights.errors import EngineError, Unauthorized
from p2pweights.receiver import ReceiverHooks, ReceiverServer, check_weights_equal, start_engine
from p2pweights.receiver.rank_server import call_rank
from replica_configs import write_config

KEY = "s3cret-key"
WRONG = {"Authorization": "Bearer not-the-key"}
RIGHT = {"Authorization": f"Bearer {KEY}"}


class RecordingHooks(ReceiverHooks):
    """Default hooks that record every call: a refused request must run none."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        for name in dir(ReceiverHooks):
            if not name.startswith("_") and callable(getattr(ReceiverHooks, name)):
                setattr(self, name, self._recorder(name, getattr(self, name)))

    def _recorder(self, name, method):
        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)
        return call


def sample_body(route: routes.Route) -> dict | None:
    """A well-formed body for ``route`` (what would run if the call were let through)."""
    if route.body is None:
        return None
    samples = {str: "x", int: 1, float: 1.0, bool: True, list: [], dict: {}}
    out = {}
    for f in dataclasses.fields(route.body):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        kind = bodies._kind(typing.get_type_hints(route.body)[f.name])
        out[f.name] = samples.get(kind, "x")
    if route.body is bodies.RegisterTransferEngineInfoReq:
        out = {"tp_rank": 0, "transfer_engine_info": {"session_id": "10.0.0.66:1234", "weights_info_dict": {}}}
    return out


def calls_of_every_route():
    for route in routes.ROUTES:
        for method in route.methods:
            yield route, method


def raw_http(port: int, data: bytes, *, shut_write: bool = False, timeout: float = 10.0) -> tuple[int | None, bytes]:
    """Send raw bytes, read the answer until the server closes: (status or None, whole answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and not shut_write:
                    head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
                    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")]
                    if length and len(rest) >= length[0]:
                        break
        except (ConnectionResetError, socket.timeout):
            pass
    answer = b"".join(chunks)
    status = int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/") else None
    return status, answer


@pytest.fixture()
def keyed_server():
    hooks = RecordingHooks()
    server = ReceiverServer(hooks, api_key=KEY, read_timeout=1.0, max_body=1 << 20).start()
    yield server, hooks
    server.close()


# ---- the key, on every route ------------------------------------------------------------------

def test_every_route_but_health_answers_401_without_the_key_or_with_a_wrong_one_and_runs_nothing(keyed_server):
    server, hooks = keyed_server
    checked = 0
    for route, method in calls_of_every_route():
        for headers in (None, WRONG, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            status, answer = request(method, server.url, route.path, body=sample_body(route),
                                     params={"rank": 0} if route.query else None, headers=headers)
            if route.health:
                assert status == p.OK, (route.path, status, answer)
            else:
                assert status == p.UNAUTHORIZED, (method, route.path, headers, status, answer)
                assert error_answers.ErrorAnswer.of(answer).fields.get("hint"), answer
            checked += 1
    assert hooks.calls == [], f"a refused call ran hooks: {hooks.calls}"
    assert checked >= 4 * len(routes.ROUTES)
    # an unknown path is no way around the key either (sglang's middleware answers 401 too)
    assert request("GET", server.url, "/no_such_route")[0] == p.UNAUTHORIZED


def test_the_right_key_passes_every_route(keyed_server):
    server, hooks = keyed_server
    for route, method in calls_of_every_route():
        status, answer = request(method, server.url, route.path, body=sample_body(route),
                                 params={"rank": 0} if route.query else None, api_key=KEY)
        assert status != p.UNAUTHORIZED, (method, route.path, answer)
    assert "server_info" in hooks.calls and "on_pause" in hooks.calls


def test_a_client_sends_the_key_from_api_key_or_P2PW_API_KEY(keyed_server, monkeypatch):
    server, _ = keyed_server
    with pytest.raises(Unauthorized) as e:
        SglangEngine(server.url, name="keyed").server_info()
    assert "401" in str(e.value) and "api_key" in (e.value.hint or "") and e.value.engine == "keyed"
    with pytest.raises(Unauthorized):
        SglangEngine(server.url, name="keyed", api_key="not-" + KEY).server_info()
    assert isinstance(SglangEngine(server.url, api_key=KEY).server_info(), dict)
    monkeypatch.setenv("P2PW_API_KEY", KEY)
    assert isinstance(SglangEngine(server.url).server_info(), dict)


# ---- a real engine: ranks, registration, the internal endpoints --------------------------------

@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory):
    cfg = write_config("qwen3", str(tmp_path_factory.mktemp("cfg")))
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="keyed", api_key=KEY)
    yield cfg, engine
    engine.close()


def test_a_keyed_engine_is_updated_end_to_end_by_a_sender_with_the_key(keyed_engine):
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    cfg, engine = keyed_engine
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, api_key="wrong") as sender:
        with pytest.raises(EngineError, match="401"):
            sender.connect([engine.url])
    with pytest.raises(EngineError, match="401"):
        check_weights_equal(engine.url, hf_seed=5)
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, api_key=KEY) as sender:
        sender.connect([engine.url])
        with sender.update("v5") as update:
            for name, t in random_checkpoint(checkpoint_tensors(cfg), 5):
                update.push(name, t)
    result = check_weights_equal(engine.url, hf_seed=5, api_key=KEY)
    assert result["success"], result["message"]
    assert SglangEngine(engine.url, api_key=KEY).weight_version() == "v5"


def test_a_ranks_weight_table_cannot_be_re_registered_without_the_key(keyed_engine):
    _, engine = keyed_engine
    client = SglangEngine(engine.url, api_key=KEY)
    before = client.transfer_engine_info(1)
    attack = {"tp_rank": 1, "transfer_engine_info": {
        "session_id": "10.66.66.66:16666", "weights_info_dict": {"model.embed_tokens.weight": [4096, 1, 2]},
        "p2pw_control_url": "http://10.66.66.66:1"}}
    for headers in (None, WRONG):
        status, answer = request("PUT", engine.url, "/register_transfer_engine_info", body=attack, headers=headers)
        assert status == p.UNAUTHORIZED, answer
    assert client.transfer_engine_info(1) == before
    assert client.server_info()["p2pw_ranks_ready"] == [0, 1]


def test_the_ranks_internal_endpoints_require_the_key(keyed_engine):
    _, engine = keyed_engine
    control_url = engine.ready[1]["control_url"]
    for key in (None, "wrong"):
        with pytest.raises(EngineError, match="Unauthorized"):
            call_rank(control_url, 1, "ping", {}, timeout=5, api_key=key)
    assert call_rank(control_url, 1, "ping", {}, timeout=5, api_key=KEY)["rank"] == 1


def test_the_key_is_on_no_command_line(keyed_engine):
    _, engine = keyed_engine
    for pid in engine.pids.values():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()


def test_bad_input_to_a_real_engine_is_a_4xx_never_a_500(keyed_engine):
    _, engine = keyed_engine
    bad = [("/weights_checker", {"action": "p2pw_compare", "hf_seed": "x"}),
           ("/weights_checker", {"action": "p2pw_compare", "hf_seed": [1]}),
           ("/weights_checker", {"action": 5}),
           ("/weights_checker", {"action": "p2pw_compare", "hf_seed": 1, "skip_tensor_list": "x"}),
           ("/get_weights_by_name", {"name": 5}),
           ("/get_weights_by_name", {"name": "no.such.param"}),
           ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "x"}),
           ("/pause_generation", {"mode": "explode"}),
           ("/update_weight_version", {"new_version": {"a": 1}}),
           ("/register_transfer_engine_info", {"tp_rank": -1, "transfer_engine_info": {}})]
    for path, body in bad:
        method = routes.BY_PATH[path].method
        status, answer = request(method, engine.url, path, body=body, api_key=KEY)
        assert 400 <= status < 500, (path, body, status, answer)
    for rank in ("x", "-1", str(10 ** 30), ""):
        status, _ = request("GET", engine.url, "/remote_instance_transfer_engine_info", params={"rank": rank},
                            api_key=KEY)
        assert 400 <= status < 500, rank
    # the internal endpoint: an unknown verb, a path outside it, a body that is not JSON
    control = engine.ready[1]["control_url"]
    port = int(control.rsplit(":", 1)[1])
    assert request("POST", control, routes.RANK_ROUTE_PREFIX + "rm_rf", body={}, api_key=KEY)[0] == p.BAD_REQUEST
    assert request("POST", control, "/elsewhere", body={}, api_key=KEY)[0] == p.NOT_FOUND
    status, _ = raw_http(port, _post(routes.RANK_ROUTE_PREFIX + "ping", b"{not json", RIGHT))
    assert status == p.BAD_REQUEST
    status, _ = raw_http(port, _post(routes.RANK_ROUTE_PREFIX + "ping", b"", RIGHT, length="99999999999"))
    assert status == p.PAYLOAD_TOO_LARGE
    assert SglangEngine(engine.url, api_key=KEY).health()


# ---- hygiene on the receiver's server ------------------------------------------------------------

def _post(path: str, body: bytes, headers: dict | None = None, length: str | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(body) if length is None else length}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_a_body_over_the_limit_is_413_unread_and_not_run(keyed_server):
    server, hooks = keyed_server
    for length in (str(2 << 20), str(10 ** 15)):
        status, answer = raw_http(server.port, _post("/pause_generation", b"", RIGHT, length=length))
        assert status == p.PAYLOAD_TOO_LARGE, answer
    assert hooks.calls == []
    assert not server.paused


def test_a_bad_content_length_is_400(keyed_server):
    server, hooks = keyed_server
    for length in ("-5", "abc", "1e3"):
        status, answer = raw_http(server.port, _post("/pause_generation", b"{}", RIGHT, length=length))
        assert status == p.BAD_REQUEST, (length, answer)
    assert hooks.calls == []


def test_a_truncated_body_is_400_and_never_executed(keyed_server):
    server, hooks = keyed_server
    whole = json.dumps({"new_version": "v-truncated"}).encode()
    status, answer = raw_http(server.port, _post("/update_weight_version", whole[:10], RIGHT, length=str(len(whole))),
                              shut_write=True)
    assert status == p.BAD_REQUEST and b"truncated" in answer, answer
    assert hooks.calls == [] and server.weight_version == "default"


def test_a_client_that_stalls_mid_body_is_cut_off_and_frees_its_thread(keyed_server):
    server, hooks = keyed_server
    t0 = time.monotonic()
    status, answer = raw_http(server.port, _post("/pause_generation", b'{"mo', RIGHT, length="100"))
    waited = time.monotonic() - t0
    assert status == p.REQUEST_TIMEOUT, answer
    assert waited < 5, f"the server held a stalled request {waited:.1f}s (read timeout 1s)"
    assert hooks.calls == [] and not server.paused
    # a client that sends half its headers and stops is dropped too
    t0 = time.monotonic()
    _, answer = raw_http(server.port, b"POST /pause_generation HTTP/1.1\r\nHost: x\r\n")
    assert time.monotonic() - t0 < 5
    assert request("GET", server.url, "/health")[0] == p.OK


def test_malformed_json_and_wrong_types_are_400_never_500(keyed_server):
    server, hooks = keyed_server
    for raw in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe", b"[" * 100_000, b"{" * 50_000, b"nan"):
        status, answer = raw_http(server.port, _post("/pause_generation", raw, RIGHT))
        assert status == p.BAD_REQUEST, (raw[:20], answer)
    wrong_values = [{"a": 1}, [1], "text", 1.5, True, -1, 10 ** 40]
    for route in routes.ROUTES:
        if route.body is None or "POST" not in route.methods and "PUT" not in route.methods:
            continue
        for f in dataclasses.fields(route.body):
            for wrong in wrong_values:
                body = {**(sample_body(route) or {}), f.name: wrong}
                status, answer = request(route.method, server.url, route.path, body=body, api_key=KEY)
                assert status < 500, (route.path, f.name, wrong, status, answer)
    assert request("GET", server.url, "/health")[0] == p.OK


# ---- Mooncake's listeners ----------------------------------------------------------------------

_LISTENERS = """
import json, os, psutil, ctypes
from p2pweights.transport.mooncake import MooncakeReceiver
before = {c.laddr for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
buf = ctypes.create_string_buffer(1 << 16)
r = MooncakeReceiver(hostname="127.0.0.1", protocol="tcp")
r.register(ctypes.addressof(buf), 1 << 16)
after = [c.laddr for c in psutil.Process().net_connections("inet") if c.status == "LISTEN" and c.laddr not in before]
print(json.dumps({"session": r.session_id, "listeners": [[a.ip, a.port] for a in after]}), flush=True)
os._exit(0)
"""


def test_mooncake_listeners_bind_the_wildcard_within_the_port_range_docs_security_names():
    """Pins what docs/security.md tells operators: Mooncake binds its RPC port and its TCP data
    port on every interface whatever MC_TCP_BIND_ADDRESS says (firewall them), and
    MC_MIN_RPC_PORT/MC_MAX_RPC_PORT confine both to the range a firewall rule names. If a Mooncake
    release starts binding the advertised host, this fails: update the doc (and bind it)."""
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_MIN_RPC_PORT": "20100", "MC_MAX_RPC_PORT": "20400"}
    out = subprocess.run([sys.executable, "-c", _LISTENERS], env=env, capture_output=True, text=True, timeout=60)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert line, out.stderr[-2000:]
    found = json.loads(line[-1])
    rpc_port = int(found["session"].rsplit(":", 1)[1])
    listeners = {port: ip for ip, port in found["listeners"]}
    assert rpc_port in listeners and len(listeners) == 2, found
    assert all(20100 <= port <= 20400 for port in listeners), found
    assert set(listeners.values()) <= {"0.0.0.0", "::"}, found
