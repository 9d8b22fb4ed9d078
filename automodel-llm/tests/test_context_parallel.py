"""Context parallelism (``distributed.cp_size > 1``) in the LLM recipe: on this CPU machine cp_size 2 trains with the
all-gather attention (``distributed.cp_attention: auto``) like one process, on packed rows; ``automodel validate``
refuses ring attention here saying why and what would run it (torch's ring attention needs CUDA's flash /
memory-efficient SDPA), and refuses what the path cannot do with the reason; a config ring attention can run passes
where the device is CUDA; the default collate pads rows to a multiple of 2 x cp_size. On a machine with two GPUs,
cp_size 2 with ring attention trains with the losses, gradient norms and validation losses of one process (the
loop's step itself is compared with one process on CPU gloo ranks in automodel-core/tests/test_parallel_context.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from llm_testing import (
    VALIDATION,
    grad_norms,
    losses,
    run_finetune,
    val_losses,
    write_config,
    write_tiny_llama_config,
    write_tiny_moe_config,
)

from automodel.cli.main import main
from automodel.testing import run_cli_inprocess
from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction

CP2 = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2", "--distributed.cp_size", "2"]
RING = ["--distributed.cp_attention", "ring"]


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path / "cfg.yaml", write_tiny_llama_config(tmp_path), tmp_path / "ckpt")


def _validate(config, cwd, *args) -> tuple[int, str]:
    result = run_cli_inprocess("validate", "-c", config, *args, cwd=cwd)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_ring_attention_is_refused_on_this_machine_saying_why_and_what_would_run_it(config, tmp_path):
    code, out = _validate(config, tmp_path, *CP2, *RING)
    assert code == 2 and "Traceback" not in out
    assert "distributed.cp_size: 2: context parallelism runs torch's ring attention" in out
    assert "flash or memory-efficient attention kernels on CUDA GPUs; this run is on cpu" in out
    assert "Run it on NVIDIA GPUs (one process per GPU, nccl), set distributed.cp_attention: all_gather" in out
    assert out.startswith("error: invalid configuration: distributed.cp_size")  # the one problem of this config
    assert _validate(config, tmp_path, *CP2)[0] == 0  # auto: the all-gather attention runs here
    code, out = _validate(config, tmp_path, *RING)
    assert code == 2 and "distributed.cp_attention: ring with cp_size 1: no sequence is split" in out


def test_what_the_context_parallel_path_cannot_do_is_refused_with_the_reason(config, tmp_path):
    code, out = _validate(config, tmp_path, *CP2, *RING, "--distributed.strategy", "ddp", "--compile.enabled", "true",
                          "--packed_sequence.packed_sequence_size", "64")
    assert code == 2 and "Traceback" not in out
    assert "distributed.strategy: ddp: the 2 context-parallel ranks of a batch hold partial gradients" in out
    assert "compile.enabled: true with cp_size 2: the context-parallel region swaps" in out
    assert "packed_sequence.packed_sequence_size: packed rows keep attention within each sample, but torch's ring " \
           "attention (distributed.cp_attention: ring, cp_size 2) runs one causal attention over the whole row" in out
    code, out = _validate(config, tmp_path, *CP2, "--packed_sequence.packed_sequence_size", "66")
    assert code == 2 and "packed_sequence.packed_sequence_size: 66: context parallelism (cp_size 2) splits each " \
        "packed row into 4 chunks; use a multiple of 4" in out
    code, out = _validate(config, tmp_path, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
                          "--distributed.cp_size", "2", "--distributed.pp_size", "2", *RING)
    assert code == 2 and "distributed.cp_attention: ring with pp_size 2: the pipeline schedule runs each " \
        "micro-batch's backward outside the stage's forward" in out  # all_gather runs pipelined (test_pipeline_...)
    code, out = _validate(config, tmp_path, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
                          "--distributed.cp_size", "2", "--distributed.tp_size", "2",
                          "--distributed.sequence_parallel", "true", "--loss_fn._target_", "FusedLinearCrossEntropy")
    assert code == 0, out  # cp x tp (the loop's step: automodel-core/tests/test_parallel_context.py)
    kd = run_cli_inprocess("validate", "kd", "llm", "-c", config, *CP2, "--teacher_model._target_",
                 "automodel_llm.AutoModelForCausalLM.from_config", "--teacher_model.config",
                 str(tmp_path / "config.json"), cwd=tmp_path)
    assert kd.returncode == 2 and "distributed.cp_size: 2: the teacher runs beside the student on whole sequences" \
        in kd.stderr


def test_a_config_ring_attention_can_run_passes_validation_where_the_device_is_cuda(config, monkeypatch,
                                                                                    capsys):
    """Only the device is CUDA's here (the same checks a GPU machine runs); the sdpa attention is accepted; eager
    refused by ring attention and run as SDPA by the all-gather attention; flash attention refused by both."""
    monkeypatch.setattr("automodel.training.stages.context_parallel.validation_device",
                        lambda: torch.device("cuda"))
    assert main(["validate", "-c", str(config), *CP2, *RING]) == 0, capsys.readouterr().err
    assert main(["validate", "-c", str(config), *CP2, *RING, "--model.attn_implementation", "eager"]) == 2
    assert "model.attn_implementation: 'eager': context parallelism replaces SDPA's attention" in \
        capsys.readouterr().err
    assert main(["validate", "-c", str(config), *CP2, "--model.attn_implementation", "eager"]) == 0  # runs as SDPA
    capsys.readouterr()
    assert main(["validate", "-c", str(config), *CP2, "--model.attn_implementation", "flash_attention_2"]) == 2
    assert "model.attn_implementation: 'flash_attention_2': context parallelism's all-gather attention replaces " \
        "the model's SDPA calls (eager attention runs as SDPA inside it); use sdpa or eager" in capsys.readouterr().err


def test_expert_parallelism_over_the_context_parallel_ranks_passes_validation_where_the_device_is_cuda(
        monkeypatch, tmp_path, capsys):
    """ep 2 x cp 2 on two ranks: the ep group is the two context-parallel ranks of the one data-parallel replica."""
    monkeypatch.setattr("automodel.training.stages.context_parallel.validation_device",
                        lambda: torch.device("cuda"))
    config = write_config(tmp_path / "cfg.yaml", write_tiny_moe_config(tmp_path), tmp_path / "ckpt")
    assert main(["validate", "-c", str(config), *CP2, "--distributed.ep_size", "2"]) == 0, capsys.readouterr().err
    assert main(["validate", "-c", str(config), *CP2, "--distributed.ep_size", "4"]) == 2
    assert "distributed.ep_size: 4 does not divide the data-parallel x context-parallel ranks (2" in \
        capsys.readouterr().err


def test_the_default_collate_pads_rows_to_a_multiple_of_twice_cp_size():
    recipe = SimpleNamespace(cfg=SimpleNamespace(distributed=SimpleNamespace(cp_size=3, tp_size=1,
                                                                           sequence_parallel=False)))
    assert FinetuneRecipeForNextTokenPrediction.length_multiple(recipe) == 6


@pytest.mark.slow
def test_cp2_with_the_all_gather_attention_trains_packed_rows_and_generates_like_one_process(tmp_path):
    """On this machine's CPU: packed rows (several samples per row, attention kept within each) split over two
    ranks; the losses, gradient norms, validation losses and the generated answers after training are one
    process's (fp32)."""
    config = write_config(tmp_path / "cfg.yaml", write_tiny_llama_config(tmp_path), tmp_path / "one",
                          validation_dataset=VALIDATION, packed_sequence={"packed_sequence_size": 128},
                          eval_generation={"enabled": True, "num_examples": 2},
                          step_scheduler={"max_steps": 3, "val_check_interval": 3},
                          distributed={"mp_policy": {"param_dtype": "float32"}},
                          dataloader={"batch_size": 2, "shuffle": False})
    one = run_finetune(config, tmp_path, tmp_path / "one")
    log = run_finetune(config, tmp_path, tmp_path / "cp2", *CP2, "--distributed.cp_attention", "all_gather")
    assert "context_parallel [cp_attention]: 1 attention modules run as all-gather attention" in log
    assert losses(tmp_path / "cp2") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert grad_norms(tmp_path / "cp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)
    assert [v for _, v in val_losses(tmp_path / "cp2")] == pytest.approx(
        [v for _, v in val_losses(tmp_path / "one")], rel=1e-5)
    answers = [[line for line in text.splitlines() if "expected:" in line] for text in (one, log)]
    assert answers[1] == answers[0] and len(answers[0]) == 2  # generation on whole sequences, as one process


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="ring attention runs on two CUDA GPUs")
def test_cp2_on_two_gpus_trains_like_one_process(tmp_path):
    """fp32, so the ring attention's merge order is the only difference (the one process runs SDPA with the
    padding mask; rows are right-padded, which causal attention keeps out of every real token's view)."""
    config = write_config(tmp_path / "cfg.yaml", write_tiny_llama_config(tmp_path), tmp_path / "one",
                          validation_dataset=VALIDATION,
                          step_scheduler={"max_steps": 4, "val_check_interval": 2},
                          distributed={"mp_policy": {"param_dtype": "float32"}},
                          dataloader={"batch_size": 4, "shuffle": False})
    run_finetune(config, tmp_path, tmp_path / "one")
    log = run_finetune(config, tmp_path, tmp_path / "cp2", *CP2)
    assert "context_parallel [cp_attention]: 1 attention modules run as torch's ring attention over cp 2" in log
    assert losses(tmp_path / "cp2") == pytest.approx(losses(tmp_path / "one"), rel=1e-3)
    assert grad_norms(tmp_path / "cp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-3)
    assert [v for _, v in val_losses(tmp_path / "cp2")] == pytest.approx(
        [v for _, v in val_losses(tmp_path / "one")], rel=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism runs on two CUDA GPUs")
def test_ep2_with_cp2_on_two_gpus_trains_like_one_process(tmp_path):
    """A tiny Qwen3-MoE (4 experts, top-2): each context-parallel rank holds 2 of the 4 experts and half of every
    row's tokens; the losses and gradient norms are one process's."""
    config = write_config(tmp_path / "cfg.yaml", write_tiny_moe_config(tmp_path), tmp_path / "one",
                          step_scheduler={"max_steps": 4},
                          distributed={"mp_policy": {"param_dtype": "float32"}},
                          dataloader={"batch_size": 4, "shuffle": False})
    run_finetune(config, tmp_path, tmp_path / "one")
    log = run_finetune(config, tmp_path, tmp_path / "ep_cp", *CP2, "--distributed.ep_size", "2")
    assert "each rank holds 2 of 4 experts" in log
    assert losses(tmp_path / "ep_cp") == pytest.approx(losses(tmp_path / "one"), rel=1e-3)
    assert grad_norms(tmp_path / "ep_cp") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-3)


RECURRENT = {  # tiny hybrids of recurrent and attention layers, the shipped tokenizer's vocabulary (482)
    "nemotron_h": {"layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"],
                   "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                   "intermediate_size": 48, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8,
                   "n_groups": 1, "chunk_size": 8, "num_nextn_predict_layers": 0},
    "qwen3_next": {"num_hidden_layers": 2, "full_attention_interval": 2, "hidden_size": 32, "intermediate_size": 48,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16, "decoder_sparse_step": 1},
    "falcon_h1": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 8, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
                  "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 8},
    "kimi_linear": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                    "mlp_layer_types": ["dense", "dense"], "hidden_size": 32, "intermediate_size": 48,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "kv_lora_rank": 16,
                    "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                    "linear_head_dim": 8, "linear_num_heads": 4, "num_experts": 4, "moe_intermediate_size": 16},
    "lfm2": {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "hidden_size": 32, "intermediate_size": 48,
             "num_attention_heads": 4, "num_key_value_heads": 2, "block_auto_adjust_ff_dim": False},
}


@pytest.mark.parametrize("model_type", [  # make test-slow: the hybrid's and the short convolutions' mixer names
    pytest.param(name, marks=pytest.mark.slow) if name in ("falcon_h1", "lfm2") else name for name in RECURRENT])
def test_cp2_runs_recurrent_layers_on_the_whole_rows_like_one_process(tmp_path, model_type):
    """Mamba (Nemotron-H; Falcon-H1's beside attention), gated-delta-rule (Qwen3-Next), delta-attention (Kimi Linear)
    and short-convolution (LFM2) layers carry a state along the whole sequence: under
    cp 2 each of their mixers runs on the gathered rows and every rank keeps its part, so the losses and gradient
    norms are one process's (before, cp 2 refused them: a rank's part alone from a zero state trains another
    model). Kimi Linear's full-attention layers are a latent attention, whose keys are wider than its values."""
    import json

    data = {"model_type": model_type, "vocab_size": 482, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "tie_word_embeddings": False, **RECURRENT[model_type]}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(data))
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "model" / "config.json", tmp_path / "one",
                          step_scheduler={"max_steps": 3}, dataloader={"batch_size": 2, "shuffle": False})
    run_finetune(config, tmp_path, tmp_path / "one")
    log = run_finetune(config, tmp_path, tmp_path / "cp2", *CP2)
    assert "recurrent mixers (Mamba, linear attention) run on the whole rows" in log
    assert losses(tmp_path / "cp2") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert grad_norms(tmp_path / "cp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)


def test_pp2_x_cp2_with_a_stage_of_recurrent_layers_only_trains_like_one_process(tmp_path):
    """Nemotron-H's four layers over two pipeline stages: the second holds a Mamba layer and an MLP one, no attention
    (before: 'found no attention module' stopped it); its Mamba mixer runs on the whole rows there."""
    import json

    data = {"model_type": "nemotron_h", "vocab_size": 482, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "tie_word_embeddings": False, **RECURRENT["nemotron_h"]}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(data))
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "model" / "config.json", tmp_path / "one",
                          step_scheduler={"max_steps": 3}, dataloader={"batch_size": 2, "shuffle": False})
    run_finetune(config, tmp_path, tmp_path / "one")
    run_finetune(config, tmp_path, tmp_path / "pp_cp", "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
                 "--distributed.pp_size", "2", "--distributed.cp_size", "2")
    assert losses(tmp_path / "pp_cp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert grad_norms(tmp_path / "pp_cp") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)
