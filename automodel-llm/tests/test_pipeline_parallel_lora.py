"""LoRA under pipeline parallelism through the CLI on CPU ranks (gloo): ``peft:`` (every linear layer but the head) on a
tiny 2-layer Llama cut into two stages (``distributed.pp_size: 2``, 1F1B) trains with the per-step losses and gradient
norms of one process (two micro-batches accumulated per step). Its output head is tied to its input embedding, which
LoRA keeps frozen: the last stage's head is a copy of the first stage's embedding; the adapter it saves, written from
both stages' shards, loads with ``peft.PeftModel.from_pretrained`` and gives the one process's merged weights and
logits; its step-3 checkpoint resumes in one process with the uninterrupted run's losses. With the interleaved 1F1B
schedule (two stages per rank) a 4-layer Llama trains and saves its adapter like one process too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from llm_testing import (
    SIX_STEPS,
    fsdp2_ranks_with,
    grad_norms,
    losses,
    run_finetune,
    write_config,
    write_two_layer_llama_config,
)

STEPS = [*SIX_STEPS, "--step_scheduler.grad_accumulation_steps", "2"]
LORA = {"dim": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The one-process LoRA run and the pp=2 one (1F1B), six steps each with checkpoints after steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("pp_lora")
    config = write_config(tmp / "cfg.yaml", write_two_layer_llama_config(tmp, tied=True), tmp / "ckpt", peft=LORA)
    run_finetune(config, tmp, tmp / "one", *STEPS)
    log = run_finetune(config, tmp, tmp / "pp2", *STEPS, *fsdp2_ranks_with("pp_size"),
                       "--distributed.pipeline.pp_schedule", "1f1b")
    assert "LoRA r=4 alpha=8 (pipeline stage 0)" in log and "pipeline stage 0 of 2 on this rank" in log
    assert "the output head (tied to the input embedding) is the first stage's embedding" in log
    return {"config": config, "model": tmp / "config.json", "one": tmp / "one", "pp2": tmp / "pp2", "tmp": tmp}


def test_lora_pp2_trains_like_one_process(runs):
    assert len(losses(runs["one"])) == 6
    assert losses(runs["pp2"]) == pytest.approx(losses(runs["one"]), rel=1e-4)
    assert grad_norms(runs["pp2"]) == pytest.approx(grad_norms(runs["one"]), rel=1e-4)


def test_lora_pp2_adapter_loads_in_peft_with_the_one_process_weights_and_logits(runs):
    """Both stages' adapters, under peft's names, in one adapter_model.safetensors (the head has none)."""
    last = "epoch_0_step_6"
    assert_same_adapter(runs["model"], runs["pp2"] / last / "model", runs["one"] / last / "model")


def assert_same_adapter(model_config: Path, adapter: Path, reference: Path) -> None:
    """``adapter`` loads with peft on a base model, adapts every layer but not the head, and gives the
    ``reference`` adapter's merged weights and logits (1e-5)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config))
    tokens = torch.randint(0, base.config.vocab_size, (2, 12))
    merged, logits = [], []
    for directory in (adapter, reference):
        model = PeftModel.from_pretrained(copy.deepcopy(base), directory)
        adapted = {k.split(".layers.")[1].split(".")[0] for k in model.state_dict() if "lora_B" in k}
        assert adapted == {str(layer) for layer in range(base.config.num_hidden_layers)}
        assert not any("lm_head" in k and "lora_" in k for k in model.state_dict())
        with torch.no_grad():
            logits.append(model(tokens).logits)
        merged.append(model.merge_and_unload().state_dict())
    assert merged[0].keys() == merged[1].keys()
    for key, value in merged[1].items():
        assert (merged[0][key] - value).abs().max().item() < 1e-5, key
    assert (logits[0] - logits[1]).abs().max().item() < 1e-5


@pytest.mark.slow
def test_a_lora_pp2_checkpoint_resumes_in_one_process(runs, tmp_path):
    again = tmp_path / "again"
    log = run_finetune(runs["config"], tmp_path, again, *STEPS, "--restore_from.path",
                       runs["pp2"] / "epoch_0_step_3")
    assert "written by 2 ranks, resuming on 1" in log
    assert losses(again) == pytest.approx(losses(runs["one"])[3:], rel=1e-4)


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_lora_with_interleaved_1f1b_trains_like_one_process(tmp_path):
    """A 4-layer Llama, stages 0 and 2 on one rank, 1 and 3 on the other (three steps): the rank's two stages
    save one adapter with theirs; the tied head of stage 3 is stage 0's embedding."""
    model = write_two_layer_llama_config(tmp_path, tied=True)
    model.write_text(json.dumps({**json.loads(model.read_text()), "num_hidden_layers": 4}))
    config = write_config(tmp_path / "cfg.yaml", model, tmp_path / "ckpt", peft=LORA)
    steps = [*STEPS, "--step_scheduler.max_steps", "3"]
    run_finetune(config, tmp_path, tmp_path / "one", *steps)
    log = run_finetune(config, tmp_path, tmp_path / "pp2", *steps, *fsdp2_ranks_with("pp_size"),
                       "--distributed.pipeline.pp_schedule", "interleaved1f1b")
    assert "pipeline stages 0 (embedding + layers 0-0), 2 (layers 2-2) of 4 on this rank" in log
    assert losses(tmp_path / "pp2") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert grad_norms(tmp_path / "pp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)
    assert_same_adapter(model, tmp_path / "pp2" / "epoch_0_step_3" / "model",
                        tmp_path / "one" / "epoch_0_step_3" / "model")
