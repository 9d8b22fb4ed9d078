"""Wan 2.1 text-to-video (WanPipeline) trains: the training input is the clip's AutoencoderKLWan latents normalised
as WanPipeline undoes before decoding, the captions through the pipeline's own encode_prompt, the noisy latents fed
unpacked with the timestep sigma * 1000 and the target noise minus the latents (upstream's simple adapter); upstream's
Wan 2.1 forms (tests/upstream_forms/wan_*_upstream.yaml) train through the CLI on a folder of clips, save a pipeline
diffusers loads (with the trained weights) and a LoRA adapter WanPipeline.load_lora_weights loads; generate diffusion
writes videos at output.fps; what cannot act is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch
from diffusion_testing import (
    ASSETS,
    CLIP_CAPTIONS,
    assert_a_cache_gives_the_full_pipelines_loss,
    assert_cli_run_saved_the_trained_pipeline,
    assert_denoiser_equal_with_adapter,
    build_refusals_on_the_sd3_pipeline,
    clip_batch,
    family_model,
    form_overrides,
    load_config,
    refusals,
    tiny_clips,
    tiny_wan,
    train_inprocess,
    train_on_fixed_batch,
)
from PIL import Image

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import assert_states_equal, run_cli

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE, LORA, GENERATE = (FORMS / f"{name}_upstream.yaml" for name in ("wan_finetune", "wan_lora", "generate_wan"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_wan(tmp_path_factory.mktemp("wan") / "base")


# ---- the clips -------------------------------------------------------------------------------------------------


def test_clips_are_read_from_gifs_webps_and_frame_folders_with_their_captions(clips):
    from automodel_diffusion.datasets import VideoCaptionDataset

    data = VideoCaptionDataset(str(clips), resolution=16, num_frames=3)
    assert len(data) == 4 and data.captions == list(CLIP_CAPTIONS) and data.num_frames == 3
    first = data[0]["pixel_values"]
    assert first.shape == (3, 3, 16, 16) and -1 <= float(first.min()) < float(first.max()) <= 1
    assert not torch.equal(first[:, 0], first[:, 2]), "the square should move between frames"
    folder = VideoCaptionDataset(str(clips), resolution=32)[3]["pixel_values"]  # clip_3: a folder of PNG frames
    expected = numpy.asarray(Image.open(clips / "clip_3" / "004.png").convert("RGB"), dtype=numpy.float32) / 127.5 - 1
    torch.testing.assert_close(folder[:, 4], torch.from_numpy(expected).permute(2, 0, 1))


def test_clips_listed_in_metadata_jsonl(clips, tmp_path):
    from automodel_diffusion.datasets import VideoCaptionDataset

    rows = [{"file_name": str(clips / "clip_1.gif"), "caption": "one"}, {"video": "../clips/clip_3", "caption": "two"}]
    folder = tmp_path / "listed"
    folder.mkdir()
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r).replace("../clips", str(clips)) for r in rows))
    data = VideoCaptionDataset(str(folder), resolution=32)
    assert data.captions == ["one", "two"] and data[1]["pixel_values"].shape == (3, 5, 32, 32)


def test_clip_folders_that_cannot_train_are_refused(clips, tmp_path):
    from automodel_diffusion.datasets import VideoCaptionDataset

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("no clips")
    with pytest.raises(AutomodelError, match="has no clips"):
        VideoCaptionDataset(str(tmp_path / "empty"))
    with pytest.raises(AutomodelError, match=r"clip_0.gif: 5 frames, fewer than num_frames \(9\)|fewer than num_fr"):
        VideoCaptionDataset(str(clips), num_frames=9)
    mixed = tiny_clips(tmp_path / "mixed")
    short = Image.open(mixed / "clip_0.gif")
    short.save(mixed / "clip_0.gif", save_all=True, append_images=[short.copy()], duration=100)
    with pytest.raises(AutomodelError, match="different frame counts.*set num_frames"):
        VideoCaptionDataset(str(mixed))
    (mixed / "clip_1.txt").unlink()
    with pytest.raises(AutomodelError, match="1 clips have no caption file.*clip_1.gif"):
        VideoCaptionDataset(str(mixed))


# ---- the training step, against diffusers' own code ------------------------------------------------------------


def test_a_latent_cache_gives_the_transformer_alone_the_full_pipelines_loss(base, clips):
    assert_a_cache_gives_the_full_pipelines_loss(base, "WanTransformer3DModel", list(CLIP_CAPTIONS[:3]),
                                                 clip_batch(clips, 3))


def test_latents_are_the_pipelines_normalised_vae_latents(base, clips):
    model = family_model(base)
    vae = model.pipeline.vae
    x = clip_batch(clips)
    latents = model.encode_images(x, torch.Generator().manual_seed(5))
    raw = vae.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(5))
    # what WanPipeline does before decoding: latents / (1 / std) + mean
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    torch.testing.assert_close(latents / std + mean, raw)
    assert latents.shape == (2, 4, 2, 4, 4)
    with pytest.raises(AutomodelError, match="clips of 1 \\+ 4k frames.*have 6: set num_frames .* to e.g. 5"):
        model.encode_images(torch.zeros(1, 3, 6, 32, 32), None)
    with pytest.raises(AutomodelError, match="multiple of 16"):
        model.conditioning.pack(torch.zeros(1, 4, 2, 3, 4))


def test_the_transformer_is_fed_the_noisy_latents_the_timestep_and_the_pipelines_prompt_embeddings(base, clips):
    from automodel_diffusion.objectives import randn_like

    model = family_model(base, max_sequence_length=16)
    seen = {}
    model.denoiser.register_forward_hook(lambda m, args, kwargs, out: seen.update(kwargs, out=out[0]),
                                         with_kwargs=True)
    x = clip_batch(clips)
    captions = list(CLIP_CAPTIONS[:2])
    losses = model(x, captions, generator=torch.Generator().manual_seed(3))

    replay = torch.Generator().manual_seed(3)  # the same draws, in the same order
    latents = model.encode_images(x, replay).float()
    sigmas = model.objective.sigmas(2, replay)
    noise = randn_like(latents, replay)
    s = sigmas.view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(seen["hidden_states"], (1 - s) * latents + s * noise)
    torch.testing.assert_close(seen["timestep"], sigmas * 1000)  # WanPipeline feeds the scheduler's timestep
    embeds, _ = model.pipeline.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=16)
    assert embeds.shape == (2, 16, 32) and torch.equal(seen["encoder_hidden_states"], embeds)
    target = noise - latents  # upstream's flow-matching target
    torch.testing.assert_close(losses, (seen["out"] - target).pow(2).flatten(1).mean(1))


def test_wans_unipc_scheduler_trains_with_flow_matching_at_its_flow_shift(base):
    from automodel_diffusion.objectives import FlowMatching

    model = family_model(base)
    assert isinstance(model.objective, FlowMatching) and model.objective.shift == 3.0
    assert model.conditioning.text_kwargs == {"max_sequence_length": 512}  # WanPipeline.__call__'s default


def test_loss_falls_on_a_fixed_batch(base, clips):
    first, last = train_on_fixed_batch(family_model(base), clip_batch(clips, 4), list(CLIP_CAPTIONS))
    assert numpy.isfinite(first) and last < first * 0.8, (first, last)


def test_our_own_config_form_trains_validates_and_samples_a_wan_pipeline(base, clips, tmp_path):
    from diffusion_testing import EXAMPLES

    from automodel.testing import read_jsonl

    ckpt = tmp_path / "ckpt"
    data = f"{{_target_: VideoCaptionDataset, path: {clips}, resolution: 32, num_frames: 5}}"
    train_inprocess(EXAMPLES / "tiny_flow.yaml", "--model.config", base, "--model.max_sequence_length", 16,
                    "--parallel_scheme", "{transformer: fsdp2, vae: ddp, text_encoder: ddp}", "--dataset", data,
                    "--validation_dataset", data, "--dataloader.batch_size", 2, "--step_scheduler.max_steps", 2,
                    "--step_scheduler.val_check_interval", 2, "--step_scheduler.checkpoint_interval", 2,
                    "--sample_generation.num_inference_steps", 2, "--checkpoint.checkpoint_dir", ckpt)
    assert [r["step"] for r in read_jsonl(ckpt / "validation.jsonl")] == [2]
    with Image.open(ckpt / "samples" / "step_2.webp") as grid:  # the example's 4 prompts, one row, 5 frames
        grid.load()
        assert grid.n_frames == 5 and grid.size == (4 * 32, 32) and grid.info["duration"] == 62  # 16 fps


# ---- upstream's Wan 2.1 forms -----------------------------------------------------------------------------------


def test_finetune_form_trains_through_the_cli_and_saves_a_wan_pipeline(base, clips, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_cli("finetune", "diffusion", "-c", FINETUNE, *form_overrides(base, clips, ckpt),
                     "--step_scheduler.ckpt_every_steps", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flow matching step 3: uniform sampling, shift 3," in result.stderr
    # upstream's Wan examples carry i2v_prob: 0.3, which its simple adapter never reads: a note, as here
    assert "note: flow_matching.i2v_prob: 0.3 governs nothing in this run" in result.stderr
    assert_cli_run_saved_the_trained_pipeline(ckpt, base, "WanPipeline")


def test_saved_transformer_is_the_trained_one_and_generate_writes_videos_at_the_fps(base, clips, tmp_path,
                                                                                       monkeypatch):
    from diffusers import DiffusionPipeline

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(FINETUNE, *form_overrides(base, clips, ckpt), "--sample_generation.enabled", "true",
                             "--sample_generation.num_inference_steps", 2, "--step_scheduler.val_every_steps", 3)
    trained = {k.removeprefix("components.transformer."): v for k, v in recipe.model.state_dict().items()}
    model_dir = ckpt / "epoch_0_step_3" / "model"
    loaded = DiffusionPipeline.from_pretrained(str(model_dir))
    assert type(loaded).__name__ == "WanPipeline"
    assert_states_equal(loaded.transformer.state_dict(), trained)
    with Image.open(ckpt / "samples" / "step_3.webp") as grid:  # 4 prompts, one row, 5 frames
        assert grid.n_frames == 5 and grid.size == (4 * 32, 32)

    monkeypatch.chdir(tmp_path)
    recipe_cls, cfg = load_config(GENERATE, "--model.pretrained_model_name_or_path", model_dir,
                                  route=("generate", "diffusion"))
    generate = recipe_cls(cfg)
    generate.setup()
    generate.run_train_validation_loop()
    written = sorted((tmp_path / "inference_outputs").iterdir())
    assert [p.name for p in written] == ["sample_000_a_red_square_moving_right.webp",
                                         "sample_001_a_blue_square_moving_down.webp"]
    with Image.open(written[0]) as video:
        video.load()  # Pillow reads a WebP frame's duration when it decodes the frame
        assert video.n_frames == 5 and video.size == (32, 32) and video.info["duration"] == 125  # 8 fps


def test_lora_form_trains_an_adapter_that_wanpipeline_loads(base, clips, tmp_path):
    import diffusers

    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(LORA, *form_overrides(base, clips, ckpt))
    model_dir = ckpt / "epoch_0_step_3" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["pytorch_lora_weights.safetensors"]
    pipeline = diffusers.WanPipeline.from_pretrained(str(base))
    pipeline.load_lora_weights(str(model_dir))
    plain = diffusers.WanPipeline.from_pretrained(str(base)).transformer
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(2, 4, 2, 4, 4, generator=g), "timestep": torch.tensor([200.0, 700.0]),
              "encoder_hidden_states": torch.randn(2, 16, 32, generator=g)}
    assert_denoiser_equal_with_adapter(recipe.model.components["transformer"], pipeline.transformer, plain, inputs)


# ---- what cannot act is refused, naming the key ---------------------------------------------------------------


@pytest.mark.parametrize("override,key,needle", [
    (("--flow_matching.i2v_prob", "1.5"), "flow_matching.i2v_prob", "must be a probability (0 to 1), found 1.5"),
    (("--flow_matching.adapter_kwargs", "{scale: 1}"), "flow_matching.adapter_kwargs", "the simple / "
                                                                                       "qwen_image_edit adapter"),
    (("--flow_matching.adapter_type", "cosmos"), "flow_matching.adapter_type", "cosmos model family is not "
                                                                               "implemented"),
    (("--data.dataloader.model_type", "flux"), "data.dataloader.model_type", "only wan, ltx2 and hunyuan clips"),
    (("--data.dataloader.base_resolution", "[32, 64]"), "data.dataloader.base_resolution", "only square"),
    (("--data.dataloader.num_frames", "0"), "data.dataloader.num_frames", "expected a number of frames >= 1"),
    (("--data.dataloader.dynamic_batch_size", "true"), "data.dataloader.dynamic_batch_size", "not implemented"),
    (("--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow")), "flow_matching.adapter_type",
     "'simple' (Wan 2.1) needs a WanPipeline, but"),
])
def test_wan_settings_that_cannot_act_are_refused_at_validation(override, key, needle):
    found = refusals(FINETUNE, *override)
    assert key in found and needle in found[key], found


def test_upstreams_latent_cache_is_never_read(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "sample_0.pt").write_bytes(b"pickle")
    found = refusals(FINETUNE, "--data.dataloader.cache_dir", tmp_path / "cache")
    assert "never loaded here, because loading it unpickles" in found["data.dataloader.cache_dir"], found


def test_model_type_wan_needs_a_wan_pipeline(base):
    from automodel_diffusion.upstream import apply_adapter

    found = refusals(LORA, "--model.pretrained_model_name_or_path", str(ASSETS / "tiny_flow"))
    assert "'wan' (Wan 2.1) needs a WanPipeline, but" in found["model.model_type"], found
    found = build_refusals_on_the_sd3_pipeline(LORA)  # a hub name is only known once built
    assert set(found) == {"model.model_type", "flow_matching.adapter_type", "data.dataloader.model_type"}
    assert "'simple' (Wan 2.1), but the pipeline is a StableDiffusion3Pipeline" in found["flow_matching.adapter_type"]
    _, cfg = load_config(LORA, "--model.pretrained_model_name_or_path", base)
    assert apply_adapter(cfg, family_model(base)) is None


def test_wan_2_2_ti2v_and_image_to_video_pipelines_are_refused(base):
    import diffusers

    from automodel_diffusion import AutoDiffusionPipeline
    from automodel_diffusion.pipeline import index_issue, read_model_index

    index = read_model_index(base)
    assert index_issue(index) is None
    assert "WanImageToVideoPipeline with a WanTransformer3DModel denoiser, which diffusion training does not " \
           "support" in index_issue({**index, "_class_name": "WanImageToVideoPipeline"})
    pipeline = diffusers.WanPipeline.from_pretrained(str(base))
    pipeline.register_to_config(expand_timesteps=True)  # Wan 2.2 TI2V's per-token timesteps
    with pytest.raises(AutomodelError, match="per-token timesteps .* use a text-to-video pipeline"):
        AutoDiffusionPipeline(pipeline)


def test_output_fps_on_an_image_pipeline_is_refused(tmp_path):
    route = ("generate", "diffusion")
    recipe_cls, cfg = load_config(FORMS / "generate_upstream.yaml", "--output.fps", 8, route=route)
    with pytest.raises(AutomodelError, match="output.fps: applies to video pipelines.*StableDiffusion3Pipeline make"):
        recipe_cls(cfg).setup()
    with pytest.raises(ConfigError, match="output.fps: must be > 0"):
        load_config(GENERATE, "--output.fps", 0, route=route)
