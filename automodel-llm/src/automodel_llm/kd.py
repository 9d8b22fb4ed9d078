"""Knowledge distillation: loss = (1 - kd_ratio) * CE + kd_ratio * KD, both over the label tokens."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from automodel.config import Free, Refused, Target
from automodel.errors import ConfigIssue
from automodel.model_kwargs import MTP_KEYS
from automodel.training.loss import LINEAR, loss_fn_named
from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction

IGNORE_INDEX = -100


class KDLoss(torch.nn.Module):
    """Forward KL(teacher || student) at ``temperature``, scaled by T², summed over label tokens.

    ``fp32_upcast`` (upstream's key): the logits are cast to float32 before the temperature divides them (true, the
    default), or divided in their own dtype, bf16 say (false); the softmax computes in float32 either way."""

    def __init__(self, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX, fp32_upcast: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"kd_loss_fn.temperature must be > 0, found {temperature}")
        self.temperature, self.ignore_index, self.fp32_upcast = temperature, ignore_index, fp32_upcast

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        keep = labels.reshape(-1) != self.ignore_index
        t = self.temperature
        student = F.log_softmax(self._scaled(student_logits, keep), dim=-1, dtype=torch.float32)
        teacher = F.log_softmax(self._scaled(teacher_logits, keep), dim=-1, dtype=torch.float32)
        return F.kl_div(student, teacher, log_target=True, reduction="sum") * (t * t)

    def _scaled(self, logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        kept = logits.reshape(-1, logits.shape[-1])[keep]
        return (kept.float() if self.fp32_upcast else kept) / self.temperature


# Why upstream's separate teacher mesh (separate_meshes / teacher_distributed) is refused
_TEACHER_PLACEMENT = ("here the teacher is a whole frozen copy on every rank of the student, fed the student's own "
                      "batches; putting it on ranks of its own and sending its logits across is not implemented")


class KnowledgeDistillationRecipe(FinetuneRecipeForNextTokenPrediction):
    """Trains the student (``model``) towards a frozen ``teacher_model`` and the labels."""

    adds_mtp_loss = False  # compute_loss below combines the next-token and distillation losses only
    encoder_decoder_unsupported = ("knowledge distillation here compares a causal student's next-token logits with "
                                   "a causal teacher's; use the fine-tuning recipe for an encoder-decoder model")

    tensor_parallel_unsupported = ("the distillation loss compares the student's whole logits with the teacher's, "
                                   "which tensor parallelism keeps sharded over the vocabulary; use tp_size: 1")
    pipeline_parallel_unsupported = ("the teacher runs beside the student on whole batches, which pipeline stages "
                                     "split over ranks; use pp_size: 1")
    context_parallel_unsupported = ("the teacher runs beside the student on whole sequences, which context "
                                    "parallelism splits over ranks; use cp_size: 1")

    sections = {
        "teacher_model": Target("the frozen teacher: {_target_: ..., ...}", required=True),
        "kd_ratio": Free("weight of the KD term in [0, 1] (0: plain fine-tuning)"),
        "temperature": Free("softmax temperature of the KD term (default 1.0)"),
        "kd_loss_fn": Target("the distillation loss (default automodel_llm.kd.KDLoss)"),
        "separate_meshes": Free("upstream's choice of ranks of its own for the teacher: false only (the default, "
                                "upstream's too: the teacher runs on the student's ranks)"),
        "teacher_distributed": Refused(f"the teacher's own layout (upstream's, with separate_meshes: true); "
                                       f"{_TEACHER_PLACEMENT}: remove the section"),
    }

    @classmethod
    def check_config(cls, cfg: Any) -> list[ConfigIssue]:
        issues = super().check_config(cfg)
        ratio = cfg.resolved.get("kd_ratio", 0.5)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            issues.append(ConfigIssue("kd_ratio", f"expected a number in [0, 1], found {ratio!r}"))
        temperature = cfg.resolved.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
            issues.append(ConfigIssue("temperature", f"expected a number > 0, found {temperature!r}"))
        separate = cfg.resolved.get("separate_meshes", False)
        if separate is True:
            issues.append(ConfigIssue("separate_meshes", f"true puts the teacher on ranks of its own (upstream's "
                                                         f"teacher_distributed: layout); {_TEACHER_PLACEMENT}: set "
                                                         "false and remove teacher_distributed"))
        elif separate not in (False, None):
            issues.append(ConfigIssue("separate_meshes", f"expected true or false, found {separate!r}"))
        teacher = cfg.teacher_model
        for key in MTP_KEYS:
            if teacher is not None and teacher.get(key) not in (None, False, 0):
                issues.append(ConfigIssue(f"teacher_model.{key}", "MTP heads train with the student; the frozen "
                                          "teacher only serves its next-token logits, so its heads would never run: "
                                          "remove it"))
        if loss_fn_named(cfg, LINEAR) is not None:
            issues.append(ConfigIssue("loss_fn._target_", "FusedLinearCrossEntropy computes the loss inside the "
                                      "student's output head, so no logits are left for the distillation loss; use "
                                      "MaskedCrossEntropy or ChunkedCrossEntropy"))
        return issues

    def setup(self) -> None:
        self.kd_ratio = float(self.cfg.resolved.get("kd_ratio", 0.5))
        super().setup()
        teacher = self.cfg.teacher_model.instantiate()
        teacher.to(self.device).eval()
        teacher.requires_grad_(False)
        self.teacher = teacher
        self.teacher_head = self.attach_head(teacher) if self.cfg.logits.label_positions_only else None
        node = self.cfg.kd_loss_fn
        temperature = float(self.cfg.resolved.get("temperature", 1.0))
        self.kd_loss_fn = node.instantiate() if node is not None else KDLoss(temperature)
        self.log(f"distilling from {self.cfg.teacher_model.target} (frozen) with kd_ratio={self.kd_ratio}")
        if self.cfg.resolved.get("separate_meshes") is False:
            self.log("note: separate_meshes: false is what runs: the teacher is on every rank of the student")

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, targets = self.next_token_logits(model, batch, self.head_positions)
        ce = self.loss_fn(logits, targets)
        if self.kd_ratio == 0:
            return ce
        with torch.no_grad():
            teacher_logits, _ = self.next_token_logits(self.teacher, batch, self.teacher_head)
        kd = self.kd_loss_fn(logits, teacher_logits, targets)
        return (1 - self.kd_ratio) * ce + self.kd_ratio * kd
