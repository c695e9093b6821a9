"""Connect checks from the engine's identity: same sglang build, a GPU architecture whose
post-processing the replica reproduces (any for BF16, Hopper only for FP8 block-quantized
checkpoints), resolved flags read from /server_info, and the engine layouts refused with their
reason (a running draft model, engine PP, MoE DP, attention CP, DCP) at connect and in check-layout.

Unit checks of replica.build_check and models.layout_refusals, then real receiver engines (their own
/server_info and publications), and a proxy of a real engine that answers a doctored /server_info
or publication (what an sglang server of another build, or on another GPU, would answer)."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from engine_proxy import PosingAs
from p2pweights.cli import main
from p2pweights.control import SglangEngine
from p2pweights.errors import EngineMismatch, UnsupportedLayout
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.receiver import ReceiverServer, start_engine
from p2pweights.replica.build_check import engine_identity, normalize_arch, replica_environment
from p2pweights.sender import WeightSender
from p2pweights.transport.publication import EnginePublication
from replica_configs import _COMMON, CONFIGS, write_config

MINE = replica_environment().sglang_version
BF16 = {**_COMMON, **CONFIGS["qwen3"]}
FP8 = {**_COMMON, **CONFIGS["deepseek_v3"],
       "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}
FP8_UE8M0 = {**FP8, "quantization_config": {**FP8["quantization_config"], "scale_fmt": "ue8m0"}}
FP8_B64 = {**FP8, "quantization_config": {**FP8["quantization_config"], "weight_block_size": [64, 64]}}
#: what sglang 0.5.23's /server_info says of an FP8 engine on Hopper (the keys connect reads)
FP8_HOPPER = {"version": MINE, "device": "cuda", "tp_size": 2, "moe_runner_backend": "auto",
              "moe_a2a_backend": "none", "fp8_gemm_runner_backend": "auto",
              "disable_shared_experts_fusion": False, "enforce_shared_experts_fusion": False}


def test_the_sender_knows_the_sglang_it_builds_replicas_with():
    import sglang

    assert MINE == sglang.__version__


@pytest.mark.parametrize("given, arch", [
    ("sm90", "sm90"), ("sm_90a", "sm90"), ("9.0", "sm90"), ("90", "sm90"), ((10, 0), "sm100"),
    ("SM100", "sm100"), ("gfx942:sramecc+:xnack-", "gfx942"), ("cpu", "cpu"), (None, None), ("", None),
])
def test_gpu_architectures_are_read_in_every_spelling(given, arch):
    assert normalize_arch(given) == arch


def test_a_word_that_is_no_architecture_is_refused():
    with pytest.raises(ValueError, match="not a GPU architecture"):
        normalize_arch("hopper")
    with pytest.raises(EngineMismatch, match="gpu_arch='hopper'"):
        engine_identity("e0", FP8_HOPPER, FP8, gpu_arch="hopper")


def test_a_receiver_rank_names_its_architecture_as_the_sender_reads_it(monkeypatch):
    import torch

    from p2pweights.receiver.build_report import device_arch

    assert device_arch("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0) if index == 1 else (10, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert device_arch("cuda:1") == "sm90" == normalize_arch(device_arch("cuda:1"))
    assert device_arch("cuda") == "sm100"

    class Mi300:
        gcnArchName = "gfx942:sramecc+:xnack-"

    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Mi300())
    assert device_arch("cuda:0") == "gfx942" == normalize_arch(device_arch("cuda:0"))


# ---- same build ------------------------------------------------------------------------------------------


def test_another_sglang_version_is_refused_naming_both():
    with pytest.raises(EngineMismatch) as info:
        engine_identity("e0", {"version": "0.5.22"}, BF16)
    e = info.value
    assert "engine e0 runs sglang 0.5.22" in str(e) and f"built with sglang {MINE}" in str(e)
    assert (e.engine, e.parameter) == ("e0", "version") and "sglang==0.5.22" in e.hint
    engine_identity("e0", {"version": MINE}, BF16)  # the same build passes
    engine_identity("e0", {"version": f"v{MINE}"}, BF16)


def test_an_engine_without_a_version_is_refused_for_fp8_and_warned_about_for_bf16():
    with pytest.warns(UserWarning, match="does not report its sglang version"):
        engine_identity("e0", {}, BF16)
    with pytest.raises(EngineMismatch, match="does not report its sglang version.*FP8"):
        engine_identity("e0", {k: v for k, v in FP8_HOPPER.items() if k != "version"}, FP8, gpu_arch="sm90")


def test_a_rank_of_another_build_is_refused_naming_the_rank():
    identity = engine_identity("e0", {"version": MINE}, BF16)
    identity.check_rank(0, "sm100", MINE)  # BF16: any architecture
    with pytest.raises(EngineMismatch) as info:
        identity.check_rank(3, "sm90", "0.5.22")
    assert info.value.rank == 3 and "rank 3 runs sglang 0.5.22" in str(info.value) and MINE in str(info.value)


# ---- same architecture: BF16 anywhere, FP8 on Hopper -----------------------------------------------------


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100", "gfx942", "cpu"])
def test_bf16_layouts_are_written_on_any_architecture(arch):
    assert engine_identity("e0", {"version": MINE, "p2pw_device_archs": {"0": arch}}, BF16).arch == arch


def test_fp8_on_hopper_is_accepted_from_an_override_or_the_receivers_report():
    assert engine_identity("e0", FP8_HOPPER, FP8, gpu_arch="9.0").arch == "sm90"
    reported = engine_identity("e0", {**FP8_HOPPER, "p2pw_device_archs": {"0": "sm90", "1": "sm90"}}, FP8)
    assert reported.arch == "sm90" and reported.fp8
    # a p2pweights receiver holding a GPU rank's layout in host memory (sglang's CUDA path, no DeepGEMM)
    assert engine_identity("e0", {**FP8_HOPPER, "p2pw_device_archs": {"0": "cpu"}}, FP8).arch == "cpu"


@pytest.mark.parametrize("config, arch, device, words", [
    (FP8_B64, "sm100", "cuda", r"requantizes the block scales to UE8M0.*weight_block_size \[64, 64\]"),
    (FP8_UE8M0, "sm100", "cuda", "scale_fmt is ue8m0"),
    (FP8, "sm120", "cuda", "Blackwell/SM12x"),
    (FP8, "sm80", "cuda", "Marlin"),
    (FP8, "gfx942", "cuda", "e4m3fnuz"),
    (FP8, "sm90", "cpu", "AMX"),  # sglang's own CPU engine
    (FP8, "sm90", "npu", "device 'npu'"),
])
def test_fp8_off_hopper_is_refused_saying_why(config, arch, device, words):
    with pytest.raises(EngineMismatch, match=words) as info:
        engine_identity("e0", {**FP8_HOPPER, "device": device}, config, gpu_arch=arch)
    assert info.value.engine == "e0" and "reproduces FP8 layouts only on sm90" in str(info.value)


def test_fp8_with_an_unknown_architecture_is_refused_telling_how_to_give_it():
    with pytest.raises(EngineMismatch, match="does not report its GPU architecture") as info:
        engine_identity("e0", FP8_HOPPER, FP8)
    assert "gpu_arch='sm90'" in info.value.hint


@pytest.mark.parametrize("flag", ["disable_shared_experts_fusion", "moe_runner_backend", "fp8_gemm_runner_backend"])
def test_fp8_flags_come_from_server_info_never_from_defaults(flag):
    with pytest.raises(EngineMismatch, match=f"does not report {flag}") as info:
        engine_identity("e0", {k: v for k, v in FP8_HOPPER.items() if k != flag}, FP8, gpu_arch="sm90")
    assert info.value.parameter == flag


@pytest.mark.parametrize("flag, value", [("moe_runner_backend", "flashinfer_trtllm"),
                                         ("moe_runner_backend", "cutlass"), ("moe_a2a_backend", "megamoe")])
def test_fp8_moe_backends_that_repack_experts_are_refused(flag, value):
    with pytest.raises(EngineMismatch, match=f"{flag}='{value}'"):
        engine_identity("e0", {**FP8_HOPPER, flag: value}, FP8, gpu_arch="sm90")


def test_architecture_reports_that_disagree_are_refused():
    with pytest.raises(EngineMismatch, match="rank 0: sm90, rank 1: sm100"):
        engine_identity("e0", {**FP8_HOPPER, "p2pw_device_archs": {"0": "sm90", "1": "sm100"}}, BF16)
    with pytest.raises(EngineMismatch, match="given gpu_arch=sm90, but its ranks report sm100"):
        engine_identity("e0", {**FP8_HOPPER, "p2pw_device_archs": {"0": "sm100"}}, FP8, gpu_arch="sm90")
    identity = engine_identity("e0", FP8_HOPPER, FP8, gpu_arch="sm90")
    with pytest.raises(EngineMismatch, match="rank 1 runs on sm100, but the engine client's gpu_arch says sm90"):
        identity.check_rank(1, "sm100", MINE)
    unknown = engine_identity("e0", {"version": MINE}, BF16)
    unknown.check_rank(0, "sm100", MINE)  # BF16: no architecture claimed, any is fine


# ---- layouts refused, with their reason -----------------------------------------------------------------


@pytest.mark.parametrize("args, parameter, words", [
    ({"pp_size": 2}, "pp_size", "keys each publication by tp_rank"),
    ({"moe_dp_size": 2}, "moe_dp_size", "from tp and ep only"),
    ({"attn_cp_size": 2}, "attn_cp_size", "attention TP becomes tp / \\(attn_dp x attn_cp\\)"),
    ({"dcp_size": 2}, "dcp_size", "no DCP group"),
    ({"speculative_algorithm": "EAGLE3"}, "speculative_algorithm", "draft roles are built for EAGLE and NEXTN"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/m", "model_path": "/m"},
     "speculative_algorithm", "draft roles are built for EAGLE and NEXTN"),
    ({"speculative_algorithm": "EAGLE", "speculative_token_map": "/m/map.pt"}, "speculative_token_map",
     "derived copy"),
    ({"speculative_algorithm": "EAGLE", "enable_multi_layer_eagle": True}, "enable_multi_layer_eagle",
     "multi-layer EAGLE"),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/draft", "model_path": "/m"},
     "speculative_draft_model_path", "separate draft checkpoint"),
    ({"speculative_algorithm": "EAGLE", "speculative_moe_runner_backend": "triton", "moe_runner_backend": "deep_gemm"},
     "speculative_moe_runner_backend", "draft's MoE layout would differ"),
    ({"speculative_algorithm": "EAGLE", "speculative_moe_a2a_backend": "deepep", "moe_a2a_backend": "none"},
     "speculative_moe_a2a_backend", "draft's MoE layout would differ"),
])
def test_engine_layouts_the_replica_cannot_build_are_refused_with_the_reason(args, parameter, words):
    with pytest.raises(UnsupportedLayout, match=words) as info:
        EngineLayout.from_server_info({"tp_size": 2, **args})
    assert info.value.parameter == parameter and parameter in str(info.value)


def test_a_draft_with_the_targets_own_backends_or_no_weights_is_not_refused_for_them():
    infos = [
        {"tp_size": 2, "speculative_algorithm": "NGRAM"},  # no draft weights
        {"tp_size": 2, "speculative_algorithm": None},
        # the target's own MTP layer with the target's backends: a draft role (tests/test_draft_roles.py)
        {"tp_size": 2, "speculative_algorithm": "EAGLE", "moe_runner_backend": "triton",
         "speculative_moe_runner_backend": "triton"},
        {"tp_size": 2, "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/m", "model_path": "/m"},
    ]
    for info in infos:
        layout = EngineLayout.from_server_info(info)
        # accepted as the engine runs: its ranks, and the algorithm that decides the draft role, kept
        assert layout.world_size == 2 and layout.get("speculative_algorithm") == info["speculative_algorithm"]
        assert layout.get("moe_runner_backend") == info.get("moe_runner_backend", "auto")


@pytest.fixture
def no_check_rank(monkeypatch):
    import p2pweights.replica.check as check

    def refuse(*args, **kwargs):
        raise AssertionError("check-layout checked a layout it must refuse (it would answer for the target only)")

    monkeypatch.setattr(check, "check_rank", refuse)


@pytest.mark.parametrize("engine, words", [
    # (a NEXTN draft of a model without one: tests/test_draft_roles.py, the model decides it)
    ("tp=2,speculative_algorithm=STANDALONE", "draft roles are built for EAGLE and NEXTN"),
    ("tp=2,speculative_algorithm=EAGLE3,speculative_num_steps=3", "draft roles are built for EAGLE and NEXTN"),
    ("tp=2,speculative_algorithm=EAGLE,speculative_token_map=/m/map.pt", "derived copy"),
    ("tp=2,pp=2", "PPMissingLayer"),
    ("tp=2,moe_dp_size=2", "MoE data parallelism"),
    ("tp=2,cp=2", "attention context parallelism"),
    ("tp=2,dcp_size=2", "decode context parallelism"),
])
def test_check_layout_refuses_what_connect_refuses_with_the_same_reason(no_check_rank, capsys, engine, words):
    assert main(["check-layout", "--model", "qwen3-0.6b", "--engine", engine, "--json"]) == 2
    err = capsys.readouterr().err
    assert words in err and "cannot honour it" not in err
    with pytest.raises(UnsupportedLayout) as info:  # connect's words are check-layout's
        EngineLayout.parse(engine)
    assert str(info.value) in err


# ---- real receiver engines ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("configs")))


@pytest.fixture(scope="module")
def engine(model):
    with start_engine(model, "tp=2", transport="mooncake", name="identity") as e:
        yield e


def test_the_sglang_version_is_read_in_one_place_for_the_sender_and_the_receiver():
    from p2pweights.models.sglang_version import sglang_version
    from p2pweights.receiver.build_report import server_identity

    assert replica_environment().sglang_version == sglang_version()  # what the sender's replicas are built with
    assert server_identity({})["version"] == sglang_version()        # what a receiver reports without ranks
    pkg = pathlib.Path(sglang_version.__wrapped__.__code__.co_filename).parents[1]
    readers = {str(f.relative_to(pkg)) for f in pkg.rglob("*.py")
               if re.search(r'(?<!\w)version\(\s*"sglang"\s*\)|sglang\.__version__', f.read_text())}
    assert readers == {"models/sglang_version.py"}


def test_doctor_reports_the_sglang_version_both_sides_read(monkeypatch):
    """doctor reads sglang's version through the same one lookup (models/sglang_version.py); a source
    tree that fails to import is reported, not raised."""
    from p2pweights.commands import doctor
    from p2pweights.models import sglang_version as sv

    monkeypatch.setattr(sv, "sglang_version", lambda: "0.0.0-from-the-one-lookup")
    assert doctor.collect()["sglang"] == "0.0.0-from-the-one-lookup"

    def broken() -> str:
        raise ImportError("a broken source tree")

    monkeypatch.setattr(sv, "sglang_version", broken)
    assert "a broken source tree" in doctor.collect()["sglang"]


def test_the_receiver_reports_its_sglang_version_and_each_ranks_architecture(engine):
    info = SglangEngine(engine.url).server_info()
    assert info["version"] == MINE
    assert info["p2pw_device_archs"] == {"0": "cpu", "1": "cpu"} and info["device"] == "cuda"
    for rank in (0, 1):
        pub = EnginePublication.from_json(SglangEngine(engine.url).transfer_engine_info(rank))
        assert (pub.device_arch, pub.sglang_version) == ("cpu", MINE)
        assert json.loads(pub.to_json())["device_arch"] == "cpu"


class _Doctored(PosingAs):
    """A real engine's server, except for what a test rewrites of its /server_info."""

    def __init__(self, real: str, info: dict):
        super().__init__(real)
        self.info = info

    def server_info(self) -> dict:
        return {**super().server_info(), **self.info}


def _serve(engine, info=None, doctor=None, ranks=2) -> ReceiverServer:
    """A server posing as ``engine``: its /server_info with ``info`` over it, and each rank's
    publication as ``doctor(rank, publication dict)`` leaves it."""
    server = ReceiverServer(_Doctored(engine.url, info or {})).start()
    for rank in range(ranks):
        d = EnginePublication.from_json(SglangEngine(engine.url).transfer_engine_info(rank)).to_dict()
        if doctor is not None:
            doctor(rank, d)
        peer, table = d.pop("remote_instance_transfer_engine_info")
        d.pop("rank", None)
        server.register_transfer_engine_info(rank, peer, table, d)
    return server


def _connect(config, engines):
    sender = WeightSender(config, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect(engines)
        return [(p.rank, len(p.targets)) for p in sender.prepared]
    finally:
        sender.close()


def test_a_bf16_engine_of_the_same_build_connects(model, engine):
    assert _connect(model, [SglangEngine(engine.url, name="same")]) == [(0, 1), (1, 1)]


def test_an_engine_of_another_sglang_version_is_refused_at_connect(model, engine):
    with _serve(engine, {"version": "0.5.22"}) as server:
        with pytest.raises(EngineMismatch) as info:
            _connect(model, [SglangEngine(server.url, name="older")])
    assert "engine older runs sglang 0.5.22" in str(info.value) and MINE in str(info.value)


def test_a_rank_publishing_another_sglang_version_is_refused_at_connect(model, engine):
    def older(rank, answer):
        if rank == 1:
            answer["sglang_version"] = "0.5.22"

    with _serve(engine, doctor=older) as server:
        with pytest.raises(EngineMismatch) as info:
            _connect(model, [SglangEngine(server.url, name="mixed")])
    assert info.value.rank == 1 and "rank 1 runs sglang 0.5.22" in str(info.value)


def test_an_fp8_checkpoint_into_a_blackwell_engine_is_refused_at_connect(engine):
    # sm100 takes 128x128 blocks with float32 scales (replayed: tests/test_sm100_updates.py), no other
    with _serve(engine, {"p2pw_device_archs": {"0": "sm100", "1": "sm100"}}) as server:
        with pytest.raises(EngineMismatch, match=r"runs on sm100.*UE8M0.*weight_block_size \[64, 64\]") as info:
            _connect(FP8_B64, [SglangEngine(server.url, name="b200")])
    assert info.value.engine == "b200"
    # an sglang server reports no architecture: told by the client, and refused the same way
    with _serve(engine, {"p2pw_device_archs": {}}) as server:
        with pytest.raises(EngineMismatch, match="does not report its GPU architecture"):
            _connect(FP8, [SglangEngine(server.url, name="sglang")])
        with pytest.raises(EngineMismatch, match="e4m3fnuz"):
            _connect(FP8, [SglangEngine(server.url, name="mi300", gpu_arch="gfx942")])


@pytest.mark.parametrize("doctored, words", [
    ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}, "Qwen3ForCausalLM is not supported"),
    ({"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}, "draft roles are built for EAGLE and NEXTN"),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/elsewhere"}, "separate draft checkpoint"),
    ({"speculative_algorithm": "EAGLE", "speculative_token_map": "/m/map.pt"}, "derived copy"),
    ({"pp_size": 2}, "pipeline parallelism"),
    ({"moe_dp_size": 2}, "MoE data parallelism"),
    ({"attn_cp_size": 2}, "attention context parallelism"),
    ({"dcp_size": 2}, "decode context parallelism"),
])
def test_an_engine_layout_the_replica_cannot_build_is_refused_at_connect(model, engine, doctored, words):
    with _serve(engine, doctored) as server:
        with pytest.raises(UnsupportedLayout, match=words):
            _connect(model, [SglangEngine(server.url, name="refused")])


# ---- an FP8 engine of the receiver (H1's tiny FP8 DeepSeek-V3): host-memory ranks of a GPU layout ---------


@pytest.fixture(scope="module")
def fp8_engine():
    from p2pweights.models import resolve_model

    model = resolve_model("deepseek-v3-fp8-tiny")
    with start_engine(model, "tp=1", transport="mooncake", name="fp8identity") as e:
        yield model, e


def test_an_fp8_checkpoint_connects_to_receiver_ranks_and_a_rank_on_blackwell_is_refused(fp8_engine):
    model, engine = fp8_engine
    info = SglangEngine(engine.url).server_info()
    assert info["p2pw_device_archs"] == {"0": "cpu"} and info["device"] == "cuda"
    assert _connect(model, [SglangEngine(engine.url, name="host")]) == [(0, 1)]

    def blackwell(rank, d):
        d["device_arch"] = "sm100"

    with _serve(engine, {"p2pw_device_archs": {}}, doctor=blackwell, ranks=1) as server:
        # the client says Hopper, the rank's own publication says Blackwell: the rank is believed
        with pytest.raises(EngineMismatch, match="rank 0 runs on sm100, but the engine client's gpu_arch says sm90"):
            _connect(model, [SglangEngine(server.url, name="b200", gpu_arch="sm90")])
        # no architecture for the engine in /server_info nor from the client: refused before any
        # replica is built, telling how to give it
        with pytest.raises(EngineMismatch, match="does not report its GPU architecture"):
            _connect(model, [SglangEngine(server.url, name="b200")])
