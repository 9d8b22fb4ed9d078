"""Knowledge distillation for the recipes that train on next-token logits: the loss, the recipe mix-in, and a
teacher on ranks of its own (``separate_meshes: true``)."""

from automodel.training.distillation.loss import KDLoss
from automodel.training.distillation.recipe import KnowledgeDistillation

__all__ = ["KDLoss", "KnowledgeDistillation"]
