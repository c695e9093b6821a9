"""Safe updates from one sender (issue 14, items 5, 8 and 10): validate before pausing, roll back
when nothing was written, trainer inputs (tied names, DTensor, cast, NaN), versions that must
increase, the report as JSON, log lines and metrics.

Real receiver processes (sglang models) over Mooncake on loopback; the engine is asked what state
it is in after each failure.
"""
from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from p2pweights.control import FailurePolicy, SglangEngine
from p2pweights.errors import (
    EngineError,
    LayoutMismatch,
    NonFiniteTensor,
    P2PWeightsError,
    SenderGroupError,
    UnknownParameter,
    UnsupportedTensor,
    VersionRefused,
)
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import check_weights_equal, start_engines
from p2pweights.sender import WeightSender
from p2pweights.sender import metrics as sender_metrics
from p2pweights.sender.report import Progress
from replica_configs import write_config

GENERATING = "generating"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    # qwen3 here ties its word embeddings: lm_head.weight is not in the checkpoint the engine loads
    # (large enough that an update fills several 2 MiB slots: a failure can come after writes)
    return write_config("qwen3", str(tmp_path_factory.mktemp("safety")), hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, vocab_size=4096)


@pytest.fixture(scope="module")
def engine(cfg):
    (e,) = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix="safe")
    yield e
    e.close()


@pytest.fixture
def sender(cfg, engine):
    s = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
    s.connect([SglangEngine(engine.url, name=engine.name)])
    yield s
    s.close()


def _client(engine):
    return SglangEngine(engine.url, name=engine.name)


def _state(engine) -> str:
    """"generating" when the engine has no weight-update session open (the receiver's own word in
    /server_info); else its session's state ("open", "torn")."""
    c = SglangEngine(engine.url, name=engine.name)
    session = c.server_info().get("p2pw_weight_update")
    if session is not None:
        return GENERATING if session["state"] == "none" else session["state"]
    try:  # a receiver that does not say: begin is refused on a generating engine (and changes nothing)
        c.begin_weight_update()
    except EngineError as e:
        return GENERATING if "generation is running" in str(e) else str(e)
    c.end_weight_update()
    c.continue_generation()
    return "paused without a session"


def _tensors(cfg, seed):
    return list(random_checkpoint(checkpoint_tensors(cfg), seed))


def _full_update(sender, cfg, version, seed, **kw):
    with sender.update(version, **kw) as u:
        for name, t in _tensors(cfg, seed):
            u.push(name, t)
    return u.report


# -- item 5: validate before pausing, roll back when nothing was written ----------------------------
def test_a_bad_first_push_fails_before_the_engines_are_paused(sender, engine):
    before = _client(engine).weight_version()
    with pytest.raises(UnknownParameter, match="q_prj"):
        with sender.update("bad-first") as u:
            u.push("model.layers.0.self_attn.q_prj.weight", torch.zeros(1))
    assert _state(engine) == GENERATING
    assert _client(engine).weight_version() == before


def test_a_failure_after_the_pause_but_before_any_write_ends_the_session_and_resumes(sender, engine, cfg):
    before = _client(engine).weight_version()
    tensors = dict(_tensors(cfg, 1))
    with pytest.raises(LayoutMismatch, match="expects shape") as info:
        with sender.update("unwritten") as u:
            u.push("model.layers.0.self_attn.q_proj.weight", tensors["model.layers.0.self_attn.q_proj.weight"])
            assert _state(engine) != GENERATING  # the first good push paused the engine
            u.push("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, dtype=torch.bfloat16))
    assert u.times.slots == 0  # nothing reached the writer
    assert "nothing was written" in u.outcome and "generate again" in u.outcome
    assert any("generate again" in n for n in getattr(info.value, "__notes__", [u.outcome]))
    assert _state(engine) == GENERATING
    assert _client(engine).weight_version() == before


def test_on_failure_leave_paused_keeps_an_unwritten_update_paused_until_the_next_one(sender, engine, cfg):
    with pytest.raises(RuntimeError, match="trainer died"):
        with sender.update("kept", on_failure=FailurePolicy.LEAVE_PAUSED) as u:  # the enum, or its value
            u.push(*_tensors(cfg, 1)[0])
            raise RuntimeError("trainer died")
    assert "leave_paused" in u.outcome
    assert _state(engine) != GENERATING
    _full_update(sender, cfg, "kept-healed", 2)
    assert _state(engine) == GENERATING
    assert check_weights_equal(engine.url, hf_seed=2)["success"]


def test_a_failure_after_writes_leaves_the_engines_paused_says_so_and_the_next_update_heals(sender, engine, cfg):
    before = _client(engine).weight_version()
    items = _tensors(cfg, 3)
    with pytest.raises(RuntimeError, match="loss exploded") as info:
        with sender.update("torn") as u:
            for name, t in items[: len(items) - 2]:
                u.push(name, t)
            assert u.times.slots > 0  # slots went to the writer: bytes landed in the engine
            raise RuntimeError("loss exploded")
    assert "stay paused" in u.outcome and "heals" in u.outcome
    assert any("stay paused" in n for n in getattr(info.value, "__notes__", [u.outcome]))
    assert _state(engine) != GENERATING
    assert _client(engine).weight_version() == before
    report = _full_update(sender, cfg, "healed", 4)
    assert all(e.state == "ok" for e in report.engines)
    assert _state(engine) == GENERATING
    assert _client(engine).weight_version() == "healed"
    assert check_weights_equal(engine.url, hf_seed=4)["success"]


def test_pause_mode_is_an_argument_of_update(sender):
    with pytest.raises(ValueError, match="pause_mode"):
        sender.update("pm", pause_mode="sleep")
    with pytest.raises(ValueError, match="on_failure"):
        sender.update("pm", on_failure="pray")
    # no policy serves partly written weights (every engine refuses continue_generation inside a session)
    with pytest.raises(ValueError, match="on_failure must be one of resume_if_unwritten, leave_paused, got"):
        sender.update("pm", on_failure="continue_unfinished")


def test_a_split_the_sender_does_not_know_is_refused_at_construction(cfg):
    from p2pweights.sender import WeightSender

    with pytest.raises(ValueError, match="split must be one of 'engine_ranks', 'layers', got 'params'"):
        WeightSender(cfg, split="params")


# -- item 8: trainer inputs ---------------------------------------------------------------------------
def test_the_tied_lm_head_of_an_hf_state_dict_is_skipped_as_sglang_skips_it(sender, engine, cfg):
    tensors = _tensors(cfg, 5)
    embed = dict(tensors)["model.embed_tokens.weight"]
    with sender.update("tied") as u:
        for name, t in tensors:
            u.push(name, t)
        u.push("lm_head.weight", embed)  # HF's state_dict() lists the tied head too
    assert u.report.skipped == ["lm_head.weight"]
    assert check_weights_equal(engine.url, hf_seed=5)["success"]
    with pytest.raises(LayoutMismatch, match="tied"):  # still checked: a head of the wrong shape
        sender.update("tied-2").push("lm_head.weight", torch.zeros(3, 3, dtype=torch.bfloat16))
    assert _state(engine) == GENERATING


def test_an_fsdp2_dtensor_is_gathered_at_push(sender, engine, cfg):
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with sender.update("dtensor") as u:
            for name, t in _tensors(cfg, 6):
                u.push(name, distribute_tensor(t, mesh, [Shard(0)]) if t.dim() == 2 else t)
    finally:
        dist.destroy_process_group()
    assert check_weights_equal(engine.url, hf_seed=6)["success"]


def test_cast_turns_float32_inputs_into_the_checkpoint_dtype(sender, engine, cfg):
    tensors = _tensors(cfg, 7)
    name, t = tensors[0]
    with pytest.raises(LayoutMismatch, match="dtype"):
        sender.update("no-cast").push(name, t.float())  # refused before any pause
    assert _state(engine) == GENERATING
    assert "not paused" in sender._update.abort()  # the caller gives that update up
    with sender.update("cast", cast=True) as u:
        for name, t in tensors:
            u.push(name, t.float())  # bf16 -> f32 -> bf16 is exact
    assert check_weights_equal(engine.url, hf_seed=7)["success"]


@pytest.mark.parametrize("how", ["keyword", "env"])
def test_nan_is_refused_naming_the_tensor_before_any_write_and_the_engines_resume(cfg, engine, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("P2PW_CHECK_FINITE", "1")
    sender = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
    sender.connect([_client(engine)])
    try:
        before = _client(engine).weight_version()
        tensors = _tensors(cfg, 8)
        name, t = tensors[0]
        bad = t.clone()
        bad.view(-1)[7] = float("nan")
        kw = {"check_finite": True} if how == "keyword" else {}
        with pytest.raises(NonFiniteTensor, match=name.replace(".", r"\.")) as info:
            with sender.update(f"nan-{how}", **kw) as u:
                u.push(name, bad)
        assert info.value.parameter == name
        assert _state(engine) == GENERATING and _client(engine).weight_version() == before
        # mid-update: refused before anything of its group is written; pushing it right goes on
        with sender.update(f"nan-{how}-2", **kw) as u:
            for n, x in tensors[:-1]:
                u.push(n, x)
            last, x = tensors[-1]
            bad = x.clone()
            bad.view(-1)[0] = float("inf")
            with pytest.raises(NonFiniteTensor, match="NaN/Inf"):
                u.push(last, bad)
            u.push(last, x)
        assert check_weights_equal(engine.url, hf_seed=8)["success"]
    finally:
        sender.close()


def _without_dense_bytes(kind: str, t: torch.Tensor) -> torch.Tensor:
    if kind == "meta":
        return torch.empty_like(t, device="meta")
    if kind == "sparse_coo":
        return t.to_sparse()
    if kind == "sparse_csr":
        return t.reshape(t.shape[0], -1).to_sparse_csr() if t.dim() > 1 else t.to_sparse()
    if kind == "mkldnn":
        return t.float().to_mkldnn()
    return torch.nested.nested_tensor([t])  # nested


@pytest.mark.filterwarnings("ignore:(Sparse CSR tensor|The PyTorch API of nested tensors):UserWarning")
@pytest.mark.parametrize("kind", ["meta", "sparse_coo", "sparse_csr", "mkldnn", "nested"])
def test_a_tensor_without_dense_bytes_is_refused_at_push_naming_it_first_or_last(sender, engine, cfg, kind):
    if kind == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no MKL-DNN")
    tensors = _tensors(cfg, 11)
    before = _client(engine).weight_version()
    first, x = tensors[0]
    with pytest.raises(UnsupportedTensor, match=rf"{first.replace('.', '[.]')}.* is a .*nothing was staged") as info:
        with sender.update(f"{kind}-first") as u:
            u.push(first, _without_dense_bytes(kind, x))
    assert info.value.parameter == first and info.value.hint
    assert _state(engine) == GENERATING and _client(engine).weight_version() == before  # never paused
    # last: the engines are paused and every other group written; the refusal leaves the update whole
    with sender.update(f"{kind}-last") as u:
        for n, t in tensors[:-1]:
            u.push(n, t)
        last, x = tensors[-1]
        with pytest.raises(UnsupportedTensor, match=rf"{last.replace('.', '[.]')}.*(layout|device)") as info:
            u.push(last, _without_dense_bytes(kind, x))
        assert info.value.parameter == last
        u.push(last, x)
    assert _state(engine) == GENERATING and _client(engine).weight_version() == f"{kind}-last"
    assert check_weights_equal(engine.url, hf_seed=11)["success"]


def test_nan_passes_without_check_finite(sender, cfg):
    name, t = _tensors(cfg, 9)[0]
    bad = t.clone()
    bad.view(-1)[0] = float("nan")
    u = sender.update("nan-off")
    u.push(name, bad)  # staged: not checked
    assert "generate again" in u.abort()


def test_versions_must_increase_per_sender_and_against_the_engines(sender, engine, cfg):
    _full_update(sender, cfg, "5", 10)
    for version in ("4", "5", "5.0", ""):
        with pytest.raises(VersionRefused):
            sender.update(version)
    assert _state(engine) == GENERATING
    _full_update(sender, cfg, "10", 11)  # numerically after 5 (not as text)
    # a fresh sender (no history) is checked against the engine's current version
    fresh = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
    fresh.connect([_client(engine)])
    try:
        with pytest.raises(VersionRefused, match="engine") as info:
            fresh.update("9")
        assert info.value.engine == engine.name
        with pytest.raises(VersionRefused, match="empty"):
            fresh.update("  ", force=True)
        _full_update(fresh, cfg, "9", 12, force=True)  # the caller says so
        assert _client(engine).weight_version() == "9"
    finally:
        fresh.close()


# -- item 4 (in one process): several senders need their group ------------------------------------
def test_several_senders_with_control_and_no_group_are_refused_saying_pass_group(cfg, engine):
    s = WeightSender(cfg, sender_index=0, num_senders=2, transport="mooncake", buffer_size=1 << 20)
    s.connect([_client(engine)])
    try:
        with pytest.raises(SenderGroupError, match="group=") as info:
            s.update("no-group")
        assert "group" in (info.value.hint or "")
        assert _state(engine) == GENERATING
        s.update("no-group", control=False).abort()  # with a coordinator it is allowed
    finally:
        s.close()


def test_a_second_update_while_one_is_in_flight_is_refused(sender, cfg):
    first = sender.update("flight-1")
    with pytest.raises(P2PWeightsError, match="still in flight"):
        sender.update("flight-2")
    first.abort()
    sender.update("flight-2").abort()  # once it ended, the next one may start


# -- item 10: observability -------------------------------------------------------------------------
def test_report_to_dict_is_json_and_every_phase_logs_a_line(sender, engine, cfg, caplog):
    caplog.set_level(logging.INFO, logger="p2pweights.sender")
    report = _full_update(sender, cfg, "logged", 13)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["version"] == "logged" and d["bytes"] == report.bytes > 0
    assert d["engines"][0]["engine"] == engine.name and d["gbps"] == pytest.approx(report.gbps)
    assert set(d["control"]) >= {"pause_generation", "begin", "end_weight_update", "update_weight_version",
                                 "continue_generation"}
    lines = [r.getMessage() for r in caplog.records if r.name == "p2pweights.sender"]
    for phase in ("validated", "paused", "writes done", "ended, versioned and continued", "done in"):
        assert any(phase in line for line in lines), (phase, lines)
    assert any(f"{report.bytes} bytes" in line for line in lines)
    assert any("end_weight_update" in line and "update_weight_version" in line for line in lines)


def test_metrics_are_optional(cfg, engine):
    if sender_metrics.available():
        import prometheus_client as pc

        registry = pc.CollectorRegistry()
        s = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, metrics=registry)
        s.connect([_client(engine)])
        try:
            _full_update(s, cfg, "metrics", 14)
            with pytest.raises(RuntimeError):
                with s.update("metrics-failed") as u:
                    u.push(*_tensors(cfg, 14)[0])
                    raise RuntimeError("the trainer broke")
        finally:
            s.close()
        assert registry.get_sample_value("p2pw_update_bytes_total", {"engine": engine.name}) > 0
        assert registry.get_sample_value("p2pw_update_failures_total", {"engine": "sender 0"}) == 1
        assert registry.get_sample_value("p2pw_update_seconds_count") == 1
    else:  # without prometheus_client: a no-op, never an error
        assert sender_metrics.metrics_for(True) is None
        s = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, metrics=True)
        s.connect([_client(engine)])
        try:
            _full_update(s, cfg, "metrics", 14)
        finally:
            s.close()


def test_progress_goes_to_stderr_only_for_long_work():
    quiet, loud = io.StringIO(), io.StringIO()
    p = Progress("connect", 3, after=60, stream=quiet)
    p.step(1)
    p.done()
    assert quiet.getvalue() == ""
    p = Progress("connect", 3, after=0, every=0, stream=loud)
    p.step(1, "rank 0")
    p.done()
    assert "connect: 1/3" in loud.getvalue() and "3/3" in loud.getvalue()
