"""Weight-update sessions inside a real sglang 0.5.23 server (``python -m sglang.launch_server``, tp=1,
a tiny Qwen3 with dummy weights, on the CPU through the plugin's CPU platform): the plugin's gate
keeps the receiver's owner rules around sglang's own routes (sglang_plugin/sessions.py, with
engine/core.py). One server for the whole module; each test leaves no session open.

Calls go through p2pweights' own engine client (``SglangEngine``: the owner and lease headers a
sender sends) and, where the status itself matters, through the raw HTTP request."""
from __future__ import annotations

import contextlib
import secrets
import time
import types

import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import start_sglang_server

require_sglang()  # skips without sglang; fails in CI

import p2pweights  # noqa: E402
from p2pweights.control import http  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.control.sglang import SglangEngine  # noqa: E402
from p2pweights.control.update_session import UPDATED, UpdateSession  # noqa: E402
from p2pweights.errors import EngineError, InvalidRequest, SessionConflict, TornWeights  # noqa: E402
from p2pweights.sglang_plugin import server_info  # noqa: E402

STARTUP_TIMEOUT_S = 300.0  # the harness's 120 s is too short on a shared 2-core host under load
SHORT_LEASE_S = 1.0  # what the lapse test asks for; it then stays silent for more than twice that


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_sessions")
    model_dir = write_config("qwen3", str(root))
    s = start_sglang_server(model_dir, str(root / "server.log"))
    try:
        s.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        yield s
    finally:
        s.stop()


CONTROLLERS: list[SglangEngine] = []  # every controller a test made, for ``heal``


def controller(server, label: str | None) -> SglangEngine:
    """A controller of the engine: its own owner token (``None``: sglang's anonymous clients)."""
    engine = SglangEngine(server.url, name=label or "anonymous", timeout=60)
    if label is not None:
        engine.session_owner, engine.session_label = secrets.token_urlsafe(32), f"test:{label}"
    CONTROLLERS.append(engine)
    return engine


def raw(engine: SglangEngine, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One POST with ``engine``'s owner header (if any): (status, answer)."""
    headers = {p.SESSION_OWNER_HEADER: engine.session_owner} if engine.session_owner else None
    return http.request("POST", engine.base_url, path, body=body or {}, headers=headers, timeout=60)


def weight_update(server) -> dict:
    return server.get_json("/server_info")["p2pw_weight_update"]


@pytest.fixture
def heal(server):
    """Afterwards, whatever a failed test left: its owner ends an open session; a fresh owner takes a
    torn one over and ends it; then generation continues."""
    CONTROLLERS.clear()
    yield
    for engine in CONTROLLERS:
        if weight_update(server)["state"] == "open":
            with contextlib.suppress(EngineError):
                engine.end_weight_update()
    if weight_update(server)["state"] == p.TORN:
        cleaner = controller(server, "cleaner")
        cleaner.begin_weight_update()
        cleaner.end_weight_update()
    controller(server, "cleaner").continue_generation()


def test_server_info_says_the_plugin_keeps_sessions(server):
    info = server.get_json("/server_info")
    plugin = info["p2pw_plugin"]
    assert {k: plugin[k] for k in ("version", "protocol")} == {"version": p2pweights.__version__,
                                                               "protocol": server_info.PROTOCOL}, plugin
    assert "sessions" in plugin["offers"] and "error" not in plugin, plugin
    assert info["p2pw_weight_update"]["state"] == "none"


def test_only_the_owner_may_continue_version_or_end_its_session(server, heal):
    owner, other, anonymous = controller(server, "owner"), controller(server, "other"), controller(server, None)
    weak = controller(server, "weak")
    weak.session_owner = "short"
    owner.pause_generation()
    with pytest.raises(InvalidRequest, match=p.SESSION_OWNER_HEADER):  # a guessable token never opens a session
        weak.begin_weight_update()
    begun = owner.begin_weight_update(lease=600)
    assert begun["success"] is True and begun["took_over"] is False and begun["epoch"] == 1
    assert begun["lease"] == begun["lease_max"] == 30.0  # the ask is capped to the engine's P2PW_SESSION_LEASE
    state = weight_update(server)
    assert state["state"] == "open" and state["owner"].endswith("test:owner") and state["torn"] is None
    assert owner.session_owner not in str(server.get_json("/server_info"))  # the token is never shown

    for who in (other, anonymous):  # sglang's own routes, refused before sglang sees them
        for path, body in (("/continue_generation", {}), ("/update_weight_version", {"new_version": "x"}),
                           ("/end_weight_update", {}), ("/pause_generation", {}), ("/renew_weight_update", {})):
            status, answer = raw(who, path, body)
            assert status == p.CONFLICT and answer["error"]["type"] == "SessionConflict", (who.name, path, answer)
            assert "test:owner" in answer["message"]
    with pytest.raises(SessionConflict, match="belongs to owner #"):  # what a sender's client raises
        other.begin_weight_update()
    assert owner.model_info()["weight_version"] != "x"

    assert owner.renew_weight_update(lease=20)["lease"] == 20.0
    with pytest.raises(EngineError, match="end_weight_update"):  # not even the owner serves a half-written update
        owner.continue_generation()
    assert owner.end_weight_update()["success"] is True
    assert weight_update(server)["state"] == "none"
    other.continue_generation()  # no session: anyone's again


def test_a_lapsed_lease_leaves_the_engine_torn_until_a_complete_update(server, heal):
    lost, next_owner, anyone = controller(server, "lost"), controller(server, "next"), controller(server, None)
    lost.pause_generation()
    assert lost.begin_weight_update(lease=SHORT_LEASE_S)["lease"] == SHORT_LEASE_S
    time.sleep(2.5 * SHORT_LEASE_S)  # the owner stays silent past its lease

    state = weight_update(server)
    assert state["state"] == p.TORN and state["owner"] is None and "expired" in state["torn"], state
    for who in (lost, anyone):
        for path, body in (("/continue_generation", {}), ("/update_weight_version", {"new_version": "x"}),
                           ("/end_weight_update", {})):
            status, answer = raw(who, path, body)
            assert status == p.CONFLICT and answer["error"]["type"] == "TornWeights", (who.name, path, answer)
    with pytest.raises(TornWeights):
        lost.renew_weight_update()

    taken = next_owner.begin_weight_update()  # sglang's session is still open: taken over, not begun again
    assert taken["success"] is True and taken["took_over"] is True, taken
    state = weight_update(server)
    assert state["state"] == "open" and state["owner"].endswith("test:next") and state["torn"], state
    status, answer = raw(lost, "/continue_generation")
    assert status == p.CONFLICT and answer["error"]["type"] == "SessionConflict"  # now the next owner's
    assert next_owner.end_weight_update()["success"] is True  # a complete update heals it
    assert weight_update(server)["state"] == "none"
    next_owner.update_weight_version("healed")
    next_owner.continue_generation()
    assert anyone.weight_version() == "healed"


def test_a_senders_update_session_keeps_a_lease_and_a_failed_one_leaves_the_engine_torn(server, heal):
    """The sender's own control plane (``UpdateSession``, no writes), unchanged: the plugin's begin
    answers a lease, so the sender renews it; a failed update gives the session up (torn) and the
    next one takes it over and heals it."""
    engine, other = SglangEngine(server.url, name="engine", timeout=60), controller(server, "other")
    with UpdateSession(engine, version="plugin-1") as session:
        assert session.lease_deadline() < float("inf")  # the engine keeps a lease for this owner
        assert weight_update(server)["state"] == "open"
        status, answer = raw(other, "/continue_generation")
        assert status == p.CONFLICT and answer["error"]["type"] == "SessionConflict"
    assert session.outcome == {"engine": UPDATED} and engine.weight_version() == "plugin-1"
    assert weight_update(server)["state"] == "none"

    with pytest.raises(RuntimeError, match="a write failed"):
        with UpdateSession(engine, version="plugin-2"):
            raise RuntimeError("a write failed")
    state = weight_update(server)
    assert state["state"] == p.TORN and "given up" in state["torn"], state
    status, answer = raw(other, "/continue_generation")
    assert status == p.CONFLICT and answer["error"]["type"] == "TornWeights"

    with UpdateSession(engine, version="plugin-3") as healing:
        pass
    assert healing.resumed == {"engine"} and healing.outcome == {"engine": UPDATED}
    assert weight_update(server)["state"] == "none" and engine.weight_version() == "plugin-3"


def test_sglangs_key_check_wraps_the_gate():
    """In this process, on a stand-in app with sglang's gated paths: the gate installed as the hook
    does, then sglang's own key middleware as ``_setup_and_run_http_server`` adds it after the hook.
    A call without the key is 401 (never a 409 naming the owner); with it, another owner's is 409."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.auth import AuthLevel, add_api_key_middleware, auth_level

    from p2pweights.sglang_plugin import sessions

    app = FastAPI()

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def stand_in() -> dict:
        return {"success": True, "message": "Success"}

    for path in set(sessions.GATED_PATHS) - {sessions.RENEW_PATH, sessions.APPLY_PATH}:
        app.add_api_route(path, stand_in, methods=["POST"])
    host = sessions.SglangSessionHost("stand-in", lease=30, tokenizer=types.SimpleNamespace(is_pause=True))
    for path in (sessions.RENEW_PATH, sessions.APPLY_PATH):
        app.add_api_route(path, sessions._answered_by_the_gate(), methods=["POST"])
    app.add_middleware(sessions.SessionGate, host=host)  # what install() does, without the module's HOST
    add_api_key_middleware(app, api_key="key", admin_api_key=None)
    client, key = TestClient(app), {"Authorization": "Bearer key"}
    owner, other = secrets.token_urlsafe(32), secrets.token_urlsafe(32)

    begun = client.post("/begin_weight_update", json={}, headers={**key, p.SESSION_OWNER_HEADER: owner})
    assert begun.status_code == 200 and begun.json()["lease"] == 30.0
    for path in ("/continue_generation", sessions.RENEW_PATH):
        assert client.post(path, json={}, headers={p.SESSION_OWNER_HEADER: other}).status_code == p.UNAUTHORIZED
        refused = client.post(path, json={}, headers={**key, p.SESSION_OWNER_HEADER: other})
        assert refused.status_code == p.CONFLICT and refused.json()["error"]["type"] == "SessionConflict"
    assert client.post(sessions.RENEW_PATH, json={}, headers={**key, p.SESSION_OWNER_HEADER: owner}).json()["lease"] == 30.0
