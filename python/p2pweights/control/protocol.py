"""The control plane's vocabulary, written once: status codes, the markers in sglang's and the
receiver's messages, p2pweights' headers and body keys, pause modes and selectors. The rest of the
protocol lives by job: :mod:`.routes` (the route table), :mod:`.bodies` (request and answer bodies,
their JSON encoding and checks), :mod:`.error_answers` (the one error payload, reading any error
answer, and the hints). The engine client (``control.sglang``) and the receiver's HTTP server
(``receiver.server``) both read them; no route, mode or status is spelled anywhere else.

The protocol is sglang 0.5.23's own HTTP API (``srt/entrypoints/http_server.py`` for the routes,
``srt/managers/io_struct.py`` for the bodies, ``srt/entrypoints/engine_info_bootstrap_server.py``
for the bootstrap routes); tests/test_engines_sglang_routes.py checks the route table against the
installed sglang's source. What p2pweights adds is described in docs/protocol.md.
"""
from __future__ import annotations

PAUSE_MODES = ("abort", "retract", "in_place")   # sglang's PauseGenerationReqInput.mode
SELECTORS = ("target", "draft", "all")           # which weights a session or check covers (draft: EAGLE/MTP)

# ---- status codes ------------------------------------------------------------------------------

OK = 200
BAD_REQUEST = 400         # a malformed body, or a call out of order for the session (sglang's code for both)
UNAUTHORIZED = 401        # sglang's --api-key
FORBIDDEN = 403
NOT_FOUND = 404           # no such route; on the bootstrap server: that rank published nothing
METHOD_NOT_ALLOWED = 405
REQUEST_TIMEOUT = 408     # the client stalled while sending its request body (front.guard)
CONFLICT = 409            # the engine's weight-update session is another controller's, or its weights are torn
PAYLOAD_TOO_LARGE = 413   # a body over the receiver's limit, refused unread
ENGINE_FAILED = 500       # a hook raised inside the engine; its state is unchanged
NOT_IMPLEMENTED = 501     # a receiver whose hooks do not implement one of p2pweights' own routes
SERVICE_UNAVAILABLE = 503  # /health while the engine starts


def ok(status: int) -> bool:
    return 200 <= status < 300


# what sglang's (and the receiver's) messages say, matched by the client
SESSION_ALREADY_OPEN = "already open"           # "a weight-update session is already open; ..."
NO_SESSION = "no weight-update session"
SEED_FLAG = "--remote-instance-weight-loader-start-seed-via-transfer-engine"

#: sessions with an owner (docs/protocol.md, "Sessions: owner and lease"): every call an update's
#: controller makes carries its owner token (a secret: never shown) and a non-secret label
#: (``host:pid``, what the engine shows of the owner); begin and renew carry the lease it asks for,
#: in seconds (capped by the engine's own). sglang ignores all three headers.
SESSION_OWNER_HEADER = "X-P2PW-Session-Owner"
SESSION_LABEL_HEADER = "X-P2PW-Session-Label"
SESSION_LEASE_HEADER = "X-P2PW-Session-Lease"
TORN = "torn"                                   # what /health and /server_info say of torn weights

#: A receiver's begin answers ``END_FOLDS: true``: its end_weight_update may be asked, in its body's
#: ``END_THEN`` (``{"new_version": str, "continue": bool, "torch_empty_cache": bool}``), to bump the
#: version and continue generation right after it ended, in the same call; its answer then says what
#: each did under ``END_THEN`` (``{"update_weight_version": {"success", "message", ...}, ...}``).
#: One round trip instead of three; sglang's servers never get it (they do not answer END_FOLDS).
END_FOLDS = "p2pw_end_then"
END_THEN = "p2pw_then"
#: A receiver's begin answers ``BEGIN_PAUSES: true``: its next begin_weight_update may carry
#: ``PAUSE_FIRST: {"mode": ...}`` (a PauseGenerationReq) in its body, and then pauses generation first,
#: in the same call, answering what the pause said under ``PAUSE_FIRST``. The owner's pause and begin
#: in one round trip; learned from a begin's answer, so sglang's servers never get it.
BEGIN_PAUSES = "p2pw_begin_pauses"
PAUSE_FIRST = "p2pw_pause"
#: a receiver's answer to a session verb carries its own timings under this key (seconds by phase:
#: ``server_s``, its fan-outs to the ranks, each rank's, and a folded end's ``<verb>_s``)
TIMINGS_KEY = "p2pw_timings"

#: The p2pweights sglang plugin (sglang_plugin/): ``/server_info`` carries ``PLUGIN_FIELD`` =
#: ``{"version", "protocol", "offers", "gpu_arch"?, "error"?}``; ``offers`` names the guarantees it
#: enforces in that server (``PLUGIN_SESSIONS``: owners, leases, torn, as a receiver), from protocol 2
#: on. Protocol 3 adds ``PLUGIN_GPU_ARCH``, the GPU architecture of the engine's ranks in the
#: receiver's spelling (``sm90``, ``gfx942``; absent on a server without GPUs), and the offer
#: ``PLUGIN_BOOTSTRAP_KEY``: the engine-info bootstrap server requires the server's API key.
PLUGIN_FIELD = "p2pw_plugin"
PLUGIN_PROTOCOL = 3
PLUGIN_SESSIONS = "sessions"
#: the offer: the server answers ``POST /p2pw_weights_digest`` as a receiver does (``update(verify=True)``)
PLUGIN_DIGEST = "digest"
#: the offer: the server takes delta updates (docs/deltas.md): its ranks publish delta areas, its begin
#: answers the claim ``p2pw_delta``, its end applies the manifests before sglang's post-processing
PLUGIN_DELTAS = "deltas"
PLUGIN_BOOTSTRAP_KEY = "bootstrap_key"
PLUGIN_GPU_ARCH = "gpu_arch"
#: the offer: a takeover revokes every rank's registrations under the next epoch, published with the
#: ranks' tables and in begin's answer (docs/security.md, "Epochs"); the sender follows it as a receiver's
PLUGIN_FENCING = "fencing"


def plugin_offers(server_info: object) -> frozenset[str]:
    """What an engine's plugin enforces, read from its ``/server_info`` (nothing: no plugin, an older
    protocol, or a refused one)."""
    offers = _plugin_field(server_info, since=2).get("offers")
    return frozenset(o for o in offers if isinstance(o, str)) if isinstance(offers, list) else frozenset()


def plugin_gpu_arch(server_info: object) -> object:
    """The GPU architecture an engine's plugin reports (protocol 3 on), as sent (the reader checks its
    spelling); None when it reports none (no plugin, an older one, or a server without GPUs)."""
    return _plugin_field(server_info, since=3).get(PLUGIN_GPU_ARCH)


def _plugin_field(server_info: object, since: int) -> dict:
    """``PLUGIN_FIELD`` of a plugin of protocol ``since`` or later; {} for anything else."""
    info = server_info.get(PLUGIN_FIELD) if isinstance(server_info, dict) else None
    if not isinstance(info, dict) or not isinstance(info.get("protocol"), int) or info["protocol"] < since:
        return {}
    return info
