"""The engine control plane: p2pweights' sglang client against receiver servers in real processes."""
from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import socket
import time

import pytest

from p2pweights.control import FailurePolicy, SglangEngine, UpdateSession, call_engines
from p2pweights.errors import EngineError
from p2pweights.receiver import ReceiverHooks, ReceiverServer, register_transfer_engine_info

SPAWN = mp.get_context("spawn")


class RecordingHooks(ReceiverHooks):
    """A stand-in engine: records every control hook; can be told to fail one."""

    def __init__(self, fail: str | None = None):
        self.fail = fail
        self.calls: list[list] = []

    def _record(self, *call):
        self.calls.append(list(call))
        if self.fail == call[0]:
            raise RuntimeError(f"injected failure in {call[0]}")

    def server_info(self):
        # the call log rides on /server_info so the tests read it through the protocol itself
        return {"tp_size": 1, "dtype": "bfloat16", "calls": self.calls}

    def model_info(self):
        return {"model_path": "test/tiny", "architectures": ["Qwen3ForCausalLM"]}

    def on_pause(self, mode):
        self._record("pause", mode)

    def on_continue(self, torch_empty_cache):
        self._record("continue", torch_empty_cache)

    def on_begin_update(self, selector):
        self._record("begin", selector)

    def on_end_update(self):
        self._record("end")

    def on_weight_version(self, new_version, abort_all_requests):
        self._record("version", new_version, abort_all_requests)

    def weights_checker(self, request):
        return {"success": True, "message": "ok", "per_engine_checksum": "abc", "request": request}

    def get_weights_by_name(self, name, truncate_size):
        if name != "lm_head.weight":
            return None
        return [[float(i)] for i in range(min(truncate_size, 3))]


def _serve(conn, fail):
    server = ReceiverServer(RecordingHooks(fail)).start()
    conn.send(server.url)
    try:
        conn.recv()  # until the test closes its end
    except EOFError:
        pass
    server.close()


class EngineProcess:
    def __init__(self, name: str, fail: str | None = None):
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_serve, args=(child, fail), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(30):
            raise RuntimeError(f"engine process {name} did not start")
        self.url = self.conn.recv()
        self.client = SglangEngine(self.url, name=name, timeout=10)

    def calls(self):
        return self.client.server_info()["calls"]

    def stop(self):
        self.conn.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def start_engine():
    started = []

    def start(name: str, fail: str | None = None) -> EngineProcess:
        e = EngineProcess(name, fail)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(url: str, method: str, path: str, body: bytes | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, text = resp.status, resp.read().decode()
    conn.close()
    return status, text


def test_update_session_runs_sglangs_order_and_bumps_the_version_only_after_end(start_engine):
    engines = [start_engine("e0"), start_engine("e1")]
    clients = [e.client for e in engines]
    with UpdateSession(clients, version=7) as session:
        for c in clients:  # during the writes: paused, session open, old version
            assert c.weight_version() == "default"
            assert [k[0] for k in c.server_info()["calls"]] == ["pause", "begin"]
    assert session.outcome == {"e0": "updated", "e1": "updated"}
    for e in engines:
        assert e.calls() == [["pause", "abort"], ["begin", "all"], ["end"], ["version", "7", False],
                             ["continue", True]]
        assert e.client.weight_version() == "7"


def test_version_bump_is_refused_while_an_update_is_open(start_engine):
    c = start_engine("e0").client
    c.pause_generation()
    c.begin_weight_update()
    with pytest.raises(EngineError, match=r"e0 .*update_weight_version.*HTTP 400.*end_weight_update"):
        c.update_weight_version(3)
    assert c.weight_version() == "default"
    c.end_weight_update()
    c.update_weight_version(3)
    assert c.weight_version() == "3"


def test_out_of_order_calls_answer_clear_errors(start_engine):
    c = start_engine("e0").client
    with pytest.raises(EngineError, match=r"end_weight_update.*HTTP 400.*no weight-update session.*begin_weight_update"):
        c.end_weight_update()
    with pytest.raises(EngineError, match=r"begin_weight_update.*HTTP 400.*pause_generation"):
        c.begin_weight_update()
    c.pause_generation("retract")
    c.pause_generation("retract")  # idempotent, as in sglang
    c.begin_weight_update("target")
    with pytest.raises(EngineError, match=r"HTTP 400.*already open.*UpdateSession resumes"):
        c.begin_weight_update()
    status, text = _raw(c.base_url, "POST", "/update_weight_version", b"{}")
    assert status == 400 and "new_version" in text
    status, text = _raw(c.base_url, "POST", "/pause_generation", b'{"mode": "nap"}')
    assert status == 400 and "mode" in text
    status, _ = _raw(c.base_url, "GET", "/pause_generation")
    assert status == 405
    with pytest.raises(EngineError, match=r"HTTP 404.*control endpoints"):
        c._call("health", base=c.base_url + "/nowhere")


def test_a_down_engine_fails_fast_with_an_error_naming_it():
    url = f"http://127.0.0.1:{_free_port()}"
    c = SglangEngine(url, name="engine-7")
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        c.pause_generation()
    assert time.monotonic() - t0 < 2
    msg = str(info.value)
    assert "engine-7" in msg and url in msg and "/pause_generation" in msg and "connection refused" in msg


def test_concurrent_verbs_collect_each_engines_error(start_engine):
    up = [start_engine("e0").client, start_engine("e1").client]
    down = SglangEngine(f"http://127.0.0.1:{_free_port()}", name="gone")
    calls = call_engines(up + [down], "pause_generation", "in_place")
    assert set(calls.results) == {"e0", "e1"} and set(calls.errors) == {"gone"}
    assert "connection refused" in str(calls.errors["gone"])
    with pytest.raises(EngineError, match=r"pause_generation failed on 1 engine") as info:
        calls.raise_for_errors()
    assert info.value.failures.keys() == {"gone"}
    with pytest.raises(ValueError, match="two engines are named"):
        call_engines([up[0], SglangEngine(up[0].base_url, name="e0")], "health")


def test_a_failed_update_leaves_engines_paused_unbumped_and_the_next_update_resumes(start_engine):
    engines = [start_engine("e0"), start_engine("e1")]
    clients = [e.client for e in engines]
    with pytest.raises(RuntimeError, match="write to e1 failed"):
        with UpdateSession(clients, version=1) as session:
            raise RuntimeError("write to e1 failed")
    assert session.outcome == {"e0": "paused, session open", "e1": "paused, session open"}
    for e in engines:
        assert e.calls() == [["pause", "abort"], ["begin", "all"]]  # never ended, never bumped
        assert e.client.weight_version() == "default"
    with UpdateSession(clients, version=2) as session:
        pass
    assert session.resumed == {"e0", "e1"}
    for e in engines:
        assert [k[0] for k in e.calls()] == ["pause", "begin", "pause", "end", "version", "continue"]
        assert e.client.weight_version() == "2"


def test_no_failure_policy_generates_on_partly_written_weights():
    with pytest.raises(ValueError, match="one of resume_if_unwritten, leave_paused, got 'continue_unfinished'"):
        FailurePolicy.parse("continue_unfinished")


def test_on_failure_resume_if_unwritten_rolls_back_only_when_told_nothing_was_written(start_engine):
    unwritten, written = start_engine("unwritten"), start_engine("written")
    session = UpdateSession(unwritten.client, version=1, on_failure=FailurePolicy.RESUME_IF_UNWRITTEN)
    with session:
        session.abort("failed before any write", written=False)
    assert session.outcome == {"unwritten": "rolled back"}
    assert unwritten.calls() == [["pause", "abort"], ["begin", "all"], ["end"], ["continue", True]]
    with pytest.raises(ValueError):  # the block's exit cannot see the writes: it leaves the engines paused
        with UpdateSession(written.client, version=1, on_failure="resume_if_unwritten") as session:
            raise ValueError("a write failed")
    assert session.outcome == {"written": "paused, session open"}
    assert written.calls() == [["pause", "abort"], ["begin", "all"]]


def test_failure_policy_is_one_vocabulary_its_values_are_the_strings_callers_pass():
    assert [str(p) for p in FailurePolicy] == ["resume_if_unwritten", "leave_paused"]
    assert FailurePolicy.parse("leave_paused") is FailurePolicy.LEAVE_PAUSED
    assert json.dumps({"on_failure": FailurePolicy.LEAVE_PAUSED}) == '{"on_failure": "leave_paused"}'
    assert f"{FailurePolicy.LEAVE_PAUSED}" == "leave_paused"
    for old in ("stay_paused", "continue", "continue_unfinished"):  # the session's former words are gone
        with pytest.raises(ValueError, match="on_failure must be one of resume_if_unwritten, leave_paused"):
            UpdateSession(SglangEngine("http://127.0.0.1:1", name="e"), version=1, on_failure=old)
    with pytest.raises(ValueError, match="one of leave_paused, got 'resume_if_unwritten'"):
        FailurePolicy.parse("resume_if_unwritten", (FailurePolicy.LEAVE_PAUSED,))


def test_opening_failure_rolls_back_engines_that_saw_no_write(start_engine):
    good, bad = start_engine("good"), start_engine("bad", fail="begin")
    with pytest.raises(EngineError, match=r"opening the weight update failed on 1 engine.*\n  bad: .*HTTP 500.*"
                                          r"injected failure in begin"):
        session = UpdateSession([good.client, bad.client], version=1)
        with session:
            pytest.fail("the body must not run when opening failed")
    assert session.outcome == {"good": "rolled back", "bad": "failed"}
    assert good.calls() == [["pause", "abort"], ["begin", "all"], ["end"], ["continue", True]]
    assert good.client.weight_version() == "default"

    down = SglangEngine(f"http://127.0.0.1:{_free_port()}", name="down")
    with pytest.raises(EngineError, match=r"\n  down: .*connection refused"):
        # a client that has not learned that good pauses in its begin (control/folds.py): paused apart
        session = UpdateSession([SglangEngine(good.client.base_url, name="good"), down], version=2)
        with session:
            pass
    assert session.outcome == {"good": "generating", "down": "failed"}
    assert [k[0] for k in good.calls()[4:]] == ["pause", "continue"]  # paused, never begun, continued

    with pytest.raises(EngineError, match=r"\n  down: .*connection refused"):
        session = UpdateSession([good.client, down], version=3)  # good's pause rides on a begin never sent
        with session:
            pass
    assert session.outcome == {"good": "generating", "down": "failed"}
    assert [k[0] for k in good.calls()[6:]] == []  # never paused: untouched


def test_an_engine_whose_end_fails_is_not_bumped_while_the_others_are(start_engine):
    ok, bad = start_engine("ok"), start_engine("bad", fail="end")
    with pytest.raises(EngineError, match=r"finishing weight update 5 failed on 1 engine.*\n  bad: .*end_weight_update"):
        session = UpdateSession([ok.client, bad.client], version=5)
        with session:
            pass
    assert session.outcome == {"ok": "updated", "bad": "paused, session open"}
    assert ok.client.weight_version() == "5"
    assert bad.client.weight_version() == "default"
    assert [k[0] for k in bad.calls()] == ["pause", "begin", "end"]  # the end hook raised: no bump, no continue


def test_transfer_engine_info_is_served_per_rank_from_what_each_rank_registered(start_engine):
    e = start_engine("e0")
    # two rank processes of one engine publish their regions (here: this test process registers)
    register_transfer_engine_info(e.url, 0, "10.0.0.1:15000", {"lm_head.weight": [1 << 20, 4096, 2]})
    register_transfer_engine_info(e.url, 1, "10.0.0.1:15001", {"lm_head.weight": [2 << 20, 4096, 2]})
    via_http = e.client.transfer_engine_info(1)
    # registered_from: the address the registration came from, filled in by the server from the socket
    # (never from the body), so a sender can tell whose session id a rank claims
    assert via_http == {"rank": 1, "remote_instance_transfer_engine_info":
                        ["10.0.0.1:15001", {"lm_head.weight": [2 << 20, 4096, 2]}], "registered_from": "127.0.0.1"}
    via_bootstrap = SglangEngine(e.url, bootstrap_url=e.url, name="e0").transfer_engine_info(1)
    assert via_bootstrap == via_http
    with pytest.raises(EngineError, match=r"rank=2.*HTTP 400.*--remote-instance-weight-loader-start-seed-via"):
        e.client.transfer_engine_info(2)
    with pytest.raises(EngineError, match=r"get_transfer_engine_info\?rank=2.*HTTP 404.*bootstrap"):
        SglangEngine(e.url, bootstrap_url=e.url, name="e0").transfer_engine_info(2)


def test_checks_and_infos_round_trip(start_engine):
    c = start_engine("e0").client
    assert c.health() is True
    assert c.server_info()["tp_size"] == 1
    assert c.model_info() == {"model_path": "test/tiny", "architectures": ["Qwen3ForCausalLM"],
                              "weight_version": "default"}
    answer = c.weights_checker(action="checksum", skip_tensor_list=["rotary"])
    assert answer["success"] and answer["request"] == {"action": "checksum", "allow_quant_error": False,
                                                       "skip_tensor_list": ["rotary"], "selector": "all"}
    assert c.get_weights_by_name("lm_head.weight", truncate_size=2) == [[0.0], [1.0]]
    with pytest.raises(EngineError, match=r"get_weights_by_name.*HTTP 400.*Get parameter by name failed"):
        c.get_weights_by_name("nope")


def test_server_info_reports_the_engines_build_from_what_its_ranks_registered():
    """sglang's /server_info says ``version``; a receiver says it too, and each rank's GPU
    architecture as the rank published it (``device_arch``), which connect checks."""
    from p2pweights.replica.build_check import replica_environment

    class Reporting(ReceiverHooks):
        def __init__(self, info):
            self.info = info

        def server_info(self):
            return dict(self.info)

    with ReceiverServer(Reporting({"tp_size": 2})) as server:
        c = SglangEngine(server.url, name="e0")
        assert c.server_info()["version"] == replica_environment().sglang_version  # the sglang it runs
        assert c.server_info()["p2pw_device_archs"] == {}  # no rank registered yet: unknown, never guessed
        register_transfer_engine_info(server.url, 1, "10.0.0.1:15001", {"w": [1 << 20, 8, 2]},
                                      extra={"device_arch": "sm90", "sglang_version": "0.5.23"})
        server.register_transfer_engine_info(0, "10.0.0.1:15000", {"w": [2 << 20, 8, 2]},
                                             extra={"device_arch": "sm90", "sglang_version": "0.5.23"})
        assert c.server_info()["p2pw_device_archs"] == {"0": "sm90", "1": "sm90"}
        assert c.server_info()["version"] == "0.5.23"  # what the ranks run
        assert c.transfer_engine_info(1)["device_arch"] == "sm90"
    with ReceiverServer(Reporting({"version": "9.9.9"})) as server:  # an engine's own word wins
        assert SglangEngine(server.url).server_info()["version"] == "9.9.9"


def test_a_slow_engine_times_out_naming_it():
    class Slow(ReceiverHooks):
        def on_end_update(self):
            time.sleep(1.0)

    with ReceiverServer(Slow()) as server:
        c = SglangEngine(server.url, name="slowpoke", timeout=0.2)
        c.pause_generation()
        c.begin_weight_update()
        with pytest.raises(EngineError, match=r"slowpoke: .*end_weight_update.*no answer within 0.2s.*P2PW_ENGINE_TIMEOUT"):
            c.end_weight_update()


def test_receiver_server_closes_and_frees_its_port():
    server = ReceiverServer().start()
    port = server.port
    server.close()
    server.close()  # idempotent
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    with pytest.raises(RuntimeError, match="closed"):
        server.start()


def test_verbs_on_many_engines_run_concurrently():
    class SlowPause(ReceiverHooks):
        def on_pause(self, mode):
            time.sleep(1.5)

    servers = [ReceiverServer(SlowPause()).start() for _ in range(4)]
    try:
        engines = [SglangEngine(s.url, name=f"e{i}") for i, s in enumerate(servers)]
        t0 = time.monotonic()
        assert call_engines(engines, "pause_generation").ok
        assert time.monotonic() - t0 < 4.5  # together ~1.5 s; one after another would be 6 s
    finally:
        for s in servers:
            s.close()
