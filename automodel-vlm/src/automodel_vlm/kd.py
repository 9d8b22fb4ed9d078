"""Knowledge distillation of a vision-language model (``automodel kd vlm``; upstream's
``KnowledgeDistillationRecipeForVLM``): the core's :class:`~automodel.training.distillation.KnowledgeDistillation`
over the VLM recipe. Student and teacher get the same micro-batch (text and media, through the processor the student
was given), so the teacher must share the student's tokenizer; the loss compares their next-token logits on the
label tokens."""

from __future__ import annotations

from typing import Any

from automodel.errors import ConfigIssue
from automodel.training.distillation import KnowledgeDistillation
from automodel_vlm.drafter import uses_drafter
from automodel_vlm.recipe import FinetuneRecipeForVLM

_MORE_RANKS = "give the teacher more ranks with teacher_distributed.tp_size or dp_size"


class KnowledgeDistillationRecipeForVLM(KnowledgeDistillation, FinetuneRecipeForVLM):
    """Trains a vision-language student (``model``) towards a frozen vision-language ``teacher_model`` and the
    labels."""

    teacher_copy_unsupported = {
        "cp_size": "the context-parallel teacher splits a text sequence over its ranks, but a vision-language "
                   "teacher merges its images into the sequence first (the VLM recipe does that for its student "
                   f"only); {_MORE_RANKS}",
        "pp_size": "the pipeline teacher cuts a text model into stages; a vision-language teacher's vision tower and "
                   f"merge would need the VLM recipe's own cut (its student's only); {_MORE_RANKS}",
    }

    @classmethod
    def check_config(cls, cfg: Any) -> list[ConfigIssue]:
        issues = super().check_config(cfg)
        if uses_drafter(cfg):
            issues.append(ConfigIssue("model._target_", "a Gemma 4 drafter trains jointly with its base in the "
                                      "fine-tuning recipe (automodel finetune vlm); distillation trains the student "
                                      "on the teacher's logits only: remove the drafter here"))
        return issues
