"""The upstream schedule of a plain ``lr_scheduler:`` section, against values worked out from its formulas.

``n`` is the number of optimizer steps taken: the update of step ``s`` trains at the rate for ``n = s - 1``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from automodel.errors import ConfigError
from automodel.optim import OptimizerParamScheduler, build_scheduler, lr_scheduler_issues

pi, cos, sqrt = math.pi, math.cos, math.sqrt


def make_optimizer(lr: float = 2.0, weight_decay: float = 0.05, cls=torch.optim.AdamW) -> torch.optim.Optimizer:
    return cls([torch.nn.Parameter(torch.ones(3))], lr=lr, weight_decay=weight_decay)


def trace(steps: int, optimizer=None, **settings) -> tuple[list[float], list[float]]:
    """The (lr, weight decay) each of the first ``steps`` + 1 updates trains with: index n is n steps taken."""
    optimizer = optimizer or make_optimizer()
    scheduler = build_scheduler(optimizer, **settings)
    lrs, wds = [], []
    for _ in range(steps + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        wds.append(optimizer.param_groups[0]["weight_decay"])
        optimizer.step()
        scheduler.step()
    return lrs, wds


def test_cosine_warms_up_from_init_lr_then_decays_to_min_lr():
    lrs, _ = trace(14, total_steps=12, lr_decay_style="cosine", lr_warmup_steps=4, init_lr=0.5, min_lr=0.2)
    assert lrs[0] == pytest.approx(0.5)                         # step 1 trains at init_lr
    assert lrs[2] == pytest.approx(0.5 + (2.0 - 0.5) * 2 / 4)   # half-way through warmup
    assert lrs[4] == pytest.approx(2.0)                         # warmup ends at max_lr (the optimizer's lr)
    assert lrs[6] == pytest.approx(0.2 + 1.8 * 0.5 * (1 + cos(pi * 2 / 8)))
    assert lrs[8] == pytest.approx(0.2 + 1.8 * 0.5)             # half-way through the decay
    assert lrs[12] == pytest.approx(0.2)
    assert lrs[13] == lrs[14] == pytest.approx(0.2)             # after the decay: min_lr


def test_linear_without_warmup():
    lrs, _ = trace(11, total_steps=10, lr_decay_style="linear", lr_warmup_steps=0, min_lr=0.0)
    assert lrs[0] == pytest.approx(2.0)
    assert lrs[3] == pytest.approx(2.0 * (1 - 3 / 10))
    assert lrs[5] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(0.0) and lrs[11] == pytest.approx(0.0)


def test_constant_holds_max_lr_after_warmup_even_past_the_decay_steps():
    lrs, _ = trace(20, total_steps=10, lr_decay_style="constant", lr_warmup_steps=2, init_lr=0.0)
    assert lrs[:3] == pytest.approx([0.0, 1.0, 2.0])
    assert lrs[10] == lrs[11] == lrs[20] == pytest.approx(2.0)


def test_inverse_square_root():
    lrs, _ = trace(101, total_steps=100, lr_decay_style="inverse-square-root", lr_warmup_steps=4, min_lr=0.1)
    assert lrs[4] == pytest.approx(2.0)
    assert lrs[16] == pytest.approx(2.0 * sqrt(4) / sqrt(16))
    assert lrs[64] == pytest.approx(2.0 * sqrt(4) / sqrt(64))
    assert lrs[99] == pytest.approx(2.0 * sqrt(4) / sqrt(99))
    assert lrs[101] == pytest.approx(0.1)                       # past lr_decay_steps
    clamped, _ = trace(99, total_steps=100, lr_decay_style="inverse-square-root", lr_warmup_steps=4, min_lr=0.45)
    assert clamped[99] == pytest.approx(0.45)                   # 2 * 2 / sqrt(99) = 0.402 < min_lr
    no_warmup, _ = trace(4, total_steps=100, lr_decay_style="inverse-square-root", lr_warmup_steps=0, min_lr=0.0)
    assert no_warmup[0] == pytest.approx(2.0) and no_warmup[4] == pytest.approx(2.0 / sqrt(4))


@pytest.mark.parametrize(("style", "half", "end"), [
    ("linear", 1 - 0.5, 0.0),
    ("cosine", 0.5 * (1 + cos(pi * 0.5)), 0.0),
    ("exponential", 2 * 0.5 ** 0.5 - 1, 0.0),
    ("minus_sqrt", 1 - sqrt(0.5), 0.0),
])
def test_wsd_is_stable_then_decays_over_its_last_steps(style, half, end):
    lrs, _ = trace(11, total_steps=10, lr_decay_style="WSD", lr_warmup_steps=2, init_lr=0.0, min_lr=0.2,
                   wsd_decay_steps=4, lr_wsd_decay_style=style)
    assert lrs[1] == pytest.approx(1.0)                         # warmup
    assert lrs[2] == lrs[4] == lrs[6] == pytest.approx(2.0)     # stable until lr_decay_steps - wsd_decay_steps
    assert lrs[7] != pytest.approx(2.0)
    assert lrs[8] == pytest.approx(0.2 + 1.8 * half)            # half-way through the final decay
    assert lrs[10] == pytest.approx(0.2 + 1.8 * end) and lrs[11] == pytest.approx(0.2)


def test_defaults_follow_upstream():
    lrs, wds = trace(51, total_steps=50)                        # cosine, warmup a tenth of the run
    assert lrs[0] == pytest.approx(0.2)                         # init_lr: a tenth of the optimizer's lr
    assert lrs[5] == pytest.approx(2.0)                         # warmup: 50 // 10 steps
    assert lrs[50] == pytest.approx(0.02) and lrs[51] == pytest.approx(0.02)  # min_lr: a hundredth
    assert set(wds) == {0.05}                                   # weight decay: the optimizer's, constant
    long = build_scheduler(make_optimizer(), total_steps=20000)
    assert long.lr_warmup_steps == 1000 and long.lr_decay_steps == 20000


@pytest.mark.parametrize(("style", "at_two", "at_five"), [
    ("linear", 0.01 + 0.1 * 2 / 10, 0.01 + 0.1 * 5 / 10),
    ("cosine", 0.01 + 0.1 * 0.5 * (1 - cos(pi * 2 / 10)), 0.01 + 0.1 * 0.5 * (1 - cos(pi * 5 / 10))),
])
def test_weight_decay_increases_and_reaches_the_parameter_groups(style, at_two, at_five):
    _, wds = trace(12, total_steps=20, start_wd=0.01, end_wd=0.11, wd_incr_steps=10, wd_incr_style=style)
    assert wds[0] == pytest.approx(0.01)
    assert wds[2] == pytest.approx(at_two) and wds[5] == pytest.approx(at_five)
    assert wds[10] == pytest.approx(0.11) and wds[12] == pytest.approx(0.11)


def test_weight_decay_schedule_acts_on_the_update():
    """AdamW with the scheduled decay moves the weights as AdamW with that decay fixed does."""
    scheduled = make_optimizer(lr=0.1, weight_decay=0.0)
    build_scheduler(scheduled, total_steps=10, lr_decay_style="constant", lr_warmup_steps=0, start_wd=0.3,
                    end_wd=0.3)
    fixed = make_optimizer(lr=0.1, weight_decay=0.3)
    for optimizer in (scheduled, fixed):
        (optimizer.param_groups[0]["params"][0] * 2).sum().backward()
        optimizer.step()
    assert torch.equal(scheduled.param_groups[0]["params"][0], fixed.param_groups[0]["params"][0])


def checkpoint_round_trip(state: dict) -> dict:
    """The state as the checkpoint stores and reads it (torch.save / torch.load with weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


SETTINGS = dict(total_steps=12, lr_decay_style="WSD", lr_warmup_steps=3, wsd_decay_steps=5,
                lr_wsd_decay_style="cosine", start_wd=0.0, end_wd=0.2, wd_incr_style="linear")


def resumed_after(steps: int, **config) -> tuple[torch.optim.Optimizer, OptimizerParamScheduler]:
    first = make_optimizer()
    scheduler = build_scheduler(first, **SETTINGS)
    for _ in range(steps):
        first.step()
        scheduler.step()
    state = checkpoint_round_trip(scheduler.state_dict())
    optimizer = make_optimizer()
    resumed = build_scheduler(optimizer, **{**SETTINGS, **config})
    resumed.load_state_dict(state)
    return optimizer, resumed


def test_resume_mid_run_continues_the_uninterrupted_schedule():
    lrs, wds = trace(14, **SETTINGS)
    optimizer, resumed = resumed_after(7)
    assert all(isinstance(v, (int, float, str, bool, list, type(None))) for v in resumed.state_dict().values())
    for n in range(7, 15):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lrs[n])
        assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(wds[n])
        optimizer.step()
        resumed.step()


def test_resume_settings_follow_the_upstream_flags():
    with pytest.warns(UserWarning, match="checkpoint's min_lr"):
        _, kept = resumed_after(7, min_lr=0.5)
    assert kept.min_lr == pytest.approx(0.02)                    # default: the checkpoint's settings
    _, overridden = resumed_after(7, min_lr=0.5, override_opt_param_scheduler=True)
    assert overridden.min_lr == 0.5 and overridden.last_epoch == 7
    with pytest.raises(ConfigError, match="lr_scheduler.min_lr: the config says 0.5, the checkpoint 0.02"):
        resumed_after(7, min_lr=0.5, use_checkpoint_opt_param_scheduler=False)


@pytest.mark.parametrize(("node", "key", "text"), [
    ({"lr_decay_style": "polynomial"}, "lr_decay_style",
     "use one of: cosine, linear, WSD, inverse-square-root, constant"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_style": "linear"}, "wsd_decay_steps",
     "required with lr_decay_style: WSD"),
    ({"lr_decay_style": "WSD", "wsd_decay_steps": 2, "lr_wsd_decay_style": "step"}, "lr_wsd_decay_style",
     "use one of: linear, cosine, exponential, minus_sqrt"),
    ({"wd_incr_style": "quadratic"}, "wd_incr_style", "use one of: constant, linear, cosine"),
    ({"start_wd": 0.0, "end_wd": 0.1}, "wd_incr_style", "constant, but start_wd (0.0) != end_wd (0.1)"),
    ({"start_wd": 0.2, "end_wd": 0.1, "wd_incr_style": "linear"}, "start_wd", "above end_wd"),
    ({"min_lr": 0.1, "max_lr": 0.01}, "min_lr", "above max_lr"),
    ({"init_lr": 0.1, "max_lr": 0.01}, "init_lr", "above max_lr"),
    ({"lr_warmup_steps": 10, "lr_decay_steps": 9}, "lr_warmup_steps", "10 is above lr_decay_steps (9)"),
    ({"lr_warmup_steps": 0.5}, "lr_warmup_steps", "expected a whole number of steps >= 0, found 0.5"),
    ({"lr_decay_steps": 0}, "lr_decay_steps", "expected a whole number of steps >= 1"),
    ({"min_lr": -1.0}, "min_lr", "expected a number >= 0"),
    ({"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True},
     "override_opt_param_scheduler", "set one of them false"),
])
def test_validation_refuses_what_cannot_act(node, key, text):
    issues = lr_scheduler_issues(node, total_steps=10)
    assert [i.key for i in issues] == [f"lr_scheduler.{key}"], issues
    assert text in issues[0].message


def test_validation_passes_a_full_upstream_section_and_leaves_targets_alone():
    node = {"lr_decay_style": "WSD", "lr_warmup_steps": 2, "lr_decay_steps": 20, "init_lr": 0.0, "max_lr": 1e-3,
            "min_lr": 1e-5, "wsd_decay_steps": 5, "lr_wsd_decay_style": "minus_sqrt", "start_wd": 0.0,
            "end_wd": 0.1, "wd_incr_steps": 20, "wd_incr_style": "cosine"}
    assert lr_scheduler_issues(node, total_steps=None) == []
    assert lr_scheduler_issues({"_target_": "automodel.optim.CosineAnnealingWarmup", "x": 1}, 10) == []


def test_a_warmup_as_long_as_the_run_or_longer_makes_every_step_a_warmup_step():
    """A short test run of a config written for a long one (lr_warmup_steps: 100, max_steps: 3): upstream stops on
    an assertion; here every step warms up, as the warmup formula gives, with a warning."""
    assert lr_scheduler_issues({"lr_warmup_steps": 100}, total_steps=3) == []
    with pytest.warns(UserWarning, match="lr_warmup_steps: 100 is not below the run's 3 steps, so every step warms"):
        schedule = build_scheduler(make_optimizer(), total_steps=3, lr_warmup_steps=100, init_lr=0.0, max_lr=1.0)
    assert [schedule.lr_at(n) for n in range(4)] == pytest.approx([0.0, 0.01, 0.02, 0.03])
    with pytest.warns(UserWarning, match="every step warms up"):
        schedule = build_scheduler(make_optimizer(), total_steps=5, lr_warmup_steps=5, init_lr=0.0, max_lr=1.0)
    assert [schedule.lr_at(n) for n in (4, 5, 6)] == pytest.approx([0.8, 1.0, schedule.min_lr])


def test_build_time_checks_name_the_key():
    with pytest.raises(ConfigError, match="lr_scheduler.lr_warmup_steps: 5 is above lr_decay_steps"):
        build_scheduler(make_optimizer(), total_steps=5, lr_warmup_steps=5, lr_decay_steps=4)
    with pytest.raises(ConfigError, match="lr_scheduler.init_lr: 3.0 .* is above max_lr"):
        build_scheduler(make_optimizer(), total_steps=5, init_lr=3.0)   # max_lr: the optimizer's 2.0
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # has no weight decay
    with pytest.raises(ConfigError, match="lr_scheduler.start_wd: LBFGS has no weight_decay"):
        build_scheduler(lbfgs, total_steps=5, start_wd=0.1, end_wd=0.1)
    with pytest.raises(ConfigError, match="lr_scheduler.min_lr: expected a number >= 0, found 'low'"):
        OptimizerParamScheduler(make_optimizer(), lr_decay_steps=5, min_lr="low")    # the _target_ form
    with pytest.raises(ConfigError, match="set lr_decay_steps and lr_warmup_steps"):
        build_scheduler(make_optimizer(), total_steps=None)

