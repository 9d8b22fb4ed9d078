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


def test_upstream_sigma_sampling_shift_clamp_and_mix_by_hand():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    config = ObjectiveConfig(type="flow_matching", timestep_sampling="logit_normal", shift=2.5, sigma_min=0.2,
                             sigma_max=0.7, mix_uniform_ratio=0.5, num_train_timesteps=500)
    objective = build_objective(config, scheduler)
    drawn = objective.sigmas(64, torch.Generator().manual_seed(4))
    generator = torch.Generator().manual_seed(4)
    coin = float(torch.rand(1, generator=generator))  # one draw per micro-batch: uniform instead, with p = 0.5
    u = torch.rand(64, generator=generator) if coin < 0.5 else torch.sigmoid(torch.randn(64, generator=generator))
    u = u.clamp(min=1e-5)
    expected = (2.5 / (2.5 + (1 / u - 1))).clamp(0.2, 0.7)  # upstream's form of the shift
    torch.testing.assert_close(drawn, expected)
    assert objective.num_train_timesteps == 500
    x0 = latents()
    _, timesteps, _ = objective.noise(x0, torch.Generator().manual_seed(5))
    assert float(timesteps.min()) >= 0.2 * 500 - 1e-3 and float(timesteps.max()) <= 0.7 * 500 + 1e-3


def test_unshifted_beta_and_mode_sampling():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    plain = build_objective(ObjectiveConfig(type="flow_matching", shift_sigmas=False), scheduler)
    torch.testing.assert_close(plain.sigmas(16, torch.Generator().manual_seed(1)),
                               torch.rand(16, generator=torch.Generator().manual_seed(1)))
    beta = build_objective(ObjectiveConfig(type="flow_matching", timestep_sampling="beta", beta_alpha=2.0,
                                           beta_beta=6.0), scheduler)
    state = torch.get_rng_state()
    draws = beta.sigmas(20000, torch.Generator().manual_seed(2))
    assert torch.equal(state, torch.get_rng_state()), "a generator's draw leaves the global RNG alone"
    assert abs(float(draws.mean()) - 2.0 / 8.0) < 0.01  # Beta(2, 6) has mean 1/4, and is not shifted
    mode = ObjectiveConfig(timestep_sampling="mode")
    u = torch.rand(8, generator=torch.Generator().manual_seed(3))
    expected = (1 - u - 1.29 * (torch.cos(torch.pi * u / 2) ** 2 - 1 + u)).clamp(0, 1)
    torch.testing.assert_close(sample_unit(8, mode, torch.Generator().manual_seed(3)), expected)


def test_linear_loss_weights_and_flow_only_settings():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    linear = build_objective(ObjectiveConfig(loss_weighting="linear"), scheduler)
    timesteps = torch.tensor([0.0, 500.0, 1000.0])
    torch.testing.assert_close(linear.loss_weights(timesteps), torch.tensor([1.0, 2.5, 4.0]))
    assert build_objective(ObjectiveConfig(), scheduler).loss_weights(timesteps) is None
    with pytest.raises(AutomodelError, match="loss_weighting apply to flow matching only"):
        build_objective(ObjectiveConfig(loss_weighting="linear"), DDPMScheduler())
