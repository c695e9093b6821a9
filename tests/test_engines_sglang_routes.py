"""The client sends, and the receiver serves, exactly sglang 0.5.23's routes and request bodies.

Read from the installed sglang's own source (http_server.py's route table, io_struct.py's request
structs, engine_info_bootstrap_server.py's routes), parsed with ``ast``: in this minimal install
http_server.py cannot be imported (it needs uvloop) nor io_struct.py (torchvision).
"""
from __future__ import annotations

import ast
import importlib.util
import os

import pytest

from p2pweights.control import sglang as client
from p2pweights.control.sglang import SglangEngine
from p2pweights.receiver import server as receiver

spec = importlib.util.find_spec("sglang")
if spec is None or spec.origin is None:
    pytest.skip("sglang is not installed", allow_module_level=True)
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
    """class name -> {field: has_default} from io_struct.py, inherited fields included."""
    classes = {n.name: n for n in _parse("managers/io_struct.py").body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> dict[str, bool]:
        node = classes[name]
        out: dict[str, bool] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = stmt.value is not None
        return out

    return fields


class _Recorder:
    def __init__(self):
        self.sent: list[tuple[str, str, str, dict | None]] = []

    def __call__(self, method, base, target, body):
        self.sent.append((method, base, target, body))
        if target.startswith("/health"):
            return 200, b""
        return 200, b'{"success": true, "message": "ok"}'


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


def test_client_routes_are_sglangs_routes(sglang_routes, bootstrap_routes):
    for verb, (method, path, body_cls) in client.ROUTES.items():
        assert path in sglang_routes, f"{verb}: sglang 0.5.23 has no route {path}"
        methods, sglang_body = sglang_routes[path]
        assert method in methods, f"{verb}: sglang serves {path} with {methods}, not {method}"
        assert body_cls == sglang_body, f"{verb}: sglang's body for {path} is {sglang_body}, not {body_cls}"
    for verb, (method, path, _) in client.BOOTSTRAP_ROUTES.items():
        assert method in bootstrap_routes.get(path, set()), f"{verb}: the bootstrap server has no {method} {path}"


def test_client_bodies_use_sglangs_field_names(sglang_routes, io_structs, monkeypatch):
    engine = SglangEngine("http://10.0.0.9:30000", bootstrap_url="http://10.0.0.9:6789", name="e")
    plain = SglangEngine("http://10.0.0.9:30000", name="e")
    rec = _Recorder()
    monkeypatch.setattr(SglangEngine, "_send", lambda self, *a: rec(*a))
    _every_verb(engine)
    plain.transfer_engine_info(3)
    sent_paths = set()
    for method, base, target, body in rec.sent:
        path = target.split("?")[0]
        sent_paths.add(path)
        if base.endswith(":6789"):
            assert path == "/get_transfer_engine_info" and target.endswith("?rank=3")
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
        required = {f for f, has_default in fields.items() if not has_default}
        assert required <= set(body), f"{path}: sglang's {body_cls} requires {sorted(required - set(body))}"
    assert sent_paths >= {path for _, path, _ in client.ROUTES.values()}
    # the version bump never aborts requests (sglang's default would)
    (bump,) = [b for _, _, t, b in rec.sent if t == "/update_weight_version"]
    assert bump == {"new_version": "12", "abort_all_requests": False}
    assert io_structs("UpdateWeightVersionReqInput")["abort_all_requests"] is True  # sglang defaults to abort


def test_receiver_serves_sglangs_paths_with_sglangs_methods(sglang_routes, bootstrap_routes):
    for path, (methods, _) in receiver.ROUTES.items():
        assert path in sglang_routes, f"the receiver serves {path}, which sglang 0.5.23 does not have"
        assert set(methods) == sglang_routes[path][0], f"{path}: sglang allows {sglang_routes[path][0]}"
    for path, (methods, _) in receiver.BOOTSTRAP_ROUTES.items():
        assert set(methods) == bootstrap_routes[path]
    # everything the client can call, the receiver serves
    assert {path for _, path, _ in client.ROUTES.values()} <= set(receiver.ROUTES)
    assert {path for _, path, _ in client.BOOTSTRAP_ROUTES.values()} <= set(receiver.BOOTSTRAP_ROUTES)


def test_receiver_reads_sglangs_field_names(io_structs):
    """Every field the receiver reads from a body exists in sglang's struct, with sglang's default."""
    expected = {
        "PauseGenerationReqInput": {"mode"},
        "ContinueGenerationReqInput": {"torch_empty_cache"},
        "BeginWeightUpdateReqInput": {"selector"},
        "UpdateWeightVersionReqInput": {"new_version", "abort_all_requests"},
        "CheckWeightsReqInput": {"action", "allow_quant_error", "skip_tensor_list", "selector"},
        "GetWeightsByNameReqInput": {"name", "truncate_size"},
    }
    src = open(receiver.__file__).read()
    for cls, names in expected.items():
        fields = io_structs(cls)
        assert names <= set(fields), f"{cls}: {names - set(fields)} not in sglang"
        for n in names:
            assert f'"{n}"' in src, f"the receiver does not read {cls}.{n}"
