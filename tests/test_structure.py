"""The package's shape: no import cycles, layers that import only downward (nothing imports the CLI or
the demo), small modules. The architecture is drawn in docs/architecture.md; this pins it."""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python"
PKG = ROOT / "p2pweights"

# Lower layers never import higher ones. A module's layer is that of its first-level package.
LAYERS = [
    {"errors", "settings", "_native"},
    {"models", "transport", "control", "front"},
    {"planner", "replica", "copyplans", "deltas", "engine"},
    {"sender", "receiver", "baseline", "sglang_plugin", "vllm_backend"},
    {"benchmarking", "commands", "cli", "__main__"},
]
MAX_LINES = 500

# Imports of the package's own modules inside functions, and why each stays there. They are still
# edges of the cycle and layer checks above (``_imports`` reads function bodies), so none can hide
# a cycle; this list keeps them few and explained. Every other import is at module level.
LAZY_IMPORTS = {
    # the CLI imports every command module to build its parser: a command's imports run when it runs
    "p2pweights.commands.check_layout": "start-up: the CLI parser",
    "p2pweights.commands.demo": "start-up: the CLI parser",
    "p2pweights.commands.demo_run": "start-up: the CLI parser",
    "p2pweights.commands.demo_churn": "start-up: the CLI parser",
    "p2pweights.commands.demo_vllm": "start-up: the CLI parser",
    "p2pweights.commands.doctor": "start-up: the CLI parser; doctor must report a broken import, not die of it",
    "p2pweights.commands.serve": "start-up: the CLI parser",
    "p2pweights.benchmarking.transport_vs_vendor": "each vendor's transport is imported only when its row runs",
    "p2pweights.transport": "Mooncake and NIXL import their vendor library: only the one chosen is loaded",
    # ``import p2pweights`` reaches the sender; replica/ (sglang_env, probe, roles, ...: ~0.1 s of modules, no
    # sglang) loads only when a sender is built, connects or warms up
    "p2pweights.sender.warmup": "start-up: replica/ loads on the warm-up thread, not at `import p2pweights`",
    "p2pweights.sender.adapter_bytes": "start-up: replica/ and sglang's LoRA code load at an adapter's first update",
    "p2pweights.sender.weight_sender": "start-up: replica/ loads at WeightSender() and connect, not at `import p2pweights`",
    "p2pweights.sglang_plugin": "every sglang process imports it: cpu_platform (torch, sglang's platforms) only on a "
                                "host without CUDA, sessions (starlette, the session keeper) only in the HTTP process",
}

# Modules that read a name (not a submodule) from the package root ``p2pweights`` although the root
# imports them (its ``__init__`` imports the sender, which reaches them): the root is half-initialized
# while they load, so that import only works inside a function, a cycle the checks above cannot see
# (they skip edges to a module's own ancestors). Each entry is a gap to close, not a reason to keep.
ROOT_NAME_IMPORTS_TO_REMOVE: dict[str, str] = {}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(ROOT).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return mods


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only; never imported)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _lazy_table(node: ast.AST) -> list[str] | None:
    """The relative module names of a ``_LAZY = {name: ".module"}`` table (replica/, receiver/), else
    None: each is imported on first use by name, so each is an edge like an import statement."""
    if (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_LAZY"]
            and isinstance(node.value, ast.Dict)):
        return [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return None


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in _runtime_nodes(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif _lazy_table(node) is not None:  # a package's ``_LAZY`` exports: modules named by strings
                targets = [m + module for module in _lazy_table(node)]
            elif isinstance(node, ast.ImportFrom):
                base = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and t.startswith("p2pweights") and not m.startswith(t + "."):
                    edges[m].add(t)
    return edges


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package root re-exports the public API
    for i, layer in enumerate(LAYERS):
        if parts[1] in layer:
            return i
    raise AssertionError(f"{module}: first-level name {parts[1]!r} is in no layer of tests/test_structure.py")


def test_no_import_cycles():
    edges = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_layers_import_only_downward():
    upward = []
    for m, targets in _imports(_modules()).items():
        lm = _layer(m)
        for t in targets:
            lt = _layer(t)
            if lm is not None and lt is not None and lt > lm:
                upward.append(f"{m} -> {t}")
    assert not upward, "imports into a higher layer: " + ", ".join(sorted(upward))


def test_nothing_imports_the_cli_or_the_demo():
    bad = [f"{m} -> {t}" for m, ts in _imports(_modules()).items() for t in ts
           if (t.startswith("p2pweights.commands") or t == "p2pweights.cli")
           and not (m.startswith("p2pweights.commands") or m in ("p2pweights.cli", "p2pweights.__main__"))]
    assert not bad, ", ".join(bad)


def test_modules_stay_small():
    big = {m: f.read_text().count("\n") for m, f in _modules().items()}
    big = {m: n for m, n in big.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by job): {big}"


def test_the_extension_has_a_type_stub():
    assert any(PKG.glob("_native*.pyi")), "python/p2pweights/_native.pyi is missing"


def test_every_declared_pytest_marker_is_used():
    project = ROOT.parent
    # read without tomllib (Python 3.11+; pyproject allows 3.10): the markers array is one of plain strings
    pyproject = (project / "pyproject.toml").read_text()
    block = re.search(r"^\[tool\.pytest\.ini_options\]$.*?^markers = (\[.*?^\])$", pyproject, re.M | re.S)
    assert block, "pyproject.toml: [tool.pytest.ini_options] markers = [...] not found"
    declared = [m.split(":")[0].strip() for m in ast.literal_eval(block.group(1))]
    assert declared, "no pytest markers read from pyproject.toml"
    sources = "".join(p.read_text() for d in ("tests", "benchmarks") for p in (project / d).rglob("*.py"))
    unused = [m for m in declared if not re.search(rf"pytest\.mark\.{m}\b", sources)]
    assert not unused, f"markers declared in pyproject.toml and never used: {unused}"


def test_the_sender_is_importable_from_the_package_root():
    import p2pweights
    from p2pweights.sender.weight_sender import WeightSender

    assert p2pweights.WeightSender is WeightSender and "WeightSender" in p2pweights.__all__
    assert [name for name in p2pweights.__all__ if not hasattr(p2pweights, name)] == []


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_no_receiver_module_imports_or_names_the_broadcast_baseline():
    """The broadcast path reaches an engine rank only as a BroadcastReceiver it is given: of the
    receiver's modules only the rank process's entry point (rank_process.py, which picks it by
    --broadcast-receiver) imports p2pweights.baseline, and none names it in a string (importlib, ``-m``,
    a ``mod:attr`` default), which would hide the dependency from the checks above. Docstrings may."""
    mods = _modules()
    edges = _imports(mods)
    offenders = [f"{m} imports {e}" for m in mods if m.startswith("p2pweights.receiver")
                 and m != "p2pweights.receiver.rank_process" for e in edges[m] if e.startswith("p2pweights.baseline")]
    for m, path in mods.items():
        if not m.startswith("p2pweights.receiver"):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        offenders += [f"{path.name}:{n.lineno} names {n.value!r}" for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                      and re.search(r"\bp2pweights\.baseline\b", n.value)]
    assert not offenders, offenders


def _function_level_imports() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for m, f in _modules().items():
        for fn in ast.walk(ast.parse(f.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("p2pweights"))
                            or isinstance(node, ast.Import) and any(a.name.startswith("p2pweights") for a in node.names)):
                        found.setdefault(m, []).append(f"{f.name}:{node.lineno}")
    return found


def test_imports_inside_functions_are_the_listed_few():
    """No function-level import of the package's own modules dodges a cycle: each module that has
    one is listed in LAZY_IMPORTS with its reason (start-up time, a vendor library, sglang)."""
    unlisted = {m: where for m, where in _function_level_imports().items() if m not in LAZY_IMPORTS}
    assert not unlisted, f"imports inside functions (move them to module level, or list why): {unlisted}"
    stale = sorted(set(LAZY_IMPORTS) - set(_function_level_imports()))
    assert not stale, f"LAZY_IMPORTS lists modules without a function-level import: {stale}"


def test_no_two_modules_share_a_name():
    """One name, one job: a module's file name appears once in the package (a package and a
    module of one name count too: ``replica/`` and a ``replica/replica.py`` would be two names for two things)."""
    seen: dict[str, list[str]] = {}
    for m in _modules():
        name = m.rsplit(".", 1)[-1]
        if name not in ("__init__", "__main__") and m != "p2pweights":
            seen.setdefault(name, []).append(m)
    twice = {n: ms for n, ms in seen.items() if len(ms) > 1}
    assert not twice, f"module names used twice: {twice}"


def test_every_lazy_package_export_names_a_module_that_defines_it():
    """replica/ and receiver/ export names lazily (their modules import sglang): each entry of their
    ``_LAZY`` table names an existing module of the package that defines the name, and the module
    is a real edge for the checks above (a module named by a string is imported here)."""
    import importlib

    for package in ("p2pweights.replica", "p2pweights.receiver"):
        pkg = importlib.import_module(package)
        for name, module in pkg._LAZY.items():
            assert f"{package}{module}" in _modules(), f"{package}._LAZY[{name!r}] names {module}, which does not exist"
            assert getattr(importlib.import_module(module, package), name) is getattr(pkg, name)


def _reached_from_the_root(edges: dict[str, set[str]]) -> set[str]:
    seen, todo = {"p2pweights"}, ["p2pweights"]
    while todo:
        for t in edges[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def test_no_module_the_root_imports_reads_a_name_from_the_root():
    """``from .. import __version__`` in a module that ``p2pweights/__init__.py`` itself reaches is an
    import cycle hidden from test_no_import_cycles (edges to a module's own ancestors are skipped
    there); submodules of the root (``from .. import _native``, ``errors``) are ordinary edges."""
    mods = _modules()
    reached = _reached_from_the_root(_imports(mods))
    offenders = {}
    for m, f in mods.items():
        if m == "p2pweights" or m not in reached:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
            stem = (".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
                    if node.level else node.module or "")
            names = [a.name for a in node.names if stem == "p2pweights" and a.name != "_native"
                     and f"p2pweights.{a.name}" not in mods]
            if names:
                offenders.setdefault(m, []).append(f"{f.name}:{node.lineno} {', '.join(names)}")
    new = {m: where for m, where in offenders.items() if m not in ROOT_NAME_IMPORTS_TO_REMOVE}
    assert not new, f"names read from the package root by modules the root imports (a hidden cycle): {new}"
    fixed = sorted(set(ROOT_NAME_IMPORTS_TO_REMOVE) - set(offenders))
    assert not fixed, f"ROOT_NAME_IMPORTS_TO_REMOVE lists modules that no longer read from the root: {fixed}"
