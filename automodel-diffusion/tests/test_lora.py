"""LoRA on the denoiser (``peft:``): only the adapters train, the base stays, the adapter is saved in diffusers' LoRA
format that ``<Pipeline>.load_lora_weights`` loads into a fresh base (same outputs as the trained model), a resume
from a LoRA checkpoint continues exactly, and upstream's form (tests/upstream_forms/flow_lora_upstream.yaml:
``nemo_automodel...PeftConfig`` with glob target_modules) validates and runs through the CLI."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest
import torch
import yaml
from diffusion_testing import ASSETS, EXAMPLES, assert_denoiser_equal_with_adapter, cli, load_config, train_inprocess

from automodel.errors import ConfigError
from automodel.testing import losses_by_step

FORM = Path(__file__).parent / "upstream_forms" / "flow_lora_upstream.yaml"
GLOBS = yaml.safe_load(FORM.read_text())["peft"]["target_modules"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The shipped tiny SD3-style and UNet pipelines, initialised once and saved with weights (LoRA's base)."""
    from automodel_diffusion import AutoDiffusionPipeline

    root = tmp_path_factory.mktemp("bases")
    for name in ("tiny_flow", "tiny_unet"):
        AutoDiffusionPipeline.from_config(str(ASSETS / name), seed=0).pipeline.save_pretrained(str(root / name))
    return {"flow": root / "tiny_flow", "unet": root / "tiny_unet"}


@pytest.fixture(scope="module")
def flow_lora(bases, tmp_path_factory):
    """Upstream's LoRA form trained 3 steps on the saved tiny SD3-style base (a checkpoint at every step)."""
    root = tmp_path_factory.mktemp("flow_lora")
    recipe = train_inprocess(FORM, "--model.pretrained_model_name_or_path", bases["flow"],
                             "--checkpoint.checkpoint_dir", root)
    return {"recipe": recipe, "root": root}


def fresh_pipeline(base: Path):
    import diffusers

    pipeline = diffusers.DiffusionPipeline.from_pretrained(str(base))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def flow_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(2, 4, 16, 16, generator=g), "timestep": torch.tensor([100.0, 700.0]),
            "encoder_hidden_states": torch.randn(2, 5, 64, generator=g),
            "pooled_projections": torch.randn(2, 64, generator=g)}


def unet_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"sample": torch.randn(2, 4, 16, 16, generator=g), "timestep": torch.tensor([100, 700]),
            "encoder_hidden_states": torch.randn(2, 7, 32, generator=g)}


def base_weights(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped denoiser's own weights under the plain model's names."""
    return {k.replace(".base_layer.", "."): v for k, v in denoiser.state_dict().items() if ".lora_" not in k}


def lora_parameter_count(denoiser: torch.nn.Module, matches, rank: int) -> int:
    """What LoRA of ``rank`` on the linear layers ``matches`` selects should add: rank x (in + out) each."""
    return sum(rank * (m.in_features + m.out_features) for name, m in denoiser.named_modules()
               if isinstance(m, torch.nn.Linear) and matches(name))


def test_only_the_adapters_train_and_the_base_weights_stay(flow_lora, bases):
    model = flow_lora["recipe"].model
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:5]
    base = fresh_pipeline(bases["flow"]).transformer
    expected = lora_parameter_count(base, lambda name: any(fnmatch.fnmatch(name, g) for g in GLOBS), rank=4)
    assert sum(p.numel() for p in trainable.values()) == expected > 0
    trained = base_weights(model.components["transformer"])
    reference = base.state_dict()
    assert trained.keys() == reference.keys()
    assert all(torch.equal(trained[k], reference[k]) for k in reference), "the denoiser's base weights changed"
    still = sorted(n for n, p in trainable.items() if ".lora_B." in n and not p.abs().max() > 0)  # B starts at 0
    # the last MMDiT block is context_pre_only: its caption queries (add_q_proj) feed nothing, so get no gradient
    assert still == ["components.transformer.transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"], still


def test_checkpoints_hold_the_adapter_in_diffusers_format(flow_lora, bases):
    root = flow_lora["root"]
    assert sorted(p.name for p in (root / "epoch_0_step_3" / "model").iterdir()) == \
        ["pytorch_lora_weights.safetensors"], "a LoRA checkpoint's model/ is the adapter only"
    assert not (root / "pipeline_base").exists()
    pipeline = fresh_pipeline(bases["flow"])
    base = fresh_pipeline(bases["flow"]).transformer
    pipeline.load_lora_weights(str(root / "epoch_0_step_3" / "model"))
    trained = flow_lora["recipe"].model.components["transformer"]
    assert_denoiser_equal_with_adapter(trained, pipeline.transformer, base, flow_inputs())


def test_resume_from_the_step_2_checkpoint_through_the_cli(flow_lora, bases, tmp_path, capsys):
    args = ["finetune", "diffusion", "-c", FORM, "--model.pretrained_model_name_or_path", bases["flow"],
            "--checkpoint.checkpoint_dir", tmp_path]
    assert cli("validate", *args) == 0, capsys.readouterr().err
    assert cli(*args, "--restore_from.path", flow_lora["root"] / "epoch_0_step_2") == 0, capsys.readouterr().err
    assert losses_by_step(tmp_path / "training.jsonl") == {3: losses_by_step(flow_lora["root"] / "training.jsonl")[3]}
    from safetensors.torch import load_file

    resumed = load_file(str(tmp_path / "epoch_0_step_3" / "model" / "pytorch_lora_weights.safetensors"))
    straight = load_file(str(flow_lora["root"] / "epoch_0_step_3" / "model" / "pytorch_lora_weights.safetensors"))
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


def unet_config(tmp_path: Path, base: Path, **peft) -> Path:
    """tiny_unet on the saved base, 2 steps, no samples, with ``peft:``."""
    data = yaml.safe_load((EXAMPLES / "tiny_unet.yaml").read_text())
    data["model"]["config"] = str(base)
    data["step_scheduler"].update(max_steps=2, checkpoint_interval=2, val_check_interval=100, log_interval=1)
    data["sample_generation"] = {"enabled": False}
    data["checkpoint"]["checkpoint_dir"] = str(tmp_path / "ckpt")
    data["peft"] = peft
    path = tmp_path / "unet_lora.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("form", ["ours", "peft"])
def test_unet_lora_by_module_names_loads_with_diffusers(bases, tmp_path, form):
    """Plain module names, in our PeftConfig or in a peft.LoraConfig given as is."""
    names = ["to_q", "to_k", "to_v", "to_out.0"]
    peft = {"dim": 2, "alpha": 8} if form == "ours" else {"_target_": "peft.LoraConfig", "r": 2, "lora_alpha": 8}
    recipe = train_inprocess(unet_config(tmp_path, bases["unet"], target_modules=names, **peft))
    unet = recipe.model.components["unet"]
    base = fresh_pipeline(bases["unet"]).unet
    expected = lora_parameter_count(base, lambda n: any(n == t or n.endswith("." + t) for t in names), rank=2)
    assert sum(p.numel() for p in recipe.model.parameters() if p.requires_grad) == expected > 0
    pipeline = fresh_pipeline(bases["unet"])
    assert type(pipeline).__name__ == "StableDiffusionPipeline"
    pipeline.load_lora_weights(str(tmp_path / "ckpt" / "epoch_0_step_2" / "model"))
    assert_denoiser_equal_with_adapter(unet, pipeline.unet, base, unet_inputs())


@pytest.mark.parametrize("targets", [["*.to_nothing"], ["to_nothing"]])
def test_target_modules_matching_nothing_are_refused(bases, tmp_path, targets):
    with pytest.raises(ConfigError) as info:
        train_inprocess(unet_config(tmp_path, bases["unet"], dim=2, target_modules=targets))
    assert [issue.key for issue in info.value.issues] == ["peft.target_modules"]
    assert "to_nothing" in str(info.value)


def test_what_lora_on_the_denoiser_cannot_do_is_refused_at_validation(tmp_path):
    data = yaml.safe_load((EXAMPLES / "tiny_unet.yaml").read_text())
    data["model"]["trainable_components"] = ["unet", "text_encoder"]
    data["parallel_scheme"]["text_encoder"] = {"strategy": "ddp"}
    data["peft"] = {"dim": 2, "use_dora": True}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert {issue.key for issue in info.value.issues} == {"model.trainable_components", "peft.use_dora"}
