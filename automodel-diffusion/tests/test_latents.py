"""``automodel precompute diffusion`` and ``model.pipeline_spec.load_full_pipeline: false``: the transformer trains
alone on a latent cache of safetensors shards, with the conditioning encoding on the fly gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from diffusion_testing import ASSETS, SHAPES, cli, load_config

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import read_jsonl

PRETRAIN = Path(__file__).parent / "upstream_forms" / "flow_pretrain_upstream.yaml"
ALONE = ("--model.pipeline_spec.load_full_pipeline", "false")
# the transformer initialised alike; caption dropout draws the empty caption's encoding; every step logged
SEED = ("--model.seed", "5", "--flow_matching.cfg_dropout_prob", "0.5", "--step_scheduler.log_interval", "1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A tiny SD3-style pipeline saved with all its weights, and its latent cache of the shapes (3 shards)."""
    from automodel_diffusion import AutoDiffusionPipeline

    root = tmp_path_factory.mktemp("latents")
    (root / "shapes").mkdir()
    rows = [json.loads(line) for line in (SHAPES / "train.jsonl").read_text().splitlines()[:20]]
    (root / "shapes" / "train.jsonl").write_text("".join(
        json.dumps({**row, "image": str(SHAPES / row["image"])}) + "\n" for row in rows))
    AutoDiffusionPipeline.from_config(str(ASSETS / "tiny_flow"), seed=3).pipeline.save_pretrained(str(root / "pipe"))
    config = root / "precompute.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": str(root / "pipe"), "max_sequence_length": 16},
        "dataset": {"_target_": "automodel_diffusion.datasets.ImageCaptionDataset", "path": str(root / "shapes"),
                    "resolution": 32},
        "output": {"cache_dir": str(root / "cache"), "shard_size": 8}}))
    assert cli("precompute", "diffusion", "-c", config) == 0
    return {"pipe": root / "pipe", "cache": root / "cache", "shapes": root / "shapes"}


def pretrain(cache: dict, ckpt: Path, *overrides) -> int:
    return cli("pretrain", "diffusion", "-c", PRETRAIN, "--model.pretrained_model_name_or_path", cache["pipe"],
               "--checkpoint.checkpoint_dir", ckpt, *SEED, *overrides)


def test_precompute_writes_safetensors_shards_and_a_manifest(cache):
    from automodel_diffusion.latents import LatentCacheDataset, collate_latents

    folder = cache["cache"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["pipeline_class"], manifest["transformer_class"], manifest["count"]) == \
        ("StableDiffusion3Pipeline", "SD3Transformer2DModel", 20)
    assert [s["count"] for s in manifest["shards"]] == [8, 8, 4] and manifest["resolution"] == 32
    assert manifest["tensors"]["latent_parameters"] == {"shape": [8, 16, 16], "dtype": "float32"}
    assert sorted(p.name for p in folder.iterdir()) == ["empty_caption.safetensors", "manifest.json",
                                                        "shard_00000.safetensors", "shard_00001.safetensors",
                                                        "shard_00002.safetensors"]
    dataset = LatentCacheDataset(str(folder))
    batch = collate_latents([dataset[0], dataset[19]])
    assert batch["cached"]["latent_parameters"].shape == (2, 8, 16, 16) and len(batch["captions"]) == 2
    assert set(batch["cached"]["conditions"][0]) == {"encoder_hidden_states", "pooled_projections"}


def test_the_transformer_alone_trains_on_the_cache_with_the_full_pipelines_loss(cache, tmp_path):
    from diffusers import SD3Transformer2DModel

    assert pretrain(cache, tmp_path / "full", "--data.dataloader.cache_dir", cache["shapes"],
                    "--step_scheduler.max_steps", "1") == 0
    full = read_jsonl(tmp_path / "full" / "training.jsonl")
    assert pretrain(cache, tmp_path / "alone", *ALONE, "--data.dataloader.cache_dir", cache["cache"]) == 0
    alone = read_jsonl(tmp_path / "alone" / "training.jsonl")
    assert [r["step"] for r in alone] == [1, 2, 3] and [r["step"] for r in full] == [1]
    torch.testing.assert_close(alone[0]["loss"], full[0]["loss"], rtol=1e-5, atol=0)
    model_dir = tmp_path / "alone" / "epoch_0_step_3" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["scheduler", "transformer"]
    trained = SD3Transformer2DModel.from_pretrained(str(model_dir / "transformer"))
    torch.manual_seed(5)
    fresh = SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config(str(cache["pipe"] / "transformer")))
    changed = [k for k, v in fresh.state_dict().items() if not torch.equal(v, trained.state_dict()[k])]
    assert len(changed) > len(fresh.state_dict()) // 2, "the saved transformer is the trained one"


def test_the_transformer_alone_is_fresh_with_mode_pretrain_and_pretrained_with_finetune(cache):
    from diffusers import SD3Transformer2DModel

    from automodel_diffusion.upstream import load_upstream_pipeline

    spec = {"transformer_cls": "SD3Transformer2DModel", "subfolder": "transformer", "load_full_pipeline": False}
    saved = SD3Transformer2DModel.from_pretrained(str(cache["pipe"] / "transformer")).state_dict()
    finetune = load_upstream_pipeline(str(cache["pipe"]), mode="finetune", pipeline_spec=spec)
    pretrain = load_upstream_pipeline(str(cache["pipe"]), mode="pretrain", pipeline_spec=spec, seed=1)
    assert all(torch.equal(v, saved[k]) for k, v in finetune.denoiser.state_dict().items())
    assert not all(torch.equal(v, saved[k]) for k, v in pretrain.denoiser.state_dict().items())
    for model in (finetune, pretrain):
        assert model.transformer_only and model.trainable_components == ["transformer"]
        assert sorted(n for n, c in model.pipeline.components.items() if c is not None) == ["scheduler", "transformer"]
    with pytest.raises(AutomodelError, match="transformer_cls: 'FluxTransformer2DModel', but the pipeline's"):
        load_upstream_pipeline(str(cache["pipe"]), pipeline_spec={**spec, "transformer_cls": "FluxTransformer2DModel"})


# ---- refused, each with its reason -------------------------------------------------------------------------------


def refusals(*overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(PRETRAIN, *ALONE, *overrides, route=("pretrain", "diffusion"))
    return {issue.key: issue.message for issue in info.value.issues}


def test_a_pickle_cache_or_images_are_refused_with_how_to_precompute(tmp_path):
    (tmp_path / "pickles" / "512x512").mkdir(parents=True)
    (tmp_path / "pickles" / "512x512" / "sample_0.pt").write_bytes(b"never read")
    found = refusals("--data.dataloader.cache_dir", tmp_path / "pickles")
    assert "loading it unpickles" in found["data.dataloader.cache_dir"]
    assert "automodel precompute diffusion" in found["data.dataloader.cache_dir"]
    found = refusals("--data.dataloader.cache_dir", SHAPES)
    assert "is not a latent cache" in found["data.dataloader.cache_dir"]


@pytest.mark.parametrize("override,key,needle", [
    (("--model.trainable_components", "[transformer, vae]"), "model.trainable_components", "only 'transformer'"),
    (("--peft", "{dim: 4}"), "peft", "LoRA is not implemented"),
    (("--sample_generation.enabled", "true"), "sample_generation.enabled", "samples need the full pipeline"),
    (("--validation_dataset", f"{{_target_: automodel_diffusion.datasets.ImageCaptionDataset, path: {SHAPES}}}"),
     "validation_dataset", "validates on latent caches"),
    (("--data.dataloader.base_resolution", "[64, 64]"), "data.dataloader.base_resolution", "encoded at 32x32"),
    (("--model.pipeline_spec.transformer_cls", "null"), "model.pipeline_spec.transformer_cls", "required"),
])
def test_what_needs_the_full_pipeline_is_refused(cache, override, key, needle):
    found = refusals("--data.dataloader.cache_dir", cache["cache"], *override)
    assert key in found and needle in found[key], found


def test_a_cache_of_another_family_or_a_corrupted_shard_is_refused_naming_it(cache, tmp_path, capfd):
    from automodel_diffusion.latents import LatentCacheDataset

    foreign = tmp_path / "foreign"
    shutil.copytree(cache["cache"], foreign)
    manifest = json.loads((foreign / "manifest.json").read_text())
    (foreign / "manifest.json").write_text(json.dumps({**manifest, "pipeline_class": "FluxPipeline"}))
    assert pretrain(cache, tmp_path / "ckpt", *ALONE, "--data.dataloader.cache_dir", foreign) != 0
    assert "it was made with a FluxPipeline, but the model is a StableDiffusion3Pipeline" in capfd.readouterr().err
    shard = foreign / "shard_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(AutomodelError, match="shard_00001.safetensors' is missing or corrupted"):
        LatentCacheDataset(str(foreign))


@pytest.mark.parametrize("adapter,transformer,loader", [
    ("flux", "FluxTransformer2DModel", "build_text_to_image_multiresolution_dataloader"),
    ("qwen_image", "QwenImageTransformer2DModel", "build_text_to_image_multiresolution_dataloader"),
    ("simple", "WanTransformer3DModel", "build_video_multiresolution_dataloader"),
])
def test_upstreams_pretrain_forms_validate_with_a_latent_cache(cache, tmp_path, adapter, transformer, loader):
    """Upstream's FLUX.1 / Qwen-Image / Wan 2.1 pre-training forms: a hub pipeline, the transformer alone."""
    form = yaml.safe_load(PRETRAIN.read_text())
    form["model"].update(pretrained_model_name_or_path=f"org/{adapter}-pipeline", max_sequence_length=None,
                         pipeline_spec={"transformer_cls": transformer, "subfolder": "transformer",
                                        "load_full_pipeline": False})
    form["flow_matching"].update(adapter_type=adapter, use_loss_weighting=False)
    form["data"]["dataloader"].update(
        _target_=f"nemo_automodel.components.datasets.diffusion.{loader}", cache_dir=str(cache["cache"]),
        **({"model_type": "wan"} if adapter == "simple" else {}))
    path = tmp_path / "form.yaml"
    path.write_text(yaml.safe_dump(form))
    _, cfg = load_config(path, route=("pretrain", "diffusion"))
    assert cfg.model.pipeline_spec.transformer_cls == transformer


def test_a_cache_of_other_caption_lengths_says_both_and_the_value_to_set():
    """A cache made with the pipeline's own caption length (max_sequence_length unset) and a run asking for 16 (or
    the other way round) are told apart in words, with the value that matches the cache."""
    from types import SimpleNamespace

    from automodel_diffusion.latents import fit_issue

    class StableDiffusion3Pipeline:
        pass

    model = SimpleNamespace(pipeline=StableDiffusion3Pipeline(), conditioning=SimpleNamespace(vae_config={}),
                            max_sequence_length=16)
    manifest = {"pipeline_class": "StableDiffusion3Pipeline", "vae_config": {}, "max_sequence_length": None}
    assert fit_issue(manifest, model) == (
        "its captions were encoded with max_sequence_length unset (the pipeline's own default), this run's is 16: "
        "set model.max_sequence_length to null to match, or remake the cache")
    assert fit_issue({**manifest, "max_sequence_length": 16}, model) is None
