"""Muon (upstream's ``dion.Muon``): its parameter groups, two steps against the formulas worked out by hand (the
Newton-Schulz orthogonalisation is torch's own function), the groups' rates under the upstream schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, _zeropower_via_newtonschulz

from automodel.optim import Muon, build_scheduler
from automodel.optim.muon import muon_issues


class Tiny(nn.Module):
    """An embedding, a linear layer with a bias, a norm, a 3-D (convolution) weight and an output head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8, bias=False)
        self.conv = nn.Conv1d(8, 4, kernel_size=3, bias=False)
        self.lm_head = nn.Linear(4, 11, bias=False)


def with_grads(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def ns(matrix: torch.Tensor, eps: float) -> torch.Tensor:
    flat = matrix.reshape(matrix.shape[0], -1)
    result = _zeropower_via_newtonschulz(flat, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, eps)
    return result.reshape(matrix.shape).float()


def adamw_once(p, g, lr, wd, betas, eps):
    """One AdamW step from zero state (bias-corrected: m / (1 - b1) = g, v / (1 - b2) = g^2)."""
    return p * (1 - lr * wd) - lr * g / (g.abs() + eps)


SETTINGS = {"lr": 0.02, "mu": 0.9, "weight_decay": 0.1, "epsilon": 1e-7, "nesterov": True,
            "scalar_betas": (0.8, 0.99), "scalar_eps": 1e-6, "scalar_lr": 0.003, "embed_lr": 0.004}


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
@pytest.mark.parametrize("flatten", [False, True])
def test_two_steps_equal_the_formulas(adjust_lr, flatten):
    torch.manual_seed(0)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = Muon(model.parameters(), model=model, adjust_lr=adjust_lr, flatten=flatten, **SETTINGS)
    with_grads(model, 1)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    after_one = {n: p.detach().clone() for n, p in model.named_parameters()}
    with_grads(model, 2)
    second = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    lr, mu, wd, eps = SETTINGS["lr"], SETTINGS["mu"], SETTINGS["weight_decay"], SETTINGS["epsilon"]

    def scaled(shape):
        d_out, d_in = shape[0], math.prod(shape[1:])
        return {"spectral_norm": lr * math.sqrt(d_out / d_in), "rms_norm": lr * 0.2 * math.sqrt(max(d_out, d_in)),
                None: lr}[adjust_lr]

    matrices = ["proj.weight", "conv.weight"] if flatten else ["proj.weight"]
    for name in matrices:  # Muon: M1 = G1, M2 = mu M1 + G2; nesterov U = mu M + G
        momentum = mu * first[name] + second[name]
        update = ns(mu * momentum + second[name], eps)
        expected = after_one[name] * (1 - lr * wd) - scaled(before[name].shape) * update
        torch.testing.assert_close(model.get_parameter(name).detach(), expected, rtol=0, atol=1e-6)
        step_one = before[name] * (1 - lr * wd) - scaled(before[name].shape) * ns((1 + mu) * first[name], eps)
        torch.testing.assert_close(after_one[name], step_one, rtol=0, atol=1e-6)
        assert "momentum_buffer" in optimizer.state[model.get_parameter(name)]

    lm_head_lr = lr / math.sqrt(4)  # upstream's default: lr / sqrt(d_in)
    scalar = {"proj.bias": (SETTINGS["scalar_lr"], wd), "norm.weight": (SETTINGS["scalar_lr"], wd),
              "embed.weight": (SETTINGS["embed_lr"], 0.0), "lm_head.weight": (lm_head_lr, 0.0)}
    if not flatten:
        scalar["conv.weight"] = (SETTINGS["scalar_lr"], wd)  # >2-D without flatten: AdamW, as upstream
    for name, (rate, decay) in scalar.items():
        expected = adamw_once(before[name], first[name], rate, decay, SETTINGS["scalar_betas"], SETTINGS["scalar_eps"])
        torch.testing.assert_close(after_one[name], expected, rtol=1e-5, atol=1e-6)
        assert set(optimizer.state[model.get_parameter(name)]) == {"step", "exp_avg", "exp_avg_sq"}
    assert len(matrices) + len(scalar) == len(before)


def test_groups_follow_upstream_and_the_schedule_keeps_their_ratios():
    model = Tiny()
    optimizer = Muon(model.parameters(), model=model, lr=0.01, weight_decay=0.1, scalar_lr=0.002,
                     lm_head_lr=0.005, betas=(0.5, 0.6))
    lrs = [g["lr"] for g in optimizer.param_groups]
    assert lrs == pytest.approx([0.01, 0.002, 0.002, 0.005])  # matrix, vector, embed (scalar_lr), lm_head
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.0, 0.0]
    assert optimizer.param_groups[1]["betas"] == (0.5, 0.6)  # betas stand in without scalar_betas
    scheduler = build_scheduler(optimizer, total_steps=10, lr_warmup_steps=0, min_lr=0.0, start_wd=0.2,
                                end_wd=0.4, wd_incr_style="linear")
    for _ in range(5):
        with_grads(model, 3)
        optimizer.step()
        scheduler.step()
    factor = optimizer.param_groups[0]["lr"] / 0.01
    assert 0 < factor < 1
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([rate * factor for rate in lrs])
    assert [g["weight_decay"] for g in optimizer.param_groups] == pytest.approx([0.3, 0.3, 0.0, 0.0])
    assert scheduler.get_last_lr() == pytest.approx([g["lr"] for g in optimizer.param_groups])


def test_only_trainable_parameters_are_grouped_and_the_state_round_trips():
    model = Tiny()
    model.embed.weight.requires_grad_(False)
    optimizer = Muon([p for p in model.parameters() if p.requires_grad], model=model)
    assert optimizer.param_groups[2]["params"] == []
    with_grads(model, 4)
    optimizer.step()
    again = Muon([p for p in model.parameters() if p.requires_grad], model=model)
    again.load_state_dict(optimizer.state_dict())
    for param in optimizer.state:
        for key, value in optimizer.state[param].items():
            assert torch.equal(again.state[param][key], value)


def test_refusals_name_the_argument_and_the_reason():
    issues = muon_issues({"use_triton": True, "scalar_opt": "lion", "lr": 0, "mu": 1.5, "scalar_betas": [0.9]})
    assert set(issues) == {"use_triton", "scalar_opt", "lr", "mu", "scalar_betas"}
    assert "CUDA" in issues["use_triton"] and "use adamw" in issues["scalar_opt"]
    assert muon_issues({"use_triton": False, "scalar_opt": "adamw", "flatten": True}) == {}
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon(Tiny().parameters(), model=Tiny(), adjust_lr="frobenius")
    with pytest.raises(ValueError, match="not parameters of the model"):
        Muon(list(Tiny().parameters()), model=Tiny())
