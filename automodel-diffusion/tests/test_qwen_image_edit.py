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
    assert_denoiser_equal_with_adapter,
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
from automodel.testing import assert_states_equal, losses_by_step

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE = FORMS / "qwen_image_edit_finetune_upstream.yaml"
LORA = FORMS / "qwen_image_edit_lora_upstream.yaml"
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


def sized_manifest(folder: Path, sizes: list[tuple[tuple[int, int], tuple[int, int]]]) -> Path:
    """A manifest folder of one edit per (source size, target size), each (width, height)."""
    (folder / "media").mkdir(parents=True)
    rows = []
    for index, (source, target) in enumerate(sizes):
        picture(folder / "media" / f"source_{index}.png", 200, 30 + index, size=source)
        picture(folder / "media" / f"target_{index}.png", 30 + index, 200, size=target)
        media = [{"role": "target", "file_name": f"media/target_{index}.png"},
                 {"role": "context", "file_name": f"media/source_{index}.png"}]
        rows.append({"id": index, "prompt": EDITS[index % 2][0], "media": media, "metadata": {}})
    (folder / "hf_image_edit_manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
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

    dataset = ImageEditDataset(str(manifest_folder(tmp_path / "ok")), resolution=32)
    sample = dataset[1]
    assert sample["caption"] == EDITS[1][0] and sample["pixel_values"].shape == (3, 32, 32)
    assert [image.size for image in sample["source_images"]] == [(32, 32)] and sample["source_sizes"] == [(32, 32)]
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
    load_config(FINETUNE, *form, "--data.dataloader.base_resolution", "[32, 64]")  # a budget of 32x64 pixels
    found = refusals(FINETUNE, *form, "--data.dataloader.base_resolution", "[16, 16]",
                     "--data.dataloader.dynamic_batch_size", "true")
    assert "under one 32x32 image" in found["data.dataloader.base_resolution"]
    assert "as upstream's image-edit loader refuses it" in found["data.dataloader.dynamic_batch_size"]
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


# ---- aspect-ratio buckets, as upstream's image-edit loader forms them --------------------------------------------


def test_images_keep_their_aspect_ratio_within_the_pixel_budget_and_share_buckets_by_size(tmp_path):
    """As upstream's image-edit preprocessing sizes them (sides multiples of 32, at most base_resolution's pixels),
    the target and each source alike; a bucket is the target's size with every source's."""
    from automodel_diffusion.buckets import fit_area
    from automodel_diffusion.edit import ImageEditDataset

    assert fit_area(1000, 600, 1024 * 1024) == (1312, 768)
    assert fit_area(3000, 100, 64 * 64) == (128, 32)  # rounded down, then the longer side shortened to fit
    assert fit_area(32, 32, 64 * 64) == (64, 64)
    wide, tall = ((64, 32), (64, 32)), ((32, 64), (32, 64))
    data = sized_manifest(tmp_path / "edits", [wide, tall, wide, ((60, 30), (32, 64)), ((48, 48), (48, 48))])
    dataset = ImageEditDataset(str(data), resolution=[64, 64])
    assert list(dataset.buckets.items()) == [(((32, 64), (32, 64)), [1]), (((32, 64), (64, 32)), [3]),
                                             (((64, 32), (64, 32)), [0, 2]), (((64, 64), (64, 64)), [4])]
    sample = dataset[3]
    assert sample["pixel_values"].shape == (3, 64, 32)  # the tall target, not centre-cropped
    assert [image.size for image in sample["source_images"]] == [(60, 30)] and sample["source_sizes"] == [(64, 32)]
    assert sample["pixel_values"][1].mean() > 0.5  # the target (green 200), not the source
    assert ImageEditDataset(str(data), resolution=[32, 64]).sizes[4] == ((32, 32), (32, 32))


def test_batches_are_drawn_within_one_bucket_in_a_seeded_order_that_resumes():
    from automodel.training.bucket_sampler import BucketBatchSampler

    buckets = [[0, 1, 2, 3, 4], [5, 6, 7], [8]]
    sampler = BucketBatchSampler(buckets, batch_size=2, shuffle=True, drop_last=True, seed=3)
    first = list(sampler)
    assert len(first) == len(sampler) == 3 and all(len(batch) == 2 for batch in first)
    assert all(any(set(batch) <= set(bucket) for bucket in buckets) for batch in first)
    assert list(sampler) == first  # the epoch's order is the seed's
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    assert list(BucketBatchSampler(buckets, 2, shuffle=False, drop_last=False)) == [[0, 1], [2, 3], [4], [5, 6],
                                                                                    [7], [8]]
    ranks = [list(BucketBatchSampler(buckets, 1, shuffle=False, drop_last=False, replicas=2, rank=r)) for r in (0, 1)]
    assert ranks == [[[0], [2], [4], [5], [7], [8]], [[1], [3], [0], [6], [5], [8]]]  # each bucket padded by itself

    sampler.set_epoch(1)
    batches = iter(sampler)
    next(batches)
    resumed = BucketBatchSampler(buckets, batch_size=2, shuffle=True, drop_last=True, seed=3)
    resumed.load_state_dict(sampler.state_dict())
    resumed.set_epoch(1)  # what the step scheduler calls on resuming epoch 1
    assert list(resumed) == second[1:]


def test_edits_of_different_aspect_ratios_train_two_to_a_batch_in_their_buckets(base, tmp_path):
    data = sized_manifest(tmp_path / "edits", [((64, 32), (64, 32)), ((32, 64), (32, 64))] * 2)
    seen = []

    def record(recipe):
        recipe.model.components["transformer"].register_forward_hook(
            lambda module, args, kwargs, output: seen.append([[tuple(s) for s in shapes]
                                                              for shapes in kwargs["img_shapes"]]), with_kwargs=True)

    recipe = train_inprocess(FINETUNE, "--model.pretrained_model_name_or_path", base, "--checkpoint.checkpoint_dir",
                             tmp_path / "ckpt", "--data.dataloader.cache_dir", data,
                             "--data.dataloader.base_resolution", "[64, 64]", "--step_scheduler.local_batch_size", "2",
                             "--step_scheduler.max_steps", "2", before_run=record)
    assert recipe.step_scheduler.step == 2
    # per step one bucket, two edits: the wide target and source (latents 8x16, packed 4x8), or the tall ones
    assert sorted(seen) == [[[(1, 4, 8), (1, 4, 8)]] * 2, [[(1, 8, 4), (1, 8, 4)]] * 2]


def test_a_resumed_run_draws_the_buckets_batches_of_the_uninterrupted_one(base, tmp_path):
    """Resumed mid-epoch from step 3: steps 4-6 (the rest of epoch 0, then epoch 1's new order) see the batches, and
    so the losses, of the run that went on."""
    data = sized_manifest(tmp_path / "edits", [((64, 32), (64, 32)), ((32, 64), (32, 64))] * 2)
    form = (FINETUNE, "--model.pretrained_model_name_or_path", base, "--data.dataloader.cache_dir", data,
            "--data.dataloader.base_resolution", "[64, 64]", "--step_scheduler.global_batch_size", "1",
            "--step_scheduler.max_steps", "6", "--step_scheduler.log_interval", "1")
    run = train_inprocess(*form, "--checkpoint.checkpoint_dir", tmp_path / "run")
    assert run.dataloader.batch_sampler.epoch == 1  # the step scheduler moved the buckets' order to epoch 1
    train_inprocess(*form, "--checkpoint.checkpoint_dir", tmp_path / "again", "--restore_from.path",
                    next((tmp_path / "run").glob("epoch_0_step_3")))
    losses, resumed = (losses_by_step(tmp_path / name / "training.jsonl") for name in ("run", "again"))
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == losses[s] for s in (4, 5, 6)), (resumed, losses)


def test_the_conditioning_encodes_each_source_at_its_buckets_size(base, tmp_path):
    model = family_model(base)
    picture(tmp_path / "wide.png", 200, 30, size=(64, 32))
    source = Image.open(tmp_path / "wide.png").convert("RGB")
    with torch.no_grad():
        plain = model.conditioning.encode([EDITS[0][0]], torch.device("cpu"), sources=[[source]])
        sized = model.conditioning.encode([EDITS[0][0]], torch.device("cpu"), sources=[[source]],
                                          source_sizes=[[(32, 32)]])
        expected, _ = model.conditioning.source_latents(
            model.pipeline.image_processor.preprocess(source, 32, 32).unsqueeze(2))
    assert plain["source_shapes"] == [[(1, 4, 8)]] and sized["source_shapes"] == [[(1, 4, 4)]]
    torch.testing.assert_close(sized["source_latents"], expected)
    # the text encoder still sees the source as the pipeline shows it (from the original, at its condition area)
    torch.testing.assert_close(sized["encoder_hidden_states"], plain["encoder_hidden_states"])


# ---- LoRA ----------------------------------------------------------------------------------------------------------


def test_lora_form_trains_an_adapter_that_qwenimageeditpluspipeline_loads(base, tmp_path):
    import diffusers

    data, ckpt = manifest_folder(tmp_path / "edits"), tmp_path / "ckpt"
    recipe = train_inprocess(LORA, "--model.pretrained_model_name_or_path", base, "--checkpoint.checkpoint_dir", ckpt,
                             "--data.dataloader.cache_dir", data)
    assert recipe.step_scheduler.step == 2
    model_dir = next(ckpt.glob("epoch_*_step_2")) / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["pytorch_lora_weights.safetensors"]
    processor = recipe.pipeline.processor
    pipeline = diffusers.QwenImageEditPlusPipeline.from_pretrained(str(base), processor=processor)
    pipeline.load_lora_weights(str(model_dir))
    plain = diffusers.QwenImageTransformer2DModel.from_pretrained(str(base / "transformer"))
    g = torch.Generator().manual_seed(0)
    # a 32x32 target's 16 noisy tokens, then a 32x32 source's 16 latent tokens, as the pipeline feeds them
    inputs = {"hidden_states": torch.randn(2, 32, 16, generator=g), "timestep": torch.tensor([0.2, 0.7]),
              "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
              "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
              "img_shapes": [[(1, 4, 4), (1, 4, 4)]] * 2}
    assert_denoiser_equal_with_adapter(recipe.model.components["transformer"], pipeline.transformer, plain, inputs)
    source = Image.open(data / "media" / "source_0.png").convert("RGB")
    edited = pipeline(prompt=EDITS[0][0], image=source, height=32, width=32, num_inference_steps=2,
                      generator=torch.Generator().manual_seed(0)).images[0]
    assert edited.size == (32, 32)
