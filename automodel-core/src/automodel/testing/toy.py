"""The toy recipe: the engine on a tiny torch model and synthetic data (no Hugging Face library involved).

``ToyRecipe`` trains ``ToyModel`` on ``ToyDataset``; ``toy_config`` writes a run's config (its ``recipe:`` key
names the class, so ``automodel run -c`` runs it) and ``ToyPlugin`` registers the route ``automodel train toy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from automodel.plugins.markers import hookimpl
from automodel.testing import deep_update
from automodel.training.recipe import TrainRecipe


class ToyDataset(torch.utils.data.Dataset):
    """Synthetic regression rows: ``x`` [targets, dim] -> ``y`` [targets]; ``mask`` keeps 1..targets of them, so
    samples carry different numbers of targets (like answers of different lengths)."""

    def __init__(self, size: int = 64, dim: int = 8, targets: int = 4, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, targets, dim, generator=generator)
        weights = torch.randn(dim, generator=generator)
        self.y = torch.tanh(self.x @ weights) + 0.1 * torch.randn(size, targets, generator=generator)
        lengths = torch.randint(1, targets + 1, (size,), generator=generator)
        self.mask = (torch.arange(targets) < lengths[:, None]).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index], "mask": self.mask[index]}


class ToyModel(torch.nn.Module):
    """A small MLP with a ModuleList of identical blocks (what FSDP2 shards block by block)."""

    def __init__(self, dim: int = 8, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Linear(dim, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h).squeeze(-1)


class ToyRecipe(TrainRecipe):
    """Squared error summed over the masked targets of a ToyDataset; a target counts as a label token."""

    domain = "toy"

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]).sum()

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["mask"].sum())


class ToyPlugin:
    """Registers ``automodel train toy`` (pass it to ``PluginManager(extra_plugins=[("toy", ToyPlugin)])``).

    It registers no targets: the toy's classes are the core's, which registers ``automodel.testing.toy``.
    """

    @staticmethod
    @hookimpl
    def automodel_register_routes(routes: Any) -> None:
        routes.add("train", "toy", recipe="automodel.testing.toy.ToyRecipe", help="The engine on a toy model")


def toy_config(checkpoint_dir: str | Path, **sections: Any) -> dict[str, Any]:
    """A toy run's config (``sections`` deep-merged in; None removes one): 64 rows at batch 4, 6 steps."""
    base = {
        "recipe": {"_target_": "automodel.testing.toy.ToyRecipe"},
        "step_scheduler": {"max_steps": 6, "log_interval": 1, "num_epochs": 100},
        "rng": {"seed": 1234},
        "model": {"_target_": "automodel.testing.toy.ToyModel"},
        "dataset": {"_target_": "automodel.testing.toy.ToyDataset"},
        "dataloader": {"batch_size": 4},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1.0e-2},
        "checkpoint": {"checkpoint_dir": str(checkpoint_dir)},
    }
    return deep_update(base, sections)
