"""LoRA under tensor parallelism through the CLI on CPU ranks (gloo): ``distributed.tp_size: 2`` with ``peft:`` on
every projection of a tiny Llama (column-wise q/k/v/gate/up, row-wise o/down) trains with the per-step losses of
one process, with and without sequence parallelism, and its saved adapter loads in peft with the one process's
values and exports merged as the one process's does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_testing import losses, run_finetune, write_config, write_two_layer_llama_config

from automodel.testing import run_cli

STEPS = ["--step_scheduler.max_steps", "4", "--dataloader.batch_size", "2", "--dataloader.shuffle", "false",
         "--step_scheduler.checkpoint_interval", "4"]
TP2 = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2", "--distributed.tp_size", "2"]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT = {"_target_": "nemo_automodel.components._peft.lora.PeftConfig", "target_modules": PROJECTIONS, "dim": 4,
        "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tp_lora")
    config = write_config(tmp / "cfg.yaml", write_two_layer_llama_config(tmp), tmp / "ckpt", peft=PEFT)
    run_finetune(config, tmp, tmp / "one", *STEPS)
    log = run_finetune(config, tmp, tmp / "tp2", *STEPS, *TP2)
    assert "lora_B" in log  # the plan the build logs names the sharded adapter matrices
    log = run_finetune(config, tmp, tmp / "tp2_sp", *STEPS, *TP2, "--distributed.sequence_parallel", "true",
                       "--eval_generation.enabled", "false")
    assert "tensor parallel over tp 2, sequence parallel" in log
    return {"one": tmp / "one", "tp2": tmp / "tp2", "tp2_sp": tmp / "tp2_sp", "config": tmp / "config.json"}


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_lora_tp2_has_the_losses_of_one_process(runs, layout):
    one, tp2 = losses(runs["one"]), losses(runs[layout])
    assert len(one) == 4 and tp2 == pytest.approx(one, rel=1e-4)


def test_lora_tp2_adapter_loads_in_peft_and_equals_one_process(runs):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    adapters = {}
    for name in ("one", "tp2", "tp2_sp"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(runs["config"]))
        model = PeftModel.from_pretrained(base, runs[name] / "epoch_0_step_4" / "model")
        adapters[name] = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert any("o_proj.lora_A" in k for k in adapters["one"]) and any("q_proj.lora_B" in k for k in adapters["one"])
    for layout in ("tp2", "tp2_sp"):
        assert adapters[layout].keys() == adapters["one"].keys()
        assert any(v.abs().sum() > 0 for k, v in adapters[layout].items() if "o_proj.lora_B" in k)
        for key, value in adapters["one"].items():
            assert torch.allclose(adapters[layout][key], value, atol=1e-5), (layout, key)


def test_the_tp2_checkpoint_exports_the_merged_model_of_one_process(runs, tmp_path):
    """``automodel export`` rebuilds the base in its one process: the run's layout (tp_size 2 on two ranks, in the
    checkpoint's config.yaml) is not checked against it."""
    from safetensors.torch import load_file

    merged = {}
    for name in ("one", "tp2"):
        result = run_cli("export", runs[name] / "epoch_0_step_4", tmp_path / name, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        merged[name] = load_file(str(tmp_path / name / "model.safetensors"))
    assert merged["tp2"].keys() == merged["one"].keys() and not any("lora_" in key for key in merged["one"])
    for key, value in merged["one"].items():
        assert torch.allclose(merged["tp2"][key], value, atol=1e-5), key


@pytest.mark.slow
def test_lora_on_gathering_projections_and_the_head_tp2_has_the_losses_of_one_process(tmp_path):
    """Phi-3's plan shards its fused ``qkv_proj`` / ``gate_up_proj`` column-wise with the output gathered
    (``colwise_gather_output``) and ``o_proj`` / ``down_proj`` row-wise on a replicated input
    (``rowwise_split_input``): the adapters take those styles (the head's too) and train as in one process."""
    import json

    from llm_testing import LLAMA_CONFIG
    from transformers import Phi3Config

    ids = {key: json.loads(LLAMA_CONFIG.read_text()).get(key) for key in ("vocab_size", "bos_token_id",
                                                                          "eos_token_id", "pad_token_id")}
    Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False, **ids).save_pretrained(tmp_path)
    peft = {**PEFT, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]}
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "config.json", tmp_path / "ckpt", peft=peft)
    run_finetune(config, tmp_path, tmp_path / "one", *STEPS)
    log = run_finetune(config, tmp_path, tmp_path / "tp2", *STEPS, *TP2)
    assert "qkv_proj.lora_B" in log and "lm_head.lora_B" in log  # sharded with their base layers
    one, tp2 = losses(tmp_path / "one"), losses(tmp_path / "tp2")
    assert len(one) == 4 and tp2 == pytest.approx(one, rel=1e-4)
