"""Training objectives: flow matching (rectified flow) and epsilon / v-prediction (DDPM-style schedulers).

An objective turns clean latents into (noisy input, denoiser timestep, regression target). All randomness —
timesteps, noise, caption dropout — comes from the ``generator`` it is given, or from torch's global RNG when
that is None (training: the engine's StatefulRNG saves and restores it, so a resumed run draws the same noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from automodel.config import FieldErrors
from automodel.errors import AutomodelError

OBJECTIVES = ("auto", "flow_matching", "epsilon", "v_prediction")
MODE_SCALE = 1.29  # SD3's mode sampling


SAMPLINGS = ("uniform", "logit_normal", "lognorm", "mix", "mode", "beta")
WEIGHTINGS = ("none", "linear", "bsmntw")


@dataclass
class ObjectiveConfig:
    type: Literal["auto", "flow_matching", "epsilon", "v_prediction"] = field(default="auto", metadata={
        "help": "flow_matching (rectified flow; flow-match schedulers, e.g. SD3 transformers), epsilon or "
                "v_prediction (DDPM-style schedulers, e.g. UNets); auto: what the pipeline's scheduler implies"})
    timestep_sampling: Literal["uniform", "logit_normal", "lognorm", "mix", "mode", "beta"] = field(
        default="uniform", metadata={
            "help": "how training timesteps are drawn: uniform in [0, 1); logit_normal: sigmoid of N(logit_mean, "
                    "logit_std); lognorm / mix: sigmoid of N(0, 1); mode: SD3's mode sampling (scale 1.29); beta "
                    "(flow matching): sigma ~ Beta(beta_alpha, beta_beta), not shifted"})
    logit_mean: float = field(default=0.0, metadata={"help": "logit_normal: mean of the normal"})
    logit_std: float = field(default=1.0, metadata={"help": "logit_normal: standard deviation of the normal"})
    mix_uniform_ratio: float = field(default=0.0, metadata={
        "help": "flow matching: probability that a micro-batch draws uniform timesteps instead (upstream's mix)"})
    beta_alpha: float = field(default=2.5, metadata={"help": "beta sampling: the alpha shape parameter"})
    beta_beta: float = field(default=1.5, metadata={"help": "beta sampling: the beta shape parameter"})
    shift: float | None = field(default=None, metadata={
        "help": "flow matching: timestep shift sigma' = shift*s / (1 + (shift-1)*s) (null: the scheduler's shift)"})
    shift_sigmas: bool = field(default=True, metadata={
        "help": "flow matching: false draws sigma uniformly and never shifts it (upstream's use_sigma_noise: false)"})
    sigma_min: float = field(default=0.0, metadata={"help": "flow matching: sigmas are clamped to at least this"})
    sigma_max: float = field(default=1.0, metadata={"help": "flow matching: sigmas are clamped to at most this"})
    num_train_timesteps: int | None = field(default=None, metadata={
        "help": "flow matching: the denoiser's timestep is sigma * this (null: the scheduler's)"})
    loss_weighting: Literal["none", "linear", "bsmntw"] = field(default="none", metadata={
        "help": "flow matching: per-sample loss weight; linear: 1 + shift * sigma; bsmntw: a bell curve over the "
                "timesteps centred mid-trajectory (mean 1)"})
    caption_dropout: float = field(default=0.0, metadata={
        "help": "probability of training a sample on the empty caption (enables classifier-free guidance)"})

    def __post_init__(self) -> None:
        bad = {}
        if self.logit_std <= 0:
            bad["logit_std"] = f"must be > 0, found {self.logit_std}"
        for name in ("caption_dropout", "mix_uniform_ratio", "sigma_min", "sigma_max"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad[name] = f"must be in [0, 1], found {getattr(self, name)}"
        if self.sigma_min > self.sigma_max:
            bad["sigma_min"] = f"{self.sigma_min} is above sigma_max {self.sigma_max}"
        for name in ("shift", "beta_alpha", "beta_beta"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                bad[name] = f"must be > 0, found {getattr(self, name)}"
        if self.num_train_timesteps is not None and self.num_train_timesteps < 1:
            bad["num_train_timesteps"] = f"must be >= 1, found {self.num_train_timesteps}"
        if bad:
            raise FieldErrors(bad)

    @property
    def flow_only(self) -> list[str]:
        """The settings given that only flow matching reads (refused with epsilon / v-prediction)."""
        defaults = ObjectiveConfig.__dataclass_fields__
        names = ("mix_uniform_ratio", "shift", "shift_sigmas", "sigma_min", "sigma_max", "num_train_timesteps",
                 "loss_weighting")
        changed = [n for n in names if getattr(self, n) != defaults[n].default]
        return changed + (["timestep_sampling"] if self.timestep_sampling == "beta" else [])


def is_flow_scheduler(scheduler: Any) -> bool:
    """Flow-match schedulers, and multistep solvers set to flow sigmas (WanPipeline's UniPC: flow_prediction)."""
    config = scheduler.config
    return "FlowMatch" in type(scheduler).__name__ or not hasattr(scheduler, "alphas_cumprod") \
        or bool(config.get("use_flow_sigmas")) or config.get("prediction_type") == "flow_prediction"


def scheduler_shift(scheduler: Any) -> float:
    """The scheduler's sigma shift (flow-match schedulers: ``shift``; UniPC / DPM solvers: ``flow_shift``)."""
    config = scheduler.config
    return float(config.get("shift") or config.get("flow_shift") or 1.0)


def sample_unit(n: int, config: ObjectiveConfig, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` draws in (0, 1) on the CPU as ``config.timestep_sampling`` says (beta: see FlowMatching.sigmas)."""
    kind = config.timestep_sampling
    if kind in ("logit_normal", "lognorm", "mix"):
        mean, std = (config.logit_mean, config.logit_std) if kind == "logit_normal" else (0.0, 1.0)
        normal = torch.randn(n, generator=generator)
        return torch.sigmoid(mean + std * normal)
    u = torch.rand(n, generator=generator)
    if kind == "mode":
        return (1.0 - u - MODE_SCALE * (torch.cos(math.pi * u / 2.0) ** 2 - 1.0 + u)).clamp(0.0, 1.0)
    return u


def sample_beta(n: int, alpha: float, beta: float, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` draws of Beta(alpha, beta); torch's sampler takes no generator, so with one it runs on the global RNG
    seeded from the generator, and the global RNG is left as it was."""
    distribution = torch.distributions.Beta(torch.full((n,), alpha), torch.full((n,), beta))
    if generator is None:
        return distribution.sample()
    seed = int(torch.randint(2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return distribution.sample()


def bsmntw_weights(steps: int) -> torch.Tensor:
    """Bell-shaped mid-trajectory timestep weights: exp(-2 ((t - T/2) / T)^2), shifted to 0 at its minimum and
    scaled to mean 1 over the T timesteps."""
    t = torch.arange(steps, dtype=torch.float32)
    weights = torch.exp(-2.0 * ((t - steps / 2) / steps) ** 2)
    weights = weights - weights.min()
    return weights * (steps / weights.sum())


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

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weights for the timesteps ``noise`` drew (None: every sample weighs 1)."""
        return None

    def describe(self) -> str:
        return f"{self.name} ({self.config.timestep_sampling} timesteps)"


class FlowMatching(Objective):
    """Rectified flow: x_s = (1 - s) x0 + s noise, the denoiser predicts the velocity noise - x0 at t = T s."""

    name = "flow_matching"

    def __init__(self, config: ObjectiveConfig, scheduler: Any):
        super().__init__(config, scheduler)
        if config.num_train_timesteps is not None:
            self.num_train_timesteps = config.num_train_timesteps
        self.shift = float(config.shift) if config.shift is not None else scheduler_shift(scheduler)
        self.bsmntw = bsmntw_weights(self.num_train_timesteps) if config.loss_weighting == "bsmntw" else None
        self.last_sigmas: torch.Tensor | None = None  # the latest draw, for the flow_matching log lines
        self.last_method = ""

    def sigmas(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        """``n`` sigmas: drawn as ``timestep_sampling`` says (a micro-batch draws uniform ones instead with
        probability ``mix_uniform_ratio``), shifted (not beta, not with ``shift_sigmas: false``), then clamped."""
        config = self.config
        if not config.shift_sigmas or config.timestep_sampling == "beta":
            if config.shift_sigmas:
                sigmas, method = sample_beta(n, config.beta_alpha, config.beta_beta, generator), "beta"
            else:
                sigmas, method = torch.rand(n, generator=generator), "uniform, not shifted"
            return self._record(sigmas.clamp(config.sigma_min, config.sigma_max), method)
        uniform = config.timestep_sampling == "uniform" or (
            config.mix_uniform_ratio > 0 and float(torch.rand(1, generator=generator)) < config.mix_uniform_ratio)
        if uniform:
            u, method = torch.rand(n, generator=generator), "uniform"
        else:
            u, method = sample_unit(n, config, generator), config.timestep_sampling
        u = u.clamp(min=1e-5)
        sigmas = self.shift * u / (1 + (self.shift - 1) * u)
        return self._record(sigmas.clamp(config.sigma_min, config.sigma_max), method)

    def _record(self, sigmas: torch.Tensor, method: str) -> torch.Tensor:
        self.last_sigmas, self.last_method = sigmas, method
        return sigmas

    def noise(self, latents, generator):
        sigmas = self.sigmas(latents.shape[0], generator).to(latents.device, latents.dtype)
        noise = randn_like(latents, generator)
        s = sigmas.view(-1, *([1] * (latents.dim() - 1)))
        noisy = (1 - s) * latents + s * noise
        return noisy, sigmas * self.num_train_timesteps, noise - latents

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        weighting = self.config.loss_weighting
        if weighting == "linear":
            return 1.0 + self.shift * timesteps.float() / self.num_train_timesteps
        if weighting == "bsmntw":
            index = timesteps.long().clamp(0, self.num_train_timesteps - 1)
            return self.bsmntw.to(timesteps.device)[index.cpu()].to(timesteps.device)
        return None

    def describe(self) -> str:
        weighting = "" if self.config.loss_weighting == "none" else f", {self.config.loss_weighting} loss weights"
        return f"flow matching ({self.config.timestep_sampling} timesteps, shift {self.shift:g}{weighting})"


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
    if config.flow_only:
        raise AutomodelError(f"objective: {', '.join(config.flow_only)} apply to flow matching only; this "
                             f"pipeline trains with {kind} (its scheduler is {scheduler_name}): remove them")
    if kind not in ("epsilon", "v_prediction"):
        raise AutomodelError(f"objective.type: the scheduler's prediction_type '{kind}' is not supported; set "
                             "objective.type to epsilon or v_prediction")
    if flow:
        raise AutomodelError(f"objective.type: {kind} needs a DDPM-style scheduler with alphas_cumprod (DDPM, DDIM, "
                             f"Euler...); this pipeline's is {scheduler_name}: use flow_matching")
    if scheduler.config.get("prediction_type") != kind:
        scheduler.register_to_config(prediction_type=kind)
    return NoisePrediction(config, scheduler, kind)
