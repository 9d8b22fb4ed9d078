"""Data sets for causal LM training."""

from automodel_llm.datasets.chat import ChatDataset
from automodel_llm.datasets.column_mapped import ColumnMappedTextInstructionDataset
from automodel_llm.datasets.packing import PackedDataset
from automodel_llm.datasets.pretraining import MockDataset, PretrainingTextDataset
from automodel_llm.datasets.squad import SquadDataset, make_squad_dataset

__all__ = ["ChatDataset", "ColumnMappedTextInstructionDataset", "MockDataset", "PackedDataset",
           "PretrainingTextDataset", "SquadDataset", "make_squad_dataset"]
