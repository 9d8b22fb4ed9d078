"""LTX-2 (LTX2Pipeline) trains its video and audio streams as upstream's ltx2 adapter does: the text conditioning is
what LTX2Pipeline feeds its transformer (encode_prompt, then the connectors), the video latents are normalised as the
pipeline does, the clips' (silent) audio latents are noised with each sample's sigma and their loss added with
audio_loss_weight; upstream's LTX-2 forms (tests/upstream_forms/ltx2_*_upstream.yaml) train on a folder of clips,
save a pipeline LTX2Pipeline loads and a LoRA adapter its load_lora_weights loads; generate diffusion writes the video
and its audio; what cannot act is refused."""

from __future__ import annotations

import math
import wave
from pathlib import Path

import pytest
import torch
from diffusion_testing import (
    ASSETS,
    CLIP_CAPTIONS,
    assert_denoiser_equal_with_adapter,
    build_refusals_on_the_sd3_pipeline,
    clip_batch,
    family_model,
    form_overrides,
    load_config,
    refusals,
    tiny_ltx2,
    train_inprocess,
)
from PIL import Image

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import assert_states_equal

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE, LORA, GENERATE = (FORMS / f"{name}_upstream.yaml" for name in ("ltx2_finetune", "ltx2_lora",
                                                                          "generate_ltx2"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_ltx2(tmp_path_factory.mktemp("ltx2") / "base")


# ---- the training step, against diffusers' own code ------------------------------------------------------------


def test_text_conditioning_is_what_ltx2pipeline_feeds_its_transformer(base):
    model = family_model(base, max_sequence_length=16)
    seen = {}
    model.pipeline.transformer.register_forward_hook(lambda m, args, kwargs, out: seen.update(call=kwargs),
                                                     with_kwargs=True)
    prompt = "red"  # two tokens, left-padded to 16
    model.pipeline(prompt, height=32, width=32, num_frames=5, num_inference_steps=1, guidance_scale=1.0,
                   stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=1.0, max_sequence_length=16,
                   output_type="latent", generator=torch.Generator().manual_seed(0))
    ours = model.conditioning.encode([prompt], torch.device("cpu"))
    call = seen["call"]
    for key in ("encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask"):
        torch.testing.assert_close(ours[key], call[key], atol=0, rtol=0)
    assert ours["encoder_hidden_states"].shape == (1, 16, 16)
    _, tokens, _, _ = model.pipeline.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=16)
    assert tokens.tolist() == [[0] * 14 + [1] * 2]  # the connectors got the encoder's left-padded tokens
    assert call["use_cross_timestep"] and call["fps"] == 24.0  # what the trained transformer is called with too


def test_the_transformer_gets_both_noisy_streams_and_the_loss_adds_the_weighted_audio_loss(base, clips):
    from automodel_diffusion.objectives import randn_like

    model = family_model(base, max_sequence_length=16)
    model.conditioning.set_streams(fps=12.0, audio_loss_weight=0.5)
    seen = {}
    model.denoiser.register_forward_hook(lambda m, args, kwargs, out: seen.update(kwargs, out=out), with_kwargs=True)
    x, captions = clip_batch(clips), list(CLIP_CAPTIONS[:2])
    losses = model(x, captions, generator=torch.Generator().manual_seed(3))

    replay = torch.Generator().manual_seed(3)  # the same draws, in the same order
    latents = model.encode_images(x, replay).float()
    raw = model.pipeline.vae.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(3))
    vae = model.pipeline.vae  # what LTX2Pipeline undoes before decoding
    torch.testing.assert_close(model.pipeline._denormalize_latents(latents, vae.latents_mean, vae.latents_std,
                                                                   vae.config.scaling_factor), raw)
    assert latents.shape == (2, 4, 3, 16, 16)
    video = model.pipeline._pack_latents(latents)
    sigmas = model.objective.sigmas(2, replay)
    video_noise = randn_like(video, replay)
    audio = model.conditioning.silent_audio(5, torch.device("cpu")).expand(2, -1, -1)
    audio_noise = randn_like(audio, replay)
    s = sigmas.view(-1, 1, 1)
    torch.testing.assert_close(seen["hidden_states"], (1 - s) * video + s * video_noise)
    torch.testing.assert_close(seen["audio_hidden_states"], (1 - s) * audio + s * audio_noise)
    torch.testing.assert_close(seen["timestep"], sigmas * 1000)  # the scheduler's timestep, as the pipeline feeds
    torch.testing.assert_close(seen["sigma"], sigmas * 1000)
    assert (seen["num_frames"], seen["height"], seen["width"], seen["fps"]) == (3, 16, 16, 12.0)
    assert seen["audio_num_frames"] == audio.shape[1] and seen["use_cross_timestep"]
    video_out, audio_out = seen["out"]
    expected = (video_out - (video_noise - video)).pow(2).flatten(1).mean(1) \
        + 0.5 * (audio_out - (audio_noise - audio)).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(losses, expected)


def test_silent_audio_is_the_audio_vaes_normalised_encoding_of_silences_log_mel(base):
    model = family_model(base)
    audio_vae = model.pipeline.audio_vae
    model.conditioning.set_streams(fps=24.0)
    tokens = model.conditioning.silent_audio(121, torch.device("cpu"))
    mel_frames = round(121 / 24 * 16000) // 160 + 1  # a centred STFT over the clip's 5.04 s at hop 160
    mel = torch.full((1, 2, mel_frames, 8), math.log(1e-5))
    latents = audio_vae.encode(mel).latent_dist.mode()  # (1, 2 channels, length, 2 mel bins)
    packed = latents.transpose(1, 2).flatten(2, 3)
    torch.testing.assert_close(tokens, (packed - audio_vae.latents_mean) / audio_vae.latents_std)
    # the length LTX2Pipeline gives 121 frames at 24 fps (upstream's preprocessing accepts one latent more or less)
    assert abs(tokens.shape[1] - round(121 / 24 * 16000 / 160 / 4)) <= 1


def test_a_latent_cache_read_by_the_full_pipeline_gives_its_on_the_fly_loss(base, clips):
    """precompute diffusion's entries (one clip, one caption at a time) give the same losses: LTX-2 trains on a cache
    with its full pipeline loaded (the VAEs' statistics are weights), never the transformer alone."""
    from automodel_diffusion.objectives import ObjectiveConfig, build_objective

    model = family_model(base, max_sequence_length=16)
    model.objective = build_objective(ObjectiveConfig(caption_dropout=0.5), model.pipeline.scheduler)
    conditioning, cpu = model.conditioning, torch.device("cpu")
    x, captions = clip_batch(clips, 3), list(CLIP_CAPTIONS[:3])
    with torch.no_grad():
        cached = {"latent_parameters": torch.cat([model.encode_pixels(x[i:i + 1]).latent_dist.parameters
                                                  for i in range(3)]),
                  "conditions": [conditioning.split(conditioning.encode([c], cpu))[0] for c in captions],
                  "empty_conditions": conditioning.split(conditioning.encode([""], cpu))[0]}
        expected = model(x, captions, generator=torch.Generator().manual_seed(4))
        got = model(None, captions, generator=torch.Generator().manual_seed(4), cached=cached)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_precompute_makes_a_cache_the_full_pipeline_trains_on(base, clips, tmp_path, capsys):
    import yaml
    from diffusion_testing import cli

    config = tmp_path / "precompute.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": str(base), "max_sequence_length": 16},
        "dataset": {"_target_": "automodel_diffusion.datasets.VideoCaptionDataset", "path": str(clips),
                    "resolution": 32, "num_frames": 5},
        "output": {"cache_dir": str(tmp_path / "cache")}}))
    assert cli("precompute", "diffusion", "-c", config) == 0
    assert "train on it with the full pipeline (its latents are normalised with VAE weights)" in capsys.readouterr().err
    recipe = train_inprocess(FINETUNE, *form_overrides(base, tmp_path / "cache", tmp_path / "ckpt"))
    assert type(recipe.train_dataset).__name__ == "LatentCacheDataset" and recipe.step_scheduler.step == 3


def test_clips_that_the_video_vae_cannot_encode_and_a_transformer_alone_are_refused(base):
    from automodel_diffusion import AutoDiffusionPipeline

    model = family_model(base)
    with pytest.raises(AutomodelError, match="clips of 1 \\+ 2k frames.*have 4: set num_frames .* to e.g. 3"):
        model.encode_images(torch.zeros(1, 3, 4, 32, 32), None)
    with pytest.raises(AutomodelError, match="latents_mean / latents_std, which are weights"):
        AutoDiffusionPipeline.load_transformer_only(str(base), "LTX2VideoTransformer3DModel")


# ---- upstream's LTX-2 forms ------------------------------------------------------------------------------------


def test_finetune_form_trains_saves_an_ltx2pipeline_and_generate_writes_video_and_audio(base, clips, tmp_path,
                                                                                          monkeypatch):
    from diffusers import LTX2Pipeline

    ckpt, rates = tmp_path / "ckpt", []

    def watch(recipe):  # the frame rate of every transformer call, the samples' last
        recipe.model.pipeline.transformer.register_forward_hook(
            lambda m, args, kwargs, out: rates.append(kwargs["fps"]), with_kwargs=True)

    recipe = train_inprocess(FINETUNE, *form_overrides(base, clips, ckpt), "--sample_generation.enabled", "true",
                             "--sample_generation.num_inference_steps", 1, "--step_scheduler.val_every_steps", 3,
                             before_run=watch)
    conditioning = recipe.model.conditioning
    assert (conditioning.fps, conditioning.audio_loss_weight) == (12.0, 0.5)  # the form's adapter_kwargs
    assert set(rates) == {12.0} and (ckpt / "samples" / "step_3.webp").is_file()  # samples at the trained rate
    model_dir = ckpt / "epoch_1_step_3" / "model"  # two steps an epoch: four clips, two a batch
    loaded = LTX2Pipeline.from_pretrained(str(model_dir))
    trained = {k.removeprefix("components.transformer."): v for k, v in recipe.model.state_dict().items()}
    assert_states_equal(loaded.transformer.state_dict(), trained)
    before = LTX2Pipeline.from_pretrained(str(base)).transformer.state_dict()
    assert any(not torch.equal(before[k], trained[k]) for k in before), "training changed nothing"

    monkeypatch.chdir(tmp_path)
    recipe_cls, cfg = load_config(GENERATE, "--model.pretrained_model_name_or_path", model_dir,
                                  route=("generate", "diffusion"))
    generate = recipe_cls(cfg)
    generate.setup()
    generate.run_train_validation_loop()
    written = sorted(p.name for p in (tmp_path / "inference_outputs").iterdir())
    assert written == ["sample_000_a_red_square_moving_right.wav", "sample_000_a_red_square_moving_right.webp"]
    with Image.open(tmp_path / "inference_outputs" / written[1]) as video:
        video.load()
        assert video.n_frames == 5 and video.size == (32, 32)
    with wave.open(str(tmp_path / "inference_outputs" / written[0])) as sound:
        assert (sound.getnchannels(), sound.getframerate(), sound.getsampwidth()) == (2, 16000, 2)
        assert sound.getnframes() > 0


def test_lora_form_trains_an_adapter_that_ltx2pipeline_loads(base, clips, tmp_path, capsys):
    """Upstream's save_consolidated: false beside it governs nothing (model/ is the adapter alone): a note says so."""
    import diffusers

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(LORA, *form_overrides(base, clips, ckpt))
    assert "note: checkpoint.save_consolidated: false governs nothing in this LoRA run" in \
        "".join(capsys.readouterr())
    model_dir = ckpt / "epoch_0_step_3" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["pytorch_lora_weights.safetensors"]
    pipeline = diffusers.LTX2Pipeline.from_pretrained(str(base))
    pipeline.load_lora_weights(str(model_dir))
    plain = diffusers.LTX2Pipeline.from_pretrained(str(base)).transformer
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 12, 4, generator=g), "audio_hidden_states": torch.randn(1, 2, 4,
                                                                                                       generator=g),
              "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
              "audio_encoder_hidden_states": torch.randn(1, 8, 16, generator=g), "timestep": torch.tensor([500.0]),
              "sigma": torch.tensor([500.0]), "num_frames": 3, "height": 2, "width": 2, "audio_num_frames": 2}
    assert_denoiser_equal_with_adapter(recipe.model.components["transformer"], pipeline.transformer, plain, inputs)


# ---- what cannot act is refused, naming the key ---------------------------------------------------------------


@pytest.mark.parametrize("override,key,needle", [
    (("--flow_matching.adapter_kwargs", "{fps: 24, audio_only: true}"), "flow_matching.adapter_kwargs.audio_only",
     "not a setting of the ltx2 adapter here (it takes audio_loss_weight, fps)"),
    (("--flow_matching.adapter_kwargs", "{fps: 0}"), "flow_matching.adapter_kwargs.fps", "a frame rate > 0"),
    (("--flow_matching.adapter_kwargs", "{audio_loss_weight: -1}"), "flow_matching.adapter_kwargs.audio_loss_weight",
     "a number >= 0"),
    (("--checkpoint.save_consolidated", "false"), "checkpoint.save_consolidated", "writes model/ in a layout of"),
    (("--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow")), "flow_matching.adapter_type",
     "'ltx2' (LTX-2) needs a LTX2Pipeline, but"),
])
def test_ltx2_settings_that_cannot_act_are_refused_at_validation(override, key, needle):
    found = refusals(FINETUNE, *override)
    assert key in found and needle in found[key], found


def test_the_ltx2_family_keys_need_an_ltx2_pipeline():
    found = build_refusals_on_the_sd3_pipeline(LORA)  # a hub name is only known once built
    assert set(found) == {"model.model_type", "flow_matching.adapter_type", "data.dataloader.model_type"}
    assert "'ltx2' (LTX-2), but the pipeline is a StableDiffusion3Pipeline" in found["data.dataloader.model_type"]


def test_audio_sample_rate_is_refused_for_a_pipeline_without_audio(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe_cls, cfg = load_config(GENERATE, "--model.pretrained_model_name_or_path", ASSETS / "tiny_flow",
                                  "--output.audio_sample_rate", 16000, "--output.fps", "null",
                                  "--inference.pipeline_kwargs", "{}", route=("generate", "diffusion"))
    with pytest.raises(AutomodelError, match="output.audio_sample_rate: applies to audio-video pipelines"):
        recipe_cls(cfg).setup()
    with pytest.raises(ConfigError, match="must be >= 1"):
        load_config(GENERATE, "--output.audio_sample_rate", 0, route=("generate", "diffusion"))
