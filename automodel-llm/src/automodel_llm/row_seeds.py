"""Random draws per row that a resumed run repeats: the diffusion LM's masks, the DFlash drafts' blocks."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


class RowSeeds:
    """Generators, one per row: a function of the run's seed, the phase (training or validation), the step and the
    row's tokens, never of the global random state or of where the row lands, so a resumed run draws the same, every
    validation the same, and a row the same whatever the number of data-parallel ranks or micro-batches (upstream
    seeds each sample by its place in the global batch for the same reason)."""

    def __init__(self, seed: int):
        self.seed, self.phase, self.step = seed, "train", 0

    def start(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step

    def generator(self, tokens: torch.Tensor) -> torch.Generator:
        """The generator of a row whose real tokens (on the host) are ``tokens``."""
        key = f"{self.seed}/{self.phase}/{self.step}/".encode() + tokens.numpy().tobytes()
        return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:7], "little"))


class SeededSteps:
    """A recipe mix-in: its ``seeds`` (:class:`RowSeeds`) enter each training step at that step, and each
    validation at step 0 of the validation phase (every validation draws the same)."""

    seeds: RowSeeds

    def train_step(self, batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.seeds.start("train", self.step_scheduler.step)
        return super().train_step(batches)

    def validate(self) -> None:
        self.seeds.start("validation", 0)
        super().validate()
