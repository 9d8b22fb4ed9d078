"""Meta-device materialisation in one process: what it reports, and input it refuses with a clear error (the
two-rank behaviour is in test_parallel_fsdp.py)."""

from __future__ import annotations

import json

import pytest
import torch
from parallel_workers import local_model, meta_model, tiny_config
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.parallel.materialize import materialize, parameters_on_meta
from automodel.training.parallel.module_init import module_seed


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("base")
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(directory)  # one model.safetensors
    return directory


def test_parameters_on_meta_leaves_buffers_real():
    with parameters_on_meta():
        model = nn.BatchNorm1d(4)
    assert model.weight.is_meta and model.bias.is_meta
    assert not model.running_mean.is_meta and torch.equal(model.running_var, torch.ones(4))
    assert not nn.Linear(2, 2).weight.is_meta  # outside the block: as usual


def test_report_says_what_came_from_the_files(base):
    model = meta_model(tiny_config(), lora=True)
    report = materialize(model, "cpu", seed=3, weights=base)
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in report.loaded
    assert sorted(report.initialised) == sorted(n for n, _ in model.named_parameters() if "lora_" in n)
    assert report.unused == []


def test_a_plain_module_without_hf_init_uses_reset_parameters():
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    report = materialize(model, "cpu", seed=5)
    assert report.initialised == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert torch.equal(model[1].weight, torch.ones(3))
    generator_seeded = nn.Linear(4, 3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(5, "0"))
        generator_seeded.reset_parameters()
    assert torch.equal(model[0].weight, generator_seeded.weight)  # the documented seed of module "0"


class Patches(nn.Module):
    """Like CLIP's vision embeddings: its model's _init_weights sets its child convolution's weight."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 4, bias=False)
        self.cls = nn.Parameter(torch.zeros(16))


class PatchModel(nn.Module):
    """A model whose _init_weights (as in transformers, applied to every module, children before their parent) sets
    a child's weight from the parent and overrides a child's own setting, and leaves the head's weight to the
    constructor (reset_parameters)."""

    def __init__(self):
        super().__init__()
        self.patches = Patches()
        self.head = nn.Linear(16, 4)

    def _init_weights(self, module):
        if isinstance(module, nn.Conv2d):
            nn.init.normal_(module.weight, std=0.02)  # overridden by its parent's below
        elif isinstance(module, Patches):
            nn.init.normal_(module.conv.weight, std=0.5)
            nn.init.normal_(module.cls, std=2.0)
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)


def test_a_parent_init_weights_sets_its_childrens_parameters_as_transformers_does():
    with parameters_on_meta():
        model = PatchModel()
    materialize(model, "cpu", seed=1)
    weight = model.patches.conv.weight
    assert torch.isfinite(weight).all() and 0.45 < weight.std() < 0.55  # the parent's std, not the child's 0.02
    assert 1.5 < model.patches.cls.std() < 2.5
    assert torch.equal(model.head.bias, torch.zeros(4))
    torch_default = nn.Linear(16, 4)  # the weight _init_weights leaves unset: the constructor's reset_parameters
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(1, "head"))
        torch_default.reset_parameters()
    assert torch.equal(model.head.weight, torch_default.weight)


def test_a_parent_init_weights_leaves_loaded_and_other_modules_weights_alone(tmp_path):
    from safetensors.torch import save_file

    save_file({"patches.conv.weight": torch.ones(16, 3, 4, 4)}, str(tmp_path / "model.safetensors"))
    with parameters_on_meta():
        model = PatchModel()
    report = materialize(model, "cpu", seed=1, weights=tmp_path)
    assert report.loaded == ["patches.conv.weight"] and "patches.cls" in report.initialised
    assert torch.equal(model.patches.conv.weight, torch.ones(16, 3, 4, 4))  # Patches' _init_weights ran for cls
    with parameters_on_meta():
        fresh = PatchModel()
    materialize(fresh, "cpu", seed=1)
    assert torch.equal(fresh.patches.cls, model.patches.cls)  # the same values whatever else the files hold


def test_a_parameter_the_initialiser_does_not_set_is_an_error():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))  # its constructor's value is lost on the meta device

    with parameters_on_meta():
        model = Scaled()
    model.reset_parameters = lambda: None
    with pytest.raises(AutomodelError,
                       match="'scale' .* is set neither by the model's _init_weights .* nor by a reset_parameters"):
        materialize(model, "cpu", seed=0)


def test_a_mismatching_checkpoint_is_refused(base):
    model = meta_model(tiny_config(hidden=48))
    with pytest.raises(AutomodelError, match=r"has shape \(97, 32\), the model's is \(97, 48\)"):
        materialize(model, "cpu", seed=0, weights=base)


def test_broken_weight_directories_fail_clearly(base, tmp_path):
    with pytest.raises(AutomodelError, match="holds no safetensors weights"):
        materialize(meta_model(tiny_config()), "cpu", seed=0, weights=tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AutomodelError, match="is corrupted: it is not a complete safetensors file"):
        materialize(meta_model(tiny_config()), "cpu", seed=0, weights=tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "x.st"}}))
    with pytest.raises(AutomodelError, match="names 'x.st', which is missing"):
        materialize(meta_model(tiny_config()), "cpu", seed=0, weights=tmp_path)


def test_dora_magnitudes_are_peft_s_and_other_dora_layers_are_refused(base):
    import peft
    from transformers import AutoModelForCausalLM

    config = peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], use_dora=True)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(tiny_config())
    model = peft.get_peft_model(model, config)
    report = materialize(model, "cpu", seed=0, weights=base)
    assert "base_model.model.model.layers.2.mlp.down_proj.lora_magnitude_vector.default.weight" in report.initialised
    expected = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).state_dict()
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for key in (key for key in expected if "lora_A" not in key):  # lora_A: drawn from the run's seed
        assert torch.equal(state[key], expected[key]), key

    config = peft.LoraConfig(r=2, target_modules=["embed_tokens"], use_dora=True)
    with parameters_on_meta():
        model = peft.get_peft_model(AutoModelForCausalLM.from_config(tiny_config()), config)
    with pytest.raises(AutomodelError, match="DoRA on its Embedding layer cannot be initialised on the meta device"):
        materialize(model, "cpu", seed=0)


def test_materialised_model_is_on_the_requested_device_and_trainable():
    model = local_model(tiny_config(tied=False))
    assert all(p.device.type == "cpu" and not p.is_meta and p.requires_grad for p in model.parameters())
    model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    assert model.lm_head.weight.grad is not None
