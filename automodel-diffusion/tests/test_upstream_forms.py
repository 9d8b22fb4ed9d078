"""Upstream NeMo AutoModel's diffusion schema (tests/upstream_forms/): each form validates and acts, or is refused
at validation with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch
import yaml
from diffusion_testing import ASSETS, load_config, train_inprocess

from automodel.errors import ConfigError
from automodel.testing import checkpoint_dirs, read_jsonl
from automodel_diffusion.objectives import bsmntw_weights
from automodel_diffusion.upstream import FlowMatchingSection, text_to_image_data

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE = FORMS / "flow_finetune_upstream.yaml"
PRETRAIN = FORMS / "flow_pretrain_upstream.yaml"
GENERATE = FORMS / "generate_upstream.yaml"


def refusals(config: Path, *overrides, route=("finetune", "diffusion")) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, *overrides, route=route)
    return {issue.key: issue.message for issue in info.value.issues}


def variant(tmp_path: Path, source: Path, **changes) -> Path:
    """``source`` with top-level sections replaced or removed (None)."""
    data = yaml.safe_load(source.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump(data))
    return path


# ---- training: the forms run -------------------------------------------------------------------------------


def test_finetune_form_trains_three_steps_with_each_upstream_section_acting(tmp_path, capfd):
    recipe = train_inprocess(FINETUNE, "--checkpoint.checkpoint_dir", tmp_path / "ckpt")
    assert [r["step"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [3]
    assert checkpoint_dirs(tmp_path / "ckpt") == ["epoch_0_step_3"]
    model = recipe.model
    denoiser = model.components["transformer"]
    assert denoiser.gradient_checkpointing, "fsdp.activation_checkpointing: true recomputes the blocks"
    objective = model.objective.config
    assert (objective.timestep_sampling, objective.shift, objective.mix_uniform_ratio, objective.loss_weighting,
            objective.caption_dropout, objective.num_train_timesteps) == ("logit_normal", 3.0, 0.1, "linear", 0.1, 1000)
    assert model.autocast_dtype is None, "compute_dtype equal to torch_dtype: no autocast"
    assert recipe.train_dataset.resolution == 32 and len(recipe.train_dataset) == 320
    assert recipe.dataloader.num_workers == 0 and recipe.dataloader.drop_last is False
    err = capfd.readouterr().err
    assert "flow matching step 1: sigma [" in err and "flow matching step 3: logit_normal sampling, shift 3" in err
    import diffusers

    pipeline = diffusers.DiffusionPipeline.from_pretrained(str(tmp_path / "ckpt" / "epoch_0_step_3" / "model"))
    assert type(pipeline).__name__ == "StableDiffusion3Pipeline", "diffusers_compatible: a diffusers pipeline"


def test_pretrain_form_reinitialises_the_denoiser_and_computes_in_bfloat16(tmp_path):
    recipe = train_inprocess(PRETRAIN, "--checkpoint.checkpoint_dir", tmp_path / "ckpt")
    losses = [r["loss"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all()
    model = recipe.model
    assert model.autocast_dtype == torch.bfloat16 and model.denoiser.dtype == torch.float32
    assert model.objective.config.timestep_sampling == "beta"
    assert model.objective.config.loss_weighting == "bsmntw"
    assert recipe.step_scheduler.step == 3 and recipe.ctx.batch.grad_accumulation_steps == 2


def test_pretrain_mode_keeps_every_weight_but_the_trained_denoisers(tmp_path):
    from automodel_diffusion.pipeline import AutoDiffusionPipeline
    from automodel_diffusion.upstream import load_upstream_pipeline

    saved = tmp_path / "pipeline"
    AutoDiffusionPipeline.from_config(str(ASSETS / "tiny_flow"), seed=3).pipeline.save_pretrained(str(saved))
    spec = {"transformer_cls": "SD3Transformer2DModel", "subfolder": "transformer", "load_full_pipeline": True}
    finetune = load_upstream_pipeline(str(saved), mode="finetune")
    pretrain = load_upstream_pipeline(str(saved), mode="pretrain", pipeline_spec=spec, seed=11)
    for name, tensor in finetune.pipeline.vae.state_dict().items():
        assert torch.equal(tensor, pretrain.pipeline.vae.state_dict()[name])
    ours, theirs = finetune.denoiser.state_dict(), pretrain.denoiser.state_dict()
    assert ours.keys() == theirs.keys() and any(not torch.equal(ours[k], theirs[k]) for k in ours)
    assert pretrain.components["transformer"] is pretrain.pipeline.transformer
    with pytest.raises(Exception, match="FluxTransformer2DModel"):
        load_upstream_pipeline(str(saved), mode="pretrain", pipeline_spec={**spec,
                                                                           "transformer_cls": "FluxTransformer2DModel"})


def test_generate_form_writes_one_image_per_prompt_up_to_max_samples(tmp_path, monkeypatch):
    from PIL import Image

    from automodel.testing import load_config as load
    from automodel_diffusion.generate import GenerateRecipe

    monkeypatch.chdir(tmp_path)
    recipe_cls, cfg = load(GENERATE, route=("generate", "diffusion"))
    recipe = recipe_cls(cfg)
    assert isinstance(recipe, GenerateRecipe)
    recipe.setup()
    recipe.run_train_validation_loop()
    written = sorted(p.name for p in (tmp_path / "inference_outputs").iterdir())
    assert written == ["sample_000_a_red_circle_on_a_blue_background.png",
                       "sample_001_a_green_square_on_a_white_background.png"]
    first = numpy.asarray(Image.open(tmp_path / "inference_outputs" / written[0]), dtype=numpy.int16)
    second = numpy.asarray(Image.open(tmp_path / "inference_outputs" / written[1]), dtype=numpy.int16)
    assert first.shape == (32, 32, 3) and numpy.abs(first - second).max() > 10, "another prompt and seed"
    recipe.run_train_validation_loop()  # the same seeds: the same image (up to float rounding)
    again = numpy.asarray(Image.open(tmp_path / "inference_outputs" / written[0]), dtype=numpy.int16)
    assert numpy.abs(again - first).max() <= 1


def test_generate_uses_a_training_checkpoint(tmp_path, monkeypatch):
    from automodel.testing import load_config as load

    run = train_inprocess(FINETUNE, "--checkpoint.checkpoint_dir", tmp_path / "ckpt", "--fsdp.activation_checkpointing",
                          "false")
    trained = {k: v.clone() for k, v in run.model.denoiser.state_dict().items()}
    monkeypatch.chdir(tmp_path)
    recipe_cls, cfg = load(GENERATE, "--model.checkpoint", tmp_path / "ckpt" / "epoch_0_step_3",
                           route=("generate", "diffusion"))
    recipe = recipe_cls(cfg)
    recipe.setup()
    loaded = recipe.pipeline.transformer.state_dict()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)


# ---- the mapping, without building ----------------------------------------------------------------------------


def test_flow_matching_maps_onto_the_objective_with_upstreams_defaults():
    objective = FlowMatchingSection().objective()
    assert (objective.type, objective.timestep_sampling, objective.shift, objective.mix_uniform_ratio,
            objective.caption_dropout, objective.loss_weighting, objective.shift_sigmas) == \
        ("flow_matching", "logit_normal", 3.0, 0.1, 0.1, "linear", True)
    assert FlowMatchingSection(use_loss_weighting=False).objective().loss_weighting == "none"
    assert FlowMatchingSection(use_sigma_noise=False).objective().shift_sigmas is False


def test_fsdp_section_becomes_the_denoisers_fsdp2_entry(tmp_path):
    _, cfg = load_config(FINETUNE, "--model.compute_dtype", "bfloat16", "--fsdp.reduce_dtype", "float32")
    from automodel_diffusion.upstream import effective_scheme

    scheme = effective_scheme(cfg, ["transformer"], "transformer")
    assert scheme == {"transformer": {"strategy": "fsdp2", "param_dtype": "bfloat16", "reduce_dtype": "float32",
                                      "forward_prefetch_depth": 1, "backward_prefetch_depth": 1}}
    _, cfg = load_config(PRETRAIN)
    assert effective_scheme(cfg, ["transformer"], "transformer") == {
        "transformer": {"strategy": "ddp", "find_unused_parameters": True}}


def test_fsdp_dp_size_is_the_world_validate_checks_and_a_smaller_launch_is_refused_at_validation(tmp_path, capsys):
    """Upstream's fsdp.dp_size is the number of processes: ``automodel validate`` checks the config for that many
    (as it does for distributed.*), and a launch of another size is refused before anything is built."""
    from automodel.cli.main import cli
    from automodel.training.dist import planned_world_size

    config = variant(tmp_path, FINETUNE, fsdp={"dp_size": 2, "dp_replicate_size": 1})
    batch = ("--step_scheduler.global_batch_size", "8")
    cli.main(args=["validate", "finetune", "diffusion", "-c", str(config), *batch], prog_name="automodel",
             standalone_mode=False)
    assert "checked for 2 processes: the layout's own size" in capsys.readouterr().out
    with planned_world_size(1, "--nproc-per-node 1"):
        found = refusals(config, *batch)
    assert found["fsdp.dp_size"].startswith("2, but this run has 1 process(es)")
    with planned_world_size(3, "--nproc-per-node 3"):
        found = refusals(variant(tmp_path, FINETUNE, fsdp={"dp_replicate_size": 2}))
    assert "does not divide this run's 3 process(es)" in found["fsdp.dp_replicate_size"]


def test_text_to_image_data_reads_the_folder_and_hands_the_loader_its_settings():
    data = text_to_image_data(str(ASSETS / "tiny_shapes"), base_resolution=[16, 16], num_workers=0, shuffle=False,
                              drop_last=True, prefetch_factor=None)
    assert data.dataset.resolution == 16 and data.dataset[0]["pixel_values"].shape == (3, 16, 16)
    assert data.loader == {"num_workers": 0, "shuffle": False, "drop_last": True, "pin_memory": False}


def test_bsmntw_weights_are_a_bell_with_mean_one():
    weights = bsmntw_weights(1000)
    t = torch.arange(1000, dtype=torch.float32)
    bell = torch.exp(-2.0 * ((t - 500) / 1000) ** 2)
    expected = (bell - bell.min()) * (1000 / (bell - bell.min()).sum())
    torch.testing.assert_close(weights, expected)
    assert abs(float(weights.mean()) - 1.0) < 1e-5 and int(weights.argmax()) == 500


# ---- refused at validation, each with its reason ------------------------------------------------------------


@pytest.mark.parametrize("override,key,needle", [
    (("--flow_matching.adapter_type", "cosmos"), "flow_matching.adapter_type", "cosmos model family is not "
                                                                               "implemented"),
    (("--flow_matching.adapter_type", "flux2"), "flow_matching.adapter_type", "'flux2' (FLUX.2) needs a "
                                                                             "Flux2Pipeline"),
    (("--flow_matching.adapter_type", "simple"), "flow_matching.adapter_type", "'simple' (Wan 2.1) needs a "
                                                                              "WanPipeline"),
    (("--flow_matching.adapter_kwargs", "{guidance_scale: 1}"), "flow_matching.adapter_kwargs", "no adapter"),
    (("--flow_matching.i2v_prob", "-0.1"), "flow_matching.i2v_prob", "must be a probability"),
    (("--model.transformer_engine_fp8", "true"), "model.transformer_engine_fp8", "needs a CUDA GPU"),
    (("--model.transformer_engine_fp8_recipe", "delayed"), "model.transformer_engine_fp8_recipe", "CUDA GPU"),
    (("--model.attention_backend", "flash"), "model.attention_backend", "needs a CUDA GPU"),
    (("--model.model_type", "wan"), "model.model_type", "'wan' (Wan 2.1) needs a WanPipeline"),
    (("--model.model_type", "hunyuan"), "model.model_type", "'hunyuan' (HunyuanVideo 1.5) needs a "
                                                            "HunyuanVideo15Pipeline"),
    (("--model.stage", "high_noise"), "model.stage", "applies to a two-transformer WanPipeline"),
    (("--model.compute_dtype", "float8"), "model.compute_dtype", "not a dtype we train in"),
    (("--model.fuse_qkv_projections", "true"), "model.fuse_qkv_projections", "not implemented for training"),
    (("--fsdp.tp_size", "2"), "fsdp.tp_size", "only 1 is supported"),
    (("--fsdp.dp_replicate_size", "0"), "fsdp.dp_replicate_size", "must be >= 1"),
    (("--fsdp.cpu_offload", "true"), "fsdp.cpu_offload", "needs a CUDA GPU"),
    (("--fsdp.backend", "nccl"), "fsdp.backend", "dist_env.backend sets it"),
    (("--data.dataloader.dynamic_batch_size", "true"), "data.dataloader.dynamic_batch_size", "not implemented"),
    (("--data.dataloader.base_resolution", "[32, 64]"), "data.dataloader.base_resolution", "only square"),
    (("--data.dataloader.quantization", "64"), "data.dataloader.quantization", "buckets are not implemented"),
    (("--data.dataloader.train_text_encoder", "true"), "data.dataloader.train_text_encoder", "trainable_components"),
    (("--data.dataloader.seed", "7"), "data.dataloader.seed", "shuffles with the run's seed"),
    (("--data.dataloader._target_", "nemo_automodel.components.datasets.diffusion.build_video_multiresolution_"
      "dataloader"), "data.dataloader.train_text_encoder", "build_video_multiresolution_dataloader"),
    (("--checkpoint.diffusers_compatible", "false"), "checkpoint.diffusers_compatible", "as a diffusers pipeline"),
    (("--performance.grad_clip_foreach", "false"), "performance.grad_clip_foreach", "foreach"),
])
def test_upstream_values_that_cannot_act_are_refused_with_the_reason(override, key, needle):
    found = refusals(FINETUNE, *override)
    assert key in found and needle in found[key], found


def test_one_place_per_setting(tmp_path):
    both = variant(tmp_path, FINETUNE, ddp={"find_unused_parameters": True},
                   objective={"type": "flow_matching"}, dataset={
                       "_target_": "automodel_diffusion.datasets.ImageCaptionDataset",
                       "path": str(ASSETS / "tiny_shapes"), "resolution": 32})
    found = refusals(both)
    assert "give one of parallel_scheme, fsdp and ddp" in found["ddp"]
    assert "give one of objective and flow_matching" in found["flow_matching"]
    assert "give one of dataset and data.dataloader" in found["data"]


def test_neither_data_nor_dataset_is_refused(tmp_path):
    found = refusals(variant(tmp_path, FINETUNE, data=None))
    assert "required section is missing" in found["dataset"] and "data.dataloader" in found["dataset"]


def test_an_upstream_latent_cache_is_refused_because_loading_it_unpickles(tmp_path):
    cache = tmp_path / "cache"
    (cache / "512x512").mkdir(parents=True)
    (cache / "512x512" / "sample_0.pt").write_bytes(b"not read")
    found = refusals(FINETUNE, "--data.dataloader.cache_dir", cache)
    assert "never loaded here, because loading it unpickles" in found["data.dataloader.cache_dir"]


@pytest.mark.parametrize("override,key,needle", [
    (("--vae.enable_cpu_offload", "true"), "vae.enable_cpu_offload", "needs a CUDA GPU"),
    (("--model.lora_scale", "0.5"), "model.lora_scale", "applies to lora_weights only"),
    (("--model.checkpoint_high_noise", "/"), "model.checkpoint_high_noise", "applies to a two-transformer "
                                                                             "WanPipeline"),
    (("--output.audio_sample_rate", "0"), "output.audio_sample_rate", "must be >= 1 (Hz)"),
    (("--distributed", "{parallel_scheme: {}}"), "distributed", "one process"),
    (("--seed", "x"), "seed", "expected an integer"),
])
def test_generation_values_that_cannot_act_are_refused(override, key, needle):
    found = refusals(GENERATE, *override, route=("generate", "diffusion"))
    assert key in found and needle in found[key], found


def test_check_loss_stops_an_exploding_run(tmp_path):
    from automodel.errors import AutomodelError

    with pytest.raises(AutomodelError, match="performance.check_loss: a micro-batch's loss is .* the loss exploded"):
        train_inprocess(FINETUNE, "--checkpoint.checkpoint_dir", tmp_path / "ckpt", "--flow_matching.flow_shift",
                        "10000", "--fsdp.activation_checkpointing", "false", "--step_scheduler.max_steps", "1",
                        "--lr_scheduler.lr_warmup_steps", "0")


def test_fsdp_prefetch_depths_and_deferred_gradient_sync_act_on_fsdp2_modules():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from automodel.testing import free_port
    from automodel_diffusion.parallel import _fully_shard
    from automodel_diffusion.recipe import DiffusionRecipe

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        module = Blocks()
        _fully_shard(module, {"strategy": "fsdp2", "forward_prefetch_depth": 1, "backward_prefetch_depth": 2},
                     init_device_mesh("cpu", (1,)))
        states = [block._get_fsdp_state() for block in module.blocks]
        assert [len(s._states_to_forward_prefetch) for s in states] == [1, 1, 0]
        assert [len(s._states_to_backward_prefetch) for s in states] == [0, 1, 2]
        assert states[1]._states_to_forward_prefetch == [states[2]]
        assert states[2]._states_to_backward_prefetch == [states[1], states[0]]

        _, cfg = load_config(FINETUNE)
        recipe = DiffusionRecipe(cfg)
        recipe.model = type("Pipeline", (), {"components": {"transformer": module}})()
        recipe.prepare_micro_batch(last=False)  # fsdp.defer_fsdp_grad_sync: true
        assert not any(s._fsdp_param_group.reduce_grads for s in states)
        recipe.prepare_micro_batch(last=True)
        assert all(s._fsdp_param_group.reduce_grads for s in states)
    finally:
        dist.destroy_process_group()


def test_a_backend_is_compared_only_with_a_valid_dist_env():
    found = refusals(FINETUNE, "--fsdp.backend", "nccl", "--dist_env.backend", "mpi")
    assert "dist_env.backend" in found and "fsdp.backend" not in found, found


def test_a_pipeline_of_another_family_is_refused_at_validation(tmp_path):
    hunyuan = tmp_path / "hunyuan"
    hunyuan.mkdir()
    (hunyuan / "model_index.json").write_text(json.dumps({
        "_class_name": "HunyuanVideoPipeline", "transformer": ["diffusers", "HunyuanVideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))
    found = refusals(FINETUNE, "--model.pretrained_model_name_or_path", hunyuan)
    assert "HunyuanVideoPipeline with a HunyuanVideoTransformer3DModel denoiser" in found["model"], found
