"""The model registry: one spec per architecture, one way to name a model, tied names, PP stages,
and bytes per engine rank equal to the replica's own parameters."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import require_sglang
from p2pweights.cli import main
from p2pweights.errors import P2PWeightsError, UnsupportedLayout
from p2pweights.models import (
    BUILTIN,
    UnknownModel,
    load_config,
    model_spec,
    registered,
    resolve_model,
    spec_of,
    stage_hf_names,
    stage_layers,
    stage_of,
    writer_hf_names,
    writer_layers,
)
from p2pweights.models.checkpoint import checkpoint_tensors
from p2pweights.models.stages import area_writer, check_split, layer_writers

HERE = os.path.dirname(os.path.abspath(__file__))


# -- lookup ------------------------------------------------------------------------------------------
def test_each_architecture_has_one_spec_looked_up_by_its_hf_name():
    assert model_spec("Qwen3ForCausalLM").family == "qwen3"
    assert model_spec("Qwen3MoeForCausalLM").cost == "moe"
    assert model_spec("DeepseekV3ForCausalLM").cost == "mla"
    assert model_spec("Glm4MoeForCausalLM").checkpoint is not None
    assert all(spec.architecture == arch for arch, spec in registered().items())
    with pytest.raises(UnsupportedLayout, match="MambaForCausalLM.*Qwen3ForCausalLM"):
        model_spec("MambaForCausalLM")


@pytest.mark.parametrize("name", BUILTIN)
def test_every_built_in_resolves_and_has_a_checkpoint_schema(name):
    folder = resolve_model(name)
    assert os.path.isfile(os.path.join(folder, "config.json"))
    spec = spec_of(name)
    assert spec.checkpoint is not None and spec.cost is not None


def test_a_built_in_name_a_folder_and_a_config_json_read_the_same_config():
    folder = resolve_model("qwen3-0.6b")
    by_name, by_dir = load_config("qwen3-0.6b"), load_config(folder)
    assert by_name == by_dir == load_config(os.path.join(folder, "config.json"))
    assert resolve_model(folder) == folder
    assert by_name["architectures"] == ["Qwen3ForCausalLM"]


def test_an_unknown_model_is_one_line_listing_the_built_ins(tmp_path):
    with pytest.raises(UnknownModel) as caught:
        resolve_model("qwen3-0.6x")
    message = str(caught.value)
    assert isinstance(caught.value, P2PWeightsError) and "\n" not in message
    assert "'qwen3-0.6x'" in message and all(name in message for name in BUILTIN)
    with pytest.raises(UnknownModel):
        load_config(str(tmp_path))  # a folder without config.json


# -- every command names a model the same way ---------------------------------------------------------
def test_check_layout_takes_a_built_in_name(monkeypatch, capsys):
    """It used to hand the bare name to the replica: a FileNotFoundError traceback."""
    import p2pweights.replica.check as check

    seen = []

    class Result:
        rank, params_checked, bytes_checked, groups, largest_group_bytes, seconds = 0, 1, 2, 1, 2, 0.0
        equal, mismatches, dtypes = True, [], {}

        def to_json(self):
            return {"rank": self.rank}

    def fake_check_rank(config, engine, rank, **kwargs):
        seen.append((config, engine.describe(), rank))
        return Result()

    monkeypatch.setattr(check, "check_rank", fake_check_rank)
    rc = main(["check-layout", "--model", "qwen3-0.6b", "--engine", "tp=2", "--rank", "1", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["equal"] is True
    assert seen == [(resolve_model("qwen3-0.6b"), "tp=2", 1)]


@pytest.mark.parametrize("verb", ["check-layout", "demo", "plan"])
def test_every_command_answers_an_unknown_model_in_one_line_with_exit_code_2(verb):
    argv = {"check-layout": ["--engine", "tp=2"], "demo": [], "plan": ["--trainer", "gpus=2", "--engines", "1x2"]}[verb]
    import p2pweights  # the child imports the p2pweights this test imported (source tree or installed)

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(p2pweights.__file__))}
    done = subprocess.run([sys.executable, "-m", "p2pweights", verb, "--model", "qwen3-0.6x", *argv],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"p2pweights {verb}: error: --model: " in done.stderr and "qwen3-0.6b" in done.stderr


# -- tied names --------------------------------------------------------------------------------------
def test_tied_embeddings_tie_the_lm_head_to_the_embedding_and_leave_it_out_of_the_checkpoint():
    tied, untied = spec_of("qwen3-0.6b"), spec_of("qwen3-30b-a3b")
    assert tied.tied_names(load_config("qwen3-0.6b")) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert untied.tied_names(load_config("qwen3-30b-a3b")) == {}
    assert "lm_head.weight" not in checkpoint_tensors("qwen3-0.6b")
    assert "lm_head.weight" in checkpoint_tensors("qwen3-30b-a3b")


# -- PP stages ---------------------------------------------------------------------------------------
def _tiny_deepseek(layers=4, mtp=1):
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
        "moe_intermediate_size": 8, "num_hidden_layers": layers, "num_attention_heads": 2, "n_routed_experts": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 4, "q_lora_rank": 8,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "vocab_size": 64,
        "num_nextn_predict_layers": mtp, "torch_dtype": "bfloat16",
    }


def test_each_hf_tensor_belongs_to_exactly_one_pp_stage():
    config = _tiny_deepseek(layers=5)
    names = list(checkpoint_tensors(config))
    stages = [stage_hf_names(names, 5, s, 3) for s in range(3)]
    assert sorted(n for s in stages for n in s) == sorted(names)
    assert stage_layers(5, 3) == [(0, 1), (1, 3), (3, 5)]  # the last stages take the extra layers
    assert "model.embed_tokens.weight" in stages[0]
    assert {"model.norm.weight", "lm_head.weight"} <= set(stages[2])
    assert all(stage_of(n, 5, 3) == 2 for n in names if n.startswith("model.layers.5."))  # the MTP layer
    assert all(stage_of(n, 5, 3) == 1 for n in names if n.startswith(("model.layers.1.", "model.layers.2.")))
    assert stage_hf_names(names, 5, 0, 1) == names


@pytest.mark.parametrize("pp,writers", [(1, 2), (2, 2), (3, 4), (1, 7)])
def test_a_stages_layers_split_over_its_senders_give_every_hf_tensor_exactly_one_writer(pp, writers):
    """split="layers": a layer's tensors stay with one writer (its parameter groups never split),
    the embedding with the first writer of the first stage, the head and the MTP layer with the last
    of the last; a writer past the stage's layer count pushes nothing of the layers."""
    config = _tiny_deepseek(layers=5)
    names = list(checkpoint_tensors(config))
    mine = {(s, w): writer_hf_names(names, 5, s, pp, w, writers) for s in range(pp) for w in range(writers)}
    assert sorted(n for ns in mine.values() for n in ns) == sorted(names)
    for (s, _), ns in mine.items():
        assert set(ns) <= set(stage_hf_names(names, 5, s, pp))
    assert "model.embed_tokens.weight" in mine[(0, 0)]
    last = layer_writers(5, pp, pp - 1, writers)[0] - 1  # the last writer with layers (at most one per layer)
    assert {"model.norm.weight", "lm_head.weight"} <= set(mine[(pp - 1, last)])
    assert all(n in mine[(pp - 1, last)] for n in names if n.startswith("model.layers.5."))  # MTP
    for s in range(pp):
        bounds = writer_layers(5, pp, s, writers)
        for w, (a, b) in enumerate(bounds):
            layers = {int(n.split(".")[2]) for n in mine[(s, w)] if n.startswith("model.layers.")} - {5}
            assert layers == set(range(a, b))
    assert writer_hf_names(names, 5, 0, 1, 0, 1) == names


def test_senders_past_a_stages_layers_form_groups_and_every_area_writer_has_its_own_index():
    """7 senders of 3-layer stages: 3 writers x 2 groups of engine ranks; the 7th would write nothing
    and is refused naming the fix. Each engine rank's area has one part per stage's layer writer."""
    assert layer_writers(6, 2, 0, 7) == (3, 2) and layer_writers(6, 2, 1, 2) == (2, 1)
    assert [area_writer(6, 2, s, w, 7) for s in (0, 1) for w in range(3)] == [(k, 6) for k in range(6)]
    assert check_split("layers", 6, 5, 7, 0, 2) == "layers"
    with pytest.raises(ValueError, match="sender 6 of 7 would write nothing; make num_senders a multiple of 3"):
        check_split("layers", 6, 6, 7, 0, 2)
    assert check_split("engine_ranks", 6, 6, 7, 0, 2) == "engine_ranks"


# -- bytes per engine rank ---------------------------------------------------------------------------
@pytest.mark.parametrize("model,spec", [("qwen3", "tp=2"), ("qwen3_moe", "tp=4,ep=2,dp_attention=2")])
def test_bytes_per_engine_rank_equal_the_replicas_parameter_bytes(tmp_path, model, spec):
    require_sglang()
    from p2pweights.models.shapes import engine_rank_bytes, model_shape
    from p2pweights.replica import EngineLayout, ModelReplicas
    from replica_configs import write_config

    config = write_config(model, str(tmp_path))
    engine = EngineLayout.parse(spec)
    replica = ModelReplicas(cache_dir="").get(config, engine, engine.world_size - 1)
    assert engine_rank_bytes(model_shape(load_config(config)), engine).total == replica.total_nbytes
