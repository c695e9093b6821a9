"""The route table (control.routes) is sglang 0.5.23's routes and request bodies; the client
sends exactly those. (That the receiver serves the same table: tests/test_control_protocol.py.)

Read from the installed sglang's own source (http_server.py's route table, io_struct.py's request
structs, engine_info_bootstrap_server.py's routes), parsed with ``ast``: in this minimal install
http_server.py cannot be imported (it needs uvloop) nor io_struct.py (torchvision).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os

import pytest

from conftest import require_sglang
from p2pweights.control import http, protocol, routes
from p2pweights.control.sglang import SglangEngine

require_sglang()  # skips without sglang; fails in CI
spec = importlib.util.find_spec("sglang")
SRT = os.path.join(os.path.dirname(spec.origin), "srt")


def _parse(relpath: str) -> ast.Module:
    with open(os.path.join(SRT, relpath)) as f:
        return ast.parse(f.read())


def _route_decorators(tree: ast.AST):
    """(path, methods, function) for every @app.get/post/put/api_route(...) in the tree."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            kind = dec.func.attr
            if not dec.args or not isinstance(dec.args[0], ast.Constant):
                continue
            path = dec.args[0].value
            if kind == "api_route":
                methods = next(ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods")
            elif kind in ("get", "post", "put", "delete"):
                methods = [kind.upper()]
            else:
                continue
            yield path, set(methods), fn


def _body_class(fn: ast.AST) -> str | None:
    """The request struct named in ``obj: Annotated[X, Body()]`` / ``Annotated[Optional[X], Body()]``."""
    for arg in fn.args.args:
        ann = arg.annotation
        if (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated"):
            first = ann.slice.elts[0]
            if isinstance(first, ast.Subscript):  # Optional[X]
                first = first.slice
            return first.id
    return None


@pytest.fixture(scope="module")
def sglang_routes():
    """path -> (methods, body class) from sglang's http_server.py."""
    table: dict[str, tuple[set, str | None]] = {}
    for path, methods, fn in _route_decorators(_parse("entrypoints/http_server.py")):
        old = table.get(path, (set(), None))
        table[path] = (old[0] | methods, _body_class(fn) or old[1])
    return table


@pytest.fixture(scope="module")
def bootstrap_routes():
    return {path: methods for path, methods, _ in _route_decorators(_parse("entrypoints/engine_info_bootstrap_server.py"))}


@pytest.fixture(scope="module")
def io_structs():
    """class name -> {field: default source text, or None when required} from io_struct.py,
    inherited fields included."""
    classes = {n.name: n for n in _parse("managers/io_struct.py").body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> dict[str, str | None]:
        node = classes[name]
        out: dict[str, str | None] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = ast.unparse(stmt.value) if stmt.value is not None else None
        return out

    return fields


class _Recorder:
    """Stands in for control.http.request: records each request, answers like sglang."""

    def __init__(self):
        self.sent: list[tuple[str, str, str, dict | None, dict | None]] = []

    def __call__(self, method, url, path, *, body=None, params=None, **_):
        self.sent.append((method, url, path, body, dict(params) if params else None))
        if path.startswith("/health"):
            return 200, None
        return 200, {"success": True, "message": "ok"}


def _every_verb(engine: SglangEngine) -> None:
    engine.health()
    engine.server_info()
    engine.model_info()
    engine.transfer_engine_info(3)
    engine.pause_generation()
    engine.pause_generation("retract")
    engine.begin_weight_update()
    engine.end_weight_update()
    engine.update_weight_version(12)
    engine.continue_generation()
    engine.weights_checker(action="compare", skip_tensor_list=["rotary_emb"])
    engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=5)
    engine.init_weights_update_group("10.0.0.1", 29500, 1, 5, group_name="g", backend="gloo")
    engine.update_weights_from_distributed(["model.norm.weight"], ["bfloat16"], [[64]], group_name="g",
                                           weight_version="3")
    engine.destroy_weights_update_group("g")
    engine.load_lora_adapter("a", "/adapters/a", pinned=True)
    engine.unload_lora_adapter("a")


def test_protocol_routes_are_sglangs_routes(sglang_routes, bootstrap_routes):
    """Every route of the table, with sglang's methods and sglang's body class."""
    for r in routes.ROUTES:
        if r.p2pw:  # p2pweights' own routes: a receiver serves them, sglang has none
            continue
        if r.bootstrap:
            assert r.method in bootstrap_routes.get(r.path, set()), f"the bootstrap server has no {r.method} {r.path}"
            assert set(r.methods) == bootstrap_routes[r.path]
            continue
        assert r.path in sglang_routes, f"{r.verb}: sglang 0.5.23 has no route {r.path}"
        methods, sglang_body = sglang_routes[r.path]
        assert r.method in methods and set(r.methods) == methods, f"{r.path}: sglang serves it with {methods}"
        assert r.sglang_body == sglang_body, f"{r.path}: sglang's body is {sglang_body}, not {r.sglang_body}"


def test_protocol_bodies_are_sglangs_structs(io_structs):
    """Each request body has exactly its sglang struct's fields (BaseReq's rid aside), with the same
    defaults and the same required fields."""
    bodies = {r.body for r in routes.ROUTES if r.body is not None and r.body.SGLANG}
    assert len(bodies) == 12  # LoadLoRAAdapterReq, UnloadLoRAAdapterReq: issue 38
    for cls in bodies:
        sglang = {k: v for k, v in io_structs(cls.SGLANG).items() if k not in ("rid", "http_worker_ipc")}
        ours = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("extra")}
        assert set(ours) == set(sglang), f"{cls.__name__}: fields {sorted(ours)} vs sglang's {sorted(sglang)}"
        for name, f in ours.items():
            if sglang[name] is None:
                assert f.default is dataclasses.MISSING, f"{cls.__name__}.{name} is required in sglang"
            else:
                assert f.default == ast.literal_eval(sglang[name]), f"{cls.__name__}.{name}: sglang's default is {sglang[name]}"
        for name, f in ours.items():  # a mode/selector list is sglang's Literal[...]
            if "choices" in f.metadata:
                assert io_structs(cls.SGLANG)[name] is not None
    assert protocol.PAUSE_MODES == _literal("PauseGenerationReqInput", "mode")
    assert protocol.SELECTORS == _literal("BeginWeightUpdateReqInput", "selector")


def _literal(cls_name: str, field: str) -> tuple:
    node = next(n for n in _parse("managers/io_struct.py").body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    ann = next(s.annotation for s in node.body if isinstance(s, ast.AnnAssign) and s.target.id == field)
    return tuple(ast.literal_eval(ann.slice))


def test_client_sends_every_route_with_sglangs_field_names(sglang_routes, io_structs, monkeypatch):
    engine = SglangEngine("http://10.0.0.9:30000", bootstrap_url="http://10.0.0.9:6789", name="e")
    plain = SglangEngine("http://10.0.0.9:30000", name="e")
    rec = _Recorder()
    monkeypatch.setattr(http, "request", rec)
    _every_verb(engine)
    plain.transfer_engine_info(3)
    sent_paths = set()
    for method, url, path, body, params in rec.sent:
        sent_paths.add(path)
        if url.endswith(":6789"):
            assert path == "/get_transfer_engine_info" and params == {"rank": 3}
            continue
        methods, body_cls = sglang_routes[path]
        assert method in methods
        if body_cls is None:
            assert body is None, f"{path} takes no body in sglang"
            continue
        assert body is not None, f"sglang requires a JSON body for {path} (send {{}} at least)"
        fields = io_structs(body_cls)
        unknown = set(body) - set(fields)
        assert not unknown, f"{path}: {sorted(unknown)} are not fields of sglang's {body_cls} {sorted(fields)}"
        required = {f for f, default in fields.items() if default is None}
        assert required <= set(body), f"{path}: sglang's {body_cls} requires {sorted(required - set(body))}"
    # every route a client calls, it called (the bootstrap PUT is the ranks' own, see receiver.server)
    assert sent_paths >= {r.path for r in routes.ROUTES if r.called and r.method != "PUT" and not r.p2pw}
    # the version bump never aborts requests (sglang's default would)
    (bump,) = [b for _, _, path, b, _ in rec.sent if path == "/update_weight_version"]
    assert bump == {"new_version": "12", "abort_all_requests": False}
    assert io_structs("UpdateWeightVersionReqInput")["abort_all_requests"] == "True"  # sglang defaults to abort
