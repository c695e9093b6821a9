"""The first update costs what later ones do (issue 24, item 6): an engine rank proves sglang's update
hooks at its start, in an empty session of its own, so its first begin and end do no proof work; a
loader that runs afterwards starts the proof over; hooks that change bytes keep running. Counts of
traced hook runs and verdicts, never timings."""
from __future__ import annotations

import pytest

from conftest import require_sglang
from p2pweights.receiver import start_engine
from p2pweights.receiver.rank_server import call_rank
from replica_configs import write_config


def _placed(name: str, tmp_path):
    require_sglang()
    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.receiver.region import place_parameters
    from p2pweights.replica import sglang_env

    sglang_env.prepare()
    model = sglang_env.build_model(write_config(name, str(tmp_path)), EngineLayout.parse("tp=2"), 0, device="meta")
    place_parameters(model)
    return model


def test_the_proof_at_start_is_the_first_sessions_and_a_loader_starts_it_over(tmp_path):
    from p2pweights.receiver.update_hooks import NO_OP, UNPROVEN, UpdateHooks

    model = _placed("qwen3", tmp_path)
    hooks = UpdateHooks([model], "cpu")
    assert hooks.prove_at_start() == NO_OP and hooks.traced == 2  # one empty session: its begin and its end, traced
    assert hooks.prove_at_start() == NO_OP and hooks.traced == 2  # proven once
    assert (hooks.begin(), hooks.end(loader_ran=False)) == (True, True) and hooks.traced == 2
    hooks.loader_ran()  # the broadcast path, outside a session
    assert hooks.verdict == UNPROVEN
    assert (hooks.begin(), hooks.end(loader_ran=False)) == (False, False) and hooks.traced == 4  # proven again
    assert hooks.verdict == NO_OP


def test_hooks_proven_to_change_bytes_at_start_keep_running_in_every_session(tmp_path):
    import torch

    from p2pweights.receiver.update_hooks import CHANGES, UpdateHooks

    model = _placed("deepseek_v3", tmp_path)  # post_load_weights derives w_kc / w_vc from kv_b_proj
    hooks = UpdateHooks([model], "cpu")
    assert hooks.prove_at_start() == CHANGES
    traced = hooks.traced
    attn = model.model.layers[0].self_attn
    assert hooks.begin() is False
    with torch.no_grad():
        attn.kv_b_proj.weight.normal_()  # what a session's writes do
    assert hooks.end(loader_ran=False) is False and hooks.traced == traced  # ran, untraced
    assert attn.w_kc.abs().sum() > 0  # derived from what was written: the hooks ran


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = write_config("qwen3", str(tmp_path_factory.mktemp("cfg")))
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="first")
    yield engine
    engine.close()


def test_a_rank_process_proves_before_it_reports_ready_and_its_first_begin_does_no_proof_work(engine):
    url = engine.ready[1]["control_url"]
    first = call_rank(url, 1, "begin", {})
    assert first["hooks"] == "skipped" and first["traced"] == 2, first  # the proof ran at start, not here
    assert call_rank(url, 1, "end", {})["hooks"] == "skipped"
    again = call_rank(url, 1, "begin", {})
    assert again == first, again  # no traced run since
    call_rank(url, 1, "end", {})
