"""FLUX.2 (Flux2Pipeline) trains: one step's loss is a hand computation from the pipeline's own encode_prompt, VAE
(2x2 patches normalised with its batch-norm statistics), packing and position ids, with the guidance the transformer
is fed; upstream's FLUX.2 forms (tests/upstream_forms/flux2_*_upstream.yaml) run through the CLI, save a pipeline
diffusers loads with the trained weights and a LoRA adapter Flux2Pipeline.load_lora_weights loads, and
`generate diffusion` samples from the saved pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusion_testing import (
    ASSETS,
    assert_cli_run_saved_the_trained_pipeline,
    assert_denoiser_equal_with_adapter,
    assert_generate_samples,
    family_model,
    pixels,
    refusals,
    tiny_flux2,
    train_inprocess,
)

from automodel.errors import AutomodelError
from automodel.testing import run_cli

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE = FORMS / "flux2_finetune_upstream.yaml"
LORA = FORMS / "flux2_lora_upstream.yaml"
GENERATE = FORMS / "generate_upstream.yaml"
CAPTIONS = ["a red circle", "a blue square on a green background"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny guidance-distilled Flux2Pipeline saved with weights."""
    return tiny_flux2(tmp_path_factory.mktemp("flux2") / "base")


def test_one_steps_loss_is_the_hand_computation_from_the_pipelines_own_encoding(base):
    from diffusers import Flux2Pipeline

    from automodel_diffusion.objectives import randn_like

    model = family_model(base, max_sequence_length=16, guidance_scale=2.5)
    pipeline, x = model.pipeline, pixels()
    losses = model(x, CAPTIONS, generator=torch.Generator().manual_seed(3))

    replay = torch.Generator().manual_seed(3)  # the same draws, in the same order
    raw = pipeline.vae.encode(x).latent_dist.sample(generator=replay)
    patches = Flux2Pipeline._patchify_latents(raw)  # (2, 16, 4, 4)
    mean = pipeline.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipeline.vae.bn.running_var + pipeline.vae.config.batch_norm_eps).view(1, -1, 1, 1)
    normalized = (patches - mean) / std
    tokens = Flux2Pipeline._pack_latents(normalized)  # (2, 16 tokens, 16 channels)
    positions = Flux2Pipeline._prepare_latent_ids(normalized)
    decoded = Flux2Pipeline._unpatchify_latents(  # what Flux2Pipeline does to its latents before the VAE decodes them
        Flux2Pipeline._unpack_latents_with_ids(tokens, positions) * std + mean)
    torch.testing.assert_close(decoded, raw)

    sigmas = model.objective.sigmas(2, replay)
    noise = randn_like(tokens, replay)
    s = sigmas.view(-1, 1, 1)
    embeds, text_ids = pipeline.encode_prompt(CAPTIONS, max_sequence_length=16)
    assert embeds.shape == (2, 16, 48), "the stacked hidden states of text encoder layers 10, 20 and 30"
    with torch.no_grad():
        prediction = pipeline.transformer(hidden_states=(1 - s) * tokens + s * noise, timestep=sigmas,
                                          guidance=torch.full((2,), 2.5), encoder_hidden_states=embeds,
                                          txt_ids=text_ids, img_ids=positions, return_dict=False)[0]
    torch.testing.assert_close(losses, (prediction - (noise - tokens)).pow(2).flatten(1).mean(1))

    model.conditioning.guidance = 1.0
    other = model(x, CAPTIONS, generator=torch.Generator().manual_seed(3))
    assert (other - losses).abs().max() > 1e-6, "the guidance value does not reach the transformer"
    assert family_model(base).conditioning.guidance == 4.0, "Flux2Pipeline's default guidance_scale"


def test_finetune_form_trains_through_the_cli_saves_a_flux2_pipeline_and_generate_samples_it(base, tmp_path,
                                                                                              monkeypatch):
    ckpt = tmp_path / "ckpt"
    result = run_cli("finetune", "diffusion", "-c", FINETUNE, "--model.pretrained_model_name_or_path", base,
                     "--checkpoint.checkpoint_dir", ckpt, "--step_scheduler.ckpt_every_steps", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flow matching step 3: uniform sampling, shift 3," in result.stderr
    assert_cli_run_saved_the_trained_pipeline(ckpt, base, "Flux2Pipeline")

    monkeypatch.chdir(tmp_path)
    assert_generate_samples(GENERATE, ckpt / "epoch_0_step_3" / "model", tmp_path, "Flux2Pipeline",
                            "--inference.pipeline_kwargs", "{max_sequence_length: 16}")


def test_lora_form_trains_an_adapter_that_flux2pipeline_loads(base, tmp_path):
    import diffusers

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(LORA, "--model.pretrained_model_name_or_path", base, "--checkpoint.checkpoint_dir", ckpt)
    assert recipe.model.conditioning.guidance == 3.5, "upstream's flux2 adapter_kwargs.guidance_scale"
    model_dir = ckpt / "epoch_0_step_3" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["pytorch_lora_weights.safetensors"]
    pipeline = diffusers.Flux2Pipeline.from_pretrained(str(base))
    pipeline.load_lora_weights(str(model_dir))
    plain = diffusers.Flux2Pipeline.from_pretrained(str(base)).transformer
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 4, 4, generator=g)
    inputs = {"hidden_states": diffusers.Flux2Pipeline._pack_latents(latents), "timestep": torch.tensor([0.2, 0.7]),
              "encoder_hidden_states": torch.randn(2, 16, 48, generator=g), "guidance": torch.tensor([3.5, 3.5]),
              "img_ids": diffusers.Flux2Pipeline._prepare_latent_ids(latents),
              "txt_ids": diffusers.Flux2Pipeline._prepare_text_ids(torch.zeros(2, 16, 48))}
    assert_denoiser_equal_with_adapter(recipe.model.components["transformer"], pipeline.transformer, plain, inputs)


def test_what_flux2_cannot_train_is_refused_with_the_reason(base):
    from automodel_diffusion import AutoDiffusionPipeline

    found = refusals(LORA, "--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow"))
    assert "'flux2' (FLUX.2) needs a Flux2Pipeline, but" in found["model.model_type"], found
    assert "needs a Flux2Pipeline, but" in found["flow_matching.adapter_type"], found
    with pytest.raises(AutomodelError, match="batch-norm running statistics, which are weights"):
        AutoDiffusionPipeline.load_transformer_only(str(base), "Flux2Transformer2DModel")


def test_guidance_settings_must_match_the_flux2_transformer_and_klein_is_refused(base):
    import diffusers

    from automodel.errors import ConfigError
    from automodel_diffusion import AutoDiffusionPipeline

    pipeline = diffusers.Flux2Pipeline.from_pretrained(str(base))
    config = {k: v for k, v in pipeline.transformer.config.items() if not k.startswith("_")}
    pipeline.transformer = diffusers.Flux2Transformer2DModel(**{**config, "guidance_embeds": False})
    with pytest.raises(ConfigError, match="model.guidance_scale: 2.0: this FLUX.2 transformer has no guidance"):
        AutoDiffusionPipeline(pipeline, guidance_scale=2.0)
    model = AutoDiffusionPipeline(pipeline)
    assert model.conditioning.guidance is None, "a transformer without guidance embeddings is fed none"
    with pytest.raises(ConfigError, match="true, but this FLUX.2 transformer has no guidance embeddings"):
        model.conditioning.set_guidance(True, 3.5, "flow_matching.adapter_kwargs.guidance_scale")

    klein = diffusers.Flux2KleinPipeline(**pipeline.components)
    with pytest.raises(AutomodelError, match="a Flux2KleinPipeline .* is not implemented for diffusion training"):
        AutoDiffusionPipeline(klein)
