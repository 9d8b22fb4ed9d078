"""HunyuanVideo 1.5 text-to-video (HunyuanVideo15Pipeline) trains: the transformer is fed what the pipeline feeds it
when it samples — encode_prompt's Qwen2.5-VL and glyph byT5 embeddings with their masks, the noisy latents with zero
condition latents and mask channel, zero image embeddings, the timestep sigma * 1000 — and the clip's VAE latents
times scaling_factor; upstream's i2v_prob conditions a batch on its first latent frame. Upstream's HunyuanVideo forms
(tests/upstream_forms/hunyuan_*_upstream.yaml) train, save a pipeline diffusers loads and generates from, and a LoRA
adapter the pipeline's transformer loads; what cannot act is refused."""

from __future__ import annotations

from pathlib import Path

import diffusion_testing as dt
import pytest
import torch
from PIL import Image

from automodel.errors import AutomodelError
from automodel.testing import assert_states_equal, losses_by_step
from automodel_diffusion.lora import LORA_WEIGHTS

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE, LORA, GENERATE = (FORMS / f"{name}_upstream.yaml" for name in ("hunyuan_finetune", "hunyuan_lora",
                                                                         "generate_hunyuan"))
CAPTIONS = ["a red square moving right", 'a sign that reads "hi"']  # the second has glyph text for byT5


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return dt.tiny_hunyuan(tmp_path_factory.mktemp("hunyuan") / "base")


def transformer_calls(transformer: torch.nn.Module) -> list[dict]:
    """Every call's keyword arguments (and output) from now on."""
    calls = []
    transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append({**kwargs, "out": out[0]}),
                                      with_kwargs=True)
    return calls


# ---- the training step, against diffusers' own code ------------------------------------------------------------


def test_the_transformer_is_fed_what_the_pipeline_feeds_it_when_it_samples(base, clips):
    from automodel_diffusion.objectives import randn_like

    model = dt.family_model(base)
    seen = transformer_calls(model.denoiser)
    x = dt.clip_batch(clips)
    losses = model(x, CAPTIONS, generator=torch.Generator().manual_seed(3))

    replay = torch.Generator().manual_seed(3)  # the same draws, in the same order
    latents = model.encode_images(x, replay).float()
    sigmas = model.objective.sigmas(2, replay)
    noise = randn_like(latents, replay)
    s = sigmas.view(-1, 1, 1, 1, 1)
    fed = seen[0]
    torch.testing.assert_close(fed["hidden_states"][:, :4], (1 - s) * latents + s * noise)
    torch.testing.assert_close(fed["timestep"], sigmas * 1000)
    torch.testing.assert_close(losses, (fed["out"] - (noise - latents)).pow(2).flatten(1).mean(1))

    # what HunyuanVideo15Pipeline feeds its transformer for the same captions (one step, no guidance)
    pipeline = model.pipeline
    pipeline.guider = pipeline.guider.new(guidance_scale=1.0)
    sampled = transformer_calls(pipeline.transformer)
    pipeline(prompt=CAPTIONS, height=32, width=32, num_frames=5, num_inference_steps=1, output_type="latent")
    theirs = sampled[0]
    for key in ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
                "encoder_attention_mask_2", "image_embeds"):
        assert torch.equal(fed[key], theirs[key]), key
    assert torch.equal(fed["hidden_states"][:, 4:], theirs["hidden_states"][:, 4:])  # zero condition latents, mask
    assert fed["image_embeds"].shape == (2, 729, 16) and not fed["image_embeds"].any()
    assert fed["encoder_attention_mask_2"][0].sum() == 0 < fed["encoder_attention_mask_2"][1].sum()  # glyph text


def test_latents_are_the_vaes_times_its_scaling_factor_encoded_one_clip_at_a_time(base, clips):
    model = dt.family_model(base)
    vae = model.pipeline.vae
    x = dt.clip_batch(clips)
    latents = model.encode_images(x, torch.Generator().manual_seed(5))
    dist = model.encode_pixels(x).latent_dist
    for i in range(2):  # each clip's distribution is the one the VAE gives that clip alone
        torch.testing.assert_close(dist.parameters[i:i + 1], vae.encode(x[i:i + 1]).latent_dist.parameters)
    # HunyuanVideo15Pipeline decodes latents / scaling_factor
    scaled = dist.sample(generator=torch.Generator().manual_seed(5)) * vae.config.scaling_factor
    torch.testing.assert_close(latents, scaled)
    assert latents.shape == (2, 4, 2, 4, 4)
    with pytest.raises(AutomodelError, match="clips of 1 \\+ 4k frames.*have 6: set num_frames .* to e.g. 5"):
        model.encode_images(torch.zeros(1, 3, 6, 32, 32), None)


def test_a_latent_cache_gives_the_pipeline_the_losses_of_its_own_encoding(base, clips):
    """Cache entries made one clip and one caption at a time (as precompute diffusion makes them) give the pipeline
    the losses of encoding the batch itself; the transformer alone cannot be loaded (diffusers' pipeline needs its
    VAE to be built), which is refused with the reason."""
    from automodel_diffusion import AutoDiffusionPipeline

    model = dt.family_model(base)
    x, captions, cpu = dt.clip_batch(clips), ["a red square moving right", ""], torch.device("cpu")
    conditioning = model.conditioning
    with torch.no_grad():
        cached = {"latent_parameters": model.encode_pixels(x).latent_dist.parameters,
                  "conditions": [conditioning.split(conditioning.encode([c], cpu))[0] for c in captions],
                  "empty_conditions": conditioning.split(conditioning.encode([""], cpu))[0]}
        expected = model(x, captions, generator=torch.Generator().manual_seed(4))
        got = model(None, captions, generator=torch.Generator().manual_seed(4), cached=cached)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    with pytest.raises(AutomodelError, match="HunyuanVideo15Pipeline cannot be built without its VAE"):
        AutoDiffusionPipeline.load_transformer_only(str(base), "HunyuanVideo15Transformer3DModel")


def test_i2v_prob_conditions_a_batch_on_its_first_latent_frame(base, clips):
    model = dt.family_model(base)
    seen = transformer_calls(model.denoiser)
    x = dt.clip_batch(clips)
    model(x, CAPTIONS, generator=torch.Generator().manual_seed(1))
    assert not seen[-1]["hidden_states"][:, 4:].any()  # i2v_prob 0: text-to-video
    model.conditioning.i2v_prob = 1.0
    model(x, CAPTIONS, generator=torch.Generator().manual_seed(1))
    latents = model.encode_images(x, torch.Generator().manual_seed(1))
    condition = seen[-1]["hidden_states"][:, 4:]
    torch.testing.assert_close(condition[:, :4, 0], latents[:, :, 0])
    assert not condition[:, :4, 1:].any()
    assert condition[:, 4, 0].eq(1).all() and not condition[:, 4, 1:].any()


# ---- upstream's HunyuanVideo 1.5 forms ---------------------------------------------------------------------------


def test_finetune_form_trains_saves_a_pipeline_that_loads_samples_and_generates(base, clips, tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline

    ckpt = tmp_path / "ckpt"
    recipe = dt.train_inprocess(FINETUNE, *dt.form_overrides(base, clips, ckpt), "--step_scheduler.local_batch_size", 1,
                                "--step_scheduler.global_batch_size", 1, "--sample_generation.enabled", "true",
                                "--sample_generation.num_inference_steps", 2, "--sample_generation.guidance_scale", 3,
                                "--step_scheduler.val_every_steps", 3)
    assert recipe.model.conditioning.i2v_prob == 0.3 and recipe.model.conditioning.image_embed_shape == (729, 16)
    assert recipe.model.components["transformer"].gradient_checkpointing  # fsdp.activation_checkpointing: true
    losses = losses_by_step(ckpt / "training.jsonl")  # logged every log_interval (10) steps and at the last
    assert list(losses) == [3] and torch.isfinite(torch.tensor(losses[3]))
    trained = {k.removeprefix("components.transformer."): v for k, v in recipe.model.state_dict().items()}
    before = DiffusionPipeline.from_pretrained(str(base)).transformer.state_dict()
    assert sum(not torch.equal(before[k], trained[k]) for k in before) > len(before) // 2
    model_dir = ckpt / "epoch_0_step_3" / "model"
    loaded = DiffusionPipeline.from_pretrained(str(model_dir))
    assert type(loaded).__name__ == "HunyuanVideo15Pipeline"
    assert_states_equal(loaded.transformer.state_dict(), trained)
    assert recipe.model.pipeline.guider.guidance_scale == 6.0  # the samples' guider was put back
    with Image.open(ckpt / "samples" / "step_3.webp") as grid:  # 4 prompts, one row, 5 frames
        assert grid.n_frames == 5 and grid.size == (4 * 32, 32)

    monkeypatch.chdir(tmp_path)
    recipe_cls, cfg = dt.load_config(GENERATE, "--model.pretrained_model_name_or_path", model_dir,
                                     route=("generate", "diffusion"))
    generate = recipe_cls(cfg)
    generate.setup()
    assert generate.pipeline.guider.guidance_scale == 4.0 and "guidance_scale" not in generate.call_settings
    generate.run_train_validation_loop()
    written = sorted((tmp_path / "inference_outputs").iterdir())
    assert [p.name for p in written] == ["sample_000_a_red_square_moving_right.webp",
                                         "sample_001_a_sign_that_reads_hi.webp"]
    with Image.open(written[0]) as video:
        video.load()
        assert video.n_frames == 5 and video.size == (32, 32)


def test_lora_form_trains_an_adapter_that_the_pipelines_transformer_loads(base, clips, tmp_path, monkeypatch, capsys):
    """Upstream's model_save_format: torch_save / save_consolidated: false beside it govern nothing (model/ is the
    adapter alone): a note says so."""
    import diffusers

    ckpt = tmp_path / "ckpt"
    recipe = dt.train_inprocess(LORA, *dt.form_overrides(base, clips, ckpt))
    assert "note: checkpoint.model_save_format: torch_save governs nothing in this LoRA run" in \
        "".join(capsys.readouterr())
    model_dir = ckpt / "epoch_0_step_3" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == [LORA_WEIGHTS]
    pipeline = diffusers.HunyuanVideo15Pipeline.from_pretrained(str(base))
    pipeline.transformer.load_lora_adapter(str(model_dir), prefix="transformer", weight_name=LORA_WEIGHTS)
    plain = diffusers.HunyuanVideo15Pipeline.from_pretrained(str(base)).transformer
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 9, 2, 4, 4, generator=g), "timestep": torch.tensor([700.0]),
              "encoder_hidden_states": torch.randn(1, 6, 32, generator=g),
              "encoder_attention_mask": torch.tensor([[1.0, 1, 1, 1, 0, 0]]),
              "encoder_hidden_states_2": torch.randn(1, 3, 16, generator=g),
              "encoder_attention_mask_2": torch.tensor([[1.0, 1, 0]]), "image_embeds": torch.zeros(1, 4, 16)}
    dt.assert_denoiser_equal_with_adapter(recipe.model.components["transformer"], pipeline.transformer, plain, inputs)

    monkeypatch.chdir(tmp_path)  # generate diffusion loads it through the transformer
    recipe_cls, cfg = dt.load_config(GENERATE, "--model.pretrained_model_name_or_path", base, "--model.lora_weights",
                                     model_dir, "--inference.max_samples", 1, route=("generate", "diffusion"))
    generate = recipe_cls(cfg)
    generate.setup()
    assert generate.pipeline.transformer.peft_config["default"].r == 4
    generate.run_train_validation_loop()
    assert len(list((tmp_path / "inference_outputs").iterdir())) == 1


# ---- what cannot act is refused, naming the key ---------------------------------------------------------------


@pytest.mark.parametrize("override,key,needle", [
    (("--flow_matching.adapter_kwargs", "{use_condition_latents: false}"),
     "flow_matching.adapter_kwargs.use_condition_latents", "only true"),
    (("--flow_matching.adapter_kwargs", "{default_image_embed_shape: [729]}"),
     "flow_matching.adapter_kwargs.default_image_embed_shape", "expected [tokens, width]"),
    (("--flow_matching.adapter_kwargs", "{guidance_scale: 1}"), "flow_matching.adapter_kwargs.guidance_scale",
     "not a setting of the hunyuan adapter"),
    (("--model.optimize_hunyuan_flash_varlen_mask", "true"), "model.optimize_hunyuan_flash_varlen_mask",
     "flash-attention varlen kernels), which needs a CUDA GPU"),
    (("--model.attention_backend", "flash_varlen"), "model.attention_backend", "needs a CUDA GPU"),
    (("--data.dataloader.model_type", "cosmos"), "data.dataloader.model_type", "cosmos model family"),
])
def test_hunyuan_settings_that_cannot_act_are_refused_at_validation(override, key, needle):
    found = dt.refusals(FINETUNE, *override)
    assert key in found and needle in found[key], found


def test_the_hunyuan_family_keys_need_a_hunyuan_pipeline(base, clips, tmp_path):
    from automodel_diffusion import AutoDiffusionPipeline
    from automodel_diffusion.upstream import apply_adapter

    found = dt.build_refusals_on_the_sd3_pipeline(LORA)  # a hub name is only known once built
    assert set(found) == {"model.model_type", "flow_matching.adapter_type", "data.dataloader.model_type"}, found
    assert "'hunyuan' (HunyuanVideo 1.5), but the pipeline is a StableDiffusion3Pipeline" in found["model.model_type"]
    _, cfg = dt.load_config(FINETUNE, *dt.form_overrides(base, clips, tmp_path), "--flow_matching.adapter_kwargs",
                            "{default_image_embed_shape: [729, 1152]}")
    with pytest.raises(AutomodelError, match=r"image embeddings are 16 wide .* set \[729, 16\]"):
        apply_adapter(cfg, dt.family_model(base))
    with pytest.raises(AutomodelError, match="max_sequence_length: HunyuanVideo15Pipeline encodes every caption"):
        AutoDiffusionPipeline.from_pretrained(str(base), max_sequence_length=16)


def test_an_image_to_video_hunyuan_pipeline_is_refused(base):
    from automodel_diffusion.pipeline import index_issue, read_model_index

    index = read_model_index(base)
    assert index_issue(index) is None
    assert "HunyuanVideo15ImageToVideoPipeline with a HunyuanVideo15Transformer3DModel denoiser, which diffusion " \
           "training does not support" in index_issue({**index, "_class_name": "HunyuanVideo15ImageToVideoPipeline"})
