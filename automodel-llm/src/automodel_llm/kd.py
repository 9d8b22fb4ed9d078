"""Knowledge distillation of a causal language model (``automodel kd llm``): the core's
:class:`~automodel.training.distillation.KnowledgeDistillation` over the next-token recipe."""

from __future__ import annotations

from typing import Any

from automodel.training.distillation import KDLoss, KnowledgeDistillation
from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction, config_labels_shifted

__all__ = ["KDLoss", "KnowledgeDistillationRecipe"]


class KnowledgeDistillationRecipe(KnowledgeDistillation, FinetuneRecipeForNextTokenPrediction):
    """Trains a causal student (``model``) towards a frozen causal ``teacher_model`` and the labels."""

    encoder_decoder_unsupported = ("knowledge distillation here compares a causal student's next-token logits with "
                                   "a causal teacher's; use the fine-tuning recipe for an encoder-decoder model")

    @classmethod
    def labels_shifted_in_config(cls, cfg: Any) -> bool:
        return config_labels_shifted(cfg)
