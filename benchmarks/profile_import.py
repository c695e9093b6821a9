"""What a cold connect's sglang import costs, and why: ``python3 -X importtime`` of exactly what a
connect imports (``sglang_env.prepare()`` then a cold ``ModelReplicas`` build of every rank of the
layout, the first connect's "replicas" phase), grouped by package, in a fresh interpreter.

    PYTHONPATH=python python3 benchmarks/profile_import.py --model qwen3-4b --engine tp=2
    # A/B against another tree (e.g. a worktree of HEAD: git worktree add /tmp/p2pw-head HEAD):
    PYTHONPATH=python python3 benchmarks/profile_import.py --compare /tmp/p2pw-head/python --runs 3
    # on the H200, after run_on_device.sh's set-up lines (P2PW_SGLANG_IMPORT_AS_CPU=1 as there):
    python3 benchmarks/profile_import.py --model qwen3-4b --engine tp=2 --cuda-context --json $OUT/import.json
    # sglang's own share in a trainer that has transformers' modeling imported already:
    PYTHONPATH=python python3 benchmarks/profile_import.py --preimport transformers.modeling_utils

Per package group (``sglang.srt.layers``, ``torch._inductor``, ``transformers``, ``openai``, ...):
seconds of its own module bodies (importtime's "self"), modules imported, who pulled it in first
(the chain up to the first import the profile made), and whether any of its functions ran while the
replicas were built and probed ("used by build": a group never used there is imported for
inference only). Also: modules compiled from source because no valid .pyc was there (a bundle
unpacked without bytecode pays that on every import), and the slowest imports by cumulative time.
Timings come from runs without ``-X importtime`` (it adds its own overhead); ``--compare`` alternates
fresh processes of both trees and reports medians and their ratio, of wall and of CPU seconds (the
CPU seconds move less when other jobs share the cores). Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

MARK = "P2PW_IMPORT_MARK"
# The child: torch and p2pweights first (a trainer has them), then what a cold connect imports and builds.
CHILD = r"""
import json, os, sys, time
t = time.perf_counter()
import torch
t_torch = time.perf_counter() - t
t = time.perf_counter()
import p2pweights
from p2pweights.models import resolve_model
from p2pweights.replica import ModelReplicas, sglang_env
from p2pweights.models.engine_layout import EngineLayout
t_p2pw = time.perf_counter() - t
model, engine, cuda, trace = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
t = time.perf_counter()
for name in filter(None, sys.argv[5].split(",")):  # what the trainer has imported already (--preimport)
    __import__(name)
t_pre = time.perf_counter() - t
if cuda:  # a trainer's process has its CUDA context before it connects
    torch.empty(1, device="cuda"); torch.cuda.synchronize()
import importlib._bootstrap_external as ext
compiled = []
real_source_to_code = ext.SourceLoader.source_to_code
def source_to_code(self, data, path, *a, **k):  # only called when no valid .pyc is there
    t0 = time.perf_counter()
    try:
        return real_source_to_code(self, data, path, *a, **k)
    finally:
        compiled.append(time.perf_counter() - t0)
ext.SourceLoader.source_to_code = source_to_code
before = len(sys.modules)
print("P2PW_IMPORT_MARK", file=sys.stderr, flush=True)
t, c = time.perf_counter(), time.process_time()
sglang_env.prepare()
t_prepare, c_prepare = time.perf_counter() - t, time.process_time() - c
cfg = resolve_model(model)
layout = EngineLayout.parse(engine)
replicas = ModelReplicas(cache_dir="")
used = set()
def profiler(frame, event, arg):
    if event == "call":
        used.add(frame.f_globals.get("__name__", ""))
t = time.perf_counter()
if trace:
    sys.setprofile(profiler)
for rank in range(layout.world_size):
    replicas.get(cfg, layout, rank)
sys.setprofile(None)
t_build = time.perf_counter() - t
print("P2PW_IMPORT_CHILD " + json.dumps({
    "p2pweights": os.path.dirname(p2pweights.__file__), "torch_s": t_torch, "p2pweights_s": t_p2pw, "preimport_s": t_pre,
    "prepare_s": t_prepare, "prepare_cpu_s": c_prepare, "build_s": t_build, "replica_s": replicas.seconds,
    "modules_imported": len(sys.modules) - before, "compiled_from_source": len(compiled),
    "compile_s": sum(compiled), "used_by_build": sorted(used)}), flush=True)
"""
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def run_child(model: str, engine: str, *, python_dir: str | None = None, importtime: bool = False,
              cuda: bool = False, trace: bool = False, preimport: str = "") -> tuple[dict, str]:
    env = dict(os.environ)
    if python_dir:
        env["PYTHONPATH"] = python_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    args = [sys.executable] + (["-X", "importtime"] if importtime else []) + [
        "-c", CHILD, model, engine, "1" if cuda else "0", "1" if trace else "0", preimport]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(args, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=1800)
        err.seek(0)
        stderr = err.read()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("P2PW_IMPORT_CHILD ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the profiled process failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(lines[0].split(" ", 1)[1]), stderr


def group_of(module: str) -> str:
    """The package group a module is counted under: sglang three levels deep, torch and
    transformers two, anything else its top-level package."""
    parts = module.split(".")
    depth = 3 if parts[0] == "sglang" else 2 if parts[0] in ("torch", "transformers") else 1
    return ".".join(parts[:depth])


def parse_importtime(stderr: str) -> list[dict]:
    """importtime's rows after the child's mark, each with its parent's index (rows come children first)."""
    text = stderr.split(MARK, 1)[1] if MARK in stderr else stderr
    rows = [{"self_us": int(m[1]), "cumulative_us": int(m[2]), "depth": len(m[3]) // 2, "name": m[4]}
            for m in map(_LINE.match, text.splitlines()) if m]
    nearest: dict[int, int] = {}
    for i in range(len(rows) - 1, -1, -1):
        nearest[rows[i]["depth"]] = i
        rows[i]["parent"] = nearest.get(rows[i]["depth"] - 1)
    return rows


def chain(rows: list[dict], i: int) -> list[str]:
    out = [rows[i]["name"]]
    while rows[i]["parent"] is not None:
        i = rows[i]["parent"]
        out.append(rows[i]["name"])
    return out


def analyse(rows: list[dict], used_by_build: list[str], top: int) -> dict:
    used_groups = {group_of(m) for m in used_by_build if m}
    groups: dict[str, dict] = {}
    for i, r in enumerate(rows):
        g = groups.setdefault(group_of(r["name"]), {"self_s": 0.0, "modules": 0, "first": None})
        g["self_s"] += r["self_us"] / 1e6
        g["modules"] += 1
        if g["first"] is None:
            g["first"] = i
    out = []
    for name, g in groups.items():
        # the outermost row of this group's first import: walk up while the parent is still in the group
        i = g["first"]
        while rows[i]["parent"] is not None and group_of(rows[rows[i]["parent"]]["name"]) == name:
            i = rows[i]["parent"]
        pulled = chain(rows, i)[1:]
        out.append({"group": name, "self_s": g["self_s"], "modules": g["modules"],
                    "used_by_build": name in used_groups, "pulled_in_by": " <- ".join(pulled[:4])
                    + (" <- ..." if len(pulled) > 4 else "") if pulled else "(the profile itself)"})
    out.sort(key=lambda g: -g["self_s"])
    slowest = sorted(range(len(rows)), key=lambda i: -rows[i]["cumulative_us"])[:top]
    return {"groups": out[:max(top, 60)], "total_self_s": sum(r["self_us"] for r in rows) / 1e6, "modules": len(rows),
            "slowest": [{"module": rows[i]["name"], "cumulative_s": rows[i]["cumulative_us"] / 1e6,
                         "self_s": rows[i]["self_us"] / 1e6} for i in slowest]}


def table(result: dict, top: int) -> str:
    p = result["profile"]
    t = result["timings"]
    lines = [f"{result['model']} {result['engine']}: sglang import (prepare) {t['prepare_s']:.2f} s, replica build "
             f"+ probe {t['build_s']:.2f} s, {t['modules_imported']} modules, {t['compiled_from_source']} compiled "
             f"from source ({t['compile_s']:.2f} s); torch {t['torch_s']:.2f} s, p2pweights {t['p2pweights_s']:.2f} s"
             + (f", {result['preimport']} {t['preimport_s']:.2f} s" if result["preimport"] else "") + " before it",
             f"importtime: {p['modules']} modules, {p['total_self_s']:.2f} s of module bodies", "",
             f"{'group':<34}{'self s':>8}{'mods':>6}  {'build':<6} first pulled in by"]
    for g in p["groups"][:top]:
        lines.append(f"{g['group']:<34}{g['self_s']:>8.3f}{g['modules']:>6}  {'used' if g['used_by_build'] else '-':<6} "
                     f"{g['pulled_in_by']}")
    lines += ["", f"{'slowest imports (cumulative s)':<60}{'cum s':>8}{'self s':>8}"]
    lines += [f"{s['module']:<60}{s['cumulative_s']:>8.3f}{s['self_s']:>8.3f}" for s in p["slowest"][:top]]
    if "compare" in result:
        c = result["compare"]
        lines += ["", f"A/B, {c['runs']} fresh processes each, medians (s):",
                  f"{'tree':<40}{'import':>10}{'import CPU':>12}{'build':>10}{'import+build':>14}"]
        for name in ("before", "after"):
            r = c[name]
            lines.append(f"{r['p2pweights']:<40}{r['prepare_s']:>10.2f}{r['prepare_cpu_s']:>12.2f}{r['build_s']:>10.2f}"
                         f"{r['total_s']:>14.2f}")
        lines.append(f"{'after / before':<40}{c['ratio_prepare']:>10.2f}{c['ratio_prepare_cpu']:>12.2f}"
                     f"{c['ratio_build']:>10.2f}{c['ratio_total']:>14.2f}")
    return "\n".join(lines)


def compare(model: str, engine: str, before_dir: str, runs: int, cuda: bool, preimport: str) -> dict:
    samples: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(runs):  # alternate, so load on the machine hits both alike
        samples["before"].append(run_child(model, engine, python_dir=before_dir, cuda=cuda, preimport=preimport)[0])
        samples["after"].append(run_child(model, engine, cuda=cuda, preimport=preimport)[0])  # as installed
    out: dict = {"runs": runs}
    for name, rs in samples.items():
        out[name] = {"p2pweights": rs[0]["p2pweights"], "prepare_s": statistics.median(r["prepare_s"] for r in rs),
                     "prepare_cpu_s": statistics.median(r["prepare_cpu_s"] for r in rs),
                     "build_s": statistics.median(r["build_s"] for r in rs),
                     "total_s": statistics.median(r["prepare_s"] + r["build_s"] for r in rs),
                     "all_prepare_s": [r["prepare_s"] for r in rs], "all_build_s": [r["build_s"] for r in rs],
                     "modules_imported": rs[0]["modules_imported"]}
    for k in ("prepare", "prepare_cpu", "build", "total"):
        out[f"ratio_{k}"] = out["after"][f"{k}_s"] / out["before"][f"{k}_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-4b", help="built-in model name or config folder")
    p.add_argument("--engine", default="tp=2", help="engine layout whose every rank is built, e.g. tp=2")
    p.add_argument("--top", type=int, default=25, help="rows of each table")
    p.add_argument("--cuda-context", action="store_true", help="create the CUDA context first (as a trainer has it)")
    p.add_argument("--preimport", default="", metavar="MODULES",
                   help="comma-separated modules imported before the profile, as a trainer has them "
                        "(e.g. transformers.modeling_utils): what is left is sglang's own share")
    p.add_argument("--compare", metavar="PYTHON_DIR", help="A/B: the python/ folder of another tree (the 'before')")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per tree for --compare")
    p.add_argument("--json", metavar="FILE", help="also write the result there")
    a = p.parse_args(argv)
    # the p2pweights this interpreter imports (a checkout's python/ on PYTHONPATH, or an installed wheel)
    timings, _ = run_child(a.model, a.engine, cuda=a.cuda_context, preimport=a.preimport)
    traced, stderr = run_child(a.model, a.engine, importtime=True, cuda=a.cuda_context, trace=True,
                               preimport=a.preimport)
    result = {"model": a.model, "engine": a.engine, "preimport": a.preimport, "timings": timings,
              "profile": analyse(parse_importtime(stderr), traced["used_by_build"], a.top)}
    if a.compare:
        result["compare"] = compare(a.model, a.engine, a.compare, a.runs, a.cuda_context, a.preimport)
    print(table(result, a.top))
    print("P2PW_IMPORT " + json.dumps(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
