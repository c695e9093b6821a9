"""What a sender reads of the sglang plugin in ``/server_info`` (control/protocol.py): the guarantees
it offers from protocol 2 on, nothing for a plain server, an older plugin or a malformed field."""
from __future__ import annotations

import pytest

from p2pweights.control import protocol as p
from p2pweights.sglang_plugin import server_info


@pytest.mark.parametrize("info, offers", [
    ({}, set()),
    ({"p2pw_plugin": {"version": "0.1.0", "protocol": 1}}, set()),
    ({"p2pw_plugin": {"version": "0.1.0", "protocol": 2, "offers": ["sessions"]}}, {"sessions"}),
    ({"p2pw_plugin": {"protocol": 2, "offers": [], "error": "refused"}}, set()),
    ({"p2pw_plugin": {"protocol": "2", "offers": ["sessions"]}}, set()),
    ({"p2pw_plugin": {"protocol": 2, "offers": "sessions"}}, set()),
    ({"p2pw_plugin": {"protocol": 2, "offers": ["sessions", 7]}}, {"sessions"}),
    (None, set()),
])
def test_plugin_offers_are_read_only_from_a_well_formed_field(info, offers):
    assert p.plugin_offers(info) == offers


def test_what_the_plugin_publishes_is_what_the_sender_reads():
    info = {p.PLUGIN_FIELD: server_info.plugin_info("0.1.0", offers=[p.PLUGIN_SESSIONS])}
    assert p.plugin_offers(info) == {p.PLUGIN_SESSIONS}
    assert server_info.PROTOCOL == p.PLUGIN_PROTOCOL
