"""Training objectives: flow matching (rectified flow) and epsilon / v-prediction (DDPM-style schedulers).

An objective turns clean latents into (noisy input, denoiser timestep, regression target). All randomness —
timesteps, noise, caption dropout — comes from the ``generator`` it is given, or from torch's global RNG when
that is None (training: the engine's StatefulRNG saves and restores it, so a resumed run draws the same noise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from automodel.errors import AutomodelError

OBJECTIVES = ("auto", "flow_matching", "epsilon", "v_prediction")


@dataclass
class ObjectiveConfig:
    type: Literal["auto", "flow_matching", "epsilon", "v_prediction"] = field(default="auto", metadata={
        "help": "flow_matching (rectified flow; flow-match schedulers, e.g. SD3 transformers), epsilon or "
                "v_prediction (DDPM-style schedulers, e.g. UNets); auto: what the pipeline's scheduler implies"})
    timestep_sampling: Literal["uniform", "logit_normal"] = field(default="uniform", metadata={
        "help": "how training timesteps are drawn: uniform in [0, 1), or sigmoid of a normal (logit_normal)"})
    logit_mean: float = field(default=0.0, metadata={"help": "logit_normal: mean of the normal"})
    logit_std: float = field(default=1.0, metadata={"help": "logit_normal: standard deviation of the normal"})
    shift: float | None = field(default=None, metadata={
        "help": "flow matching: timestep shift sigma' = shift*s / (1 + (shift-1)*s) (null: the scheduler's shift)"})
    caption_dropout: float = field(default=0.0, metadata={
        "help": "probability of training a sample on the empty caption (enables classifier-free guidance)"})

    def __post_init__(self) -> None:
        if self.logit_std <= 0:
            raise ValueError(f"objective.logit_std must be > 0, found {self.logit_std}")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError(f"objective.caption_dropout must be in [0, 1], found {self.caption_dropout}")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"objective.shift must be > 0, found {self.shift}")


def is_flow_scheduler(scheduler: Any) -> bool:
    return "FlowMatch" in type(scheduler).__name__ or not hasattr(scheduler, "alphas_cumprod")


def sample_unit(n: int, config: ObjectiveConfig, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` timesteps in (0, 1) on the CPU (uniform, or logit-normal: sigmoid(N(mean, std)))."""
    if config.timestep_sampling == "logit_normal":
        normal = torch.randn(n, generator=generator)
        return torch.sigmoid(config.logit_mean + config.logit_std * normal)
    return torch.rand(n, generator=generator)


def randn_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard normal noise shaped like ``x``, drawn on the generator's device (the global RNG: ``x``'s device)."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(tuple(x.shape), generator=generator, device=x.device, dtype=x.dtype)


class Objective:
    name = "objective"

    def __init__(self, config: ObjectiveConfig, scheduler: Any):
        self.config = config
        self.num_train_timesteps = int(scheduler.config.get("num_train_timesteps", 1000))

    def drop_captions(self, captions: list[str], generator: torch.Generator | None) -> list[str]:
        p = self.config.caption_dropout
        if p <= 0:
            return list(captions)
        drop = torch.rand(len(captions), generator=generator) < p
        return ["" if d else c for c, d in zip(captions, drop.tolist(), strict=True)]

    def noise(self, latents: torch.Tensor, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(noisy latents, timesteps for the denoiser, target)."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.name} ({self.config.timestep_sampling} timesteps)"


class FlowMatching(Objective):
    """Rectified flow: x_s = (1 - s) x0 + s noise, the denoiser predicts the velocity noise - x0 at t = 1000 s."""

    name = "flow_matching"

    def __init__(self, config: ObjectiveConfig, scheduler: Any):
        super().__init__(config, scheduler)
        self.shift = float(config.shift if config.shift is not None else scheduler.config.get("shift", 1.0) or 1.0)

    def sigmas(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        u = sample_unit(n, self.config, generator)
        return self.shift * u / (1 + (self.shift - 1) * u)

    def noise(self, latents, generator):
        sigmas = self.sigmas(latents.shape[0], generator).to(latents.device, latents.dtype)
        noise = randn_like(latents, generator)
        s = sigmas.view(-1, *([1] * (latents.dim() - 1)))
        noisy = (1 - s) * latents + s * noise
        return noisy, sigmas * self.num_train_timesteps, noise - latents

    def describe(self) -> str:
        return f"flow matching ({self.config.timestep_sampling} timesteps, shift {self.shift:g})"


class NoisePrediction(Objective):
    """DDPM-style: x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise; the target is the noise (epsilon) or the velocity
    v = sqrt(a_t) noise - sqrt(1 - a_t) x0 (v_prediction); t is an integer step of the scheduler."""

    def __init__(self, config: ObjectiveConfig, scheduler: Any, prediction_type: str):
        super().__init__(config, scheduler)
        self.name = prediction_type
        self.alphas_cumprod = torch.as_tensor(scheduler.alphas_cumprod, dtype=torch.float64).clone()

    def timesteps(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        u = sample_unit(n, self.config, generator)
        return (u * self.num_train_timesteps).long().clamp_(0, self.num_train_timesteps - 1)

    def noise(self, latents, generator):
        timesteps = self.timesteps(latents.shape[0], generator)
        noise = randn_like(latents, generator)
        shape = (-1, *([1] * (latents.dim() - 1)))
        alpha = self.alphas_cumprod[timesteps].to(latents.device, latents.dtype).view(shape)
        noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
        target = noise if self.name == "epsilon" else alpha.sqrt() * noise - (1 - alpha).sqrt() * latents
        return noisy, timesteps.to(latents.device), target


def build_objective(config: ObjectiveConfig | None, scheduler: Any) -> Objective:
    """The objective for this scheduler; an epsilon / v objective writes its prediction type into the
    scheduler's config, so the saved pipeline samples the way it was trained."""
    config = config or ObjectiveConfig()
    flow = is_flow_scheduler(scheduler)
    kind = config.type
    if kind == "auto":
        kind = "flow_matching" if flow else scheduler.config.get("prediction_type", "epsilon")
    scheduler_name = type(scheduler).__name__
    if kind == "flow_matching":
        if not flow:
            raise AutomodelError(f"objective.type: flow_matching needs a flow-matching scheduler (e.g. "
                                 f"FlowMatchEulerDiscreteScheduler); this pipeline's is {scheduler_name}: use "
                                 "epsilon or v_prediction")
        return FlowMatching(config, scheduler)
    if kind not in ("epsilon", "v_prediction"):
        raise AutomodelError(f"objective.type: the scheduler's prediction_type '{kind}' is not supported; set "
                             "objective.type to epsilon or v_prediction")
    if flow:
        raise AutomodelError(f"objective.type: {kind} needs a DDPM-style scheduler with alphas_cumprod (DDPM, DDIM, "
                             f"Euler...); this pipeline's is {scheduler_name}: use flow_matching")
    if scheduler.config.get("prediction_type") != kind:
        scheduler.register_to_config(prediction_type=kind)
    return NoisePrediction(config, scheduler, kind)
