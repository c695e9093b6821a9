"""A sender refuses, at connect, a publication it must not write into: entries that overlap, entries
outside the memory the rank registered, a session id that is not the rank's own (another engine's,
or another machine's). Unit checks of transport.publication, then real receiver processes over
Mooncake behind a ReceiverServer that serves a doctored publication (what a forged registration or
a corrupt engine would serve)."""
from __future__ import annotations

import json

import pytest

from engine_proxy import PosingAs
from p2pweights.control import SglangEngine
from p2pweights.errors import LayoutMismatch
from p2pweights.receiver import ReceiverServer, start_engines
from p2pweights.sender import WeightSender
from p2pweights.transport.publication import EnginePublication, ParamTarget
from p2pweights.transport.session_claims import SessionClaim, check_sessions
from replica_configs import write_config

BASE = 0x7F0000000000
TABLE = {"a": [BASE, 1024, 2], "b": [BASE + 2048, 512, 2], "c": [BASE + 4096, 256, 4]}


def _pub(table=TABLE, peer="127.0.0.1:15000", rank=0, **kw) -> EnginePublication:
    return EnginePublication("mooncake", peer, {k: ParamTarget(*v) for k, v in table.items()}, rank=rank, **kw)


# ---- the table: overlap and registered memory ------------------------------------------------------------


def test_overlapping_entries_are_refused_naming_the_engine_rank_and_both_parameters():
    _pub().check_regions(engine="e0")  # disjoint: fine
    overlapping = {**TABLE, "d": [BASE + 2048 + 512, 8, 2]}  # inside b
    with pytest.raises(LayoutMismatch) as info:
        _pub(overlapping, rank=3).check_regions(engine="e0")
    e = info.value
    assert (e.engine, e.rank, e.parameter) == ("e0", 3, "d")
    assert "engine 'e0' rank 3" in str(e) and "d [" in str(e) and "overlaps b" in str(e)
    # an entry that starts inside an earlier, longer one is caught even past a shorter one in between
    nested = {"big": [BASE, 10_000, 1], "small": [BASE + 10, 10, 1], "late": [BASE + 9_000, 10, 1]}
    with pytest.raises(LayoutMismatch, match=r"2 parameter\(s\).*small.*late"):
        _pub(nested).check_regions(engine="e0")


def test_entries_outside_the_registered_memory_are_refused_and_sglangs_tables_get_the_overlap_check_only():
    inside = _pub(registered=[(BASE, 8192)])
    inside.check_regions(engine="e0")
    straddling = _pub({**TABLE, "c": [BASE + 8000, 256, 4]}, registered=[(BASE, 8192)])
    with pytest.raises(LayoutMismatch, match=r"outside the memory it registered.*\bc \[") as info:
        straddling.check_regions(engine="e0")
    assert info.value.parameter == "c"
    elsewhere = _pub({**TABLE, "a": [0x1000, 1024, 2]}, registered=[(BASE, 8192)])
    with pytest.raises(LayoutMismatch, match=r"\ba \[0x1000"):
        elsewhere.check_regions(engine="e0")
    # sglang publishes no registered memory: nothing to check entries against
    _pub({**TABLE, "a": [0x1000, 1024, 2]}).check_regions(engine="e0")


@pytest.mark.parametrize("registered, why", [
    ([(0, 1 << 63)], "bytes registered in all"),                 # "everything": any entry would be inside
    ([(BASE, 8192), (BASE + (1 << 30), 4096)], "holds no published parameter"),  # memory beside the parameters
    ([(BASE, 8192), (-4096, 4096)], r"\[-4096"),
    ([(BASE, 8192), ((1 << 64) - 4096, 8192)], "18446744073709547520"),     # runs past 2^64
])
def test_registered_memory_that_is_not_the_parameters_allocation_is_refused(registered, why):
    _pub(registered=[(BASE, 8192)]).check_regions(engine="e0")  # the parameters' allocation: fine
    with pytest.raises(LayoutMismatch, match=rf"not its parameters' allocation.*{why}") as info:
        _pub(registered=registered, rank=2).check_regions(engine="e0")
    assert (info.value.engine, info.value.rank) == ("e0", 2)


def test_registered_memory_and_registration_address_round_trip_through_json():
    pub = _pub(registered=[(BASE, 8192)], registered_from="10.0.0.7")
    d = json.loads(pub.to_json())
    assert d["registered_memory"] == [[BASE, 8192]] and d["registered_from"] == "10.0.0.7"
    back = EnginePublication.from_json(d)
    assert back.registered == [(BASE, 8192)] and back.registered_from == "10.0.0.7"
    with pytest.raises(ValueError, match="registered_memory"):
        EnginePublication.from_json({**d, "registered_memory": [1, 2]})


def test_the_ranks_build_round_trips_through_json_and_sglangs_publication_has_none():
    pub = _pub(device_arch="sm90", sglang_version="0.5.23")
    d = json.loads(pub.to_json())
    assert (d["device_arch"], d["sglang_version"]) == ("sm90", "0.5.23")
    assert pub.extra()["device_arch"] == "sm90"  # what a rank registers with its engine's server
    back = EnginePublication.from_json(d)
    assert (back.device_arch, back.sglang_version) == ("sm90", "0.5.23")
    bare = EnginePublication.from_json({"rank": 0, "remote_instance_transfer_engine_info": ["h:1", {}]})
    assert (bare.device_arch, bare.sglang_version) == ("", "")
    assert "device_arch" not in bare.to_dict()


# ---- the session: the rank's own -----------------------------------------------------------------------


def _claim(engine, peer, hosts=("10.0.0.5",), rank=0, check_host=True, registered_from=""):
    return SessionClaim(engine, hosts, _pub(peer=peer, rank=rank, registered_from=registered_from), check_host)


def test_a_session_on_another_host_than_the_engines_is_refused():
    check_sessions([_claim("e0", "10.0.0.5:15000")])
    with pytest.raises(LayoutMismatch, match=r"engine 'e0' rank 0 published session '10.0.0.9:15000'.*not the engine's"):
        check_sessions([_claim("e0", "10.0.0.9:15000")])
    # a rank on another node, as the engine's server saw its registration come from there
    check_sessions([_claim("e0", "10.0.0.9:15000", registered_from="10.0.0.9")])
    # an engine over several nodes: its ranks advertise their own node
    check_sessions([_claim("e0", "10.0.0.9:15000", check_host=False)])
    # an engine client whose host does not resolve here: nothing to judge the host by
    check_sessions([_claim("e0", "10.0.0.9:15000", hosts=("engine0.invalid",))])
    # an engine reached on loopback runs here: any address of this machine is its own
    check_sessions([_claim("e0", "192.168.1.4:15000", hosts=("127.0.0.1",))], is_local=lambda a: True)
    with pytest.raises(LayoutMismatch, match="192.168.1.4"):
        check_sessions([_claim("e0", "192.168.1.4:15000", hosts=("127.0.0.1",))], is_local=lambda a: False)


def test_two_engine_ranks_claiming_one_session_are_refused_naming_both():
    check_sessions([_claim("e0", "10.0.0.5:15000"), _claim("e1", "10.0.0.5:15001")])
    with pytest.raises(LayoutMismatch) as info:
        check_sessions([_claim("e0", "10.0.0.5:15000"), _claim("e1", "10.0.0.5:15000")])
    assert (info.value.engine, info.value.rank) == ("e1", 0)
    assert "engine 'e1' rank 0 published session '10.0.0.5:15000', which engine 'e0' rank 0 published too" \
        in str(info.value)
    with pytest.raises(LayoutMismatch, match="engine 'e0' rank 1"):  # two ranks of one engine, too
        check_sessions([_claim("e0", "10.0.0.5:15000"), _claim("e0", "10.0.0.5:15000", rank=1)])


# ---- real receivers over Mooncake, a doctored publication served at connect ----------------------------


class _Doctored(PosingAs):
    """An engine whose server says what a real engine says, but serves the publication it is given."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("configs")))


@pytest.fixture(scope="module")
def engines(model):
    engines = start_engines(model, "tp=1", count=2, transport="mooncake", name_prefix="pubcheck")
    yield engines
    for e in engines:
        e.close()


def _served(engine_url: str, answer: dict):
    """A ReceiverServer posing as the engine at ``engine_url``, serving ``answer`` as rank 0's publication."""
    server = ReceiverServer(_Doctored(engine_url)).start()
    pub = EnginePublication.from_json(answer)
    d = pub.to_dict()
    peer, table = d.pop("remote_instance_transfer_engine_info")
    d.pop("rank", None)
    server.register_transfer_engine_info(0, peer, table, d)
    return server


def _connect(model, urls):
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect([SglangEngine(u, name=n) for n, u in urls])
    finally:
        sender.close()


def _real(engine) -> dict:
    return SglangEngine(engine.url).transfer_engine_info(0)


def test_the_receivers_publication_carries_its_registered_memory_and_connects(model, engines):
    pub = EnginePublication.from_json(_real(engines[0]))
    (base, size), = [r for r in pub.registered if r != pub.delta_area]  # the weights; the delta area apart
    assert pub.delta_area in pub.registered
    assert all(base <= t.data_ptr and t.data_ptr + t.nbytes <= base + size for t in pub.params.values())
    _connect(model, [(e.name, e.url) for e in engines])  # the genuine ones pass every check


def test_an_engine_publishing_another_engines_session_is_refused_at_connect(model, engines):
    victim, honest = engines
    forged = _real(victim)  # the victim's session id and table, served as the other engine's rank 0
    server = _served(honest.url, forged)
    try:
        with pytest.raises(LayoutMismatch) as info:
            _connect(model, [("victim", victim.url), ("forger", server.url)])
        assert (info.value.engine, info.value.rank) == ("forger", 0)
        assert "which engine 'victim' rank 0 published too" in str(info.value)
    finally:
        server.close()


def test_a_session_on_another_machine_is_refused_at_connect(model, engines):
    answer = _real(engines[0])
    answer["remote_instance_transfer_engine_info"][0] = "192.0.2.1:15432"  # TEST-NET-1: never this machine
    server = _served(engines[0].url, answer)
    try:
        with pytest.raises(LayoutMismatch, match=r"engine 'far' rank 0 published session '192.0.2.1:15432'"):
            _connect(model, [("far", server.url)])
    finally:
        server.close()


def test_overlapping_publication_is_refused_at_connect(model, engines):
    answer = _real(engines[0])
    table = answer["remote_instance_transfer_engine_info"][1]
    names = sorted(table, key=lambda n: table[n][0])
    first, second = names[0], names[1]
    table[second] = [table[first][0], *table[second][1:]]  # same byte count, written over the first
    server = _served(engines[0].url, answer)
    try:
        with pytest.raises(LayoutMismatch, match=r"overlaps.*refusing to connect") as info:
            _connect(model, [("overlap", server.url)])
        assert info.value.rank == 0 and info.value.parameter in (first, second)
        assert first in str(info.value) and second in str(info.value)
    finally:
        server.close()


def test_an_entry_outside_the_registered_memory_is_refused_at_connect_not_at_write(model, engines):
    answer = _real(engines[0])
    (base, size), = [r for r in answer["registered_memory"] if r != answer.get("delta_area")]
    table = answer["remote_instance_transfer_engine_info"][1]
    last = max(table, key=lambda n: table[n][0])
    table[last] = [base + size + (1 << 20), *table[last][1:]]  # past the region: someone else's memory
    server = _served(engines[0].url, answer)
    try:
        with pytest.raises(LayoutMismatch, match=rf"outside the memory it registered.*{last.replace('.', '[.]')}"):
            _connect(model, [("outside", server.url)])
    finally:
        server.close()


def test_a_forged_registered_memory_does_not_let_an_entry_leave_the_ranks_memory(model, engines):
    answer = _real(engines[0])
    (base, size), = [r for r in answer["registered_memory"] if r != answer.get("delta_area")]
    table = answer["remote_instance_transfer_engine_info"][1]
    last = max(table, key=lambda n: table[n][0])
    table[last] = [base + size + (1 << 20), *table[last][1:]]  # someone else's memory...
    answer["registered_memory"] = [[0, 1 << 63]]                # ...claimed "registered" with the rest of memory
    server = _served(engines[0].url, answer)
    try:
        with pytest.raises(LayoutMismatch, match=r"rank 0 published registered memory that is not its parameters'"):
            _connect(model, [("forged", server.url)])
    finally:
        server.close()


@pytest.mark.parametrize("where", ["on the weights", "unregistered"])
def test_a_delta_area_on_the_weights_or_outside_the_registration_is_refused_at_connect(model, engines, where):
    """A delta area is written one-sided like the weights: one that overlaps them (a record's bytes
    would land on a parameter) or that the rank did not register is refused before any write."""
    answer = _real(engines[0])
    weights = [r for r in answer["registered_memory"] if r != answer["delta_area"]][0]
    if where == "on the weights":
        answer["delta_area"] = [weights[0], 4096]
        answer["registered_memory"] = [weights, [weights[0], 4096]]
    else:
        answer["registered_memory"] = [weights]
    server = _served(engines[0].url, answer)
    try:
        with pytest.raises(LayoutMismatch, match="delta area"):
            _connect(model, [("area", server.url)])
    finally:
        server.close()
