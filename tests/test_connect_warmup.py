"""``WeightSender(prepare=True)``: the first connect's imports and transport agent started at
construction (sender/warmup.py). A connect called before the warm-up ends waits for it and works; a
warm-up that failed raises its own error at connect. Each case is a fresh interpreter (sglang not
imported yet, as in a trainer), against a real engine of two sglang ranks over Mooncake on loopback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from p2pweights.receiver import start_engines
from replica_configs import write_config

SENDER = r"""
import json, sys, time
from p2pweights.control import SglangEngine
from p2pweights.replica import ModelReplicas, sglang_env
from p2pweights.sender import WeightSender
cfg, url, wait_first, cache = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
s = WeightSender(cfg, transport="mooncake", buffer_size=8 << 20, prepare=True, replicas=ModelReplicas(cache_dir=cache))
if wait_first:  # the trainer's own start-up, long enough for the warm-up to end
    while not s._warmup.done():
        time.sleep(0.05)
state = {"warmup_done_at_connect": s._warmup.done(), "prepared_at_connect": sglang_env.is_prepared(),
         "model_module_at_connect": "sglang.srt.models.qwen3" in sys.modules}
errors = []
for attempt in range(2):
    try:
        s.connect([SglangEngine(url, name="engine0")])
        errors.append(None)
        state["warmup_running_after_connect"] = s._warmup is not None and not s._warmup.done()
        break
    except Exception as e:
        errors.append({"type": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])})
s.close()
p = s.connect_phases
print("RESULT " + json.dumps({**state, "errors": errors, "counts": p.counts, "phases": sorted(p.seconds),
                              "overlapped": sorted(p.overlapped_seconds)}))
"""


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("warmup")), hidden_size=256, intermediate_size=768,
                        num_hidden_layers=2, vocab_size=16384)


@pytest.fixture(scope="module")
def engine(cfg):
    (e,) = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix="warmup")
    yield e
    e.close()


def _sender(cfg: str, url: str, *, wait_first: bool, env: dict | None = None, cache: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", SENDER, cfg, url, "1" if wait_first else "0", cache], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **(env or {})})
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


def test_a_connect_called_before_the_warm_up_ended_waits_for_it_and_connects(cfg, engine):
    r = _sender(cfg, engine.url, wait_first=False)
    assert r["warmup_done_at_connect"] is False  # the sglang import takes seconds: connect came first
    assert r["errors"] == [None]
    assert "waiting for warm-up" in r["phases"]
    # the replicas built as always; the agent made at construction is the one used (not a second)
    assert r["counts"]["replicas built"] == 2 and r["counts"]["agents created"] == 1
    assert r["counts"]["peer connects"] == 2 and r["overlapped"] == ["transport agent"]


def test_a_warm_up_that_ended_before_connect_has_imported_sglang_and_the_model_module(cfg, engine):
    r = _sender(cfg, engine.url, wait_first=True)
    assert r["warmup_done_at_connect"] and r["prepared_at_connect"] and r["model_module_at_connect"]
    assert r["errors"] == [None] and r["counts"]["replicas built"] == 2


def test_a_failed_warm_up_raises_its_own_error_at_connect_and_the_next_connect_tries_again(cfg, engine):
    # SGLANG_USE_CPU_ENGINE=1 makes sglang_env.prepare refuse (it would change the loaders' layouts)
    r = _sender(cfg, engine.url, wait_first=False, env={"SGLANG_USE_CPU_ENGINE": "1"})
    first, second = r["errors"]
    assert first["type"] == "UnsupportedLayout" and "SGLANG_USE_CPU_ENGINE" in first["message"]
    assert any("warm-up" in n for n in first["notes"])  # the warm-up's exception, not a second attempt's
    # not swallowed nor sticky: the next connect runs the import itself, and meets the same refusal
    assert second["type"] == "UnsupportedLayout" and not any("warm-up" in n for n in second["notes"])


def test_a_connect_from_the_disk_cache_does_not_wait_for_the_warm_up_it_does_not_need(cfg, engine, tmp_path):
    from p2pweights.control import SglangEngine
    from p2pweights.replica import ModelReplicas
    from p2pweights.sender import WeightSender

    with WeightSender(cfg, transport="mooncake", buffer_size=8 << 20,
                      replicas=ModelReplicas(cache_dir=str(tmp_path))) as s:  # the mappings, now on disk
        s.connect([SglangEngine(engine.url, name=engine.name)])
    r = _sender(cfg, engine.url, wait_first=False, cache=str(tmp_path))
    assert r["errors"] == [None] and r["counts"]["replica disk hits"] == 2 and r["counts"]["replicas built"] == 0
    # the import is not needed to connect from the cache: the connect neither waited nor ended it
    assert "waiting for warm-up" not in r["phases"] and r["warmup_running_after_connect"] is True


def test_a_connect_to_vllm_engines_only_neither_waits_for_nor_consumes_sglangs_warm_up():
    """The warm-up imports sglang; vLLM replicas need none of it (a vLLM-only trainer may have no sglang
    at all): such a connect leaves the warm-up, and its failure, to a later connect to sglang engines."""
    from types import SimpleNamespace

    from p2pweights.replica.vllm_layout import VllmLayout
    from p2pweights.sender import WeightSender

    class FailedWarmup:
        def done(self) -> bool:
            return True

        def wait(self) -> None:
            raise ModuleNotFoundError("No module named 'sglang'")

    sender = object.__new__(WeightSender)  # only what _wait_for_warmup reads
    sender._warmup = warmup = FailedWarmup()
    sender._wait_for_warmup([VllmLayout(tp=2)], [SimpleNamespace(engines=[0], engine_rank=1)])
    assert sender._warmup is warmup
