"""``model.backend.rms_norm: torch`` (upstream's torch.nn.RMSNorm in the input's dtype) acts on a Hugging Face
model's RMSNorms; ``torch_fp32`` (and no setting) keeps the model's own float32 RMSNorm; Gemma's (1 + weight) form
computes alike with 1 + weight; an RMSNorm of another form is refused rather than computed wrongly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import automodel_llm
from automodel.errors import AutomodelError
from automodel_llm.models import AutoModelForCausalLM

TINY = str(automodel_llm.__path__[0]) + "/examples/assets/tiny_llama/config.json"


def test_rms_norm_torch_computes_like_torch_nn_rmsnorm_in_the_input_dtype():
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0)).mul(3).bfloat16()
    model = AutoModelForCausalLM.from_config(TINY, num_hidden_layers=1, dtype="bfloat16", seed=1,
                                             backend={"rms_norm": "torch"})
    own = AutoModelForCausalLM.from_config(TINY, num_hidden_layers=1, dtype="bfloat16", seed=1,
                                           backend={"rms_norm": "torch_fp32"})
    with torch.no_grad():
        for m in (model, own):
            m.model.norm.weight.copy_(torch.linspace(0.5, 1.5, 128))
        reference = torch.nn.RMSNorm(128, eps=own.model.norm.variance_epsilon, dtype=torch.bfloat16)
        reference.weight.copy_(model.model.norm.weight)
        got, kept = model.model.norm(x), own.model.norm(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, reference(x))
        assert not torch.equal(kept, got)  # the model's own RMSNorm computes in float32: a different rounding
        ids = torch.arange(10).reshape(1, 10)
        assert torch.isfinite(model(input_ids=ids).logits).all()
    layers = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(layers) == 3 and all(hasattr(m, "_input_dtype_eps") for m in layers)  # 2 per layer and the final


def test_rms_norm_torch_computes_gemmas_offset_form_in_the_input_dtype():
    """Gemma's (and Qwen3.5's) RMSNorm scales by 1 + weight: upstream's Qwen3.5 configs set rms_norm: torch."""
    config = AutoConfig.for_model("gemma", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = AutoModelForCausalLM.from_config(config.to_dict() | {"model_type": "gemma"}, dtype="bfloat16", seed=1,
                                             backend={"rms_norm": "torch"})
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)).mul(3).bfloat16()
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.linspace(-0.5, 0.5, 16))
        reference = torch.nn.RMSNorm(16, eps=model.model.norm.eps, dtype=torch.bfloat16)
        reference.weight.copy_(1 + model.model.norm.weight.float())
        got = model.model.norm(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, reference(x))
        assert torch.isfinite(model(input_ids=torch.arange(10).reshape(1, 10)).logits).all()


def test_rms_norm_torch_refuses_an_rmsnorm_of_another_form():
    class ShiftedRMSNorm(torch.nn.Module):  # neither weight * ... nor (1 + weight) * ...
        def __init__(self, size: int, eps: float = 1e-6):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(size)), eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) + 0.5

    from automodel.rms_norm import use_input_dtype_rms_norm

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ShiftedRMSNorm(4))
    with pytest.raises(AutomodelError, match=r"ShiftedRMSNorm\) is an RMSNorm of another form"):
        use_input_dtype_rms_norm(model)


def test_rms_norm_torch_in_a_run_built_on_the_meta_device(tmp_path, monkeypatch):
    from pathlib import Path

    from automodel.testing import train_inprocess

    monkeypatch.chdir(tmp_path)
    form = Path(__file__).parent / "upstream_forms" / "model_backend.yaml"
    recipe = train_inprocess(form, "--model.backend.rms_norm", "torch", "--model.torch_dtype", "bfloat16",
                             setup_only=True)
    norms = [m for m in recipe.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(hasattr(m, "_input_dtype_eps") for m in norms)
    assert all(m.weight.device.type == "cpu" for m in norms)  # materialised after the meta build
