"""``model.config`` as a ``_target_`` node naming one of transformers' configuration classes (upstream's form for a
proxy model built from scratch): the rule of the registry admits its constructor, and a tiny Qwen3-MoE built that
way trains through the CLI (in bf16 autocast with ``model.backend.gate_precision: float32``, which a model without
routers would refuse), and validation reads the model's layout from it; ``trust_remote_code: true`` in the file
stays refused (a config cannot ask for it)."""

from __future__ import annotations

import json

from llm_testing import LLAMA_CONFIG, validate_cli, write_config

from automodel.testing import read_jsonl, run_cli, run_cli_inprocess


def test_a_model_config_built_from_a_transformers_configuration_class_trains(tmp_path):
    vocab = json.loads(LLAMA_CONFIG.read_text())["vocab_size"]
    config = {"_target_": "transformers.models.qwen3_moe.configuration_qwen3_moe.Qwen3MoeConfig",
              "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": vocab, "hidden_size": 32,
              "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "rope_theta": 10000.0}
    path = write_config(tmp_path / "cfg.yaml", LLAMA_CONFIG, tmp_path / "ckpt",
                        model={"config": config, "trust_remote_code": True, "backend": {"gate_precision": "float32"}},
                        checkpoint={"enabled": False}, distributed={"mp_policy": {"param_dtype": "bf16"}})
    refused = run_cli_inprocess("validate", "-c", path, cwd=tmp_path)
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


def test_validation_reads_the_model_from_upstreams_configuration_class_path(tmp_path):
    """Validation's model checks read the config of upstream's own class path as of transformers' class: a
    DeepSeek-V4 (no SDPA attention in transformers) asked for SDPA is refused there, not when it is built."""
    node = {"_target_": "nemo_automodel.components.models.deepseek_v4.config.DeepseekV4Config",
            "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 512}
    path = write_config(tmp_path / "cfg.yaml", LLAMA_CONFIG, tmp_path / "ckpt",
                        model={"config": node, "backend": {"attn": "sdpa"}})
    code, out = validate_cli(path, tmp_path)
    assert code == 2 and "model.backend.attn: 'sdpa': DeepseekV4ForCausalLM has no sdpa attention" in out, out
    assert validate_cli(path, tmp_path, "--model.backend.attn", "eager")[0] == 0


def test_upstreams_kimi_linear_config_class_reads_the_checkpoint_config_and_its_kda_keys_act_or_are_refused(tmp_path):
    """Upstream's KimiLinear48BConfig.from_pretrained (model.config of its Kimi-Linear-48B-A3B configs) reads the
    checkpoint's config.json (its linear_attn_config block included) as transformers' KimiLinearConfig, and a tiny
    Kimi Linear trains through the CLI; the kda_* keys that describe transformers' torch attention act, the CUDA
    kernels are refused at validation."""
    vocab = json.loads(LLAMA_CONFIG.read_text())["vocab_size"]
    checkpoint = tmp_path / "kimi"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": vocab,
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 8, "num_experts": 4, "num_experts_per_token": 2,
        "num_shared_experts": 1, "first_k_dense_replace": 1, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2,
        "linear_attn_config": {"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1],
                               "full_attn_layers": [2]}}))
    upstream = {"_target_": "nemo_automodel.components.models.kimi_linear.config.KimiLinear48BConfig.from_pretrained",
                "pretrained_model_name_or_path": str(checkpoint), "name_or_path": "moonshotai/Kimi-Linear-48B-A3B",
                "kda_mode": "chunk", "kda_unpad_inputs": True, "kda_use_fused_gate": True,
                "kda_use_qk_l2norm_in_kernel": True}
    path = write_config(tmp_path / "cfg.yaml", LLAMA_CONFIG, tmp_path / "ckpt",
                        model={"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config", "config": upstream},
                        checkpoint={"enabled": False})
    code, out = validate_cli(path, tmp_path)
    assert code == 2, out
    for key in ("kda_unpad_inputs", "kda_use_fused_gate"):
        assert f"model.config.{key}: True: true" in out and "need a CUDA GPU" in out
    assert "kda_mode" not in out and "kda_use_qk_l2norm_in_kernel" not in out
    code, out = validate_cli(path, tmp_path, "--model.config.kda_mode", "fused_recurrent")
    assert "model.config.kda_mode: 'fused_recurrent'" in out
    result = run_cli("finetune", "llm", "-c", path, "--model.config.kda_unpad_inputs", "false",
                     "--model.config.kda_use_fused_gate", "false", "--step_scheduler.max_steps", "2", cwd=tmp_path,
                     OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert [row["step"] for row in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1, 2]


def test_a_key_of_a_model_config_mapping_that_nothing_reads_is_refused(tmp_path):
    """transformers keeps any keyword as a config attribute: a misspelt key of the ``model.config`` mapping (by
    ``model_type``, a configuration class, a sub-config) is refused at validation with the key it resembles; the
    keys transformers' code reads (declared or not: ``rope_theta``, T5's ``decoder_start_token_id``) pass."""
    qwen3_moe = {"_target_": "transformers.models.qwen3_moe.configuration_qwen3_moe.Qwen3MoeConfig",
                 "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
                 "rope_theta": 10000.0, "rms_norm_eps": 1.0e-6, "num_expert": 4}
    llama = {"model_type": "llama", "hidden_size": 32, "num_hiden_layers": 2, "rope_theta": 10000.0}
    llava = {"model_type": "llava", "image_token_index": 5, "text_config": {"model_type": "llama", "hiden_size": 32}}
    expected = {"model.config.num_expert": "(did you mean 'num_experts'?)",
                "model.config.num_hiden_layers": "(did you mean 'num_hidden_layers'?)",
                "model.config.text_config.hiden_size": "(did you mean 'hidden_size'?)"}
    for (key, words), config in zip(expected.items(), (qwen3_moe, llama, llava), strict=True):
        path = write_config(tmp_path / "cfg.yaml", LLAMA_CONFIG, tmp_path / "ckpt", model={"config": config})
        code, out = validate_cli(path, tmp_path)
        assert code == 2 and f"{key}: " in out and "no transformers code for" in out and words in out, out
        assert "rope_theta" not in out and "architectures" not in out and "rms_norm_eps" not in out
    t5 = {"model_type": "t5", "d_model": 32, "num_layers": 1, "decoder_start_token_id": 0}
    from automodel.config_reads import config_mapping_issues

    assert config_mapping_issues(t5) == {}
    for_model = {"_target_": "transformers.AutoConfig.for_model", "model_type": "llama", "vocab_sise": 482}
    assert "(did you mean 'vocab_size'?)" in config_mapping_issues(for_model)["config.vocab_sise"]
    assert config_mapping_issues({**t5, "num_layer": 1}).keys() == {"config.num_layer"}


def test_upstreams_topk_method_passes_where_it_names_what_transformers_router_does():
    """GLM-4.7-Flash's router in transformers always corrects its scores by bias and picks by groups (noaux_tc)
    without reading topk_method: upstream's noaux_tc passes, another method is refused; a router without that
    correction (Qwen3-MoE) reads no such key at all."""
    from automodel.config_reads import config_mapping_issues

    glm = {"_target_": "transformers.models.glm4_moe_lite.configuration_glm4_moe_lite.Glm4MoeLiteConfig",
           "n_routed_experts": 8, "n_group": 1, "topk_group": 1}
    assert config_mapping_issues({**glm, "topk_method": "noaux_tc"}) == {}
    assert "its router always picks its experts with the score-correction bias" in \
        config_mapping_issues({**glm, "topk_method": "greedy"})["config.topk_method"]
    qwen = {"model_type": "qwen3_moe", "topk_method": "noaux_tc"}
    assert "no transformers code for qwen3_moe reads it" in config_mapping_issues(qwen)["config.topk_method"]
