"""Data sets for causal LM training."""

from automodel_llm.datasets.squad import SquadDataset, make_squad_dataset

__all__ = ["SquadDataset", "make_squad_dataset"]
