"""Authentication and HTTP hygiene of the receiver (docs/security.md).

- The key: every route of ``routes.ROUTES`` but the health routes answers 401 without
  ``Authorization: Bearer KEY`` or with a wrong one, and runs nothing; the right key works end to
  end (a real engine of rank processes, real Mooncake on 127.0.0.1, WeightSender(api_key=...));
  a rank's weight table cannot be re-registered without the key; the ranks' internal endpoints
  require it too; the key never appears on a command line.
- Hygiene: every body over its limit is 413 (unread when its Content-Length says so; a streamed
  one counted while read), a truncated or stalled body is never executed (a stalled one is 408),
  malformed JSON and wrong types are 400, never 500; a handler that raises is a JSON 500, never a
  dropped connection.
- HTTP that survives the internet (the HTTP front, ``p2pweights.front``): a health route never
  reads a body (large ones to a real engine's leader leave its memory flat and its ranks up); a
  client that drips its request is cut off at the request deadline; 200 connections without the
  key dripping from the trainer's own address neither delay the trainer's keyed calls nor hold
  anything once closed; Content-Length is plain digits; every wrong-typed body, on the engine's
  routes and the ranks' internal ones, is a 400 naming the field; a rank does not take a leader
  that holds its GIL for seconds for gone.
- Mooncake's listeners: where they bind, as docs/security.md says (the vendor binds the wildcard;
  MC_MIN_RPC_PORT/MC_MAX_RPC_PORT confine the ports a firewall rule names).
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import typing

import pytest

from p2pweights.control import SglangEngine, bodies, error_answers, routes
from p2pweights.control import protocol as p
from p2pweights.control.http import POOL, request
from p2pweights.errors import EngineError, P2PWeightsError, Unauthorized, UnknownParameter
from p2pweights.receiver import ReceiverHooks, ReceiverServer, check_weights_equal, start_engine
from p2pweights.receiver.rank_server import LeaderWatch, call_rank, serve_rank_control
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


def _streamed(port: int, path: str, size: int, headers: dict) -> int | None:
    """Send a chunked body of ``size`` bytes (no Content-Length: the server can only count), stop
    there, and read the answer: its status, or None."""
    head = [f"POST {path} HTTP/1.1", "Host: x", "Transfer-Encoding: chunked"] + [f"{k}: {v}" for k, v in headers.items()]
    data = ("\r\n".join(head) + "\r\n\r\n").encode() + b"%x\r\n" % size + b"x" * size
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        answer = s.recv(65536)
    return int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/") else None


def test_every_body_limit_answers_413_and_runs_nothing():
    """Each limit, however it is crossed: a Content-Length over it (refused unread), a streamed
    (chunked) body that grows past it (counted while read), on a verb's few arguments (1 MiB), a
    large body's route (max_body), a route that takes no body (64 KiB) and an unknown path."""
    hooks = RecordingHooks()
    with ReceiverServer(hooks, api_key=KEY, max_body=4 << 20) as server:
        over = {"/pause_generation": (1 << 20) + 1, "/register_transfer_engine_info": (4 << 20) + 1,
                "/p2pw_weights_digest": (4 << 20) + 1, "/no_such_route": (64 << 10) + 1}
        for path, length in over.items():
            status, answer = raw_http(server.port, _post(path, b"", RIGHT, length=str(length)))
            assert status == p.PAYLOAD_TOO_LARGE and b"Connection: close" in answer, (path, answer)
            assert error_answers.ErrorAnswer.of(json.loads(answer.partition(b"\r\n\r\n")[2])).message, answer
            assert _streamed(server.port, path, length, RIGHT) == p.PAYLOAD_TOO_LARGE, (path, "streamed")
        head = _post("/health", b"", length=str((64 << 10) + 1)).replace(b"POST", b"GET", 1)
        assert raw_http(server.port, head)[0] == p.PAYLOAD_TOO_LARGE  # no key needed, and no body read either
        assert hooks.calls == [] and not server.paused
        assert request("POST", server.url, "/pause_generation", body={}, api_key=KEY)[0] == p.OK  # still serving


def test_a_handler_that_raises_a_plain_exception_answers_a_json_500_naming_the_route(keyed_server):
    server, hooks = keyed_server

    def boom():
        raise RuntimeError("disk on fire")

    hooks.server_info = boom
    status, answer = request("GET", server.url, "/server_info", api_key=KEY)
    assert status == p.ENGINE_FAILED, (status, answer)
    assert answer["error"]["type"] == "EngineError" and "/server_info" in answer["message"], answer
    assert "RuntimeError: disk on fire" in answer["message"], answer
    with pytest.raises(EngineError, match="disk on fire"):
        SglangEngine(server.url, api_key=KEY).server_info()
    assert request("GET", server.url, "/health")[0] == p.OK  # and the server keeps serving


def test_the_guard_answers_any_app_failure_as_json_never_an_escaped_exception():
    """The front's middleware, around any app (a Starlette app as sglang's and vLLM's, or plain
    ASGI): whatever the app raises is a JSON error answer with a 4xx/5xx status, by one mapping."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from p2pweights.errors import InvalidRequest, SessionConflict, TornWeights
    from p2pweights.front import Guard, StatusError

    raised = {"/plain": RuntimeError("plain"), "/conflict": SessionConflict("owned"), "/torn": TornWeights("torn"),
              "/input": InvalidRequest("bad input"), "/refused": StatusError("too late", p.REQUEST_TIMEOUT),
              "/typed": UnknownParameter("no such", parameter="w")}

    async def endpoint(request):
        raise raised[request.url.path]

    async def plain_asgi(scope, receive, send):
        raise KeyError("no such thing")

    expected = {"/plain": 500, "/conflict": 409, "/torn": 409, "/input": 400, "/refused": 408, "/typed": 400}
    app = Starlette(routes=[Route(path, endpoint) for path in raised])
    app.add_middleware(Guard, api_key=KEY)  # as a host adds it to sglang's or vLLM's app: inside Starlette's own
    for guarded in (app, Guard(plain_asgi, api_key=KEY)):
        client = TestClient(guarded, raise_server_exceptions=False)  # (no lifespan: the plain app has none)
        for path, status in expected.items():
            answer = client.get(path, headers=RIGHT)
            want = status if guarded is app else p.ENGINE_FAILED
            assert answer.status_code == want, (path, answer.status_code, answer.text)
            payload = answer.json()
            assert payload["success"] is False and payload["error"]["message"], payload
            if want == p.ENGINE_FAILED:
                assert path in payload["message"], payload  # the route is named
        assert client.get("/plain").status_code == p.UNAUTHORIZED  # the key first, then the app


def test_a_bad_content_length_is_400(keyed_server):
    server, hooks = keyed_server
    for length in ("-5", "abc", "1e3"):
        status, answer = raw_http(server.port, _post("/pause_generation", b"{}", RIGHT, length=length))
        assert status == p.BAD_REQUEST, (length, answer)
    assert hooks.calls == []


def test_a_truncated_body_is_never_executed(keyed_server):
    """A client that closes its side before the whole body arrived: nothing runs (uvicorn closes
    the connection at the client's end, so there is nobody left to answer)."""
    server, hooks = keyed_server
    whole = json.dumps({"new_version": "v-truncated"}).encode()
    status, answer = raw_http(server.port, _post("/update_weight_version", whole[:10], RIGHT, length=str(len(whole))),
                              shut_write=True)
    assert status in (None, p.BAD_REQUEST), answer
    time.sleep(0.2)
    assert hooks.calls == [] and server.weight_version == "default"
    assert request("GET", server.url, "/health")[0] == p.OK


def test_a_client_that_stalls_mid_body_or_mid_head_is_cut_off_at_the_read_timeout(keyed_server):
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


# ---- HTTP that survives the internet -----------------------------------------------------------

def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


class _PeakRss:
    """The highest resident set of ``pid`` seen while the block runs (sampled every few ms)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def __enter__(self) -> "_PeakRss":
        self.before = _rss(self.pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.003):
            self.peak = max(self.peak, _rss(self.pid))

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.before


def _send_body(port: int, head: bytes, body: bytes) -> int | None:
    """Send a request whose body the server may refuse unread: its status, or None if it hung up."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(head)
            s.sendall(body)
        except OSError:  # refused unread: the server closed while the body was on its way
            pass
        try:
            answer = s.recv(65536)
        except OSError:
            return None
    return int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/") else None


def test_large_bodies_to_health_leave_the_leaders_memory_flat_and_the_engine_up(keyed_engine):
    """Issue 23 item 4: three concurrent 32 MiB JSON bodies to /health, twice, took the leader to
    1.2 GB and 7 s of GIL, and rank 1 then left. A health route now reads no body at all."""
    _, engine = keyed_engine
    leader = engine.pids[0]
    port = int(engine.url.rsplit(":", 1)[1])
    body = b'{"a": [' + b"0," * ((32 << 20) // 2 - 8) + b"0]}"   # just under the 32 MiB body limit
    head = _post("/health", b"", length=str(len(body))).replace(b"POST", b"GET", 1)
    with _PeakRss(leader) as rss:
        for _ in range(2):
            threads = [threading.Thread(target=_send_body, args=(port, head, body)) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    assert rss.growth < 16 << 20, f"the leader grew {rss.growth >> 20} MiB on bodies sent to /health"
    assert raw_http(port, head)[0] == p.PAYLOAD_TOO_LARGE  # refused on its headers, the body never read
    time.sleep(3)  # rank 1's watchdog would have given up on a leader that stopped answering
    assert all(engine.alive().values()), engine.alive()
    assert SglangEngine(engine.url, api_key=KEY).server_info()["p2pw_ranks_ready"] == [0, 1]


def test_a_health_route_reads_no_body_and_parses_none(keyed_server):
    server, hooks = keyed_server
    small = _post("/health", b"[[[[not json", length=None).replace(b"POST", b"GET", 1)
    assert raw_http(server.port, small)[0] == p.OK        # a small body is dropped unparsed
    big = _post("/health", b"", length=str(1 << 20)).replace(b"POST", b"GET", 1)
    status, answer = raw_http(server.port, big)
    assert status == p.PAYLOAD_TOO_LARGE and b"Connection: close" in answer, answer


def test_a_verb_with_a_few_arguments_refuses_a_large_body_unread_a_weights_table_does_not():
    """Only the routes whose bodies can be large (a rank's weights table, every parameter's name:
    ``bodies.Body.LARGE``) take bodies up to the server's limit (32 MiB); a parse of one costs
    the leader seconds of GIL, so no other route reads more than 1 MiB."""
    hooks = RecordingHooks()
    with ReceiverServer(hooks, api_key=KEY) as server:
        big = b'{"mode": "abort", "pad": "' + b"x" * (2 << 20) + b'"}'
        status, answer = raw_http(server.port, _post("/pause_generation", b"", RIGHT, length=str(len(big))))
        assert status == p.PAYLOAD_TOO_LARGE, answer
        assert hooks.calls == [] and not server.paused
        table = {f"model.layers.{i}.mlp.weight": [4096 * i, 4096, 2] for i in range(40_000)}
        body = {"tp_rank": 1, "transfer_engine_info": {"session_id": "127.0.0.1:1", "weights_info_dict": table}}
        assert len(json.dumps(body)) > 2 << 20
        status, answer = request("PUT", server.url, "/register_transfer_engine_info", body=body, api_key=KEY)
        assert status == p.OK, answer


def _drip(port: int, first: bytes, drip: bytes, every: float, longest: float) -> tuple[float, bytes]:
    """Send ``first``, then ``drip`` one byte every ``every`` seconds until the server answers or
    closes (or ``longest`` passes): (seconds from the first byte, what the server sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(first)
        for i in range(len(drip)):
            if time.monotonic() - t0 > longest:
                break
            readable, _, _ = select.select([s], [], [], every)
            if readable:
                break
            try:
                s.sendall(drip[i:i + 1])
            except OSError:
                break
        try:
            answer = s.recv(65536)
        except OSError:
            answer = b""
        return time.monotonic() - t0, answer


def test_a_client_that_drips_its_request_is_cut_off_at_the_request_deadline():
    """Issue 23 item 5: a byte every 10-20 s held a thread for as long as the client liked (each
    read was within the read timeout). Here a read may wait 1 s, the whole request 2 s; the client
    sends a byte every 0.25 s, so only the deadline can cut it."""
    hooks = RecordingHooks()
    with ReceiverServer(hooks, api_key=KEY, read_timeout=1.0, request_deadline=2.0) as server:
        # in the headers: the connection is closed
        took, answer = _drip(server.port, b"POST /pause_generation HTTP/1.1\r\n", b"X-Drip: " + b"a" * 200,
                             every=0.25, longest=10)
        assert 1.9 < took < 2.0 + 5.0, f"a dripping client was cut after {took:.1f}s (deadline 2s; it drips for 10s)"
        assert answer == b"", answer
        # in the body: 408
        took, answer = _drip(server.port, _post("/pause_generation", b"{", RIGHT, length="300"), b" " * 299,
                             every=0.25, longest=10)
        assert 1.9 < took < 2.0 + 5.0, f"a dripping client was cut after {took:.1f}s (deadline 2s; it drips for 10s)"
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert hooks.calls == [] and not server.paused
        # a client that is not dripping is served, on a connection kept alive across requests
        for _ in range(3):
            assert request("POST", server.url, "/pause_generation", body={}, api_key=KEY)[0] == p.OK


def _dripper(port: int, first: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(first)
    return s


def test_unkeyed_clients_dripping_from_the_trainers_address_never_starve_its_keyed_calls():
    """Issue 39: 200 connections without the key, from 127.0.0.1 (the trainer's own address), each
    dripping a byte every 2 s, took every per-client slot of the thread-per-connection server: the
    trainer's next call was refused 503, and the slots stayed taken after the attacker left. On the
    HTTP front a waiting connection is a socket in the event loop, never a thread or a slot: the
    trainer's keyed calls answer at once meanwhile, and the attacker's closed sockets leave nothing."""
    hooks = RecordingHooks()
    with ReceiverServer(hooks, api_key=KEY) as server:  # the default deadlines: 60 s per head, 60 s per body
        half_head = b"POST /pause_generation HTTP/1.1\r\nHost: x\r\nX-Drip: "
        no_key_body = _post("/pause_generation", b"{", length="1000")
        attackers = [_dripper(server.port, half_head if i % 2 else no_key_body) for i in range(200)]
        stop = threading.Event()

        def drip():
            while not stop.wait(2.0):
                for s in attackers:
                    try:
                        s.send(b"a")
                    except OSError:
                        pass

        dripping = threading.Thread(target=drip, daemon=True)
        dripping.start()
        try:
            deadline = time.monotonic() + 30
            while len(server._connections) < 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(server._connections) >= 200, len(server._connections)  # all held open, none refused
            for _ in range(5):  # the trainer: its keyed calls, answered at once, again and again
                t0 = time.monotonic()
                status, info = request("GET", server.url, "/server_info", api_key=KEY)
                assert status == p.OK, info
                assert request("POST", server.url, "/pause_generation", body={}, api_key=KEY)[0] == p.OK
                assert request("POST", server.url, "/continue_generation", body={}, api_key=KEY)[0] == p.OK
                took = time.monotonic() - t0
                assert took < 2.0, f"the keyed calls took {took:.1f}s among 200 dripping connections"
                time.sleep(0.5)
            assert hooks.calls.count("on_pause") == 5, hooks.calls  # none of the attackers' calls ran
            assert server._front is not None and server._front.app.app.state.workers.busy() == 0
        finally:
            stop.set()
            dripping.join()
            for s in attackers:
                s.close()
        POOL.clear()  # the trainer's kept-alive connection too: nothing is left open
        deadline = time.monotonic() + 10
        while server._connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server._connections == [], server._connections
        assert request("GET", server.url, "/server_info", api_key=KEY)[0] == p.OK


def test_every_connection_has_nagle_off():
    """An answer's head and body are two writes: with Nagle on, the body waits for the client's
    delayed ACK of the head (40 ms on Linux), and every keyed call took 44 ms instead of 0.5."""
    with ReceiverServer(api_key=KEY) as server:
        POOL.clear()
        assert request("GET", server.url, "/server_info", api_key=KEY)[0] == p.OK  # kept alive: still open
        connections = list(server._front._state.connections)
        assert connections
        for c in connections:
            sock = c.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), c.client


def test_health_calls_without_the_key_wait_only_for_each_other():
    """The health routes need no key; their verbs run on a few threads of their own, so however
    many of them are running (or stuck), a keyed call still gets a thread at once."""
    release = threading.Event()
    with ReceiverServer(RecordingHooks(), api_key=KEY) as server:
        server.session.health = lambda: release.wait(30) and None  # every health call blocks until released
        callers = [threading.Thread(target=request, args=("GET", server.url, "/health"), daemon=True)
                   for _ in range(20)]
        for t in callers:
            t.start()
        workers = server._front.app.app.state.workers
        deadline = time.monotonic() + 10
        while workers.busy(keyed=False) < workers.sizes[False] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert workers.busy(keyed=False) == workers.sizes[False]  # every thread for unkeyed calls is taken
        try:
            t0 = time.monotonic()
            assert request("GET", server.url, "/server_info", api_key=KEY)[0] == p.OK
            assert time.monotonic() - t0 < 2.0
        finally:
            release.set()
            for t in callers:
                t.join(10)


@pytest.mark.parametrize("header", [
    "Content-Length: +2", "Content-Length: 0_2", "Content-Length: \x0b2", "Content-Length: -2", "Content-Length: 2.0",
    "Content-Length: 0x2", "Content-Length: \xb2", "Content-Length:", "Content-Length: 2\r\nContent-Length: 9",
    "Content-Length : 2",
])
def test_content_length_is_plain_digits_one_value_else_400(keyed_server, header):
    """Issue 23 item 6: ``+2``, ``0_2`` and whitespace passed ``int()``; of two headers the first won
    (a proxy reading the other one would see another request in the body). The server's parser
    (h11) refuses them; what RFC 9112 allows it takes, one length either way (next test)."""
    server, hooks = keyed_server
    data = ("POST /pause_generation HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY + "\r\n"
            + header + "\r\n\r\n{}").encode("latin-1")
    status, answer = raw_http(server.port, data)
    assert status == p.BAD_REQUEST, (header, answer)
    assert hooks.calls == [] and not server.paused
    assert raw_http(server.port, _post("/pause_generation", b"{}", RIGHT))[0] == p.OK  # plain digits pass


@pytest.mark.parametrize("header", [
    "Content-Length: 2 ", "Content-Length: 2\r\nContent-Length: 2", "Content-Length:\r\n 2",
])
def test_what_rfc_9112_allows_is_read_as_one_length(keyed_server, header):
    """Whitespace around the value, the same value given twice, a value folded onto the next line
    (RFC 9112: a server may read the fold as a space): one length, 2, however a proxy reads it."""
    server, hooks = keyed_server
    data = ("POST /pause_generation HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY + "\r\n"
            + header + "\r\n\r\n{}").encode("latin-1")
    assert raw_http(server.port, data)[0] == p.OK
    assert hooks.calls == ["on_pause"]


class _DigestHooks(RecordingHooks):
    """Digests as a rank does: a name it does not hold is an UnknownParameter."""

    def weights_digest(self, names):
        self.calls.append("weights_digest")
        import torch

        from p2pweights.control.weights_digest import parameter_digests

        model = torch.nn.Linear(2, 2)
        return {r: parameter_digests(model, ns, engine="e", rank=r) for r, ns in names.items()}


#: (route, raw JSON body, the field its 400 must name): issue 23 item 6, and every other body field
WRONG_BODIES = [
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": Infinity}', "hf_seed"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": NaN}', "hf_seed"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1e400}', "hf_seed"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1.5}', "hf_seed"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": "7"}', "hf_seed"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "skip_tensor_list": [1]}', "skip_tensor_list"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "skip_tensor_list": "x"}', "skip_tensor_list"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "changed_fraction": "0.1", "changed_steps": 1}',
     "changed_fraction"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "changed_fraction": 1.5, "changed_steps": 1}',
     "changed_fraction"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "changed_fraction": NaN, "changed_steps": 1}',
     "changed_fraction"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "changed_fraction": 0.1, "changed_steps": 2.5}',
     "changed_steps"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "changed_fraction": 0.1, "changed_steps": -1}',
     "changed_steps"),
    ("/weights_checker", b'{"action": "p2pw_compare", "hf_seed": 1, "changed_fraction": 0.1}', "changed_steps"),
    ("/weights_checker", b'{"allow_quant_error": 1}', "allow_quant_error"),
    ("/weights_checker", b'{"selector": "both"}', "selector"),
    ("/p2pw_weights_digest", b'{"names": [1, 2]}', "names"),
    ("/p2pw_weights_digest", b'{"names": {"0": [1]}}', "names"),
    ("/p2pw_weights_digest", b'{"names": {"0": "weight"}}', "names"),
    ("/p2pw_weights_digest", b'{"names": {"0": ["no.such.param"]}}', "no.such.param"),
    ("/get_weights_by_name", b'{"name": "w", "truncate_size": 1e999}', "truncate_size"),
    ("/get_weights_by_name", b'{"name": "w", "truncate_size": 100000000000000000000000}', "truncate_size"),
    ("/get_weights_by_name", b'{"name": ["w"]}', "name"),
    ("/update_weights_from_distributed", b'{"names": ["a"], "dtypes": ["bf16"], "shapes": [[1, "2"]]}', "shapes"),
    ("/update_weights_from_distributed", b'{"names": [1], "dtypes": ["bf16"], "shapes": [[1]]}', "names"),
    ("/update_weights_from_distributed", b'{"names": ["a"], "dtypes": [null], "shapes": [[1]]}', "dtypes"),
    ("/init_weights_update_group", b'{"master_address": "h", "master_port": "1", "rank_offset": 1, "world_size": 2}',
     "master_port"),
    ("/register_transfer_engine_info",
     b'{"tp_rank": 1, "transfer_engine_info": {"session_id": 5, "weights_info_dict": {}}}', "session_id"),
    ("/register_transfer_engine_info", b'{"tp_rank": 1.0, "transfer_engine_info": {}}', "tp_rank"),
    ("/update_weight_version", b'{"new_version": 1.5}', "new_version"),
    ("/continue_generation", b'{"torch_empty_cache": "yes"}', "torch_empty_cache"),
    ("/pause_generation", b'{"mode": ["abort"]}', "mode"),
    ("/renew_weight_update", b'{"release": 0}', "release"),
]


@pytest.mark.parametrize("path,raw,field", WRONG_BODIES)
def test_a_wrong_typed_body_is_a_400_naming_the_field_and_runs_no_hook(path, raw, field):
    hooks = _DigestHooks()
    with ReceiverServer(hooks, api_key=KEY) as server:
        route = routes.BY_PATH[path]
        status, answer = raw_http(server.port, _post(path, raw, RIGHT).replace(b"POST", route.method.encode(), 1))
        payload = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert status == p.BAD_REQUEST, (path, raw, answer)
        assert field in payload["message"], payload
        assert set(hooks.calls) <= {"weights_digest"}, hooks.calls  # only the digest runs: its name is the rank's to know


class _FakeRank:
    """A rank's verbs as the endpoint sees them: records what ran; a digest of an unknown name fails as a rank's."""

    rank = 1

    def __init__(self):
        self.calls = []

    def call(self, verb, body):
        self.calls.append(verb)
        if verb == "digest":
            raise UnknownParameter("engine e rank 1 holds no parameter 'no.such' to digest", rank=1, parameter="no.such")
        return {"rank": 1}


@pytest.mark.parametrize("verb,body,field", [
    ("compare", {"hf_seed": "abc"}, "hf_seed"),
    ("compare", {"hf_seed": 1, "skip": [1]}, "skip"),
    ("compare", {}, "hf_seed"),
    ("compare", {"hf_seed": 1, "changed_fraction": "x", "changed_steps": 1}, "changed_fraction"),
    ("compare", {"hf_seed": 1, "changed_fraction": 0.5, "changed_steps": True}, "changed_steps"),
    ("compare", {"hf_seed": 1, "changed_fraction": 0.5, "changed_steps": -3}, "changed_steps"),
    ("compare", {"hf_seed": 1, "changed_steps": 3}, "changed_fraction"),
    ("digest", {"names": [1, 2]}, "names"),
    ("digest", {"names": {"1": "w"}}, "names"),
    ("digest", {"names": {"1": ["no.such"]}}, "no.such"),
    ("begin", {"selector": 5}, "selector"),
    ("init_group", {"master_address": "h", "master_port": "x", "rank_offset": 0, "world_size": 2}, "master_port"),
    ("update_from_distributed", {"names": [1, 2], "dtypes": ["a", "b"], "shapes": [[1], [1]]}, "names"),
    ("destroy_group", {"group_name": 5}, "group_name"),
])
def test_a_rank_endpoint_answers_a_wrong_typed_body_400_naming_the_field(verb, body, field):
    rank = _FakeRank()
    endpoint = serve_rank_control(rank, "127.0.0.1", 0, api_key=KEY)
    try:
        url = f"http://127.0.0.1:{endpoint.port}"
        status, answer = request("POST", url, routes.RANK_ROUTE_PREFIX + verb, body=body, api_key=KEY)
        assert status == p.BAD_REQUEST and field in answer["message"], (status, answer)
        assert rank.calls == ([] if verb != "digest" or field != "no.such" else ["digest"])
        with pytest.raises(P2PWeightsError, match=field.replace(".", r"\.")):
            call_rank(url, 1, verb, body, timeout=5, api_key=KEY)
    finally:
        endpoint.close()


_STAND_IN_LEADER = r"""
import ctypes, sys
from p2pweights.receiver import ReceiverHooks, ReceiverServer

class Hooks(ReceiverHooks):
    def server_info(self):
        return {"p2pw_instance": sys.argv[1]}

server = ReceiverServer(Hooks(), port=int(sys.argv[2])).start()
print(server.port, flush=True)
libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL: no thread of this process runs Python meanwhile
for line in sys.stdin:
    libc.sleep(int(line))
    print("released", flush=True)
"""


def _stand_in_leader(instance: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _STAND_IN_LEADER, instance, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"


def test_a_leader_that_holds_its_gil_for_seconds_is_not_taken_for_gone_but_a_dead_or_replaced_one_is():
    """Issue 23 item 4: rank 1 exited because its leader, busy parsing for 7 s, did not answer
    /server_info within 2 s four times in a row. The rank's watchdog (LeaderWatch, as rank_process
    runs it) now asks the kernel: a leader whose port accepts connections is alive, however busy."""
    from p2pweights.receiver.rank_process import watch

    proc, url = _stand_in_leader("first")
    try:
        leader = LeaderWatch(url, "first", answer_timeout=0.5, connect_timeout=1.0)
        assert leader.check()
        stop = threading.Event()
        watch(leader.check, stop, interval=0.2, misses=3, why="test")
        proc.stdin.write("6\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "released"  # 6 s without a Python thread running
        assert not stop.is_set(), "a leader holding its GIL for 6 s was taken for gone"
        assert leader.busy >= 3, leader.busy  # the checks during the hold: no answer, the port open
        port = int(url.rsplit(":", 1)[1])
        proc.kill()
        proc.wait(10)
        assert stop.wait(5), "a dead leader was not noticed"
        # another instance on the same port (the engine restarted): the rank's leader is gone too
        proc, url = _stand_in_leader("second", port)
        assert not LeaderWatch(url, "first", answer_timeout=0.5).check()
        assert LeaderWatch(url, "second", answer_timeout=0.5).check()
    finally:
        proc.kill()
        proc.wait(10)
