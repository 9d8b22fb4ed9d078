"""``model.config`` as a ``_target_`` node naming one of transformers' configuration classes (upstream's form for a
proxy model built from scratch): the rule of the registry admits its constructor, and a tiny Qwen3-MoE built that
way trains through the CLI (in bf16 autocast with ``model.backend.gate_precision: float32``, which a model without
routers would refuse), and validation reads the model's layout from it; ``trust_remote_code: true`` in the file
stays refused (a config cannot ask for it)."""

from __future__ import annotations

import json

from llm_testing import LLAMA_CONFIG, validate_cli, write_config

from automodel.testing import read_jsonl, run_cli


def test_a_model_config_built_from_a_transformers_configuration_class_trains(tmp_path):
    vocab = json.loads(LLAMA_CONFIG.read_text())["vocab_size"]
    config = {"_target_": "transformers.models.qwen3_moe.configuration_qwen3_moe.Qwen3MoeConfig",
              "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": vocab, "hidden_size": 32,
              "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "rope_theta": 10000.0}
    path = write_config(tmp_path / "cfg.yaml", LLAMA_CONFIG, tmp_path / "ckpt",
                        model={"config": config, "trust_remote_code": True, "backend": {"gate_precision": "float32"}},
                        checkpoint={"enabled": False}, distributed={"mp_policy": {"param_dtype": "bf16"}})
    refused = run_cli("validate", "-c", path, cwd=tmp_path)
    assert refused.returncode == 2 and "model.trust_remote_code: true runs the Python code" in refused.stderr
    assert "model.config" not in refused.stderr  # the configuration class itself is admitted
    code, out = validate_cli(path, tmp_path, "--model.trust_remote_code", "false", "--nproc-per-node", "3",
                             "--distributed.strategy", "fsdp2", "--distributed.ep_size", "3")
    assert code == 2 and "distributed.ep_size: 3 does not divide the number of experts (4" in out  # read from it
    result = run_cli("finetune", "llm", "-c", path, "--model.trust_remote_code", "false",
                     "--step_scheduler.max_steps", "3", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "mixed precision (torch.autocast): params bf16" in result.stderr
    rows = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]


def test_upstreams_own_configuration_classes_stand_for_the_transformers_ones(tmp_path):
    """Upstream's model.config classes of models transformers ships (DeepSeek-V4, DeepSeek-V3.2, MiMo-V2-Flash)
    resolve to transformers' class of that model type, constructor and from_pretrained."""
    from transformers import DeepseekV4Config, DeepseekV32Config

    from automodel.config import instantiate
    from automodel.plugins.manager import get_plugin_manager

    resolver = get_plugin_manager().resolver()
    DeepseekV4Config(num_hidden_layers=3, num_nextn_predict_layers=1).save_pretrained(tmp_path)
    node = {"_target_": "nemo_automodel.components.models.deepseek_v4.config.DeepseekV4Config.from_pretrained",
            "pretrained_model_name_or_path": str(tmp_path), "num_nextn_predict_layers": 0}
    config = instantiate(node, resolver, "model.config")
    assert type(config) is DeepseekV4Config and config.num_hidden_layers == 3 and config.num_nextn_predict_layers == 0
    built = instantiate({"_target_": "nemo_automodel.components.models.deepseek_v32.config.DeepseekV32Config",
                         "num_hidden_layers": 2}, resolver, "model.config")
    assert type(built) is DeepseekV32Config and built.num_hidden_layers == 2
    built.save_pretrained(tmp_path / "v32")  # a key the class does not declare is kept, as from a config.json
    node = {"_target_": "nemo_automodel.components.models.deepseek_v32.config.DeepseekV32Config.from_pretrained",
            "pretrained_model_name_or_path": str(tmp_path / "v32"), "num_nextn_predict_layers": 0}
    read = instantiate(node, resolver, "model.config")
    assert type(read) is DeepseekV32Config and read.num_hidden_layers == 2 and read.num_nextn_predict_layers == 0
