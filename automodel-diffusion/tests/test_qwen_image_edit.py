"""Qwen-Image-Edit (QwenImageEditPlusPipeline) trains on image edits: the transformer sees what diffusers' own
pipeline feeds it when it edits (the instruction encoded with the source image in the prompt, the source's packed VAE
latents after the noisy target's, img_shapes for both); upstream's form (tests/upstream_forms/
qwen_image_edit_finetune_upstream.yaml, over upstream's image-edit manifest) trains, saves a pipeline
QwenImageEditPlusPipeline loads, and `generate diffusion` edits with it; what cannot act is refused.

The pipeline resizes every source to about VAE_IMAGE_SIZE (1024x1024) pixels for its VAE; these tests lower that
constant of diffusers' module to 48x48 (for diffusers' pipeline and the training alike, which reads it), so that the
tiny VAE encodes in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch
from diffusion_testing import (
    ASSETS,
    EXAMPLES,
    cli,
    family_model,
    load_config,
    refusals,
    tiny_qwen_image,
    tiny_qwen_image_edit,
    train_inprocess,
)
from PIL import Image

from automodel.errors import AutomodelError
from automodel.testing import assert_states_equal

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE = FORMS / "qwen_image_edit_finetune_upstream.yaml"
GENERATE = FORMS / "generate_upstream.yaml"
EDITS = [("make the square blue", 200, 30), ("turn it into a red circle", 40, 220)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_qwen_image_edit(tmp_path_factory.mktemp("qwen_image_edit") / "base")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return tiny_qwen_image(tmp_path_factory.mktemp("qwen_image") / "base")


@pytest.fixture(autouse=True)
def small_vae_images(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 48 * 48)


def picture(path: Path, red: int, green: int, size: tuple[int, int] = (32, 32)) -> None:
    pixels = numpy.zeros((size[1], size[0], 3), dtype=numpy.uint8)
    pixels[..., 0], pixels[..., 1] = red, green
    pixels[size[1] // 4: size[1] // 2, size[0] // 4: size[0] // 2, 2] = 255
    Image.fromarray(pixels).save(path)


def manifest_folder(folder: Path, rows: list[dict] | None = None) -> Path:
    """Upstream's image-edit manifest (hf_image_edit_manifest.jsonl) with its PNGs under media/."""
    (folder / "media").mkdir(parents=True)
    default = []
    for index, (prompt, red, green) in enumerate(EDITS):
        picture(folder / "media" / f"source_{index}.png", red, green)
        picture(folder / "media" / f"target_{index}.png", green, red)
        media = [{"role": "target", "file_name": f"media/target_{index}.png"},
                 {"role": "context", "file_name": f"media/source_{index}.png"},
                 {"role": "condition", "file_name": f"media/source_{index}.png"}]
        default.append({"id": f"edit-{index}", "prompt": prompt, "media": media,
                        "metadata": {"row_index": index, "dataset_name": "tiny"}})
    lines = [json.dumps(row) for row in (default if rows is None else rows)]
    (folder / "hf_image_edit_manifest.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def captured_call(pipeline, prompt: str, source) -> dict:
    """The inputs and output of the transformer's first call while QwenImageEditPlusPipeline edits ``source``."""
    seen = {}

    def hook(module, args, kwargs, output):
        seen.setdefault("kwargs", kwargs)
        seen.setdefault("output", output[0])

    handle = pipeline.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipeline(prompt=prompt, image=source, height=32, width=32, num_inference_steps=2, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    return seen


def test_the_conditioning_is_what_qwenimageeditpluspipeline_feeds_its_transformer(base, tmp_path):
    """Prompt embeddings (the source image in the prompt), the source's packed latents after the target's and
    img_shapes equal the pipeline's own, and the trained prediction is the pipeline's for the target's tokens."""
    model = family_model(base)
    picture(tmp_path / "wide.png", 200, 30, size=(64, 32))  # 2:1, sized 64x32 for the VAE, as the pipeline does
    source = Image.open(tmp_path / "wide.png").convert("RGB")
    seen = captured_call(model.pipeline, EDITS[0][0], source)
    fed = seen["kwargs"]
    with torch.no_grad():
        cond = model.conditioning.encode([EDITS[0][0]], torch.device("cpu"), sources=[[source]])
    torch.testing.assert_close(cond["encoder_hidden_states"], fed["encoder_hidden_states"])
    assert cond["encoder_hidden_states_mask"] is None and fed["encoder_hidden_states_mask"] is None
    target_tokens = 8 * 8 // 4
    torch.testing.assert_close(cond["source_latents"], fed["hidden_states"][:, target_tokens:])
    noisy = fed["hidden_states"][:, :target_tokens]
    _, positions = model.conditioning.pack(torch.zeros(1, 4, 8, 8))
    with torch.no_grad():
        ours = model.conditioning.denoise(model.pipeline.transformer, noisy, fed["timestep"] * 1000,
                                          {**cond, **positions})
    torch.testing.assert_close(ours, seen["output"][:, :target_tokens])
    assert [list(s) for s in fed["img_shapes"][0]] == [[1, 4, 4], [1, 4, 8]]
    # without the source latents the transformer predicts something else: they are what conditions the edit
    with torch.no_grad():
        plain = model.pipeline.transformer(hidden_states=noisy, timestep=fed["timestep"],
                                           encoder_hidden_states=cond["encoder_hidden_states"],
                                           img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
    assert (plain - ours).abs().max() > 1e-4


def test_upstream_form_trains_saves_a_pipeline_diffusers_loads_and_generate_edits_with_it(base, tmp_path,
                                                                                          monkeypatch, capfd):
    from diffusers import QwenImageEditPlusPipeline

    data, ckpt = manifest_folder(tmp_path / "edits"), tmp_path / "ckpt"
    before = {k: v.clone() for k, v in QwenImageEditPlusPipeline.from_pretrained(
        str(base), processor=family_model(base).pipeline.processor).transformer.state_dict().items()}
    recipe = train_inprocess(FINETUNE, "--model.pretrained_model_name_or_path", base, "--checkpoint.checkpoint_dir",
                             ckpt, "--data.dataloader.cache_dir", data)
    trained = {k.removeprefix("components.transformer."): v for k, v in recipe.model.state_dict().items()}
    assert any(not torch.equal(before[k], trained[k]) for k in before), "training changed nothing"
    model_dir = next(ckpt.glob("epoch_*_step_3")) / "model"  # two edits, two per step: one step per epoch
    # the processor passed in: transformers loads Qwen2VLProcessor's video processor too, which needs torchvision
    loaded = QwenImageEditPlusPipeline.from_pretrained(str(model_dir), processor=recipe.pipeline.processor)
    assert_states_equal(loaded.transformer.state_dict(), trained)
    source = Image.open(data / "media" / "source_0.png").convert("RGB")
    edited = loaded(prompt=EDITS[0][0], image=source, height=32, width=32, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0)).images[0]
    assert edited.size == (32, 32)
    samples = recipe.write_samples()  # sample_generation: the first edits of the data, each from its source
    assert Image.open(samples).size == (2 * 32, 32)

    monkeypatch.chdir(tmp_path)
    code = cli("generate", "diffusion", "-c", GENERATE, "--model.pretrained_model_name_or_path", model_dir,
               "--inference.prompts", f"[{EDITS[0][0]}, {EDITS[1][0]}]", "--inference.input_images",
               f"[{data / 'media' / 'source_0.png'}, {data / 'media' / 'source_1.png'}]",
               "--inference.guidance_scale", "null", "--inference.height", "32", "--inference.width", "32",
               "--output.output_dir", "out")
    assert code == 0
    written = sorted((tmp_path / "out").iterdir())
    assert len(written) == 2 and numpy.asarray(Image.open(written[0])).shape == (32, 32, 3)
    err = capfd.readouterr().err
    assert "(from " in err
    assert "note: data.dataloader.quantization: 64 governs nothing in this run, as in upstream's" in err


def test_the_manifest_is_read_as_upstreams_preprocessing_reads_it(tmp_path):
    from automodel_diffusion.edit import ImageEditDataset

    dataset = ImageEditDataset(str(manifest_folder(tmp_path / "ok")), resolution=16)
    sample = dataset[1]
    assert sample["caption"] == EDITS[1][0] and sample["pixel_values"].shape == (3, 16, 16)
    assert [image.size for image in sample["source_images"]] == [(32, 32)]
    assert sample["pixel_values"][0].mean() > 0.5  # the target (red 220), not the source (red 40)

    media = [{"role": "target", "file_name": "media/target_0.png"},
             {"role": "context", "file_name": "media/source_0.png"},
             {"role": "condition", "file_name": "media/target_0.png"}]
    bad = {"shows the text encoder the same images it encodes with the VAE": media,
           "needs exactly one 'target' image and at least one 'context'": media[:1],
           "its image 'media/gone.png' does not exist": [media[0], {"role": "context", "file_name": "media/gone.png"}]}
    for index, (needle, items) in enumerate(bad.items()):
        rows = [{"id": 0, "prompt": "x", "media": items, "metadata": {}}]
        with pytest.raises(AutomodelError, match="row 1 of .*" + needle.replace("(", r"\(")):
            ImageEditDataset(str(manifest_folder(tmp_path / f"bad{index}", rows)))


def test_what_cannot_act_is_refused(base, qwen, tmp_path):
    data = manifest_folder(tmp_path / "edits")
    form = ("--model.pretrained_model_name_or_path", str(base), "--data.dataloader.cache_dir", str(data))
    load_config(FINETUNE, *form)  # validates
    found = refusals(FINETUNE, *form, "--data.dataloader.quantization", "0")
    assert "expected a positive number of pixels, found 0" in found["data.dataloader.quantization"]
    found = refusals(FINETUNE, *form, "--data.dataloader.base_resolution", "[32, 64]")
    assert "only square resolutions" in found["data.dataloader.base_resolution"]
    (tmp_path / "pickles").mkdir()
    (tmp_path / "pickles" / "sample_00000000.pt").write_bytes(b"")
    found = refusals(FINETUNE, *form, "--data.dataloader.cache_dir", str(tmp_path / "pickles"))
    assert "never loaded here, because loading it unpickles" in found["data.dataloader.cache_dir"]
    found = refusals(FINETUNE, *form, "--model.pretrained_model_name_or_path", str(qwen))
    for key in ("flow_matching.adapter_type", "model.model_type"):
        assert "'qwen_image_edit' (Qwen-Image-Edit) needs a QwenImageEditPlusPipeline, but" in found[key], found


def test_a_text_to_image_pipeline_refuses_edits_and_the_edit_pipeline_refuses_captions(base, qwen):
    edit = family_model(base)
    with pytest.raises(AutomodelError, match="trains on image edits"):
        edit(torch.zeros(1, 3, 32, 32), ["a red circle"])
    with pytest.raises(AutomodelError, match="trains with the full pipeline, not the transformer alone"):
        from automodel_diffusion.conditioning import edit_conditioning

        edit_conditioning(edit.pipeline, None, edit.pipeline.vae.config)
    with pytest.raises(AutomodelError, match="model.max_sequence_length: 32, but QwenImageEditPlusPipeline's "):
        family_model(base, max_sequence_length=32)
    recipe_cls, cfg = load_config(ASSETS.parent / "tiny_precompute.yaml", "--model.pretrained_model_name_or_path",
                                  base, "--model.max_sequence_length", "null", route=("precompute", "diffusion"))
    with pytest.raises(AutomodelError, match="QwenImageEditPlusPipeline encodes each sample's source images"):
        recipe_cls(cfg).setup()
    plain = family_model(qwen)
    with pytest.raises(AutomodelError, match="does not edit images"):
        plain(torch.zeros(1, 3, 32, 32), ["a red circle"], source_images=[[Image.new("RGB", (32, 32))]])


def test_our_own_dataset_form_trains_an_edit_pipeline(base, tmp_path):
    """``dataset: {_target_: ImageEditDataset, path: <manifest folder>}`` on the shipped tiny_flow form."""
    data = manifest_folder(tmp_path / "edits")
    recipe = train_inprocess(EXAMPLES / "tiny_flow.yaml", "--model.config", base, "--model.max_sequence_length",
                             "null", "--parallel_scheme", "{transformer: {strategy: fsdp2}}", "--dataset._target_",
                             "ImageEditDataset", "--dataset.path", data, "--validation_dataset", "null",
                             "--step_scheduler.max_steps", "2", "--dataloader.batch_size", "1",
                             "--checkpoint.checkpoint_dir", tmp_path / "ckpt", "--sample_generation.enabled", "false")
    assert recipe.step_scheduler.step == 2 and len(recipe.train_dataset) == len(EDITS)
