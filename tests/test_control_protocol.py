"""The control-plane protocol is written once (control.routes, bodies, protocol, error_answers),
served by the receiver, called by the client over the one HTTP client (control.http), and its error
payloads come back as typed errors with their fields (engine, rank, parameter, hint)."""
from __future__ import annotations

import ast
import pathlib
import pickle
import socket
import time

import pytest

import p2pweights
from p2pweights import errors
from p2pweights.control import SglangEngine, UpdateSession, bodies, error_answers, http, routes
from p2pweights.control import protocol as p
from p2pweights.errors import (
    EngineError,
    EnginesFailed,
    EngineUnreachable,
    InvalidRequest,
    LayoutMismatch,
    P2PWeightsError,
    UpdateFailed,
)
from p2pweights.receiver import ReceiverHooks, ReceiverServer

PACKAGE = pathlib.Path(p2pweights.__file__).parent


@pytest.fixture
def server():
    with ReceiverServer() as s:
        yield s


# ---- one table, served and called ----------------------------------------------------------------


def test_the_receiver_serves_every_route_of_the_table_and_only_with_its_methods(server):
    server.register_transfer_engine_info(0, "127.0.0.1:1", {})  # else the bootstrap route answers 404 for rank 0
    for r in routes.ROUTES:
        status, _ = http.request(r.method, server.url, r.path, body={} if r.method != "GET" else None,
                                 params={"rank": 0} if r.query else None, timeout=5)
        assert status not in (p.NOT_FOUND, p.METHOD_NOT_ALLOWED), f"{r.method} {r.path} answered {status}"
        for other in {"GET", "POST", "PUT"} - set(r.methods):
            status, answer = http.request(other, server.url, r.path, body={}, timeout=5)
            assert status == p.METHOD_NOT_ALLOWED, f"{other} {r.path} answered {status}"
            assert answer["error"]["type"] == "EngineError" and r.path in answer["error"]["message"]
    status, answer = http.request("GET", server.url, "/no_such_route", timeout=5)
    assert status == p.NOT_FOUND and answer["success"] is False and "/no_such_route" in answer["message"]


def test_every_verb_the_client_calls_is_a_route_the_receiver_serves():
    # (weight_version reads model_info; transfer_engine_info reads either transfer-engine route)
    client_verbs = {name for name in vars(SglangEngine) if not name.startswith("_")} - {
        "weight_version", "transfer_engine_info"}
    client_verbs |= {"remote_instance_transfer_engine_info", "get_transfer_engine_info"}
    assert client_verbs <= set(routes.BY_VERB), client_verbs - set(routes.BY_VERB)
    assert all(routes.BY_PATH[routes.route(v).path].called for v in client_verbs)
    assert routes.HEALTH_PATHS == {"/health", "/health_generate", "/ready"}
    assert routes.BOOTSTRAP_PATHS == {"/get_transfer_engine_info", "/register_transfer_engine_info"}


def _string_literals(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):  # f"/pause_generation?..." counts too
            for part in node.values:
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    yield node.lineno, part.value


def test_no_route_path_or_mode_list_is_spelled_outside_the_route_table_and_the_protocol():
    paths = {r.path for r in routes.ROUTES} | {routes.RANK_ROUTE_PREFIX.rstrip("/")}
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if f in (PACKAGE / "control" / "protocol.py", PACKAGE / "control" / "routes.py"):
            continue
        tree = ast.parse(f.read_text(), str(f))
        for line, text in _string_literals(tree):
            if text.split("?")[0].rstrip("/") in paths or text.startswith(routes.RANK_ROUTE_PREFIX):
                found.append(f"{f.relative_to(PACKAGE)}:{line}: {text!r}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List)) and node.elts and all(
                    isinstance(e, ast.Constant) for e in node.elts):
                if tuple(e.value for e in node.elts) in (p.PAUSE_MODES, p.SELECTORS):
                    found.append(f"{f.relative_to(PACKAGE)}:{node.lineno}: a copy of PAUSE_MODES/SELECTORS")
    assert not found, "spelled outside control/routes.py and control/protocol.py:\n" + "\n".join(found)


def test_bodies_are_checked_the_same_way_on_both_sides(server):
    # the client refuses before sending anything (this URL has no server)
    with pytest.raises(InvalidRequest, match=r"'mode' must be one of abort, retract, in_place, got 'nap'"):
        SglangEngine("http://127.0.0.1:9", name="e0").pause_generation("nap")
    # the server answers a body the client would not send with the same words, typed
    status, answer = http.request("POST", server.url, "/pause_generation", body={"mode": "nap"}, timeout=5)
    assert status == p.BAD_REQUEST and answer["error"]["type"] == "InvalidRequest"
    assert "'mode' must be one of abort, retract, in_place" in answer["message"]
    status, answer = http.request("POST", server.url, "/get_weights_by_name", body={"truncate_size": 3}, timeout=5)
    assert status == p.BAD_REQUEST and answer["error"]["message"] == "field 'name' is required"
    assert bodies.decode(bodies.CheckWeightsReq, {"action": "p2pw_compare", "hf_seed": 7}).extra == {"hf_seed": 7}
    assert bodies.encode(bodies.CheckWeightsReq(action="p2pw_compare", extra={"hf_seed": 7}))["hf_seed"] == 7
    with pytest.raises(InvalidRequest, match="'truncate_size' must be int, got bool"):
        bodies.decode(bodies.GetWeightsByNameReq, {"name": "x", "truncate_size": True})


# ---- typed errors over the wire -------------------------------------------------------------------


class _Failing(ReceiverHooks):
    def on_end_update(self):
        raise LayoutMismatch("gate_up_proj holds 2 x 1536 rows, the replica 2 x 3072", rank=1,
                             parameter="model.layers.0.mlp.gate_up_proj.weight",
                             hint="start the engine with the tp the sender planned for")


def test_an_error_payload_comes_back_as_its_typed_exception_with_its_fields():
    with ReceiverServer(_Failing()) as server:
        engine = SglangEngine(server.url, name="engine-3", timeout=5)
        engine.pause_generation()
        engine.begin_weight_update()
        with pytest.raises(LayoutMismatch) as info:
            engine.end_weight_update()
    e = info.value
    assert (e.engine, e.rank, e.parameter) == ("engine-3", 1, "model.layers.0.mlp.gate_up_proj.weight")
    assert e.hint == "start the engine with the tp the sender planned for"
    text = str(e)
    assert "engine engine-3" in text and "HTTP 500" in text and "2 x 3072" in text and "rank 1" in text
    assert text.endswith("Hint: start the engine with the tp the sender planned for")


def test_a_trainer_catches_update_failed_and_reads_the_engine_and_rank():
    with ReceiverServer(_Failing()) as bad, ReceiverServer() as good:
        engines = [SglangEngine(good.url, name="ok", timeout=5), SglangEngine(bad.url, name="bad", timeout=5)]
        try:
            with UpdateSession(engines, version=3):
                pass  # the writes
        except UpdateFailed as e:
            caught = e
        else:
            pytest.fail("finishing on the failing engine must raise")
    assert isinstance(caught, EngineError)  # what callers caught before
    assert (caught.engine, caught.rank, caught.parameter) == ("bad", 1, "model.layers.0.mlp.gate_up_proj.weight")
    assert list(caught.failures) == ["bad"] and isinstance(caught.errors["bad"], LayoutMismatch)


def test_sglangs_own_error_answers_become_engine_errors():
    for answer in ({"success": False, "message": "boom"}, {"error": {"message": "boom"}}, {"detail": "boom"},
                   "boom", {"error": {"type": "NoSuchClass", "message": "boom"}},
                   {"error": {"type": "UpdateFailed", "message": "boom"}}):
        said = error_answers.ErrorAnswer.of(answer)
        assert said.message == "boom"
        e = said.exception("POST /x failed: boom", engine="e0")
        assert type(e) is EngineError and e.engine == "e0", answer
    assert type(error_answers.ErrorAnswer.of({"error": {"type": "NotFound", "message": "m"}}).exception("m")) is errors.NotFound


# ---- the one HTTP client: connect and read timeouts ---------------------------------------------


def _silent_listener(backlog: int = 8) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(backlog)
    return s


def test_a_server_that_never_answers_fails_within_the_read_timeout():
    with _silent_listener() as s:  # connects (the kernel accepts), never answers
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(EngineUnreachable, match=r"POST .*:\d+/end_weight_update: no answer within 0.3s") as info:
            http.request("POST", url, "/end_weight_update", body={}, timeout=0.3, connect_timeout=5)
        assert 0.25 < time.monotonic() - t0 < 2
        assert "P2PW_ENGINE_TIMEOUT" in info.value.hint and isinstance(info.value, EngineError)


def test_a_connect_that_does_not_complete_fails_within_the_connect_timeout():
    with _silent_listener(backlog=0) as s:
        addr = s.getsockname()
        fill = []
        try:
            while True:  # fill the accept queue: further connects wait for a slot that never frees
                c = socket.socket()
                c.settimeout(0.2)
                fill.append(c)
                try:
                    c.connect(addr)
                except socket.timeout:
                    break
                assert len(fill) < 64, "the accept queue never filled"
            t0 = time.monotonic()
            with pytest.raises(EngineUnreachable, match=r"GET .*/health: no connection within 0.3s"):
                http.request("GET", f"http://127.0.0.1:{addr[1]}", "/health", timeout=30, connect_timeout=0.3)
            assert 0.25 < time.monotonic() - t0 < 2
        finally:
            for c in fill:
                c.close()


def test_the_default_timeouts_come_from_the_settings(monkeypatch):
    monkeypatch.setenv("P2PW_ENGINE_TIMEOUT", "0.3")
    with _silent_listener() as s:
        t0 = time.monotonic()
        with pytest.raises(EngineUnreachable, match=r"no answer within 0.3s"):
            http.request("GET", f"http://127.0.0.1:{s.getsockname()[1]}", "/server_info")
        assert time.monotonic() - t0 < 2
        assert SglangEngine(f"http://127.0.0.1:{s.getsockname()[1]}").timeout == 0.3
    monkeypatch.setenv("P2PW_ENGINE_CONNECT_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="P2PW_ENGINE_CONNECT_TIMEOUT"):
        http.request("GET", "http://127.0.0.1:9", "/health")


def test_a_refused_connection_is_unreachable_at_once_naming_url_and_path():
    with _silent_listener() as s:
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(EngineUnreachable, match=rf"GET http://127.0.0.1:{port}/model_info: connection refused"):
        http.request("GET", f"http://127.0.0.1:{port}", "/model_info")
    assert time.monotonic() - t0 < 1


# ---- the errors themselves ------------------------------------------------------------------------


def test_every_error_carries_engine_rank_parameter_and_hint_and_still_reads_well():
    e = LayoutMismatch("shapes differ", engine="e0", rank=2, parameter="lm_head.weight", hint="check tp")
    assert str(e) == "shapes differ (engine e0, rank 2, parameter lm_head.weight). Hint: check tp"
    assert str(LayoutMismatch("shapes differ")) == "shapes differ"
    # a message that already names a field does not repeat it
    assert str(EngineError("engine e0 (http://h:1): down", engine="e0")) == "engine e0 (http://h:1): down"
    assert str(errors.NotFound("no engine 4", engine="e4")) == "no engine 4 (engine e4)"  # not KeyError's quotes
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is LayoutMismatch and back.fields() == e.fields() and str(back) == str(e)


def test_update_failed_names_the_first_failed_engine_and_rank():
    u = UpdateFailed({"e1/rank2": "write timed out after 30s", "e0/rank0": "disconnected"}, report=None)
    assert (u.engine, u.rank) == ("e1", 2)
    assert u.failures == {"e1/rank2": "write timed out after 30s", "e0/rank0": "disconnected"}
    assert str(u).splitlines() == ["weight update failed on 2 engine(s):", "  e1/rank2: write timed out after 30s",
                                   "  e0/rank0: disconnected"]
    back = pickle.loads(pickle.dumps(u))
    assert (back.engine, back.rank, back.failures) == (u.engine, u.rank, u.failures)
    many = EnginesFailed({"e5": EngineUnreachable("down", engine="e5", rank=0)}, what="pause_generation")
    assert isinstance(many, EngineError) and (many.engine, many.rank) == ("e5", 0)


def test_native_status_codes_still_map_to_their_classes():
    for code, cls in [(-1, errors.InvalidWrite), (-2, errors.TransferTimeout), (-3, errors.RemoteDisconnected),
                      (-4, errors.TransportError), (-5, errors.Closed), (-6, errors.NotFound), (-7, errors.Busy),
                      (-8, errors.OutOfRegion)]:
        with pytest.raises(cls, match="why") as info:
            errors.raise_for_status(code, "why")
        assert isinstance(info.value, P2PWeightsError) and info.value.p2pw_code == code


def test_a_typed_error_on_an_engine_rank_reaches_the_leader_with_its_class_and_fields():
    from p2pweights.errors import EngineError, LayoutMismatch
    from p2pweights.receiver.rank_server import call_rank, serve_rank_control

    class Rank:  # the rank object the internal server calls: .rank and .call(verb, body)
        rank = 3

        def call(self, verb, body):
            if verb == "end":
                raise LayoutMismatch("post-processing changed a byte count", parameter="model.norm.weight",
                                     hint="check the engine's flags")
            if verb == "boom":
                raise RuntimeError("disk on fire")
            return {"verb": verb, **body}

    httpd = serve_rank_control(Rank(), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert call_rank(url, 3, "begin", {"selector": "all"}) == {"verb": "begin", "selector": "all"}
        with pytest.raises(LayoutMismatch) as info:
            call_rank(url, 3, "end", {})
        assert (info.value.rank, info.value.parameter, info.value.hint) == (3, "model.norm.weight", "check the engine's flags")
        with pytest.raises(EngineError, match="RuntimeError: disk on fire") as info:
            call_rank(url, 3, "boom", {})
        assert info.value.rank == 3
    finally:
        httpd.shutdown()
        httpd.server_close()
