"""Data sets for causal LM training, source -> target pairs for encoder-decoder models, and labelled texts for
sequence classification."""

from automodel_llm.datasets.agent_chat import AgentChatDataset
from automodel_llm.datasets.chat import ChatDataset
from automodel_llm.datasets.column_mapped import ColumnMappedTextInstructionDataset
from automodel_llm.datasets.hellaswag import HellaSwag
from automodel_llm.datasets.megatron import MegatronPretraining
from automodel_llm.datasets.packing import PackedDataset
from automodel_llm.datasets.pretraining import (
                                               MockDataset,
                                               MockSentencesDataset,
                                               PretrainingTextDataset,
                                               mock_iterable_dataset,
)
from automodel_llm.datasets.seq2seq import Seq2SeqDataset
from automodel_llm.datasets.seq_cls import MockSequenceClassificationDataset, SequenceClassificationDataset
from automodel_llm.datasets.squad import SquadDataset, make_squad_dataset
from automodel_llm.datasets.xlam import XlamDataset

__all__ = ["AgentChatDataset", "ChatDataset", "ColumnMappedTextInstructionDataset", "HellaSwag", "MegatronPretraining",
           "MockDataset", "MockSequenceClassificationDataset", "PackedDataset", "PretrainingTextDataset",
           "Seq2SeqDataset", "SequenceClassificationDataset", "SquadDataset", "XlamDataset", "make_squad_dataset",
           "mock_iterable_dataset", "MockSentencesDataset"]
