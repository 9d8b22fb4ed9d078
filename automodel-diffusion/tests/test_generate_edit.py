"""``generate diffusion`` with ``inference.input_images``: an image-to-image pipeline (a tiny
StableDiffusion3Img2ImgPipeline over the shipped tiny SD3 components) edits one source image per prompt."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
from diffusion_testing import ASSETS, cli, load_config, tiny_flux

from automodel.errors import AutomodelError, ConfigError

GENERATE = ASSETS.parent / "tiny_generate.yaml"
ROUTE = ("generate", "diffusion")


@pytest.fixture(scope="module")
def img2img(tmp_path_factory) -> Path:
    """The tiny SD3 pipeline's components, saved with weights as a StableDiffusion3Img2ImgPipeline (so every run
    loads the same weights)."""
    import diffusers
    import torch

    from automodel_diffusion.pipeline import load_pipeline

    torch.manual_seed(0)
    base = load_pipeline(ASSETS / "tiny_flow", torch.float32)
    directory = tmp_path_factory.mktemp("img2img")
    diffusers.StableDiffusion3Img2ImgPipeline(**base.components).save_pretrained(str(directory))
    return directory


def write_image(path: Path, value: int) -> None:
    """A 32x32 source image: a vertical gradient whose red channel is ``value``."""
    from PIL import Image

    pixels = numpy.zeros((32, 32, 3), dtype=numpy.uint8)
    pixels[..., 0] = value
    pixels[..., 1] = numpy.linspace(0, 255, 32, dtype=numpy.uint8)[:, None]
    Image.fromarray(pixels).save(path)


def generate(out: str, images: str, *overrides) -> list[numpy.ndarray]:
    from PIL import Image

    code = cli("generate", "diffusion", "-c", GENERATE, "--inference.input_images", images,
               "--output.output_dir", out, *overrides)
    assert code == 0
    return [numpy.asarray(Image.open(p), dtype=numpy.int16) for p in sorted(Path(out).iterdir())]


def test_each_prompts_source_image_reaches_the_pipeline(img2img, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # relative image paths are read from the working directory, as upstream does
    write_image(tmp_path / "red.png", 255)
    write_image(tmp_path / "black.png", 0)
    model = ("--model.pretrained_model_name_or_path", img2img, "--inference.pipeline_kwargs",
             "{max_sequence_length: 16, strength: 0.5}")
    first = generate("a", "[red.png, black.png]", *model)
    assert "[2/2] a/sample_001_a_yellow_square_on_a_black_background.png (from black.png)" in capfd.readouterr().err
    second = generate("b", "[red.png, red.png]", *model)
    assert len(first) == 2 and first[0].shape == (32, 32, 3)
    assert numpy.abs(first[0] - second[0]).max() <= 1, "the same image and seed: the same output"
    assert numpy.abs(first[1] - second[1]).max() > 10, "the same seed, another source image: another output"


def test_a_flux_img2img_pipeline_gets_the_image_and_upstreams_true_cfg_scale(tmp_path, monkeypatch):
    """FluxImg2ImgPipeline (the tiny FLUX.1 components): pipeline_kwargs' true_cfg_scale with a negative prompt
    reaches the call, as in upstream's Qwen-Image-Edit config."""
    model = tiny_flux(tmp_path / "flux")
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxImg2ImgPipeline"}))
    monkeypatch.chdir(tmp_path)
    write_image(tmp_path / "red.png", 255)
    settings = ("--model.pretrained_model_name_or_path", model, "--inference.max_samples", "1",
                "--inference.guidance_scale", "null")
    kwargs = "{{max_sequence_length: 16, negative_prompt: blurry, true_cfg_scale: {}}}"
    plain = generate("plain", "[red.png, red.png]", *settings, "--inference.pipeline_kwargs", kwargs.format(1.0))
    guided = generate("guided", "[red.png, red.png]", *settings, "--inference.pipeline_kwargs", kwargs.format(4.0))
    assert len(plain) == 1 and plain[0].shape == (32, 32, 3)
    assert numpy.abs(plain[0] - guided[0]).max() > 10, "true_cfg_scale 4 with a negative prompt: another image"


def test_refused_at_validation_naming_the_image_or_the_pipeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_image(tmp_path / "ok.png", 9)
    (tmp_path / "text.png").write_text("not an image")

    def refusal(*overrides) -> str:
        with pytest.raises(ConfigError) as info:
            load_config(GENERATE, *overrides, route=ROUTE)
        return " | ".join(str(issue) for issue in info.value.issues)

    assert "one image per prompt: found 1 for 2 prompts" in refusal("--inference.input_images", "[ok.png]")
    found = refusal("--inference.input_images", "[missing.png, text.png]")
    assert "'missing.png' does not exist (relative paths are read from the working directory" in found
    assert "'text.png' is not a readable image" in found
    assert "'https://x/a.png' is a URL" in refusal("--inference.input_images", "[ok.png, 'https://x/a.png']")
    found = refusal("--model.checkpoint", "runs/epoch_0_step_9", "--model.lora_weights", "lora.safetensors")
    for key, path in (("checkpoint", "runs/epoch_0_step_9"), ("lora_weights", "lora.safetensors")):
        assert f"model.{key}: '{path}' does not exist (relative paths are read from the working directory" in found
    found = refusal("--inference.input_images", "[ok.png, ok.png]")  # the shipped tiny_flow: StableDiffusion3Pipeline
    assert "inference.input_images: applies to image-editing / image-to-image pipelines only" in found
    assert "is a StableDiffusion3Pipeline: remove it" in found
    assert "the image comes from inference.input_images" in refusal("--inference.pipeline_kwargs", "{image: ok.png}")


def test_refused_at_build_where_the_loaded_pipeline_takes_no_image_or_setting(img2img, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_image(tmp_path / "ok.png", 9)
    model = tmp_path / "model"
    model.mkdir()
    for part in img2img.iterdir():
        (model / part.name).symlink_to(part)
    edit = ("--model.pretrained_model_name_or_path", model, "--inference.input_images", "[ok.png, ok.png]")
    recipe_cls, cfg = load_config(GENERATE, *edit, "--inference.pipeline_kwargs", "{true_cfg_scale: 4.0}",
                                  route=ROUTE)
    with pytest.raises(AutomodelError, match="StableDiffusion3Img2ImgPipeline does not take true_cfg_scale"):
        recipe_cls(cfg).setup()
    recipe_cls, cfg = load_config(GENERATE, *edit, route=ROUTE)
    assert recipe_cls.describe_plan(cfg)[-1].endswith("2 into runs/tiny_generate, each edited from its "
                                                      "inference.input_images entry")
    index = json.loads((img2img / "model_index.json").read_text())
    (model / "model_index.json").unlink()  # the pipeline changed between validation and build
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(AutomodelError, match="input_images: applies to image-editing .* this is a "
                                             "StableDiffusion3Pipeline: remove it"):
        recipe_cls(cfg).setup()
