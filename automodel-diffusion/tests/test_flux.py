"""FLUX.1 (FluxPipeline) trains: the training input is diffusers' own packing of the latents, the target noise minus
the packed latents, the timestep sigma and the guidance the transformer's config asks for; upstream's FLUX.1 forms
(tests/upstream_forms/flux_*_upstream.yaml) run through the CLI, save a pipeline diffusers loads (with the trained
weights), a LoRA adapter FluxPipeline.load_lora_weights loads, and `generate diffusion` samples from both."""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest
import torch
from diffusion_testing import (
    ASSETS,
    assert_a_cache_gives_the_full_pipelines_loss,
    assert_cli_run_saved_the_trained_pipeline,
    assert_denoiser_equal_with_adapter,
    assert_generate_samples,
    build_refusals_on_the_sd3_pipeline,
    family_model,
    fixed_batch_loss,
    load_config,
    pixels,
    refusals,
    tiny_flux,
    train_inprocess,
    train_on_fixed_batch,
)
from PIL import Image

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import assert_states_equal, run_cli

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE = FORMS / "flux_finetune_upstream.yaml"
LORA = FORMS / "flux_lora_upstream.yaml"
GENERATE = FORMS / "generate_upstream.yaml"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two tiny FluxPipelines saved with weights: without and with guidance embeddings."""
    root = tmp_path_factory.mktemp("flux")
    return {"plain": tiny_flux(root / "plain"), "guided": tiny_flux(root / "guided", guidance_embeds=True)}


def flux_model(base: Path, **kwargs):
    return family_model(base, max_sequence_length=16, **kwargs)


# ---- the training step, against diffusers' own helpers ---------------------------------------------------------


def test_packing_and_positions_are_fluxpipelines(bases):
    from diffusers import FluxPipeline

    model = flux_model(bases["plain"])
    latents = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(0))
    packed, positions = model.conditioning.pack(latents)
    assert packed.shape == (2, 3 * 4, 16) and positions["img_ids"].shape == (12, 3)
    vae_scale = model.pipeline.vae_scale_factor
    unpacked = FluxPipeline._unpack_latents(packed, 6 * vae_scale, 8 * vae_scale, vae_scale)
    assert torch.equal(unpacked, latents), "FluxPipeline's unpacking (used to decode) does not invert the packing"
    for token, (_, row, column) in enumerate(positions["img_ids"].long().tolist()):
        patch = latents[:, :, 2 * row:2 * row + 2, 2 * column:2 * column + 2].reshape(2, -1)
        assert torch.equal(packed[:, token], patch), f"token {token} is not the patch at ({row}, {column})"
    with pytest.raises(Exception, match="2x2 patches"):
        model.conditioning.pack(torch.zeros(1, 4, 5, 8))


def test_a_latent_cache_gives_the_transformer_alone_the_full_pipelines_loss(bases):
    assert_a_cache_gives_the_full_pipelines_loss(bases["guided"], "FluxTransformer2DModel",
                                                 ["a red circle", "a blue square on a green background", "a dot"],
                                                 max_sequence_length=16)


@pytest.mark.parametrize("kind", ["plain", "guided"])
def test_the_transformer_is_fed_the_noised_packed_latents_sigma_and_guidance_and_regresses_noise_minus_latents(
        bases, kind):
    from diffusers import FluxPipeline

    from automodel_diffusion.objectives import randn_like

    model = flux_model(bases[kind], **({"guidance_scale": 2.0} if kind == "guided" else {}))
    seen = {}
    model.denoiser.register_forward_hook(lambda m, args, kwargs, out: seen.update(kwargs, out=out[0]),
                                         with_kwargs=True)
    x = pixels()
    losses = model(x, ["a red circle", "a blue square"], generator=torch.Generator().manual_seed(3))

    replay = torch.Generator().manual_seed(3)  # the same draws, in the same order
    latents = model.encode_images(x, replay).float()
    packed = FluxPipeline._pack_latents(latents, 2, 4, 16, 16)
    sigmas = model.objective.sigmas(2, replay)
    noise = randn_like(packed, replay)
    s = sigmas.view(-1, 1, 1)
    torch.testing.assert_close(seen["hidden_states"], (1 - s) * packed + s * noise)
    torch.testing.assert_close(seen["timestep"], sigmas)  # FluxPipeline's timestep / 1000: sigma
    assert torch.equal(seen["img_ids"], FluxPipeline._prepare_latent_image_ids(2, 8, 8, x.device, torch.float32))
    embeds, pooled, text_ids = model.pipeline.encode_prompt(["a red circle", "a blue square"],
                                                            max_sequence_length=16)
    assert torch.equal(seen["encoder_hidden_states"], embeds) and torch.equal(seen["pooled_projections"], pooled)
    assert torch.equal(seen["txt_ids"], text_ids)
    if kind == "guided":
        assert torch.equal(seen["guidance"], torch.full((2,), 2.0))
    else:
        assert seen["guidance"] is None
    target = noise - packed
    torch.testing.assert_close(losses, (seen["out"] - target).pow(2).flatten(1).mean(1))


def test_loss_falls_on_a_fixed_batch_and_guidance_acts(bases):
    model = flux_model(bases["guided"], guidance_scale=3.5)
    x, captions = pixels(4), ["a red circle", "a blue square", "a green triangle", "a white circle"]
    first, last = train_on_fixed_batch(model, x, captions)
    with torch.no_grad():
        model.conditioning.guidance = 1.0
        other = float(fixed_batch_loss(model, x, captions))
    assert numpy.isfinite(first) and last < first * 0.8, (first, last)
    assert abs(other - last) > 1e-6, "the guidance value does not reach the transformer"


def test_our_own_config_form_trains_validates_and_samples_a_flux_pipeline(bases, tmp_path):
    from diffusion_testing import EXAMPLES

    from automodel.testing import read_jsonl

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(EXAMPLES / "tiny_flow.yaml", "--model.config", bases["guided"], "--model.guidance_scale",
                             2.0, "--parallel_scheme", "{transformer: fsdp2, vae: ddp, text_encoder: ddp, "
                             "text_encoder_2: ddp}", "--step_scheduler.max_steps", 2,
                             "--step_scheduler.val_check_interval", 2, "--step_scheduler.checkpoint_interval", 2,
                             "--sample_generation.num_inference_steps", 2, "--checkpoint.checkpoint_dir", ckpt)
    assert recipe.model.conditioning.guidance == 2.0
    assert [r["step"] for r in read_jsonl(ckpt / "validation.jsonl")] == [2]
    grid = numpy.asarray(Image.open(ckpt / "samples" / "step_2.png").convert("RGB"))
    assert grid.shape == (32, 32 * 4, 3) and grid.std() > 0


# ---- upstream's FLUX.1 forms through the CLI --------------------------------------------------------------------


def test_finetune_form_trains_through_the_cli_and_saves_a_flux_pipeline(bases, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_cli("finetune", "diffusion", "-c", FINETUNE, "--model.pretrained_model_name_or_path",
                     bases["plain"], "--checkpoint.checkpoint_dir", ckpt, "--step_scheduler.ckpt_every_steps", 1,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flow matching step 3: logit_normal sampling, shift 1," in result.stderr
    assert_cli_run_saved_the_trained_pipeline(ckpt, bases["plain"], "FluxPipeline")


def test_saved_transformer_is_the_trained_one_and_generate_samples_from_it(bases, tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(FINETUNE, "--model.pretrained_model_name_or_path", bases["plain"],
                             "--checkpoint.checkpoint_dir", ckpt)
    trained = {k.removeprefix("components.transformer."): v for k, v in recipe.model.state_dict().items()}
    model_dir = ckpt / "epoch_0_step_3" / "model"
    loaded = DiffusionPipeline.from_pretrained(str(model_dir))
    assert_states_equal(loaded.transformer.state_dict(), trained)

    monkeypatch.chdir(tmp_path)
    assert_generate_samples(GENERATE, model_dir, tmp_path, "FluxPipeline", "--inference.pipeline_kwargs",
                            "{max_sequence_length: 16}")


def test_lora_form_trains_an_adapter_that_fluxpipeline_loads_and_generate_applies(bases, tmp_path, monkeypatch):
    import diffusers

    from automodel.testing import load_config as load

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(LORA, "--model.pretrained_model_name_or_path", bases["guided"],
                             "--checkpoint.checkpoint_dir", ckpt)
    model_dir = ckpt / "epoch_0_step_3" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["pytorch_lora_weights.safetensors"]
    assert recipe.model.conditioning.guidance == 3.5
    pipeline = diffusers.FluxPipeline.from_pretrained(str(bases["guided"]))
    pipeline.load_lora_weights(str(model_dir))
    base = diffusers.FluxPipeline.from_pretrained(str(bases["guided"])).transformer
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(2, 64, 16, generator=g), "timestep": torch.tensor([0.2, 0.7]),
              "encoder_hidden_states": torch.randn(2, 16, 64, generator=g),
              "pooled_projections": torch.randn(2, 32, generator=g), "guidance": torch.tensor([3.5, 3.5]),
              "img_ids": diffusers.FluxPipeline._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32),
              "txt_ids": torch.zeros(16, 3)}
    assert_denoiser_equal_with_adapter(recipe.model.components["transformer"], pipeline.transformer, base, inputs)

    monkeypatch.chdir(tmp_path)
    images = {}
    adapter = ("--model.lora_weights", ckpt / "epoch_0_step_3")
    for name, extra in (("base", ()), ("lora", adapter), ("unscaled", (*adapter, "--model.lora_scale", 0))):
        recipe_cls, cfg = load(GENERATE, "--model.pretrained_model_name_or_path", bases["guided"],
                               "--inference.pipeline_kwargs", "{max_sequence_length: 16}", "--inference.max_samples",
                               1, "--output.output_dir", tmp_path / name, *extra, route=("generate", "diffusion"))
        generate = recipe_cls(cfg)
        generate.setup()
        generate.run_train_validation_loop()
        images[name] = numpy.asarray(Image.open(next((tmp_path / name).iterdir())), dtype=numpy.int16)
    assert numpy.abs(images["base"] - images["lora"]).max() > 0, "the adapter does not change the samples"
    assert numpy.abs(images["base"] - images["unscaled"]).max() <= 1, "lora_scale 0 should switch the adapter off"
    recipe_cls, cfg = load(GENERATE, "--model.pretrained_model_name_or_path", bases["guided"], "--model.lora_weights",
                           bases["guided"], route=("generate", "diffusion"))
    with pytest.raises(AutomodelError, match="model.lora_weights: .* holds no pytorch_lora_weights.safetensors"):
        recipe_cls(cfg).setup()


# ---- what cannot act is refused, naming the key ---------------------------------------------------------------


def build_refusal(config: Path, base: Path, *overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        train_inprocess(config, "--model.pretrained_model_name_or_path", base, *overrides)
    return {issue.key: issue.message for issue in info.value.issues}


@pytest.mark.parametrize("override,key,needle", [
    (("--flow_matching.adapter_kwargs.scale", "2"), "flow_matching.adapter_kwargs.scale", "not a setting of the flux"),
    (("--flow_matching.adapter_kwargs.guidance_scale", "-1"), "flow_matching.adapter_kwargs.guidance_scale", "> 0"),
    (("--flow_matching.adapter_kwargs.use_guidance_embeds", "maybe"), "flow_matching.adapter_kwargs.use_guidance_"
     "embeds", "true or false"),
    (("--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow")), "flow_matching.adapter_type",
     "needs a FluxPipeline, but"),
])
def test_flux_settings_that_cannot_act_are_refused_at_validation(override, key, needle):
    found = refusals(FINETUNE, *override)
    assert key in found and needle in found[key], found


def test_model_type_flux_needs_a_flux_pipeline():
    found = refusals(LORA, "--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow"))
    assert "needs a FluxPipeline, but" in found["model.model_type"], found
    found = build_refusals_on_the_sd3_pipeline(LORA)  # a hub name is only known once built
    assert set(found) == {"model.model_type", "flow_matching.adapter_type"}
    assert "the pipeline is a StableDiffusion3Pipeline" in found["model.model_type"], found


def test_guidance_settings_must_match_the_transformer(bases, tmp_path):
    found = build_refusal(LORA, bases["plain"], "--checkpoint.checkpoint_dir", tmp_path)
    assert "has no guidance embeddings" in found["flow_matching.adapter_kwargs.use_guidance_embeds"], found
    found = build_refusal(FINETUNE, bases["plain"], "--checkpoint.checkpoint_dir", tmp_path,
                          "--flow_matching.adapter_kwargs.guidance_scale", "3.5")
    assert "no guidance value is fed" in found["flow_matching.adapter_kwargs.guidance_scale"], found


def test_use_guidance_embeds_false_on_a_guidance_distilled_transformer_feeds_guidance_scale_as_upstream(bases):
    """Upstream's own FLUX.1-dev form: use_guidance_embeds false, guidance_scale 1, on a transformer with guidance
    embeddings. Upstream feeds guidance_scale whatever use_guidance_embeds says (that transformer needs a value in
    every call); so does this, and says so."""
    from automodel_diffusion.upstream import apply_adapter

    _, cfg = load_config(FINETUNE)
    model = flux_model(bases["guided"])
    note = apply_adapter(cfg, model)
    assert model.conditioning.guidance == 1.0, "guidance_scale 1 is what the transformer is fed"
    assert "use_guidance_embeds: false" in note and "it is fed 1" in note, note
    assert apply_adapter(cfg, flux_model(bases["plain"])) is None


def test_model_guidance_scale_needs_guidance_embeddings(bases):
    from automodel_diffusion import AutoDiffusionPipeline

    with pytest.raises(ConfigError, match="model.guidance_scale: 2.0: this FLUX.1 transformer has no guidance"):
        flux_model(bases["plain"], guidance_scale=2.0)
    with pytest.raises(AutomodelError, match="model.guidance_scale: applies to FLUX.1"):
        AutoDiffusionPipeline.from_config(str(ASSETS / "tiny_flow"), guidance_scale=2.0)
    assert flux_model(bases["guided"]).conditioning.guidance == 3.5, "FluxPipeline's default guidance"


def test_a_transformer_wanting_conditioning_image_channels_is_refused(bases):
    import diffusers

    from automodel_diffusion import AutoDiffusionPipeline

    pipeline = diffusers.FluxPipeline.from_pretrained(str(bases["plain"]))
    config = {k: v for k, v in pipeline.transformer.config.items() if not k.startswith("_")}
    pipeline.transformer = diffusers.FluxTransformer2DModel(**{**config, "in_channels": 32})  # Fill / Control-like
    with pytest.raises(AutomodelError, match="takes 32 input channels, not the 16 of its packed latents"):
        AutoDiffusionPipeline(pipeline)
