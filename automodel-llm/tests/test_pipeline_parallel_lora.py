"""LoRA under pipeline parallelism through the CLI on CPU ranks (gloo): ``peft:`` (every linear layer but the head)
on a tiny 2-layer Llama cut into two stages (``distributed.pp_size: 2``, 1F1B) trains with the per-step losses and
gradient norms of one process (two micro-batches accumulated per step); the adapter it saves, written from both
stages' shards, loads with ``peft.PeftModel.from_pretrained`` and gives the one process's merged weights and logits;
its step-3 checkpoint resumes in one process with the uninterrupted run's losses. Interleaved schedules (several
stages per rank) with LoRA are refused by ``automodel validate``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from llm_testing import (
    SIX_STEPS,
    fsdp2_ranks_with,
    grad_norms,
    losses,
    run_finetune,
    validate_cli,
    write_config,
    write_two_layer_llama_config,
)

STEPS = [*SIX_STEPS, "--step_scheduler.grad_accumulation_steps", "2"]
LORA = {"dim": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The one-process LoRA run and the pp=2 one (1F1B), six steps each with checkpoints after steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("pp_lora")
    config = write_config(tmp / "cfg.yaml", write_two_layer_llama_config(tmp), tmp / "ckpt", peft=LORA)
    run_finetune(config, tmp, tmp / "one", *STEPS)
    log = run_finetune(config, tmp, tmp / "pp2", *STEPS, *fsdp2_ranks_with("pp_size"),
                       "--distributed.pipeline.pp_schedule", "1f1b")
    assert "LoRA r=4 alpha=8 (pipeline stage 0)" in log and "pipeline stage 0 of 2 on this rank" in log
    return {"config": config, "model": tmp / "config.json", "one": tmp / "one", "pp2": tmp / "pp2", "tmp": tmp}


def test_lora_pp2_trains_like_one_process(runs):
    assert len(losses(runs["one"])) == 6
    assert losses(runs["pp2"]) == pytest.approx(losses(runs["one"]), rel=1e-4)
    assert grad_norms(runs["pp2"]) == pytest.approx(grad_norms(runs["one"]), rel=1e-4)


def test_lora_pp2_adapter_loads_in_peft_with_the_one_process_weights_and_logits(runs):
    """Both stages' adapters, under peft's names, in one adapter_model.safetensors (the head has none)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(runs["model"]))
    tokens = torch.randint(0, base.config.vocab_size, (2, 12))
    merged, logits = {}, {}
    for name in ("one", "pp2"):
        model = PeftModel.from_pretrained(copy.deepcopy(base), runs[name] / "epoch_0_step_6" / "model")
        adapters = [k for k in model.state_dict() if "lora_B" in k]
        assert any("layers.0." in k for k in adapters) and any("layers.1." in k for k in adapters)
        assert not any("lm_head" in k for k in adapters)
        with torch.no_grad():
            logits[name] = model(tokens).logits
        merged[name] = model.merge_and_unload().state_dict()
    assert merged["pp2"].keys() == merged["one"].keys()
    for key, value in merged["one"].items():
        assert (merged["pp2"][key] - value).abs().max().item() < 1e-5, key
    assert (logits["pp2"] - logits["one"]).abs().max().item() < 1e-5


def test_a_lora_pp2_checkpoint_resumes_in_one_process(runs, tmp_path):
    again = tmp_path / "again"
    log = run_finetune(runs["config"], tmp_path, again, *STEPS, "--restore_from.path",
                       runs["pp2"] / "epoch_0_step_3")
    assert "written by 2 ranks, resuming on 1" in log
    assert losses(again) == pytest.approx(losses(runs["one"])[3:], rel=1e-4)


def test_interleaved_schedules_with_lora_are_refused(runs, tmp_path):
    code, out = validate_cli(runs["config"], tmp_path, *fsdp2_ranks_with("pp_size"),
                             "--distributed.pipeline.pp_schedule", "interleaved1f1b")
    assert code == 2 and "Traceback" not in out
    assert "distributed.pipeline.pp_schedule: interleaved1f1b with LoRA (peft)" in out
    code, out = validate_cli(runs["config"], tmp_path, *fsdp2_ranks_with("pp_size"))
    assert code == 0, out
