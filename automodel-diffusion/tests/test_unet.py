"""The UNet path (diffusion/tiny_unet: StableDiffusionPipeline + DDPM scheduler) with epsilon and v-prediction:
training lowers the loss, samples come without a validation set, and diffusers loads what was saved."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_testing import EXAMPLES, train_inprocess
from PIL import Image

from automodel.testing import losses_by_step

STEPS = 8


@pytest.fixture(scope="module", params=["epsilon", "v_prediction"])
def unet_run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"unet_{request.param}")
    recipe = train_inprocess(EXAMPLES / "tiny_unet.yaml", "--checkpoint.checkpoint_dir", root,
                             "--objective.type", request.param, "--step_scheduler.max_steps", STEPS,
                             "--step_scheduler.val_check_interval", STEPS, "--step_scheduler.checkpoint_interval",
                             STEPS, "--step_scheduler.log_interval", 1, "--sample_generation.num_images_per_prompt", 2)
    return {"kind": request.param, "root": root, "recipe": recipe}


def test_loss_falls(unet_run):
    losses = losses_by_step(unet_run["root"] / "training.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = np.mean([losses[1], losses[2]]), np.mean([losses[STEPS - 1], losses[STEPS]])
    assert last < 0.9 * first, f"{unet_run['kind']} loss did not fall: {losses}"


def test_samples_without_a_validation_set(unet_run):
    assert not unet_run["recipe"].val_dataloaders
    grid = np.asarray(Image.open(unet_run["root"] / "samples" / f"step_{STEPS}.png").convert("RGB"))
    # default prompts: the first 4 distinct training captions; 2 seeds each
    assert grid.shape == (2 * 32, 4 * 32, 3)
    assert not np.array_equal(grid[:32], grid[32:]), "different seeds gave the same images"


def test_checkpoint_loads_with_diffusers(unet_run):
    from diffusers import DiffusionPipeline, UNet2DConditionModel

    model_dir = unet_run["root"] / f"epoch_0_step_{STEPS}" / "model"
    unet = UNet2DConditionModel.from_pretrained(str(model_dir / "unet"))
    trained = unet_run["recipe"].model.components["unet"].state_dict()
    for key, value in unet.state_dict().items():
        assert torch.equal(value, trained[key]), key
    pipeline = DiffusionPipeline.from_pretrained(str(model_dir))
    assert type(pipeline).__name__ == "StableDiffusionPipeline"
    assert pipeline.scheduler.config.prediction_type == unet_run["kind"]
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline("a red circle on a blue background", num_inference_steps=2, height=32, width=32,
                     generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)


def test_only_the_denoiser_trains_by_default(unet_run):
    recipe = unet_run["recipe"]
    model = recipe.model
    assert model.trainable_components == ["unet"]
    assert all(not p.requires_grad for c in model.frozen_components().values() for p in c.parameters())
    optimized = {id(p) for group in recipe.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.components["unet"].parameters()}
    model_dir = unet_run["root"] / f"epoch_0_step_{STEPS}" / "model"
    base = unet_run["root"] / "pipeline_base"
    for name in ("vae", "text_encoder"):
        weights = next((model_dir / name).glob("*.safetensors"))
        assert weights.stat().st_ino == (base / name / weights.name).stat().st_ino, f"{name} was saved again"


def test_trainable_components_can_include_the_text_encoder(tmp_path):
    from transformers import CLIPTextModel

    initial = {}

    def remember(recipe):
        initial.update({k: v.clone() for k, v in recipe.pipeline.text_encoder.state_dict().items()})

    recipe = train_inprocess(EXAMPLES / "tiny_unet.yaml", "--checkpoint.checkpoint_dir", tmp_path,
                             "--model.trainable_components", "[unet, text_encoder]", "--step_scheduler.max_steps", 2,
                             "--step_scheduler.checkpoint_interval", 2, "--sample_generation.enabled", "false",
                             before_run=remember)
    trained = recipe.pipeline.text_encoder.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "the text encoder did not train"
    assert not (tmp_path / "pipeline_base" / "text_encoder").exists()
    saved = CLIPTextModel.from_pretrained(str(tmp_path / "epoch_0_step_2" / "model" / "text_encoder"))
    for key, value in saved.state_dict().items():
        assert torch.equal(value, trained[key]), key
