"""`p2pweights demo --churn` (issue "Elastic engine sets", item 5), run as a user runs it: a tiny
Qwen3, two receiver engines and one that joins; per step one event (restart, join, down, back,
leave) and one row per engine, every engine written checked byte for byte."""
from __future__ import annotations

import json
import subprocess
import sys

from replica_configs import write_config

TIMEOUT_S = 900


def test_the_churn_demo_writes_joins_restarts_and_returns_in_full_and_keeps_the_rest_deltas(tmp_path):
    tiny = write_config("qwen3", str(tmp_path), hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                        vocab_size=2048)
    run = subprocess.run([sys.executable, "-m", "p2pweights", "demo", "--churn", "--model", tiny, "--engines", "2",
                          "--engine", "tp=1", "--transport", "mooncake", "--json"],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"rc {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    rows = json.loads(run.stdout)["churn"]
    at = {(r["step"], r["engine"]): r for r in rows}
    assert {r["event"] for r in rows} == {"start", "restart", "join", "down", "back", "leave"}
    assert all(r["equal"] is not False for r in rows)
    written = {(s, e): at[(s, e)]["written"].split(":")[0] for s, e in at}
    assert [written[(1, e)] for e in ("engine0", "engine1", "engine2")] == ["full", "full", "not in the set"]
    assert [written[(2, e)] for e in ("engine0", "engine1")] == ["full", "delta"]  # engine0 restarted
    assert [written[(3, e)] for e in ("engine0", "engine1", "engine2")] == ["delta", "delta", "full"]  # joined
    assert [written[(4, e)] for e in ("engine0", "engine1", "engine2")] == ["delta", "skipped", "delta"]
    assert at[(4, "engine1")]["state"] == "down"
    assert [written[(5, e)] for e in ("engine0", "engine1", "engine2")] == ["delta", "full", "delta"]  # back
    assert written[(6, "engine2")] == "not in the set" and at[(6, "engine2")]["version"] == "churn5"
    assert at[(6, "engine0")]["version"] == at[(6, "engine1")]["version"] == "churn6"
    for (step, engine), r in at.items():
        if written[(step, engine)] in ("full", "delta"):
            assert r["equal"] is True and r["version"] == f"churn{step}", r
        if written[(step, engine)] == "delta":
            assert r["bytes_written"] < r["bytes"] / 4, r
