"""`p2pweights demo --lora R` (issue "LoRA adapters"), run as a user runs it: a tiny Qwen3, one receiver
engine of tp=2 with sglang's LoRA pool; step 1 writes the adapter whole, later steps are deltas; every
step's slots equal sglang's own load of the same adapter files on every rank."""
from __future__ import annotations

import json
import subprocess
import sys

from replica_configs import write_config

TIMEOUT_S = 900


def _demo(tiny: str, *extra: str) -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "p2pweights", "demo", "--lora", "4", "--model", tiny, "--engines", "1",
                          "--engine", "tp=2", "--transport", "mooncake", "--steps", "3", "--json", *extra],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"rc {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(run.stdout)["lora"]


def test_the_lora_demo_writes_the_adapter_whole_then_as_deltas_byte_exact(tmp_path):
    tiny = write_config("qwen3", str(tmp_path))
    rows = _demo(tiny, "--changed-fraction", "0")  # unchanged steps: a delta writes nothing
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["equal"] is True for r in rows)
    assert rows[0]["written"] == "full" and rows[0]["bytes_written"] == rows[0]["bytes"] > 0
    assert all(r["written"] == "delta" and r["bytes_written"] == 0 for r in rows[1:])
    assert all(r["merged_bytes"] > r["bytes"] for r in rows)
    rows = _demo(tiny, "--changed-fraction", "0.5")  # every block changes: written whole, still a delta session
    assert all(r["equal"] is True for r in rows)
    assert rows[1]["written"] == "delta" and rows[1]["bytes_written"] == rows[1]["bytes"]
