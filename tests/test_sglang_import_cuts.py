"""What a replica's sglang import leaves out, and that it leaves the rest of the process alone
(replica/sglang_imports.py; issue 17 item 3: the import is most of a cold connect).

The import runs in a fresh interpreter (this test process may have sglang imported already). That
the models built after it are unchanged is pinned by the byte-exact replica, copy-plan and
check-layout tests, which build through the same import.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import torch

from p2pweights.replica.sglang_imports import deferred_compile, sglang_imports
from replica_configs import write_config

FRESH_IMPORT = r"""
import json, sys, threading, time
import torch
emulated_gpu = lambda: True  # a GPU host's answer, to see which threads get the CPU one
torch.cuda.is_available = emulated_gpu
real_compile = torch.compile
seen_by_others = []
stop = threading.Event()
def poll():  # a trainer's thread (or the early-slots thread) while sglang imports
    while not stop.is_set():
        seen_by_others.append(torch.cuda.is_available())
        time.sleep(0.001)
poller = threading.Thread(target=poll); poller.start()
from p2pweights.replica import sglang_env
sglang_env.import_model_modules(sys.argv[1])
stop.set(); poller.join()
import sglang.srt.layers.rotary_embedding.utils as rotary
import sglang.utils
deferred = [n for n, v in vars(rotary).items() if hasattr(v, "__p2pw_deferred_compile__")]
loaded = dict(sys.modules)
import IPython
print("RESULT " + json.dumps({
    "inductor": "torch._inductor.compile_fx" in loaded, "ipython_during": "IPython" in loaded,
    "ipython_after_is_real": not vars(IPython).get("__p2pw_stub__", False) and hasattr(IPython, "get_ipython"),
    "sglang_utils_html_stubbed": type(sglang.utils.HTML).__name__ == "AnyAttribute",
    "compile_restored": torch.compile is real_compile,
    "is_available_restored": torch.cuda.is_available is emulated_gpu,
    "others_saw": sorted(set(seen_by_others)), "polls": len(seen_by_others),
    "deferred": deferred, "model_module": "sglang.srt.models.qwen3" in loaded}))
"""


def test_the_replica_import_skips_inductor_and_ipython_and_leaves_torch_and_ipython_as_they_were(tmp_path):
    cfg = write_config("qwen3", str(tmp_path), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       vocab_size=256)
    env = {**__import__("os").environ, "P2PW_SGLANG_IMPORT_AS_CPU": "1"}
    out = subprocess.run([sys.executable, "-c", FRESH_IMPORT, cfg], capture_output=True, text=True, timeout=600,
                         env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    r = json.loads(line[0][len("RESULT "):])
    assert r["model_module"]  # import_model_modules imported the config's architecture
    # the cuts: torch.compile's inductor backend and IPython were never imported
    assert r["inductor"] is False and r["ipython_during"] is False
    assert r["deferred"], "sglang's @torch.compile functions are wrapped, compiled at their first call"
    assert r["sglang_utils_html_stubbed"]
    # and the process is left as it was: a later `import IPython` is the real one, torch.compile and
    # torch.cuda.is_available are the process's own; the other thread never saw the import's "no CUDA"
    assert r["ipython_after_is_real"] and r["compile_restored"] and r["is_available_restored"]
    assert r["polls"] > 0 and r["others_saw"] == [True]


def test_the_import_context_applies_to_its_own_thread_only():
    real_available = torch.cuda.is_available
    seen: dict[str, object] = {}
    entered, leave = threading.Event(), threading.Event()

    def importer() -> None:
        with sglang_imports(as_cpu=True):
            seen["importer"] = (torch.cuda.is_available(), torch.compile(lambda x: x + 1, backend="eager"))
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=importer)
    t.start()
    assert entered.wait(30)
    try:
        seen["other"] = (torch.cuda.is_available(), torch.compile(lambda x: x + 1, backend="eager"))
    finally:
        leave.set()
        t.join()
    available, compiled = seen["importer"]
    assert available is False and hasattr(compiled, "__p2pw_deferred_compile__")
    other_available, other_compiled = seen["other"]
    assert other_available is real_available() and not hasattr(other_compiled, "__p2pw_deferred_compile__")
    assert torch.cuda.is_available is real_available


def test_a_deferred_compile_compiles_once_at_the_first_call_with_the_given_options():
    calls = []

    def real(fn, **options):
        calls.append(options)
        return torch.compile(fn, **options)

    @deferred_compile(real)(dynamic=False, backend="eager")
    def f(x):
        return x * 2 + 1

    assert calls == []  # nothing at decoration time: that is the import's saving
    x = torch.arange(6, dtype=torch.float32)
    assert torch.equal(f(x), x * 2 + 1) and torch.equal(f(x + 1), (x + 1) * 2 + 1)
    assert calls == [{"dynamic": False, "backend": "eager"}] and f.__name__ == "f"
    module = torch.nn.Linear(2, 2)
    assert deferred_compile(real)(module, backend="eager") is not module and len(calls) == 2  # modules: at once


def test_profile_import_reads_importtime_after_the_mark_as_a_tree_grouped_by_package():
    """benchmarks/profile_import.py's reading of ``-X importtime`` (the lead runs it on the H200)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "profile_import.py")
    spec = importlib.util.spec_from_file_location("profile_import", path)
    profile_import = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_import)
    code = "import sys, csv; print('P2PW_IMPORT_MARK', file=sys.stderr); import email.mime.text, json.decoder"
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True).stderr
    rows = profile_import.parse_importtime(err)
    names = [r["name"] for r in rows]
    assert "email.mime.text" in names and "csv" not in names  # only what came after the mark
    root = names.index("email.mime.text")
    assert rows[root]["parent"] is None  # imported by the profile itself
    child = next(i for i, r in enumerate(rows) if r["parent"] == root)
    assert profile_import.chain(rows, child)[-1] == "email.mime.text"
    result = profile_import.analyse(rows, ["email.message"], top=5)
    groups = {g["group"]: g for g in result["groups"]}
    assert groups["email"]["modules"] > 1 and groups["email"]["used_by_build"]
    assert not groups["json"]["used_by_build"]
    assert profile_import.group_of("sglang.srt.layers.linear") == "sglang.srt.layers"
    assert profile_import.group_of("torch._inductor.lowering") == "torch._inductor"
    assert profile_import.group_of("openai.types.responses") == "openai"
