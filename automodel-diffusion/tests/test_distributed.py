"""Two CPU ranks (gloo) through the CLI with the parallel_scheme applied: the trained transformer and the frozen
VAE sharded with FSDP2 (the VAE is called through encode/decode, not forward), the text encoders replicated; the
run resumed with the transformer under HSDP (``dp_replicate_size``); a Wan 2.2 stage's expert sharded while the idle
one stays on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from diffusion_testing import tiny_clips, tiny_wan22, train_inprocess

from automodel.testing import assert_states_equal, free_port, load_safetensors_state, losses_by_step

AUTOMODEL = Path(sys.executable).with_name("automodel")


def test_fsdp2_on_two_ranks_saves_a_diffusers_pipeline_that_resumes_on_one(tmp_path):
    out = tmp_path / "two"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    command = [str(AUTOMODEL), "finetune", "diffusion", "-c", "diffusion/tiny_flow", "--nproc-per-node", "2",
               "--step_scheduler.max_steps", "4", "--step_scheduler.checkpoint_interval", "2",
               "--step_scheduler.val_check_interval", "4", "--step_scheduler.log_interval", "1",
               "--dataloader.batch_size", "8", "--parallel_scheme.vae.strategy", "fsdp2"]
    result = subprocess.run([*command, "--master-port", str(free_port()), "--checkpoint.checkpoint_dir", str(out)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharding [diffusion]: over 2 ranks: vae: fsdp2 (frozen)" in result.stderr
    assert "transformer: fsdp2" in result.stderr
    losses = losses_by_step(out / "training.jsonl")
    assert sorted(losses) == [1, 2, 3, 4] and all(np.isfinite(v) for v in losses.values())
    assert (out / "samples" / "step_4.png").is_file()

    # resumed on two ranks from step 2: the noise and timesteps of steps 3-4 are the uninterrupted run's (the data
    # loader's iterator used to draw its seed from the restored global RNG, shifting every draw after a resume),
    # here with the transformer under HSDP (2 replica groups of 1 rank: the same gradients, all-reduced)
    again = subprocess.run([*command, "--master-port", str(free_port()), "--checkpoint.checkpoint_dir",
                            str(tmp_path / "again"), "--restore_from.path", str(out / "epoch_0_step_2"),
                            "--parallel_scheme.transformer.dp_replicate_size", "2"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "transformer: fsdp2 (HSDP: 2 replica groups)" in again.stderr
    resumed = losses_by_step(tmp_path / "again" / "training.jsonl")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == losses[s] for s in (3, 4)), (resumed, losses)

    from diffusers import DiffusionPipeline

    model_dir = out / "epoch_0_step_4" / "model"
    pipeline = DiffusionPipeline.from_pretrained(str(model_dir))  # gathered weights, the real class names
    assert type(pipeline.transformer).__name__ == "SD3Transformer2DModel"

    # the two-rank checkpoint resumes in one process (steps 3-4 run; the data order restarts at the epoch start)
    single = train_inprocess(Path(__file__).parent.parent / "src/automodel_diffusion/examples/tiny_flow.yaml",
                             "--checkpoint.checkpoint_dir", tmp_path / "one", "--restore_from.path",
                             out / "epoch_0_step_2", "--step_scheduler.max_steps", 4,
                             "--step_scheduler.checkpoint_interval", 2, "--step_scheduler.log_interval", 1,
                             "--step_scheduler.val_check_interval", 4, "--dataloader.batch_size", 8)
    assert sorted(losses_by_step(tmp_path / "one" / "training.jsonl")) == [3, 4]
    restored = load_safetensors_state(out / "epoch_0_step_2" / "model" / "transformer")
    assert restored.keys() == {k.removeprefix("components.transformer.") for k in single.model.state_dict()}
    assert_states_equal(load_safetensors_state(out / "epoch_0_step_2" / "model" / "vae"),
                        load_safetensors_state(tmp_path / "one" / "epoch_0_step_4" / "model" / "vae"))


@pytest.mark.slow
def test_a_wan22_stage_on_two_ranks_shards_its_expert_and_leaves_the_idle_one_on_the_cpu(tmp_path):
    from diffusers import DiffusionPipeline

    base, out = tiny_wan22(tmp_path / "base"), tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    command = [str(AUTOMODEL), "finetune", "diffusion", "-c",
               str(Path(__file__).parent / "upstream_forms" / "wan22_finetune_upstream.yaml"), "--nproc-per-node", "2",
               "--master-port", str(free_port()), "--model.pretrained_model_name_or_path", str(base),
               "--data.dataloader.cache_dir", str(tiny_clips(tmp_path / "clips")), "--checkpoint.checkpoint_dir",
               str(out), "--fsdp.dp_size", "2", "--step_scheduler.global_batch_size", "2", "--model.stage",
               "low_noise", "--sample_generation.enabled", "true", "--sample_generation.num_inference_steps", "2",
               "--step_scheduler.val_every_steps", "3"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "over 2 ranks: transformer: idle expert (frozen, on the CPU)" in result.stderr
    assert "transformer_2: fsdp2" in result.stderr
    assert (out / "samples" / "step_3.webp").is_file()  # sampling ran both experts, the idle one brought over
    saved = DiffusionPipeline.from_pretrained(str(out / "epoch_1_step_3" / "model"))
    assert_states_equal(saved.transformer.state_dict(), load_safetensors_state(base / "transformer"))
