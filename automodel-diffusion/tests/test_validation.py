"""Config validation (before anything is built): ``parallel_scheme`` is required, megatron_fsdp is refused, and
every other mistake in it is reported with its dotted key — exit code 2, no traceback."""

from __future__ import annotations

import pytest
import yaml
from diffusion_testing import EXAMPLES, cli


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Fail the test if validation lets the run reach the pipeline or the recipe's setup."""
    from automodel.training.recipe import TrainRecipe
    from automodel_diffusion.pipeline import AutoDiffusionPipeline

    def forbidden(*args, **kwargs):
        raise AssertionError("a pipeline/recipe was built although the config is invalid")

    monkeypatch.setattr(AutoDiffusionPipeline, "from_config", classmethod(forbidden))
    monkeypatch.setattr(AutoDiffusionPipeline, "from_pretrained", classmethod(forbidden))
    monkeypatch.setattr(TrainRecipe, "setup", forbidden)


@pytest.fixture
def example(tmp_path):
    """``example(**sections)``: the tiny_flow example with sections replaced (None removes one), as a file."""

    def write(**sections):
        data = yaml.safe_load((EXAMPLES / "tiny_flow.yaml").read_text())
        data["checkpoint"]["checkpoint_dir"] = str(tmp_path / "ckpt")
        for name, value in sections.items():
            if value is None:
                data.pop(name, None)
            else:
                data[name] = value
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write


def run(capsys, *args):
    code = cli(*args)
    out = capsys.readouterr()
    return code, out.err + out.out


def test_megatron_fsdp_is_refused(example, capsys, nothing_is_built, tmp_path):
    config = example(parallel_scheme={"transformer": {"strategy": "megatron_fsdp"}, "vae": {"strategy": "ddp"}})
    code, text = run(capsys, "finetune", "diffusion", "-c", config)
    assert code == 2, text
    assert "parallel_scheme.transformer.strategy" in text
    assert "diffusion supports DDP and FSDP2 only" in text
    assert "Traceback" not in text
    assert not (tmp_path / "ckpt").exists(), "an invalid run must not create its checkpoint directory"
    code, text = run(capsys, "validate", "finetune", "diffusion", "-c", config)
    assert code == 2 and "diffusion supports DDP and FSDP2 only" in text, text


@pytest.mark.parametrize("scheme, key", [
    ({"transformer": "megatron_fsdp"}, "parallel_scheme.transformer"),
    ({"transformer": {"strategy": "fsdp2"}, "vae": {"strategy": "ddp", "megatron_fsdp": {"x": 1}}},
     "parallel_scheme.vae.megatron_fsdp"),
    ("megatron_fsdp", "parallel_scheme"),
])
def test_megatron_fsdp_anywhere_in_the_scheme_is_refused(example, capsys, nothing_is_built, scheme, key):
    code, text = run(capsys, "finetune", "diffusion", "-c", example(parallel_scheme=scheme))
    assert code == 2, text
    assert f"{key}: megatron_fsdp is not supported: diffusion supports DDP and FSDP2 only" in text, text


def test_megatron_fsdp_as_the_distributed_strategy_is_refused_too(example, capsys, nothing_is_built):
    code, text = run(capsys, "finetune", "diffusion", "-c", example(distributed={"strategy": "megatron_fsdp"}))
    assert code == 2, text
    assert "distributed.strategy: megatron_fsdp is not supported: diffusion supports DDP and FSDP2 only" in text


def test_missing_parallel_scheme_shows_an_example(example, capsys, nothing_is_built):
    code, text = run(capsys, "pretrain", "diffusion", "-c", example(parallel_scheme=None))
    assert code == 2, text
    assert "parallel_scheme: required section is missing" in text
    # the example names this pipeline's own components, and is valid YAML
    lines = text[text.index("parallel_scheme:\n"):].splitlines()
    assert lines[1] == "  transformer: {strategy: fsdp2}", "the denoiser comes first"
    example_yaml = yaml.safe_load("\n".join(lines[:6]))
    assert example_yaml == {"parallel_scheme": {"transformer": {"strategy": "fsdp2"}, "vae": {"strategy": "ddp"},
                                                "text_encoder": {"strategy": "ddp"},
                                                "text_encoder_2": {"strategy": "ddp"},
                                                "text_encoder_3": {"strategy": "ddp"}}}
    assert "Traceback" not in text


def test_every_scheme_mistake_at_once(example, capsys, nothing_is_built):
    scheme = {"transformer": {"strategy": "fsdp2", "reshard_after_forwad": True}, "vea": {"strategy": "ddp"},
              "text_encoder": {"strategy": "zero3"}, "tokenizer": "ddp"}
    code, text = run(capsys, "finetune", "diffusion", "-c", example(parallel_scheme=scheme))
    assert code == 2, text
    assert "parallel_scheme.transformer.reshard_after_forwad: not an option of fsdp2" in text
    assert "did you mean 'reshard_after_forward'" in text
    assert "parallel_scheme.vea: not a component of this pipeline" in text and "did you mean 'vae'" in text
    assert "parallel_scheme.text_encoder.strategy: 'zero3' is not a strategy" in text
    assert "parallel_scheme.tokenizer: not a component" in text


def test_the_trained_component_needs_a_strategy(example, capsys, nothing_is_built):
    code, text = run(capsys, "finetune", "diffusion", "-c", example(parallel_scheme={"vae": "ddp"}))
    assert code == 2, text
    assert "no strategy for the trained component 'transformer'" in text


def test_lora_beyond_the_denoiser_is_refused_before_anything_is_built(example, capsys, nothing_is_built):
    config = example(peft={"dim": 4}, model={"_target_": "automodel_diffusion.AutoDiffusionPipeline.from_config",
                                              "config": "${pkg:automodel_diffusion}/examples/assets/tiny_flow",
                                              "trainable_components": ["transformer", "text_encoder"]})
    code, text = run(capsys, "finetune", "diffusion", "-c", config)
    assert code == 2, text
    assert "model.trainable_components" in text and "LoRA adapts the denoiser ('transformer') only" in text
    assert "Traceback" not in text


def test_the_example_validates_and_dry_runs(example, capsys, nothing_is_built):
    code, text = run(capsys, "finetune", "diffusion", "-c", "diffusion/tiny_flow", "--dry-run")
    assert code == 0, text
    assert "objective: flow_matching (logit_normal timesteps)" in text
    assert ("parallel_scheme: transformer: fsdp2, vae: ddp, text_encoder: ddp, text_encoder_2: ddp, "
            "text_encoder_3: ddp") in text
    code, text = run(capsys, "pretrain", "diffusion", "-c", "diffusion/tiny_unet", "--dry-run")
    assert code == 0, text


def test_diffusers_compatible_true_is_what_the_recipe_writes_and_false_is_refused(capsys, nothing_is_built):
    """model/ is always a diffusers pipeline here (test_tiny_flow loads it with DiffusionPipeline.from_pretrained),
    so upstream's ``checkpoint.diffusers_compatible: true`` holds and ``false`` cannot."""
    code, text = run(capsys, "validate", "finetune", "diffusion", "-c", "diffusion/tiny_flow",
                     "--checkpoint.diffusers_compatible", "true")
    assert code == 0, text
    code, text = run(capsys, "validate", "finetune", "diffusion", "-c", "diffusion/tiny_flow",
                     "--checkpoint.diffusers_compatible", "false")
    assert code == 2, text
    assert "checkpoint.diffusers_compatible: false, but DiffusionRecipe always writes model/ as a diffusers " \
           "pipeline (diffusers' from_pretrained loads it); remove the key" in text


def test_a_sharded_only_checkpoint_is_refused_for_a_diffusers_pipeline(example, capsys, nothing_is_built):
    """The pipeline's model/ is a layout of its own, with no sharded form: save_consolidated: false could not act."""
    code, text = run(capsys, "finetune", "diffusion", "-c", example(), "--checkpoint.save_consolidated", "false")
    assert code == 2, text
    assert "checkpoint.save_consolidated" in text and "writes model/ in a layout of its own, which has no sharded " \
        "form; remove the key (or set it to true)" in text
    assert "Traceback" not in text
