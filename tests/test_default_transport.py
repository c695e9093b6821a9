"""The default transport (issue 23 item 7): ``P2PW_TRANSPORT`` defaults to ``auto``, resolved by one
rule (``transport.resolve_transport``) for WeightSender, ``serve``, the receiver's launcher and
``demo``: nixl where NIXL's native C-API path loads (its listeners bind only the configured
devices' addresses), else mooncake (wildcard listeners, docs/security.md), with the reason. An
``auto`` sender takes the transport its engines publish for, so it never refuses an engine it
could talk to; an explicit name keeps today's behaviour."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from p2pweights import settings as S
from p2pweights import transport as transports
from p2pweights.errors import WrongTransport
from p2pweights.transport import nixl, nixl_native

LIBC = "libc.so.6"  # a library that loads everywhere: stands in for NIXL's C API when it "loads"


def _native_loads(monkeypatch) -> None:
    monkeypatch.setattr(nixl_native, "data_path", lambda: {"path": "native", "library": LIBC, "reason": "test"})
    monkeypatch.setattr(nixl, "nixl_api", lambda: None)


def _python_only(monkeypatch) -> None:
    monkeypatch.setattr(nixl_native, "data_path",
                        lambda: {"path": "python", "library": None, "reason": "no libnixl_capi.so in the wheel"})


# -- the rule -------------------------------------------------------------------------------------
def test_p2pw_transport_defaults_to_auto_and_refuses_other_names(monkeypatch):
    monkeypatch.delenv("P2PW_TRANSPORT", raising=False)
    assert S.value("P2PW_TRANSPORT") == "auto" and S.settings().transport == "auto"
    monkeypatch.setenv("P2PW_TRANSPORT", "tcp")
    with pytest.raises(S.SettingError, match="P2PW_TRANSPORT"):
        S.settings()


def test_auto_resolves_to_nixl_where_the_native_path_loads(monkeypatch):
    _native_loads(monkeypatch)
    assert transports.resolve_transport("auto") == ("nixl", "auto: NIXL's native C-API path loads here")
    monkeypatch.delenv("P2PW_TRANSPORT", raising=False)
    assert transports.resolve_transport()[0] == "nixl"  # None: P2PW_TRANSPORT, default auto


def test_auto_resolves_to_mooncake_without_the_native_path_naming_why(monkeypatch):
    _python_only(monkeypatch)
    name, why = transports.resolve_transport("auto")
    assert name == "mooncake" and "native path is not available" in why and "no libnixl_capi.so" in why


def test_auto_resolves_to_mooncake_when_the_c_api_does_not_load(monkeypatch, tmp_path):
    broken = tmp_path / "libnixl_capi.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setattr(nixl_native, "data_path", lambda: {"path": "native", "library": str(broken), "reason": ""})
    name, why = transports.resolve_transport("auto")
    assert name == "mooncake" and "does not load" in why and str(broken) in why


def test_an_explicit_transport_is_kept_whatever_loads(monkeypatch):
    _python_only(monkeypatch)
    assert transports.resolve_transport("nixl") == ("nixl", "")
    _native_loads(monkeypatch)
    assert transports.resolve_transport("mooncake") == ("mooncake", "")
    monkeypatch.setenv("P2PW_TRANSPORT", "mooncake")
    assert transports.resolve_transport() == ("mooncake", "")
    with pytest.raises(ValueError, match="unknown transport"):
        transports.resolve_transport("carrier-pigeon")


def test_the_demo_uses_the_same_rule(monkeypatch):
    from p2pweights.commands.demo import pick_transport

    _python_only(monkeypatch)
    assert pick_transport("auto")[0] == "mooncake"
    _native_loads(monkeypatch)
    assert pick_transport("auto") == ("nixl", " (auto: NIXL's native C-API path loads here)")


def test_the_receiver_launcher_resolves_auto_once_for_every_rank(monkeypatch, tmp_path):
    from p2pweights.receiver.local import LocalEngine

    monkeypatch.delenv("P2PW_TRANSPORT", raising=False)
    _native_loads(monkeypatch)
    e = LocalEngine(str(tmp_path), "tp=2")  # not started: the ranks get --transport <resolved>
    assert (e.transport, e.transport_why) == ("nixl", "auto: NIXL's native C-API path loads here")
    _python_only(monkeypatch)
    assert LocalEngine(str(tmp_path), "tp=2").transport == "mooncake"
    assert LocalEngine(str(tmp_path), "tp=2", transport="nixl").transport == "nixl"


# -- a sender: the engines' transport first --------------------------------------------------------
def test_an_auto_sender_takes_the_transport_the_engines_publish_over_the_local_rule(monkeypatch):
    _python_only(monkeypatch)  # the local rule says mooncake
    nixl_engine = {"p2pw_receiver": True, "p2pw_transport": "nixl"}
    assert transports.transport_for_engines("auto", [("e0", nixl_engine), ("e1", nixl_engine)]) == \
        ("nixl", "auto: the engines publish for nixl")
    _native_loads(monkeypatch)  # the local rule says nixl; sglang publishes Mooncake's form
    assert transports.transport_for_engines("auto", [("sglang0", {"tp_size": 2})])[0] == "mooncake"
    assert transports.transport_for_engines("auto", []) == ("nixl", "auto: NIXL's native C-API path loads here")
    assert transports.transport_for_engines("mooncake", [("e0", nixl_engine)]) == ("mooncake", "")  # explicit: kept


def test_an_auto_sender_refuses_engines_of_different_transports_naming_them():
    with pytest.raises(WrongTransport, match=r"different transports \('a': mooncake, 'b': nixl\)"):
        transports.transport_for_engines("auto", [("a", {"p2pw_transport": "mooncake"}), ("b", {"p2pw_transport": "nixl"})])


# -- real engines ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    from replica_configs import write_config

    return write_config("qwen3", str(tmp_path_factory.mktemp("configs")))


@pytest.fixture(scope="module")
def engines(cfg):
    pytest.importorskip("mooncake.engine")
    try:
        nixl.nixl_api()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NIXL is not usable here: {e}")
    from p2pweights.receiver import start_engine

    started = {}
    try:
        for t in ("mooncake", "nixl"):
            started[t] = start_engine(cfg, "tp=1", transport=t, name=f"auto-{t}")
        yield {t: e.url for t, e in started.items()}
    finally:
        for e in started.values():
            e.close()


def _update(sender, cfg: str, seed: int) -> None:
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint

    with sender.update(f"v{seed}") as update:
        for name, t in random_checkpoint(checkpoint_tensors(cfg), seed):
            update.push(name, t)


def _landed(url: str, seed: int) -> None:
    from p2pweights.receiver import check_weights_equal

    result = check_weights_equal(url, hf_seed=seed)
    assert result["success"], result["message"]


def test_an_auto_sender_writes_into_a_nixl_engine_where_the_local_rule_says_mooncake(cfg, engines, monkeypatch):
    from p2pweights.sender import WeightSender

    monkeypatch.delenv("P2PW_TRANSPORT", raising=False)
    _python_only(monkeypatch)
    with WeightSender(cfg, buffer_size=1 << 20) as sender:
        assert sender.settings.transport == "auto" and sender.transport is None
        sender.connect([engines["nixl"]])
        assert (sender.transport, sender.transport_why) == ("nixl", "auto: the engines publish for nixl")
        _update(sender, cfg, 31)
    _landed(engines["nixl"], 31)


def test_an_auto_sender_follows_its_engines_from_mooncake_to_nixl(cfg, engines, monkeypatch):
    """prepare=True makes the agent at construction by the local rule (nixl here); a Mooncake engine
    replaces it, and a reconnect to a NIXL engine replaces it again; every update lands. Engines
    of both transports at once are refused before the current connection is touched."""
    from p2pweights.sender import WeightSender

    monkeypatch.delenv("P2PW_TRANSPORT", raising=False)
    real = transports.resolve_transport
    monkeypatch.setattr(transports, "resolve_transport",  # the local rule says nixl, whatever loads here
                        lambda name=None: ("nixl", "test: the local rule") if name in (None, "auto") else real(name))
    with WeightSender(cfg, buffer_size=1 << 20, prepare=True) as sender:
        assert sender.transport == "nixl"
        sender.connect([engines["mooncake"]])
        assert sender.transport == "mooncake" and sender._transport.name == "mooncake"
        _update(sender, cfg, 41)
        _landed(engines["mooncake"], 41)
        with pytest.raises(WrongTransport, match="different transports"):
            sender.connect([engines["mooncake"], engines["nixl"]])
        assert [e.base_url for e in sender.engines] == [engines["mooncake"]]  # untouched
        sender.connect([engines["nixl"]])
        assert sender.transport == "nixl" and sender._transport.name == "nixl"
        _update(sender, cfg, 42)
    _landed(engines["nixl"], 42)


def test_an_explicit_sender_still_refuses_an_engine_of_the_other_transport(cfg, engines):
    from p2pweights.sender import WeightSender

    with WeightSender(cfg, transport="nixl", buffer_size=1 << 20) as sender:
        with pytest.raises(WrongTransport, match="published its weights for mooncake"):
            sender.connect([engines["mooncake"]])


# -- doctor ----------------------------------------------------------------------------------------
def test_doctor_shows_the_resolved_default_transport_and_why():
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PW_")}
    r = subprocess.run([sys.executable, "-m", "p2pweights", "doctor"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    expected, why = transports.resolve_transport("auto")
    assert re.search(rf"^transport\s+: {expected} \(P2PW_TRANSPORT=auto \[default\]: {re.escape(why)}\)$",
                     r.stdout, re.M), r.stdout
    r = subprocess.run([sys.executable, "-m", "p2pweights", "doctor"], env={**env, "P2PW_TRANSPORT": "mooncake"},
                       capture_output=True, text=True, timeout=120)
    assert re.search(r"^transport\s+: mooncake \(P2PW_TRANSPORT=mooncake \[P2PW_TRANSPORT\]", r.stdout, re.M), r.stdout


def test_transport_options_of_auto_name_the_resolved_transport():
    s = S.settings(transport="auto", nixl_backend="UCX", nixl_progress_delay_us=0)
    assert s.transport_options("nixl") == {"backend": "UCX", "progress_delay": 0}
    with pytest.raises(ValueError, match="pass the transport it resolved to"):
        s.transport_options()  # auto's options would be the wrong transport's half the time
