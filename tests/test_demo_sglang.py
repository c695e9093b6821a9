"""`p2pweights demo --engine-kind sglang`: the demo's P2P and broadcast steps against REAL sglang 0.5.23
servers (``python -m sglang.launch_server`` on the CPU through the plugin's ``p2pw_cpu`` platform,
publishing over Mooncake TCP on 127.0.0.1), every step checked with sglang's own ``/weights_checker``
checksums against sglang's own loader of the same tensors.

The last test runs the command itself as a subprocess (a tiny Qwen3, one tp=2 server, two senders,
two steps per mode: about 2 minutes on a loaded 2-core host); the others pin what it depends on: the
refusals, the checksum comparison, that the expected checksums tell two versions apart, and that the
broadcast baseline's group meets the group a real sglang rank makes (``init_custom_process_group``).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import require_sglang
from p2pweights import cli
from p2pweights.sglang_plugin.weight_checksums import differences
from replica_configs import write_config

DEMO_TIMEOUT_S = 1500  # two servers' worth of start-up on a host where other suites run servers too


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3 whose intermediate size tp=2 x 32 divides: a CPU sglang rank pads none of it."""
    return write_config("qwen3", str(tmp_path_factory.mktemp("demo_sglang")), intermediate_size=128)


@pytest.mark.parametrize("args, says", [
    (["--transport", "nixl"], "publishes each rank's weights as a Mooncake session only"),
    (["--engine", "tp=2,ep=2"], "--engine ep=2: demo --engine-kind sglang cannot honour it"),
    (["--model", "deepseek-v3-fp8-tiny"], "--engine-kind sglang takes BF16 models only"),
    (["--model", "TINY96", "--engine", "tp=2"], "pads intermediate_size 96 to a multiple of tp x 32 = 64"),
])
def test_what_real_sglang_servers_cannot_take_is_refused_before_anything_starts(args, says, capsys, tmp_path):
    args = [write_config("qwen3", str(tmp_path)) if a == "TINY96" else a for a in args]
    assert cli.main(["demo", "--engine-kind", "sglang", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_the_checksum_comparison_names_each_rank_and_parameter_that_differs():
    want = {0: {"a": "1", "b": "2", "c": "3"}, 1: {"a": "4"}}
    assert differences(want, want) == []
    got = {0: {"a": "1", "b": "x", "d": "5"}}
    assert differences(got, want) == ["rank 0: 3 parameters, 1 differ: b; 1 missing: c; 1 unexpected: d",
                                      "rank 1: not reported by the engine"]


def test_the_expected_checksums_tell_two_versions_apart_on_every_rank(tiny):
    require_sglang()
    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.sglang_plugin.weight_checksums import ExpectedChecksums

    expected = ExpectedChecksums(tiny, EngineLayout.parse("tp=2"))
    one, two = expected.of(1), expected.of(2)
    assert sorted(one) == [0, 1] and "model.layers.0.mlp.gate_up_proj.weight" in one[1]
    assert [line.split(":")[0:2] for line in differences(two, one)] == [  # every parameter of a version differs
        ["rank 0", " 18 parameters, 18 differ"], ["rank 1", " 18 parameters, 18 differ"]]
    assert expected.of(1) == one  # a reloaded reference gives the version's bytes again


def test_the_broadcast_group_meets_the_group_a_real_sglang_rank_makes():
    """sglang's own ``init_custom_process_group`` (what ``/init_weights_update_group`` runs in each rank)
    in a child process, the baseline's ``WeightUpdateGroup`` here: the tensor arrives. With the keys
    of a single ``PrefixStore(group_name)`` the two ends never met (the sender timed out)."""
    require_sglang()
    import torch
    import torch.distributed as dist

    from p2pweights.baseline.broadcast import WeightUpdateGroup

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, multi_tenant=True)
    rank = textwrap.dedent(f"""
        import torch
        from p2pweights.replica import sglang_env
        sglang_env.prepare()  # sglang's modules import under the replica's stubs
        from sglang.srt.utils.common import init_custom_process_group
        group = init_custom_process_group(backend="gloo", init_method="tcp://127.0.0.1:{store.port}", world_size=2,
                                          rank=1, group_name="p2pw_broadcast")
        got = torch.zeros(5)
        torch.distributed.broadcast(got, src=0, group=group)
        print(got.tolist())
    """)
    child = subprocess.Popen([sys.executable, "-c", rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        sender = WeightUpdateGroup("gloo", "127.0.0.1", store.port, 2, 0, "p2pw_broadcast", 300.0, store=store)
        sender.broadcast(torch.arange(5.0))
        out, err = child.communicate(timeout=300)
        sender.close()
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip() == "[0.0, 1.0, 2.0, 3.0, 4.0]", err[-3000:]


def test_the_demo_against_real_sglang_servers_is_equal_at_every_step(tiny):
    require_sglang()
    cmd = ["timeout", "-k", "30", str(DEMO_TIMEOUT_S), sys.executable, "-m", "p2pweights", "demo",
           "--engine-kind", "sglang", "--model", tiny, "--engines", "1", "--engine", "tp=2", "--senders", "2",
           "--steps", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S + 60,
                         env={**os.environ, "P2PW_TRANSPORT": "auto"})
    out = run.stdout
    assert run.returncode == 0, f"rc {run.returncode}\n{out[-4000:]}\n{run.stderr[-4000:]}"
    assert "1 sglang engine(s) x tp=2, 2 sender(s)" in out and "transport mooncake (engine kind sglang" in out, out[:2000]
    rows = re.findall(r"^\s*(p2p|broadcast)\s+(mooncake|gloo)\s+step (\d)\s.*equal: (\S+)", out, re.M)
    assert sorted((mode, step) for mode, _, step, _ in rows) == [
        ("broadcast", "1"), ("broadcast", "2"), ("p2p", "1"), ("p2p", "2")], out
    assert all(equal == "yes" for *_, equal in rows), out
    # the table: mode, transport, step, bytes/engine rank, bytes written, seconds, GB/s, equal
    table = re.findall(r"^\s*(p2p|broadcast)\s+(mooncake|gloo)\s+(\d)\s+\S+ \S+\s+\S+ \S+\s+[\d.]+\s+[\d.]+\s+(yes|NO|-)\b",
                       out, re.M)
    assert len(table) == 4 and all(row[3] == "yes" for row in table), out
