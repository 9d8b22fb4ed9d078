"""Qwen-Image (QwenImagePipeline) trains: the training input is diffusers' own VAE normalisation and packing of the
latents, the captions through the pipeline's own encode_prompt (chat template, dropped prefix, padding mask), the
target noise minus the packed latents, the timestep sigma; upstream's Qwen-Image forms
(tests/upstream_forms/qwen_image_*_upstream.yaml) train through the CLI, save a pipeline diffusers loads (with the
trained weights) and a LoRA adapter QwenImagePipeline.load_lora_weights loads; what cannot act is refused."""

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
    load_config,
    pixels,
    refusals,
    tiny_qwen_image,
    train_inprocess,
    train_on_fixed_batch,
)
from PIL import Image

from automodel.errors import AutomodelError
from automodel.testing import assert_states_equal, losses_by_step, run_cli

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE = FORMS / "qwen_image_finetune_upstream.yaml"
LORA = FORMS / "qwen_image_lora_upstream.yaml"
PRETRAIN = FORMS / "qwen_image_pretrain_upstream.yaml"
GENERATE = FORMS / "generate_upstream.yaml"
CAPTIONS = ["a red circle", "a blue square on a green background"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_qwen_image(tmp_path_factory.mktemp("qwen_image") / "base")


# ---- the training step, against diffusers' own helpers ---------------------------------------------------------


def test_a_latent_cache_gives_the_transformer_alone_the_full_pipelines_loss(base):
    """Captions of different lengths: each cached at its own length, padded into the batch as the pipeline pads."""
    assert_a_cache_gives_the_full_pipelines_loss(base, "QwenImageTransformer2DModel", [*CAPTIONS, "a red square"])


def test_the_tiny_tokenizer_makes_the_pipeline_drop_exactly_the_prompt_templates_prefix(base):
    """As with Qwen's own tokenizer, the template's system turn and user header are the 34 tokens QwenImagePipeline
    drops, so the text embeddings are the caption's (and the closing tokens) only."""
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(str(base))
    template = pipeline.prompt_template_encode
    ids = pipeline.tokenizer(template.format("a red circle"))["input_ids"]
    start = pipeline.prompt_template_encode_start_idx
    assert pipeline.tokenizer.decode(ids[:start]) == template[:template.index("{}")]
    assert pipeline.tokenizer.decode(ids[start:]).startswith("a red circle<|im_end|>")


def test_latents_are_the_pipelines_normalised_vae_latents_and_its_packing_inverts(base):
    from diffusers import QwenImagePipeline

    model = family_model(base)
    vae = model.pipeline.vae
    x = pixels()
    latents = model.encode_images(x, torch.Generator().manual_seed(5))
    raw = vae.encode(x.unsqueeze(2)).latent_dist.sample(generator=torch.Generator().manual_seed(5))
    # what QwenImagePipeline does before decoding: latents / (1 / std) + mean
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(latents.unsqueeze(2) / std + mean, raw)
    assert latents.shape == (2, 4, 8, 8)

    packed, positions = model.conditioning.pack(latents)
    assert packed.shape == (2, 16, 16) and positions["img_shapes"] == [[(1, 4, 4)]] * 2
    unpacked = QwenImagePipeline._unpack_latents(packed, 32, 32, model.pipeline.vae_scale_factor)
    assert torch.equal(unpacked, latents.unsqueeze(2)), "QwenImagePipeline's unpacking does not invert the packing"
    with pytest.raises(AutomodelError, match="Qwen-Image packs its latents into 2x2 patches.*multiple of 8"):
        model.conditioning.pack(torch.zeros(1, 4, 5, 8))


def test_the_transformer_is_fed_the_noised_packed_latents_sigma_and_the_pipelines_prompt_embeddings(base):
    from diffusers import QwenImagePipeline

    from automodel_diffusion.objectives import randn_like

    model = family_model(base)
    seen = {}
    model.denoiser.register_forward_hook(lambda m, args, kwargs, out: seen.update(kwargs, out=out[0]),
                                         with_kwargs=True)
    x = pixels()
    losses = model(x, CAPTIONS, generator=torch.Generator().manual_seed(3))

    replay = torch.Generator().manual_seed(3)  # the same draws, in the same order
    latents = model.encode_images(x, replay).float()
    packed = QwenImagePipeline._pack_latents(latents, 2, 4, 8, 8)
    sigmas = model.objective.sigmas(2, replay)
    noise = randn_like(packed, replay)
    s = sigmas.view(-1, 1, 1)
    torch.testing.assert_close(seen["hidden_states"], (1 - s) * packed + s * noise)
    torch.testing.assert_close(seen["timestep"], sigmas)  # QwenImagePipeline's timestep / 1000: sigma
    assert seen["img_shapes"] == [[(1, 4, 4)]] * 2 and "guidance" not in seen
    embeds, mask = model.pipeline.encode_prompt(CAPTIONS)
    assert mask is not None and mask.sum(1).tolist()[0] < mask.shape[1], "the captions should pad differently"
    assert torch.equal(seen["encoder_hidden_states"], embeds)
    assert torch.equal(seen["encoder_hidden_states_mask"], mask)
    target = noise - packed
    torch.testing.assert_close(losses, (seen["out"] - target).pow(2).flatten(1).mean(1))


def test_loss_falls_on_a_fixed_batch(base):
    first, last = train_on_fixed_batch(family_model(base), pixels(4), [*CAPTIONS, "a green triangle", "a white circle"])
    assert numpy.isfinite(first) and last < first * 0.8, (first, last)


def test_our_own_config_form_trains_validates_and_samples_a_qwen_image_pipeline(base, tmp_path):
    from diffusion_testing import EXAMPLES

    from automodel.testing import read_jsonl

    ckpt = tmp_path / "ckpt"
    train_inprocess(EXAMPLES / "tiny_flow.yaml", "--model.config", base, "--parallel_scheme",
                    "{transformer: fsdp2, vae: ddp, text_encoder: ddp}", "--step_scheduler.max_steps", 2,
                    "--step_scheduler.val_check_interval", 2, "--step_scheduler.checkpoint_interval", 2,
                    "--sample_generation.num_inference_steps", 2, "--checkpoint.checkpoint_dir", ckpt)
    assert [r["step"] for r in read_jsonl(ckpt / "validation.jsonl")] == [2]
    grid = numpy.asarray(Image.open(ckpt / "samples" / "step_2.png").convert("RGB"))
    assert grid.shape == (32, 32 * 4, 3) and grid.std() > 0


# ---- upstream's Qwen-Image forms --------------------------------------------------------------------------------


def test_finetune_form_trains_through_the_cli_and_saves_a_qwen_image_pipeline(base, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_cli("finetune", "diffusion", "-c", FINETUNE, "--model.pretrained_model_name_or_path", base,
                     "--checkpoint.checkpoint_dir", ckpt, "--step_scheduler.ckpt_every_steps", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flow matching step 3: logit_normal sampling, shift 2.23," in result.stderr
    # upstream's example carries guidance_scale 3.5 with use_guidance_embeds false, which it never feeds
    assert "note: flow_matching.adapter_kwargs.guidance_scale: 3.5 governs nothing in this run" in result.stderr
    assert_cli_run_saved_the_trained_pipeline(ckpt, base, "QwenImagePipeline")


def test_saved_transformer_is_the_trained_one_and_generate_samples_from_it(base, tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(FINETUNE, "--model.pretrained_model_name_or_path", base, "--checkpoint.checkpoint_dir",
                             ckpt)
    trained = {k.removeprefix("components.transformer."): v for k, v in recipe.model.state_dict().items()}
    model_dir = ckpt / "epoch_0_step_3" / "model"
    loaded = DiffusionPipeline.from_pretrained(str(model_dir))
    assert_states_equal(loaded.transformer.state_dict(), trained)

    monkeypatch.chdir(tmp_path)
    assert_generate_samples(GENERATE, model_dir, tmp_path, "QwenImagePipeline")


def test_lora_form_trains_an_adapter_that_qwenimagepipeline_loads(base, tmp_path):
    import diffusers

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(LORA, "--model.pretrained_model_name_or_path", base, "--checkpoint.checkpoint_dir", ckpt)
    model_dir = ckpt / "epoch_0_step_3" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["pytorch_lora_weights.safetensors"]
    pipeline = diffusers.QwenImagePipeline.from_pretrained(str(base))
    pipeline.load_lora_weights(str(model_dir))
    plain = diffusers.QwenImagePipeline.from_pretrained(str(base)).transformer
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(2, 16, 16, generator=g), "timestep": torch.tensor([0.2, 0.7]),
              "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
              "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
              "img_shapes": [[(1, 4, 4)]] * 2}
    assert_denoiser_equal_with_adapter(recipe.model.components["transformer"], pipeline.transformer, plain, inputs)


def test_pretrain_form_reinitialises_the_transformer_and_trains_it(base, tmp_path):
    from diffusers import DiffusionPipeline

    from automodel_diffusion.upstream import model_issues

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(PRETRAIN, "--model.pretrained_model_name_or_path", base, "--checkpoint.checkpoint_dir",
                             ckpt)
    assert recipe.model.autocast_dtype == torch.bfloat16 and not model_issues(recipe.cfg.model)
    losses = losses_by_step(ckpt / "training.jsonl")
    assert sorted(losses) == [1, 2] and all(numpy.isfinite(v) for v in losses.values())
    saved = DiffusionPipeline.from_pretrained(str(ckpt / "epoch_0_step_2" / "model"))
    before = DiffusionPipeline.from_pretrained(str(base))
    assert all(not torch.equal(v, saved.transformer.state_dict()[k])
               for k, v in before.transformer.state_dict().items() if k.endswith(".weight"))
    assert_states_equal(saved.text_encoder.state_dict(), before.text_encoder.state_dict())


# ---- what cannot act is refused, naming the key ---------------------------------------------------------------


@pytest.mark.parametrize("override,key,needle", [
    (("--flow_matching.adapter_kwargs.guidance_scale", "0"), "flow_matching.adapter_kwargs.guidance_scale",
     "expected a number > 0, found 0"),
    (("--flow_matching.adapter_kwargs.use_guidance_embeds", "true"), "flow_matching.adapter_kwargs.use_guidance_"
     "embeds", "takes no guidance value"),
    (("--flow_matching.adapter_kwargs.scale", "2"), "flow_matching.adapter_kwargs.scale",
     "not a setting of the qwen_image adapter"),
    (("--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow")), "flow_matching.adapter_type",
     "'qwen_image' (Qwen-Image) needs a QwenImagePipeline, but"),
    (("--flow_matching.adapter_type", "qwen_image_edit"), "flow_matching.adapter_kwargs",
     "the simple / qwen_image_edit adapter, which take none"),
])
def test_qwen_image_settings_that_cannot_act_are_refused_at_validation(override, key, needle):
    found = refusals(FINETUNE, *override)
    assert key in found and needle in found[key], found


def test_model_type_qwen_image_needs_a_qwen_image_pipeline(base):
    from automodel_diffusion.upstream import apply_adapter

    found = refusals(LORA, "--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow"))
    assert "needs a QwenImagePipeline, but" in found["model.model_type"], found
    found = build_refusals_on_the_sd3_pipeline(LORA)  # a hub name is only known once built
    assert set(found) == {"model.model_type", "flow_matching.adapter_type"}
    assert "'qwen_image' (Qwen-Image), but the pipeline is a StableDiffusion3Pipeline" in found["model.model_type"]
    _, cfg = load_config(LORA, "--model.pretrained_model_name_or_path", base)
    assert apply_adapter(cfg, family_model(base)) is None


def test_a_guidance_distilled_or_editing_qwen_image_pipeline_is_refused(base, tmp_path):
    import diffusers

    from automodel_diffusion import AutoDiffusionPipeline
    from automodel_diffusion.pipeline import index_issue, read_model_index

    with pytest.raises(AutomodelError, match="sets guidance_embeds, but diffusers' QwenImageTransformer2DModel"):
        AutoDiffusionPipeline.from_pretrained(str(tiny_qwen_image(tmp_path / "guided", guidance_embeds=True)))
    index = read_model_index(base)
    assert index_issue(index) is None
    assert "QwenImageEditPipeline with a QwenImageTransformer2DModel denoiser, which diffusion training does not " \
           "support" in index_issue({**index, "_class_name": "QwenImageEditPipeline"})
    pipeline = diffusers.QwenImagePipeline.from_pretrained(str(base))
    edit = diffusers.QwenImageEditPipeline(pipeline.scheduler, pipeline.vae, pipeline.text_encoder, pipeline.tokenizer,
                                           None, pipeline.transformer)
    with pytest.raises(AutomodelError, match="training a QwenImageEditPipeline with a QwenImageTransformer2DModel"):
        AutoDiffusionPipeline(edit)
