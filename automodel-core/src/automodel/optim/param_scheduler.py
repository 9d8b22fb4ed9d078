"""The upstream (NeMo AutoModel / Megatron) learning-rate and weight-decay schedule, from a plain ``lr_scheduler:``.

``n`` below is the number of optimizer steps taken so far (the update of step ``s`` uses ``n = s - 1``), ``W`` the
warmup steps, ``D`` the decay steps:

* warmup (``W > 0`` and ``n <= W``): ``init_lr + (max_lr - init_lr) * n / W``, so step 1 trains at ``init_lr``;
* ``constant``: ``max_lr`` after warmup; every other style gives ``min_lr`` once ``n > D``;
* ``inverse-square-root``: ``max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))``;
* ``linear`` / ``cosine``: ``min_lr + c * (max_lr - min_lr)`` with ``r = (n - W) / (D - W)`` and
  ``c = 1 - r`` / ``c = (1 + cos(pi * r)) / 2``;
* ``WSD`` (warmup-stable-decay): ``c = 1`` until ``n <= D - wsd_decay_steps``, then over the last
  ``wsd_decay_steps`` with ``r`` their fraction gone, by ``lr_wsd_decay_style``: ``linear`` ``1 - r``, ``cosine``
  ``(1 + cos(pi * r)) / 2``, ``exponential`` ``2 * 0.5**r - 1``, ``minus_sqrt`` ``1 - sqrt(r)``.

Weight decay goes from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (``r = n / wd_incr_steps``): ``constant``
(then ``start_wd == end_wd``), ``linear`` ``r``, ``cosine`` ``(1 - cos(pi * r)) / 2``; ``end_wd`` after. It is
written into every parameter group that has a ``weight_decay`` each step. A group with ``lr_mult`` / ``wd_mult``
(upstream's keys: Muon's groups) gets the rate / weight decay times them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from automodel.errors import ConfigError, ConfigIssue

LR_DECAY_STYLES = ("cosine", "linear", "WSD", "inverse-square-root", "constant")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")
SECTION = "lr_scheduler"

# The schedule's settings (saved with its state). On resume the checkpoint's win (use_checkpoint_opt_param_scheduler,
# true unless override_opt_param_scheduler is); override_opt_param_scheduler: the config's; both false: they must match.
SETTINGS = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "wsd_decay_steps",
            "lr_wsd_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")
_STEP_KEYS = ("lr_warmup_steps", "lr_decay_steps", "wsd_decay_steps", "wd_incr_steps")
_RATE_KEYS = ("init_lr", "max_lr", "min_lr", "start_wd", "end_wd")
_CHOICES = {"lr_decay_style": LR_DECAY_STYLES, "lr_wsd_decay_style": WSD_DECAY_STYLES,
            "wd_incr_style": WD_INCR_STYLES}
_FLAGS = ("use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    problems = []
    for key, value in values.items():
        if value is None:
            continue
        if key in _STEP_KEYS and not (_is_int(value) and value >= (0 if key == "lr_warmup_steps" else 1)):
            least = "0" if key == "lr_warmup_steps" else "1"
            problems.append((key, f"expected a whole number of steps >= {least}, found {value!r}"))
        elif key in _RATE_KEYS and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                        and value >= 0):
            problems.append((key, f"expected a number >= 0, found {value!r}"))
        elif key in _CHOICES and value not in _CHOICES[key]:
            problems.append((key, f"'{value}' is not supported; use one of: {', '.join(_CHOICES[key])}"))
        elif key in _FLAGS and not isinstance(value, bool):
            problems.append((key, f"expected true or false, found {value!r}"))
    return problems


def settings_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for every problem in the given schedule settings; unknown (None/absent) ones are skipped."""
    problems = _type_problems(values)
    if problems:
        return problems
    get = values.get

    def both(a: str, b: str) -> bool:
        return get(a) is not None and get(b) is not None

    if both("min_lr", "max_lr") and get("min_lr") > get("max_lr"):
        problems.append(("min_lr", f"{get('min_lr')} is above max_lr ({get('max_lr')})"))
    if both("init_lr", "max_lr") and get("init_lr") > get("max_lr"):
        problems.append(("init_lr", f"{get('init_lr')} (the rate warmup starts from) is above max_lr "
                                    f"({get('max_lr')})"))
    if both("lr_warmup_steps", "lr_decay_steps") and get("lr_warmup_steps") > get("lr_decay_steps"):
        problems.append(("lr_warmup_steps", f"{get('lr_warmup_steps')} is above lr_decay_steps "
                                            f"({get('lr_decay_steps')}): the decay would end before the warmup"))
    if both("start_wd", "end_wd") and get("start_wd") > get("end_wd"):
        problems.append(("start_wd", f"{get('start_wd')} is above end_wd ({get('end_wd')}): weight decay only "
                                     "increases"))
    if get("wd_incr_style", "constant") == "constant" and both("start_wd", "end_wd") \
            and get("start_wd") != get("end_wd"):
        problems.append(("wd_incr_style", f"constant, but start_wd ({get('start_wd')}) != end_wd ({get('end_wd')}); "
                                          "set wd_incr_style: linear or cosine, or make them equal"))
    if get("lr_decay_style") == "WSD":
        for key in ("wsd_decay_steps", "lr_wsd_decay_style"):
            if get(key) is None:
                problems.append((key, "required with lr_decay_style: WSD (the length and shape of the final "
                                      "decay)"))
    if get("use_checkpoint_opt_param_scheduler") and get("override_opt_param_scheduler"):
        problems.append(("override_opt_param_scheduler", "true together with use_checkpoint_opt_param_scheduler: "
                                                         "true; set one of them false"))
    return problems


def lr_scheduler_issues(node: Mapping[str, Any] | None, total_steps: int | None) -> list[ConfigIssue]:
    """Validation of a plain ``lr_scheduler:`` section (upstream keys); ``total_steps`` is the run's, when known."""
    if not isinstance(node, Mapping) or "_target_" in node:
        return []
    values = dict(node)
    if values.get("lr_decay_steps") is None and _is_int(total_steps):
        values["lr_decay_steps"] = decay_steps_of_run(total_steps, values.get("lr_warmup_steps"))
    return [ConfigIssue(f"{SECTION}.{key}", message) for key, message in settings_problems(values)]


class OptimizerParamScheduler(LRScheduler):
    """Warmup then decay of the learning rate, and a weight-decay schedule (module docstring: the formulas).

    Unset rates default from the optimizer's first parameter group as upstream does: ``max_lr`` its lr,
    ``init_lr`` a tenth of it, ``min_lr`` a hundredth; ``start_wd`` / ``end_wd`` its weight decay;
    ``wd_incr_steps`` is ``lr_decay_steps``. Every group gets the same schedule, times the group's ``lr_mult`` /
    ``wd_mult`` where it has them (upstream's keys; Muon's groups carry their rates' ratios). The state is plain
    numbers.
    """

    def __init__(self, optimizer: Optimizer, lr_decay_steps: int, lr_warmup_steps: int = 0,
                 lr_decay_style: str = "cosine", init_lr: float | None = None, max_lr: float | None = None,
                 min_lr: float | None = None, wsd_decay_steps: int | None = None,
                 lr_wsd_decay_style: str | None = None, start_wd: float | None = None, end_wd: float | None = None,
                 wd_incr_steps: int | None = None, wd_incr_style: str = "constant",
                 use_checkpoint_opt_param_scheduler: bool | None = None, override_opt_param_scheduler: bool = False,
                 last_epoch: int = -1):
        first = optimizer.param_groups[0]
        base_lr = float(first.get("initial_lr", first["lr"]))
        base_wd = float(first.get("weight_decay", 0.0))
        settings = {
            "init_lr": base_lr * 0.1 if init_lr is None else init_lr,
            "max_lr": base_lr if max_lr is None else max_lr,
            "min_lr": base_lr * 0.01 if min_lr is None else min_lr,
            "lr_warmup_steps": lr_warmup_steps, "lr_decay_steps": lr_decay_steps, "lr_decay_style": lr_decay_style,
            "wsd_decay_steps": wsd_decay_steps, "lr_wsd_decay_style": lr_wsd_decay_style,
            "start_wd": base_wd if start_wd is None else start_wd,
            "end_wd": base_wd if end_wd is None else end_wd,
            "wd_incr_steps": lr_decay_steps if wd_incr_steps is None else wd_incr_steps,
            "wd_incr_style": wd_incr_style,
            "use_checkpoint_opt_param_scheduler": (not override_opt_param_scheduler
                                                   if use_checkpoint_opt_param_scheduler is None
                                                   else use_checkpoint_opt_param_scheduler),
            "override_opt_param_scheduler": override_opt_param_scheduler,
        }
        problems = settings_problems(settings)
        scheduled_wd = settings["start_wd"] or settings["end_wd"]
        if scheduled_wd and not all("weight_decay" in group for group in optimizer.param_groups):
            problems.append(("start_wd", f"{type(optimizer).__name__} has no weight_decay to schedule; leave "
                                         "start_wd / end_wd unset or use an optimizer with weight decay"))
        if problems:
            raise ConfigError([ConfigIssue(f"{SECTION}.{key}", message) for key, message in problems])
        self.__dict__.update(settings, **{key: float(settings[key]) for key in _RATE_KEYS})
        super().__init__(optimizer, last_epoch)

    def lr_at(self, n: int) -> float:
        """The learning rate after ``n`` optimizer steps."""
        warmup, decay, top, bottom = self.lr_warmup_steps, self.lr_decay_steps, self.max_lr, self.min_lr
        if warmup > 0 and n <= warmup:
            return self.init_lr + (top - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return top
        if n > decay:
            return bottom
        if self.lr_decay_style == "inverse-square-root":
            return max(bottom, top * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
        if self.lr_decay_style == "WSD":
            coeff = self._wsd_coefficient(n)
        else:
            ratio = (n - warmup) / (decay - warmup)
            coeff = 1.0 - ratio if self.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
        return bottom + coeff * (top - bottom)

    def _wsd_coefficient(self, n: int) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        ratio = (n - anneal_start) / self.wsd_decay_steps
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * ratio))
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * 0.5 ** ratio - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def wd_at(self, n: int) -> float:
        """The weight decay after ``n`` optimizer steps."""
        if n > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = n / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (1.0 - math.cos(math.pi * ratio))
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self) -> list[float]:
        lr = self.lr_at(self.last_epoch)
        return [lr * group.get("lr_mult", 1.0) for group in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._set_weight_decay()

    def _set_weight_decay(self) -> None:
        wd = self.wd_at(self.last_epoch)
        for group in self.optimizer.param_groups:
            if "weight_decay" in group:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the step count from the checkpoint; the settings as the two upstream flags say."""
        state = dict(state_dict)
        configured = {key: getattr(self, key) for key in (*SETTINGS, *_FLAGS)}
        differing = [key for key in SETTINGS if key in state and state[key] != configured[key]]
        if self.override_opt_param_scheduler:
            state.update(configured)
        elif differing and not self.use_checkpoint_opt_param_scheduler:
            raise ConfigError([ConfigIssue(f"{SECTION}.{key}", f"the config says {configured[key]!r}, the checkpoint "
                                                               f"{state[key]!r}; set override_opt_param_scheduler: "
                                                               "true to use the config's, or "
                                                               "use_checkpoint_opt_param_scheduler: true for the "
                                                               "checkpoint's") for key in differing])
        elif differing:
            warnings.warn(f"{SECTION}: resuming with the checkpoint's {', '.join(differing)} (the config's differ; "
                          "override_opt_param_scheduler: true uses the config's)", stacklevel=2)
        state.update({key: configured[key] for key in _FLAGS})
        super().load_state_dict(state)
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr
        self._set_weight_decay()


def decay_steps_of_run(total_steps: int, lr_warmup_steps: Any) -> int:
    """``lr_decay_steps`` when unset: the run's steps, or the warmup's when the run is shorter (a short test run of
    a config written for a long one: every step is then a warmup step; upstream stops on an assertion)."""
    return max(total_steps, lr_warmup_steps) if _is_int(lr_warmup_steps) else total_steps


def build_scheduler(optimizer: Optimizer, total_steps: int | None = None, lr_decay_style: str = "cosine",
                    lr_warmup_steps: int | None = None, lr_decay_steps: int | None = None,
                    init_lr: float | None = None, max_lr: float | None = None, min_lr: float | None = None,
                    wsd_decay_steps: int | None = None, lr_wsd_decay_style: str | None = None,
                    start_wd: float | None = None, end_wd: float | None = None, wd_incr_steps: int | None = None,
                    wd_incr_style: str = "constant", use_checkpoint_opt_param_scheduler: bool | None = None,
                    override_opt_param_scheduler: bool = False) -> OptimizerParamScheduler:
    """The schedule a plain ``lr_scheduler:`` section (upstream keys, no ``_target_``) describes.

    Unset step counts default as upstream's: ``lr_decay_steps`` and ``wd_incr_steps`` the run's steps,
    ``lr_warmup_steps`` a tenth of them (at most 1000); a warmup as long as the run or longer makes it all warmup
    (:func:`decay_steps_of_run`).
    """
    if total_steps is None and (lr_decay_steps is None or lr_warmup_steps is None):
        raise ConfigError(ConfigIssue(f"{SECTION}.lr_decay_steps", "the run's length is unknown (a streaming data "
                                                                   "set): set lr_decay_steps and lr_warmup_steps"))
    if lr_decay_steps is None and lr_warmup_steps is not None and lr_warmup_steps >= total_steps:
        warnings.warn(f"{SECTION}.lr_warmup_steps: {lr_warmup_steps} is not below the run's {total_steps} steps, so "
                      "every step warms up (the learning rate stays under max_lr)", stacklevel=2)
    return OptimizerParamScheduler(
        optimizer, lr_decay_steps=decay_steps_of_run(total_steps, lr_warmup_steps) if lr_decay_steps is None
        else lr_decay_steps,
        lr_warmup_steps=min(1000, total_steps // 10) if lr_warmup_steps is None else lr_warmup_steps,
        lr_decay_style=lr_decay_style, init_lr=init_lr, max_lr=max_lr, min_lr=min_lr,
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=lr_wsd_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=total_steps if wd_incr_steps is None else wd_incr_steps, wd_incr_style=wd_incr_style,
        use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=override_opt_param_scheduler)
