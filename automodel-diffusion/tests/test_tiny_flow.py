"""The embedded example diffusion/tiny_flow trains on a CPU: the loss falls, samples and checkpoints are written,
and the checkpoint is a diffusers pipeline that diffusers loads and samples from."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from automodel.testing import assert_states_equal, load_safetensors_state, losses_by_step, read_jsonl

PROMPTS = 4  # the example's sample_generation.prompts


@pytest.mark.smoke
def test_loss_falls(flow_run):
    losses = losses_by_step(flow_run["ckpt"] / "training.jsonl")
    assert sorted(losses) == list(range(5, 61, 5))
    assert all(np.isfinite(v) for v in losses.values())
    first, last = np.mean([losses[5], losses[10]]), np.mean([losses[55], losses[60]])
    assert last < first - 0.05, f"training loss did not fall: {first:.4f} -> {last:.4f} ({losses})"
    val = {r["step"]: r["val_loss"] for r in read_jsonl(flow_run["ckpt"] / "validation.jsonl")}
    assert sorted(val) == [30, 60]
    assert val[60] < val[30], f"validation loss (fixed noise) did not fall: {val}"


def test_sample_grids_are_written_at_each_validation(flow_run):
    samples = flow_run["ckpt"] / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step_30.png", "step_60.png"]
    grids = [np.asarray(Image.open(samples / name).convert("RGB")) for name in ("step_30.png", "step_60.png")]
    for grid in grids:
        assert grid.shape == (32, 32 * PROMPTS, 3)  # one row (seed), one 32x32 column per prompt
        assert grid.std() > 1.0, "a sample grid is one flat colour"
    assert not np.array_equal(grids[0], grids[1]), "the model changed between the validations; its samples too"


def test_checkpoint_is_a_diffusers_pipeline_with_frozen_parts_saved_once(flow_run):
    ckpt = flow_run["ckpt"]
    assert (ckpt / "LATEST").read_text().strip() == "epoch_2_step_60"
    early, late = ckpt / "epoch_1_step_30" / "model", ckpt / "epoch_2_step_60" / "model"
    for model in (early, late):
        assert (model / "model_index.json").is_file()
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
                     "tokenizer_2", "tokenizer_3", "scheduler"):
            assert (model / name).is_dir(), name
        assert (model / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    # frozen components: one copy on disk, hard-linked into every checkpoint; the trained one is per checkpoint
    vae = "vae/diffusion_pytorch_model.safetensors"
    assert (early / vae).stat().st_ino == (late / vae).stat().st_ino
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (early / weights).stat().st_ino != (late / weights).stat().st_ino
    # the tracked training state holds the trained component only (optimizer over its parameters)
    optim = json.loads((ckpt / "epoch_2_step_60" / "optim" / "optimizer.json").read_text())
    params = {fqn for fqn, _ in optim["tensors"].values()}
    assert params and all(k.startswith("components.transformer.") for k in params)
    assert json.loads((ckpt / "epoch_2_step_60" / "trainer_state.json").read_text())["weights"] == "recipe"


def test_trained_component_loads_with_its_diffusers_class(flow_run):
    from diffusers import SD3Transformer2DModel

    model_dir = flow_run["ckpt"] / "epoch_2_step_60" / "model"
    transformer = SD3Transformer2DModel.from_pretrained(str(model_dir / "transformer"))
    trained = {k.removeprefix("components.transformer."): v for k, v in flow_run["final"].items()}
    assert_states_equal(transformer.state_dict(), trained)
    assert_states_equal(load_safetensors_state(model_dir / "transformer"), trained)


@pytest.mark.smoke
def test_pipeline_loads_with_diffusers_and_reproduces_the_validation_sample(flow_run):
    from diffusers import DiffusionPipeline

    model_dir = flow_run["ckpt"] / "epoch_2_step_60" / "model"
    pipeline = DiffusionPipeline.from_pretrained(str(model_dir))
    assert type(pipeline).__name__ == "StableDiffusion3Pipeline"
    pipeline.set_progress_bar_config(disable=True)
    prompt = flow_run["recipe"].cfg.sample_generation.prompts[0]
    image = pipeline(prompt, num_inference_steps=4, guidance_scale=1.0, height=32, width=32, max_sequence_length=16,
                     generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)
    grid = np.asarray(Image.open(flow_run["ckpt"] / "samples" / "step_60.png").convert("RGB"))
    produced = np.asarray(image.convert("RGB")).astype(int)
    assert np.abs(produced - grid[:, :32].astype(int)).max() <= 1, "the loaded pipeline samples differently"


@pytest.mark.parametrize("source", ["epoch_1_step_30", "latest"])
def test_resume_is_exact(flow_run, tmp_path, source):
    """Restored from the step-30 checkpoint (mid-epoch RNG, data position, optimizer), the losses of steps 35-60,
    including a validation and sampling step, equal the uninterrupted run's bitwise."""
    import shutil

    from diffusion_testing import EXAMPLES, train_inprocess

    root = tmp_path / "resumed"
    if source == "latest":
        root.mkdir()
        shutil.copytree(flow_run["ckpt"] / "epoch_1_step_30", root / "epoch_1_step_30")
        (root / "LATEST").write_text("epoch_1_step_30\n")
        path = "latest"
    else:
        path = flow_run["ckpt"] / source
    recipe = train_inprocess(EXAMPLES / "tiny_flow.yaml", "--checkpoint.checkpoint_dir", root,
                             "--restore_from.path", path)
    reference = losses_by_step(flow_run["ckpt"] / "training.jsonl")
    resumed = losses_by_step(root / "training.jsonl")
    assert sorted(resumed) == list(range(35, 61, 5))
    assert [resumed[s] for s in sorted(resumed)] == [reference[s] for s in sorted(resumed)], \
        "losses after resume differ (bitwise)"
    assert_states_equal(recipe.model.state_dict(), flow_run["final"])
    val = read_jsonl(root / "validation.jsonl")
    ref_val = [r for r in read_jsonl(flow_run["ckpt"] / "validation.jsonl") if r["step"] == 60]
    assert [r["val_loss"] for r in val] == [r["val_loss"] for r in ref_val]


def test_finetune_from_the_saved_pipeline(flow_run, tmp_path):
    """``AutoDiffusionPipeline.from_pretrained`` on a checkpoint's model/ continues from its weights."""
    from diffusion_testing import EXAMPLES, train_inprocess

    model_dir = flow_run["ckpt"] / "epoch_2_step_60" / "model"
    started = {}

    def check_start(recipe):
        started["state"] = {k: v.clone() for k, v in recipe.model.state_dict().items()}

    import yaml

    config = yaml.safe_load((EXAMPLES / "tiny_flow.yaml").read_text())
    config["model"] = {"_target_": "automodel_diffusion.AutoDiffusionPipeline.from_pretrained",
                       "pretrained_model_name_or_path": str(model_dir), "max_sequence_length": 16}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    recipe = train_inprocess(tmp_path / "cfg.yaml", "--checkpoint.checkpoint_dir", tmp_path / "ckpt",
                             "--step_scheduler.max_steps", 2, "--step_scheduler.log_interval", 1,
                             "--sample_generation.enabled", "false", before_run=check_start)
    assert_states_equal(started["state"], flow_run["final"])
    assert recipe.step_scheduler.step == 2
    first = losses_by_step(tmp_path / "ckpt" / "training.jsonl")[1]
    assert first < losses_by_step(flow_run["ckpt"] / "training.jsonl")[5], "it did not start from the trained model"
