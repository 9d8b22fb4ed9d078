"""Wan 2.2 A14B's two experts: ``model.stage`` trains one transformer of a two-transformer WanPipeline on its own side
of ``boundary_ratio`` (high_noise: transformer on sigmas [boundary, 1], low_noise: transformer_2 on [0, boundary]),
the other untouched; the saved pipeline loads in diffusers with both experts; ``generate diffusion`` swaps a stage
checkpoint's expert in (``checkpoint_high_noise`` / ``checkpoint_low_noise``) and samples with both; what cannot act
is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusion_testing import (
    CLIP_CAPTIONS,
    WAN22_BOUNDARY,
    load_config,
    refusals,
    tiny_wan,
    tiny_wan22,
    train_inprocess,
)

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import assert_states_equal, load_safetensors_state, run_cli

FORMS = Path(__file__).parent / "upstream_forms"
FINETUNE, GENERATE = FORMS / "wan22_finetune_upstream.yaml", FORMS / "generate_wan22_upstream.yaml"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_wan22(tmp_path_factory.mktemp("wan22") / "base")


@pytest.fixture(scope="module")
def high_run(base, clips, tmp_path_factory) -> Path:
    """A 3-step high_noise stage run of the upstream form through the CLI; its checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("high") / "ckpt"
    result = run_cli("finetune", "diffusion", "-c", FINETUNE, *overrides(base, clips, ckpt), cwd=ckpt.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"model.stage: high_noise trains transformer on sigmas [{WAN22_BOUNDARY:g}, 1]" in result.stderr
    return ckpt


def overrides(base: Path, clips: Path, ckpt: Path) -> tuple:
    return ("--model.pretrained_model_name_or_path", base, "--data.dataloader.cache_dir", clips,
            "--checkpoint.checkpoint_dir", ckpt)


# ---- the stage's sigmas -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage,boundary,low,high", [("high_noise", None, WAN22_BOUNDARY, 1.0),
                                                     ("low_noise", None, 0.0, WAN22_BOUNDARY),
                                                     ("low_noise", 0.5, 0.0, 0.5)])
def test_a_stage_draws_its_sigmas_only_from_its_side_of_the_boundary(base, stage, boundary, low, high):
    from automodel_diffusion import AutoDiffusionPipeline
    from automodel_diffusion.objectives import ObjectiveConfig, build_objective
    from automodel_diffusion.recipe import stage_objective

    model = AutoDiffusionPipeline.from_pretrained(str(base), stage=stage, boundary_ratio=boundary)  # None: the config's
    assert model.sigma_range == (low, high) and model.trainable_components == [model.denoiser_name]
    config = ObjectiveConfig(timestep_sampling="logit_normal", mix_uniform_ratio=0.3, shift=3.0)
    objective = build_objective(stage_objective(config, model.sigma_range), model.pipeline.scheduler)
    generator = torch.Generator().manual_seed(0)
    sigmas = torch.cat([objective.sigmas(64, generator) for _ in range(100)])
    assert low <= float(sigmas.min()) and float(sigmas.max()) <= high
    assert float(sigmas.max()) - float(sigmas.min()) > 0.5 * (high - low)  # the range is drawn, not one value
    # the training step feeds the stage's expert timesteps on its side of WanPipeline's switch (boundary * 1000)
    fed = []
    model.objective = objective
    model.denoiser.register_forward_hook(lambda m, args, kwargs, out: fed.append(kwargs["timestep"]),
                                         with_kwargs=True)
    model(torch.zeros(4, 3, 5, 32, 32), list(CLIP_CAPTIONS), generator=generator)
    assert model.denoiser is model.pipeline.components["transformer" if stage == "high_noise" else "transformer_2"]
    assert all(low * 1000 <= float(t) <= high * 1000 for t in fed[0])


# ---- training a stage through the CLI, and generating ------------------------------------------------------------


def test_the_high_noise_stage_trains_transformer_only_and_saves_a_pipeline_diffusers_loads(base, high_run):
    from diffusers import DiffusionPipeline

    model_dir = high_run / "epoch_0_step_3" / "model"
    loaded = DiffusionPipeline.from_pretrained(str(model_dir))
    assert type(loaded).__name__ == "WanPipeline" and loaded.config.boundary_ratio == WAN22_BOUNDARY
    before = DiffusionPipeline.from_pretrained(str(base))
    assert_states_equal(loaded.transformer_2.state_dict(), before.transformer_2.state_dict())
    changed = [k for k, v in before.transformer.state_dict().items()
               if not torch.equal(v, loaded.transformer.state_dict()[k])]
    assert len(changed) > len(before.transformer.state_dict()) // 2, changed


def test_the_low_noise_stage_trains_transformer_2_only(base, clips, tmp_path):
    ckpt = tmp_path / "ckpt"
    recipe = train_inprocess(FINETUNE, *overrides(base, clips, ckpt), "--model.stage", "low_noise")
    assert list(recipe.model.components) == ["transformer_2"]
    assert next(recipe.pipeline.transformer.parameters()).device.type == "cpu"  # the idle expert stays off
    model_dir = ckpt / "epoch_0_step_3" / "model"
    assert_states_equal(load_safetensors_state(model_dir / "transformer"), load_safetensors_state(base / "transformer"))
    trained = {k.removeprefix("components.transformer_2."): v for k, v in recipe.model.state_dict().items()}
    assert_states_equal(load_safetensors_state(model_dir / "transformer_2"), trained)
    assert any(not torch.equal(v, trained[k]) for k, v in load_safetensors_state(base / "transformer_2").items())


def test_generate_swaps_in_the_stage_checkpoints_expert_and_samples_with_both(base, high_run, tmp_path,
                                                                                 monkeypatch):
    from diffusers import DiffusionPipeline

    monkeypatch.chdir(tmp_path)
    recipe_cls, cfg = load_config(GENERATE, "--model.pretrained_model_name_or_path", base,
                                  "--model.checkpoint_high_noise", high_run / "epoch_0_step_3",
                                  route=("generate", "diffusion"))
    generate = recipe_cls(cfg)
    generate.setup()
    pipeline = generate.pipeline
    assert_states_equal(pipeline.transformer.state_dict(),
                        load_safetensors_state(high_run / "epoch_0_step_3" / "model" / "transformer"))
    assert_states_equal(pipeline.transformer_2.state_dict(),
                        DiffusionPipeline.from_pretrained(str(base)).transformer_2.state_dict())
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipeline, name).register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    generate.run_train_validation_loop()
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0, calls  # 2 steps: one on each side
    assert len(list((tmp_path / "inference_outputs").glob("*.webp"))) == 2


# ---- what cannot act is refused --------------------------------------------------------------------------------


@pytest.mark.parametrize("override,key,needle", [
    (("--model.stage", "middle"), "model.stage", "expected high_noise (trains transformer) or low_noise"),
    (("--model.boundary_ratio", "1.5"), "model.boundary_ratio", "strictly between 0 and 1, found 1.5"),
    (("--model.stage", "null"), "model.boundary_ratio", "applies with model.stage"),
    (("--model.trainable_components", "[transformer]"), "model.trainable_components", "not with model.stage"),
    (("--flow_matching.sigma_max", "0.5"), "flow_matching.sigma_max", "model.stage sets the sigma range"),
    (("--model.stage", "low_noise", "--peft", "{dim: 4, alpha: 4, target_modules: ['*.to_q']}"), "peft",
     "LoRA on the low-noise expert (transformer_2) is not implemented"),
    (("--fsdp", "null", "--parallel_scheme", "{transformer: fsdp2, transformer_2: fsdp2}"),
     "parallel_scheme.transformer_2", "keeps transformer_2, the idle expert, frozen on the CPU"),
])
def test_stage_settings_that_cannot_act_are_refused(base, override, key, needle):
    found = refusals(FINETUNE, "--model.pretrained_model_name_or_path", base, *override)
    assert key in found and needle in found[key], found


def test_a_stage_on_a_one_transformer_pipeline_or_none_on_two_is_refused(base, tmp_path):
    import diffusers

    from automodel_diffusion import AutoDiffusionPipeline

    one = tiny_wan(tmp_path / "one")
    found = refusals(FINETUNE, "--model.pretrained_model_name_or_path", one)
    assert "applies to a two-transformer WanPipeline" in found["model.stage"], found
    with pytest.raises(AutomodelError, match="model.stage: applies to a two-transformer.*has one denoiser"):
        AutoDiffusionPipeline.from_pretrained(str(one), stage="high_noise")
    found = refusals(FINETUNE, "--model.pretrained_model_name_or_path", base, "--model.stage", "null",
                     "--model.boundary_ratio", "null")
    assert "required for a two-transformer WanPipeline" in found["model.stage"], found
    pipeline = diffusers.WanPipeline.from_pretrained(str(base))
    with pytest.raises(AutomodelError, match="set model.stage: high_noise .* or low_noise"):
        AutoDiffusionPipeline(pipeline)
    pipeline.register_to_config(boundary_ratio=None)
    with pytest.raises(AutomodelError, match="model.boundary_ratio: required"):
        AutoDiffusionPipeline(pipeline, stage="low_noise")


def test_stage_checkpoints_that_cannot_act_are_refused(base, high_run, tmp_path):
    route = ("generate", "diffusion")
    with pytest.raises(ConfigError, match="give either checkpoint .* or the stage checkpoints"):
        load_config(GENERATE, "--model.checkpoint", high_run, route=route)
    with pytest.raises(ConfigError, match="checkpoint_high_noise: applies to a two-transformer WanPipeline.*is a "
                                          "WanPipeline with one denoiser"):
        load_config(GENERATE, "--model.pretrained_model_name_or_path", tiny_wan(tmp_path / "one"),
                    "--model.checkpoint_high_noise", high_run / "epoch_0_step_3", route=route)
    (tmp_path / "empty" / "model").mkdir(parents=True)
    recipe_cls, cfg = load_config(GENERATE, "--model.pretrained_model_name_or_path", base,
                                  "--model.checkpoint_high_noise", "null", "--model.checkpoint_low_noise",
                                  tmp_path / "empty", route=route)
    with pytest.raises(AutomodelError, match="holds no transformer_2 folder.*model.stage low_noise"):
        recipe_cls(cfg).setup()
