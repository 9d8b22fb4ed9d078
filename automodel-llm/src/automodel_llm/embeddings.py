"""What the LLM recipe does to a model's input embeddings: upstream's ``neftune:`` (NEFTune, noisy embeddings while
training); and upstream's top-level ``nvtx`` switch, accepted off."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from automodel.config import FieldErrors
from automodel.errors import ConfigIssue


@dataclass
class NEFTuneConfig:
    """``neftune:``: NEFTune (Jain et al., 2023): while training, uniform noise in ``[-a, a]`` with ``a =
    noise_alpha / sqrt(sequence length x hidden size)`` is added to the input embeddings (validation and
    generation see the embeddings unchanged); transformers' own hook does it."""

    noise_alpha: float | None = field(default=None, metadata={"help": (
        "the noise's scale alpha (> 0; the paper's values: 5 to 15); null: no noise")})

    def __post_init__(self) -> None:
        if self.noise_alpha is not None and self.noise_alpha <= 0:
            raise FieldErrors({"noise_alpha": f"must be > 0 (the paper uses 5 to 15), found {self.noise_alpha}: "
                                              "or null (no noise)"})


def add_neftune_noise(model: torch.nn.Module, noise_alpha: float) -> torch.nn.Module:
    """Hook NEFTune onto ``model``'s input embeddings (a Hugging Face or peft model); returns the embedding module."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    embeddings = model.get_input_embeddings()
    embeddings.neftune_noise_alpha = noise_alpha
    embeddings.register_forward_hook(neftune_post_forward_hook)
    return embeddings


def nvtx_issues(value: object) -> list[ConfigIssue]:
    """``nvtx``: upstream wraps every module in NVTX ranges for NVIDIA Nsight Systems when true; off (false, or
    not given) is the only setting here."""
    if value is None or value is False:
        return []
    if value is not True:
        return [ConfigIssue("nvtx", f"expected true or false, found {value!r}")]
    what = "true wraps every module's forward and backward in NVTX ranges for NVIDIA Nsight Systems"
    if not torch.cuda.is_available():
        return [ConfigIssue("nvtx", f"{what}, which need a CUDA GPU (this machine has none): set false")]
    return [ConfigIssue("nvtx", f"{what}, which this build does not add: set false (profile with torch.profiler)")]
