"""The three hosts of the engine core, each behind its own HTTP front, for one parametrized policy
suite (tests/test_engine_policy.py): our receiver (a real ``ReceiverServer`` over HTTP, its hooks
failing on demand), the sglang plugin's gate and the vLLM backend's gate (each in front of an app
with the engine's own paths and answers, reached through Starlette's test client; the ranks'
answers through sglang's weight-checker communicator and vLLM's ``collective_rpc`` come from
:class:`Ranks`). The real servers run the same gates in tests/test_sglang_plugin_*.py and
tests/test_vllm_*.py; here every host answers the same calls, faults included.

Each host takes the core's verbs by its engine's own paths (:data:`PATHS`) and exposes the same
few knobs: ``ranks.paused``, ``ranks.fail_apply``, ``ranks.fail_revoke``, ``ranks.fail_pause``.
"""
from __future__ import annotations

import json
import secrets
import types
from typing import Any

from p2pweights.control import http as control_http
from p2pweights.control import protocol as p
from p2pweights.deltas.committed import DELTA_KEY
from p2pweights.errors import InvalidWrite

KEY = "policy-key"
#: the core's verbs as each host's engine names them
PATHS = {
    "receiver": {"pause": "/pause_generation", "continue": "/continue_generation", "begin": "/begin_weight_update",
                 "end": "/end_weight_update", "version": "/update_weight_version", "renew": "/renew_weight_update",
                 "apply": "/p2pw_apply_deltas", "load": "/load_lora_adapter", "unload": "/unload_lora_adapter"},
    "vllm": {"pause": "/pause", "continue": "/resume", "begin": "/start_weight_update", "end": "/finish_weight_update",
             "version": "/update_weight_version", "renew": "/renew_weight_update", "apply": "/p2pw_apply_deltas",
             "load": "/v1/load_lora_adapter", "unload": "/v1/unload_lora_adapter"},
}
PATHS["sglang"] = PATHS["receiver"]
AREA = [1 << 20, 4096]  # where rank 0 says its delta area is (never written: the apply is the ranks')


class Ranks:
    """What the engine's ranks answer, faults on demand."""

    def __init__(self) -> None:
        self.paused = False
        self.fail_apply = self.fail_revoke = self.fail_pause = False
        self.applied: list[dict] = []
        self.epoch = 1
        self.adapters: dict[str, dict] = {}  # the engine's LoRA registry: name -> {"slot", "pinned", "id"}

    def load(self, name: str, pinned: bool) -> int:
        slot = 1 + len(self.adapters)
        self.adapters[name] = {"slot": slot, "pinned": bool(pinned), "id": 100 + slot}
        return slot

    def slot(self, name: str) -> int:
        """Where the engine holds ``name``: refused (a rank's own words) when not loaded or not pinned."""
        held = self.adapters.get(name)
        if held is None:
            raise InvalidWrite(f"rank 0: LoRA adapter {name!r} is not loaded", rank=0)
        if not held["pinned"]:
            raise InvalidWrite(f"rank 0: LoRA adapter {name!r} is not pinned", rank=0)
        return held["slot"]

    def apply(self, manifests: dict) -> None:
        if self.fail_apply:  # what a rank raises when its area does not hold what the manifest says
            raise InvalidWrite("rank 0: injected: the delta area does not hold what the manifest says", rank=0)
        self.applied.append(manifests)

    def revoke(self, epoch: int) -> None:
        if self.fail_revoke:
            raise RuntimeError("rank 0: injected: closing the old endpoint failed")
        self.epoch = epoch

    def pause(self) -> None:
        if self.fail_pause:
            raise RuntimeError("injected: the scheduler did not answer")
        self.paused = True


class Host:
    """One host: ``call(verb, body, owner)`` -> (status, answer) by its own path."""

    kind = ""

    def __init__(self) -> None:
        self.ranks = Ranks()

    def call(self, verb: str, body: dict | None = None, owner: str | None = None, *, path: str | None = None,
             raw: bytes | None = None, key: str | None = KEY) -> tuple[int, Any]:
        headers = {p.SESSION_OWNER_HEADER: owner} if owner else {}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return self._post(path or PATHS[self.kind][verb], body or {}, headers, raw)

    def state(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        pass


def owner() -> str:
    return secrets.token_urlsafe(32)


def manifest() -> dict:
    return {"bytes": 0, "records": 0, "sha256": "0" * 64}


# ---- our receiver ------------------------------------------------------------------------------


class ReceiverHost(Host):
    kind = "receiver"

    def __init__(self) -> None:
        super().__init__()
        from p2pweights.receiver import ReceiverHooks, ReceiverServer

        ranks = self.ranks

        class Hooks(ReceiverHooks):
            def on_pause(self, mode: str) -> None:
                ranks.pause()

            def on_continue(self, torch_empty_cache: bool) -> None:
                ranks.paused = False

            def on_apply_deltas(self, manifests: dict) -> None:
                ranks.apply(manifests)

            def on_apply_deltas_then_end(self, manifests: dict) -> None:
                ranks.apply(manifests)

            def on_revoke(self, epoch: int) -> dict:
                ranks.revoke(epoch)
                return {0: ("127.0.0.1:2", {}, {"epoch": epoch, "delta_area": AREA})}

            def adapter(self, op: str, name: str, path: str | None = None, pinned: bool = True) -> int | None:
                if op == "load":
                    return ranks.load(name, pinned)
                if op == "unload":
                    ranks.adapters.pop(name, None)
                    return None
                return ranks.slot(name)

        self.server = ReceiverServer(Hooks(), api_key=KEY, session_lease=30).start()
        self.server.register_transfer_engine_info(0, "127.0.0.1:1", {}, {"delta_area": AREA, "epoch": 1})

    def _post(self, path: str, body: dict, headers: dict, raw: bytes | None) -> tuple[int, Any]:
        if raw is not None:  # the head and what the server reads of the body: it may answer before the rest
            import socket

            head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Type": "application/json",
                                                          "Content-Length": str(len(raw))}.items())
            with socket.create_connection(("127.0.0.1", self.server.port), timeout=30) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + raw[:65536])
                answer = sock.recv(65536).decode("latin-1")
            status = int(answer.split(" ", 2)[1])
            return status, json.loads(answer.split("\r\n\r\n", 1)[1] or "null")
        return control_http.request("POST", self.server.url, path, body=body, headers=headers, timeout=30)

    def state(self) -> dict:
        return self.server.core.state()

    def close(self) -> None:
        self.server.close()


# ---- the sglang plugin's gate --------------------------------------------------------------------


class _Asgi(Host):
    def _post(self, path: str, body: dict, headers: dict, raw: bytes | None) -> tuple[int, Any]:
        if raw is not None:
            r = self.client.post(path, content=raw, headers={**headers, "Content-Type": "application/json"})
        else:
            r = self.client.post(path, json=body, headers=headers)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text


def _engine_session_routes(app: Any, host: Host, begin: str, end: str, already: str) -> None:
    """An engine's own begin and end: its own update session, "already open" in its own words."""
    from fastapi.responses import JSONResponse

    open_ = [False]

    async def begin_route() -> Any:
        if open_[0]:
            return JSONResponse({"success": False, "message": already}, status_code=400)
        open_[0] = True
        return {"success": True, "message": "Success"}

    async def end_route() -> Any:
        open_[0] = False
        return {"success": True, "message": "Success"}

    app.add_api_route(begin, begin_route, methods=["POST"])
    app.add_api_route(end, end_route, methods=["POST"])


class SglangHost(_Asgi):
    kind = "sglang"

    def __init__(self, monkeypatch: Any, api_key: str | None = KEY, admin_api_key: str | None = None) -> None:
        super().__init__()
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse
        from fastapi.testclient import TestClient
        from sglang.srt.utils.auth import AuthLevel, add_api_key_middleware, auth_level

        from p2pweights.replica import sglang_env
        from p2pweights.sglang_plugin import delta_updates, lora_slots, rank_deltas, rank_epochs, sessions

        sglang_env.prepare()  # sglang's io_struct (the ranks' requests) imports what a CPU host lacks
        ranks, app = self.ranks, FastAPI()

        class Tokenizer:  # sglang's tokenizer manager, as the gate's steps reach the schedulers
            @property
            def is_pause(self) -> bool:
                return ranks.paused

            def auto_create_handle_loop(self) -> None:
                pass

            async def check_weights_communicator(self, req: Any) -> list:
                args = json.loads(req.skip_tensor_list[0])
                try:
                    if req.action == lora_slots.ACTION:
                        answer = {"ranks": [{"rank": 0, "slot": ranks.slot(args["lora_name"])}]}
                        return [types.SimpleNamespace(success=True, message=json.dumps(answer))]
                    if req.action == rank_deltas.ACTION:
                        ranks.apply(args["manifests"])
                    elif req.action == rank_epochs.ACTION:
                        ranks.revoke(args[rank_epochs.EPOCH_KEY])
                        delta_updates.EPOCHS[0] = args[rank_epochs.EPOCH_KEY]
                except (RuntimeError, InvalidWrite) as e:
                    error = {rank_deltas.ERROR_KEY: {"type": type(e).__name__, "message": str(e)}}
                    return [types.SimpleNamespace(success=False, message=json.dumps(error))]
                return [types.SimpleNamespace(success=True, message="{}")]

        tokenizer = Tokenizer()
        for name, value in (("TOKENIZER", tokenizer), ("TP_SIZE", 1), ("AREAS", {0: AREA}), ("EPOCHS", {0: 1})):
            monkeypatch.setattr(delta_updates, name, value)

        @auth_level(AuthLevel.ADMIN_OPTIONAL)
        async def pause() -> dict:
            ranks.pause()
            return {"success": True, "message": "Generation paused successfully."}

        @auth_level(AuthLevel.ADMIN_OPTIONAL)
        async def resume() -> dict:
            ranks.paused = False
            return {"success": True, "message": "Generation continued successfully."}

        @auth_level(AuthLevel.ADMIN_OPTIONAL)
        async def ok() -> dict:
            return {"success": True, "message": "Success"}

        @auth_level(AuthLevel.ADMIN_OPTIONAL)
        async def load(request: Any) -> Any:  # sglang's own load: its registry (the ranks' here)
            body = await request.json()
            ranks.load(body["lora_name"], body.get("pinned", False))
            return JSONResponse({"success": True, "error_message": None,
                                 "loaded_adapters": {body["lora_name"]: body["lora_path"]}})

        @auth_level(AuthLevel.ADMIN_OPTIONAL)
        async def unload(request: Any) -> Any:
            ranks.adapters.pop((await request.json())["lora_name"], None)
            return JSONResponse({"success": True, "error_message": None})

        app.add_api_route("/pause_generation", pause, methods=["POST"])
        app.add_api_route("/continue_generation", resume, methods=["POST"])
        app.add_route("/load_lora_adapter", load, methods=["POST"])  # a Starlette route: the raw request
        app.add_route("/unload_lora_adapter", unload, methods=["POST"])
        _engine_session_routes(app, self, "/begin_weight_update", "/end_weight_update",
                               f"a weight-update session is {p.SESSION_ALREADY_OPEN}")
        for path in set(sessions.GATED_PATHS) - {sessions.RENEW_PATH, sessions.APPLY_PATH, "/pause_generation",
                                                 "/continue_generation", "/begin_weight_update", "/end_weight_update",
                                                 "/load_lora_adapter", "/unload_lora_adapter"}:
            app.add_api_route(path, ok, methods=["POST"])
        app.add_api_route(sessions.CHECKER_PATH, ok, methods=["POST"])
        monkeypatch.setattr(sessions, "HOST", None)  # install() sets the process's gate: restored after the test
        self.gate = sessions.install(app, engine="sglang-policy", lease=30, tokenizer=tokenizer)
        add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)  # as sglang adds it, after the hook
        self.client = TestClient(app)

    def state(self) -> dict:
        return self.gate.core.state()


# ---- the vLLM backend's gate ---------------------------------------------------------------------


class VllmHost(_Asgi):
    kind = "vllm"

    def __init__(self, monkeypatch: Any) -> None:
        super().__init__()
        from fastapi import FastAPI
        from fastapi.responses import PlainTextResponse
        from fastapi.testclient import TestClient

        from p2pweights.vllm_backend import gate, rank_calls

        # vLLM's request type (vllm is importable only in the vLLM tests' own processes: tests/test_vllm_suite.py)
        monkeypatch.setattr(gate, "_update_request", lambda info: types.SimpleNamespace(update_info=info))

        ranks, app = self.ranks, FastAPI()

        class EngineClient:  # vLLM's engine client, as the gate's steps reach the workers
            async def is_paused(self) -> bool:
                return ranks.paused

            async def collective_rpc(self, method: str, args: tuple = ()) -> list:
                if method != rank_calls.RPC_METHOD:
                    return []
                verb, body = args
                if verb == "publication":
                    return [{"rank": 0, "delta_area": AREA, "epoch": ranks.epoch}]
                if verb == "adapter_slot":  # a worker's answer: vLLM's slot and whether it is pinned
                    name = next(n for n, a in ranks.adapters.items() if a["id"] == body["lora_int_id"])
                    held = ranks.adapters[name]
                    return [{"rank": 0, "slot": held["slot"], "pinned": held["pinned"]}]
                if verb == "revoke":
                    ranks.revoke(body["epoch"])
                return [{"rank": 0}]

            async def update_weights(self, request: Any) -> None:
                ranks.apply(request.update_info[DELTA_KEY])

            async def pin_lora(self, lora_id: int) -> bool:
                for held in ranks.adapters.values():
                    if held["id"] == lora_id:
                        held["pinned"] = True
                return True

            async def remove_lora(self, lora_id: int) -> bool:
                return True

        async def pause() -> dict:
            ranks.pause()
            return {"status": "paused"}

        async def resume() -> dict:
            ranks.paused = False
            return {"status": "resumed"}

        async def ok() -> dict:
            return {"status": "ok"}

        async def load(request: Any) -> Any:  # vLLM's own load: its API server's registry
            body = await request.json()
            ranks.load(body["lora_name"], False)  # vLLM pins only when the gate asks it to (pin_lora)
            models.lora_requests[body["lora_name"]] = types.SimpleNamespace(
                lora_int_id=ranks.adapters[body["lora_name"]]["id"])
            return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

        async def unload(request: Any) -> Any:
            name = (await request.json())["lora_name"]
            ranks.adapters.pop(name, None)
            models.lora_requests.pop(name, None)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        models = types.SimpleNamespace(lora_requests={})
        app.state.openai_serving_models = models
        app.add_api_route("/pause", pause, methods=["POST"])
        app.add_api_route("/resume", resume, methods=["POST"])
        app.add_route("/v1/load_lora_adapter", load, methods=["POST"])  # a Starlette route: the raw request
        app.add_route("/v1/unload_lora_adapter", unload, methods=["POST"])
        _engine_session_routes(app, self, "/start_weight_update", "/finish_weight_update",
                               "a weight update is already active")
        for path in ("/update_weight_version", "/update_weights", gate.INIT, "/shutdown_weight_transfer_engine"):
            app.add_api_route(path, ok, methods=["POST"])
        app.state.engine_client = EngineClient()
        app.state.args = types.SimpleNamespace(api_key=[KEY], api_server_count=1)
        app.add_middleware(gate.SessionGate, engine="vllm-policy", lease=30)
        self.client = TestClient(app)

    def state(self) -> dict:
        r = self.client.get("/p2pw_weight_update", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        return r.json()


def make(kind: str, monkeypatch: Any) -> Host:
    if kind == "receiver":
        return ReceiverHost()
    if kind == "sglang":
        return SglangHost(monkeypatch)
    return VllmHost(monkeypatch)
