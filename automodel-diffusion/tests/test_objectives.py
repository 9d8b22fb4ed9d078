"""The objectives' arithmetic against diffusers' own schedulers, timestep sampling, and objective selection."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from automodel.errors import AutomodelError
from automodel_diffusion.objectives import FlowMatching, ObjectiveConfig, build_objective, sample_unit


def latents(seed=0, shape=(64, 4, 8, 8)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_flow_matching_is_rectified_flow_with_the_schedulers_shift():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    objective = build_objective(ObjectiveConfig(type="auto"), scheduler)
    assert isinstance(objective, FlowMatching) and objective.shift == 3.0
    x0 = latents()
    noisy, timesteps, target = objective.noise(x0, torch.Generator().manual_seed(1))
    # the same draws, by hand: timesteps first, then the noise
    generator = torch.Generator().manual_seed(1)
    u = torch.rand(x0.shape[0], generator=generator)
    sigma = 3.0 * u / (1 + 2.0 * u)
    noise = torch.randn(x0.shape, generator=generator)
    s = sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, (1 - s) * x0 + s * noise)
    torch.testing.assert_close(target, noise - x0)
    torch.testing.assert_close(timesteps, sigma * 1000)
    # diffusers' own forward process agrees at the scheduler's discrete sigmas
    scheduler.set_timesteps(10)
    t = scheduler.timesteps[3]
    expected = scheduler.scale_noise(x0[:1], t.reshape(1), noise[:1])
    sigma_t = t / 1000
    torch.testing.assert_close((1 - sigma_t) * x0[:1] + sigma_t * noise[:1], expected)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
def test_noise_prediction_matches_ddpm_add_noise_and_velocity(kind):
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    objective = build_objective(ObjectiveConfig(type=kind), scheduler)
    assert scheduler.config.prediction_type == kind, "the saved scheduler must sample the way it was trained"
    x0 = latents()
    noisy, timesteps, target = objective.noise(x0, torch.Generator().manual_seed(2))
    assert timesteps.dtype == torch.long and 0 <= int(timesteps.min()) and int(timesteps.max()) < 1000
    generator = torch.Generator().manual_seed(2)
    torch.rand(x0.shape[0], generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    torch.testing.assert_close(noisy, scheduler.add_noise(x0, noise, timesteps))
    expected = noise if kind == "epsilon" else scheduler.get_velocity(x0, noise, timesteps)
    torch.testing.assert_close(target, expected)


def test_logit_normal_concentrates_mid_trajectory():
    n = 20000
    uniform = sample_unit(n, ObjectiveConfig(timestep_sampling="uniform"), torch.Generator().manual_seed(0))
    logit = sample_unit(n, ObjectiveConfig(timestep_sampling="logit_normal"), torch.Generator().manual_seed(0))
    shifted = sample_unit(n, ObjectiveConfig(timestep_sampling="logit_normal", logit_mean=1.0),
                          torch.Generator().manual_seed(0))
    for u in (uniform, logit, shifted):
        assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(uniform.std()) - 12 ** -0.5) < 0.01  # uniform: std 1/sqrt(12)
    assert float(logit.std()) < 0.22 and abs(float(logit.mean()) - 0.5) < 0.01
    assert abs(float(torch.logit(logit).std()) - 1.0) < 0.03  # logit of it: the standard normal back
    assert float(shifted.mean()) > 0.65


def test_training_draws_come_from_the_global_rng():
    objective = build_objective(ObjectiveConfig(), FlowMatchEulerDiscreteScheduler())
    x0 = latents()
    torch.manual_seed(7)
    first = objective.noise(x0, None)
    torch.manual_seed(7)
    second = objective.noise(x0, None)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    third = objective.noise(x0, None)
    assert not torch.equal(first[0], third[0])


def test_caption_dropout():
    objective = build_objective(ObjectiveConfig(caption_dropout=0.5), FlowMatchEulerDiscreteScheduler())
    captions = [f"caption {i}" for i in range(200)]
    dropped = objective.drop_captions(captions, torch.Generator().manual_seed(0))
    empty = sum(c == "" for c in dropped)
    assert 60 < empty < 140 and all(c in ("", o) for c, o in zip(dropped, captions, strict=True))
    none = build_objective(ObjectiveConfig(), FlowMatchEulerDiscreteScheduler()).drop_captions(captions, None)
    assert none == captions


def test_objective_and_scheduler_must_agree():
    with pytest.raises(AutomodelError, match="flow_matching needs a flow-matching scheduler"):
        build_objective(ObjectiveConfig(type="flow_matching"), DDPMScheduler())
    with pytest.raises(AutomodelError, match="epsilon needs a DDPM-style scheduler"):
        build_objective(ObjectiveConfig(type="epsilon"), FlowMatchEulerDiscreteScheduler())
    assert build_objective(ObjectiveConfig(), DDPMScheduler(prediction_type="v_prediction")).name == "v_prediction"
    with pytest.raises(ValueError, match="logit_std"):
        ObjectiveConfig(logit_std=0)
