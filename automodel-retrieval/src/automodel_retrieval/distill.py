"""Embedding distillation: a bi-encoder student trained towards a frozen teacher encoder's embeddings.

loss = distill_loss_weight * cosine + mse_loss_weight * MSE + nce_distill_loss_weight * listwise KD, each the
micro-batch's (distill_losses.py). The student (``model``) is projected to the teacher's width for the cosine and
MSE terms when the widths differ (student.py); the listwise term compares the two encoders' own rankings of the
batch's documents. Everything else — tokenizer, data, collation, validation (the student's recall), saving (a
sentence-transformers model of the student) — is the bi-encoder recipe's; the loop is the core's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from automodel.config import Config, Free, Refused, Target
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.modules import unwrap
from automodel.training.parallelism import model_hf_config
from automodel_retrieval import upstream, upstream_distill
from automodel_retrieval.models import BiEncoder
from automodel_retrieval.negatives import gather_documents
from automodel_retrieval.recipe import BiEncoderRecipe, _expanded
from automodel_retrieval.student import ProjectedBiEncoder, embedding_width

_LOSSES = "automodel_retrieval.distill_losses"
# weight key -> (loss section, default weight): upstream's names and defaults
WEIGHTS = {"distill_loss_weight": ("distill_loss", 1.0), "mse_loss_weight": ("mse_loss", 0.0),
           "nce_distill_loss_weight": ("infonce_distill_loss", 0.0)}
_NOT_HERE = ("upstream's {what} is not implemented here (the cosine, MSE and listwise InfoNCE distillation losses "
             "are: distill_loss_weight, mse_loss_weight, nce_distill_loss_weight)")


def _loss_section(help: str, target: str) -> Target:
    return Target(help, plain=True, default_target=f"{_LOSSES}.{target}", default={})


class DistillLoss(nn.Module):
    """The weighted sum of the three distillation losses; a loss whose weight is 0 is not computed."""

    def __init__(self, losses: dict[str, nn.Module], weights: dict[str, float]):
        super().__init__()
        self.losses = nn.ModuleDict(losses)
        self.weights = weights

    def forward(self, student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, torch.Tensor],
                ranking: tuple[Any, ...] | None = None) -> torch.Tensor:
        """``student``: (queries [B, H], documents [D, H], projected queries, projected documents); ``teacher``:
        (queries, documents). Query i's positive is document i (the collator's order), which the cosine and MSE
        losses compare; ``ranking`` (student documents, teacher documents, labels, candidates) is what the listwise
        loss ranks instead of the batch's documents (every rank's, say)."""
        query, documents, projected_query, projected_documents = student
        teacher_query, teacher_documents = teacher
        batch = query.shape[0]
        ranking = ranking or (documents, teacher_documents, None, None)
        total = query.new_zeros(())
        for name, weight in self.weights.items():
            if weight == 0:
                continue
            loss = self.losses[name]
            if name == "infonce_distill_loss":
                value = loss(query, ranking[0], teacher_query, ranking[1], ranking[2], ranking[3])
            else:
                value = loss(projected_query, teacher_query, projected_documents[:batch], teacher_documents[:batch])
            total = total + weight * value
        return total


class EmbeddingDistillRecipe(BiEncoderRecipe):
    """Trains a bi-encoder student (``model``) towards a frozen ``teacher_model``'s embeddings of the same texts
    (one tokenizer for both, as upstream's recipe)."""

    sections = {
        "model": Target("the student bi-encoder: {_target_: automodel_retrieval.BiEncoder.from_config | "
                        ".from_pretrained, ...} (projected to the teacher's width when they differ)", required=True),
        "teacher_model": Target("the frozen teacher bi-encoder (same forms as model); its tokenizer must be the "
                                "student's", required=True),
        "distill_loss": _loss_section("cosine distillation loss (default automodel_retrieval.distill_losses."
                                      "EmbeddingDistillLoss: {reduction: mean})", "EmbeddingDistillLoss"),
        "mse_loss": _loss_section("MSE distillation loss (default ...EmbeddingMSELoss: {normalize: false, "
                                  "reduction: mean})", "EmbeddingMSELoss"),
        "infonce_distill_loss": _loss_section("listwise InfoNCE distillation loss (default ...InfoNCEDistillLoss: "
                                              "{temperature: 0.05, direction: q2d, divergence: kl, ...})",
                                              "InfoNCEDistillLoss"),
        "distill_loss_weight": Free("weight of distill_loss (cosine) in the loss: a number >= 0 (default 1.0)"),
        "mse_loss_weight": Free("weight of mse_loss in the loss: a number >= 0 (default 0.0)"),
        "nce_distill_loss_weight": Free("weight of infonce_distill_loss in the loss: a number >= 0 (default 0.0)"),
        "loss_fn": Refused("the distillation recipe's loss is distill_loss, mse_loss and infonce_distill_loss, "
                           "weighed by distill_loss_weight, mse_loss_weight and nce_distill_loss_weight"),
        "temperature": Refused("the contrastive temperature belongs to the bi-encoder recipe; the listwise "
                               "distillation's is infonce_distill_loss.temperature"),
        "teacher_embeddings_cache": Refused(_NOT_HERE.format(what="cached teacher embeddings") +
                                            "; the teacher embeds each batch"),
        "score_loss_weight": Refused(_NOT_HERE.format(what="score-matching loss")),
        "intermediate_loss_weight": Refused(_NOT_HERE.format(what="intermediate-layer loss")),
        "nce_loss_weight": Refused(_NOT_HERE.format(what="contrastive InfoNCE term") +
                                   "; `automodel finetune retrieval` trains contrastively"),
        "projection_lr": Refused("the projection trains with the optimizer's learning rate (no group of its own)"),
    }

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = super().check_config(cfg)
        for key, (_, default) in WEIGHTS.items():
            weight = cfg.resolved.get(key, default)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
                issues.append(ConfigIssue(key, f"expected a number >= 0, found {weight!r}"))
        if not any(cls.weights(cfg).values()):
            issues.append(ConfigIssue("distill_loss_weight", "every loss weight is 0: nothing would train; give "
                                      "distill_loss_weight, mse_loss_weight or nce_distill_loss_weight > 0"))
        for key in ("model", "teacher_model"):  # the student's other upstream keys: upstream_issues
            node = cfg.get(key)
            if _expanded(cfg, node) in cls.upstream_models():
                settings = node.to_dict()
                issues += upstream_distill.distill_issues(settings, key)
                if key == "teacher_model":
                    issues += upstream.bi_encoder_issues(settings, key)
                issues += [ConfigIssue(f"{key}.{name}", "sets the contrastive bi-encoder's in-batch negatives; the "
                                       "listwise distillation loss takes every rank's documents as "
                                       "infonce_distill_loss.cross_device_negatives says: remove it")
                           for name in (upstream.GATHER, upstream.DETACH) if name in settings]
        return issues + _teacher_width_issues(cfg)

    @classmethod
    def upstream_models(cls) -> tuple[str, ...]:
        return (*super().upstream_models(), *upstream_distill.ENCODERS)

    @classmethod
    def weights(cls, cfg: Config) -> dict[str, float]:
        """Loss section -> its weight (upstream's defaults for the weights not given)."""
        found = {section: cfg.resolved.get(key, default) for key, (section, default) in WEIGHTS.items()}
        return {k: float(v) for k, v in found.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        """The bi-encoder recipe's plan less its contrastive in-batch negatives (not this recipe's loss)."""
        mix = " + ".join(f"{w} * {name}" for name, w in cls.weights(cfg).items())
        return super(BiEncoderRecipe, cls).describe_plan(cfg) + [f"distillation loss: {mix}"]

    # ---- building ---------------------------------------------------------------------------------------

    def setup_domain(self) -> None:
        """The tokenizer, then the frozen teacher (its width decides the student's projection)."""
        super().setup_domain()
        teacher = self.ctx.instantiate("teacher_model")
        if not isinstance(teacher, BiEncoder):
            raise AutomodelError(f"teacher_model: built {type(teacher).__name__}; the teacher must be an "
                                 "automodel_retrieval.BiEncoder (BiEncoder.from_config / .from_pretrained)")
        teacher.to(self.device).eval()
        teacher.requires_grad_(False)
        self._check_vocab([teacher.encoder("query"), teacher.encoder("document")])
        self.teacher = teacher

    def build_model(self, ctx: BuildContext) -> torch.nn.Module:
        """The student, projected to the teacher's width when it differs (upstream's student names the width:
        ``teacher_hidden_size``, which must be the teacher's)."""
        student = super().build_model(ctx)
        width = embedding_width(self.teacher)
        if not isinstance(student, BiEncoder):
            raise AutomodelError(f"model: built {type(student).__name__}; the student must be an "
                                 "automodel_retrieval.BiEncoder (BiEncoder.from_config / .from_pretrained)")
        if not isinstance(student, ProjectedBiEncoder):
            student = ProjectedBiEncoder.around(student, None if embedding_width(student) == width else width)
        if student.projected_width != width:
            raise AutomodelError(f"model.teacher_hidden_size: {student.projected_width}, but the teacher's "
                                 f"embeddings are {width} wide; set {width}")
        return student

    def build_loss_fn(self, ctx: BuildContext) -> torch.nn.Module:
        weights = self.weights(self.cfg)
        return DistillLoss({name: ctx.instantiate(name) for name in weights}, weights)

    def setup_negatives(self) -> None:
        nce = self.loss_fn.losses["infonce_distill_loss"]
        if self.world_size > 1 and self.loss_fn.weights["infonce_distill_loss"] and nce.use_in_batch_negatives:
            where = "every rank's" if nce.cross_device_negatives else "each rank's own"
            self.log(f"listwise distillation candidates: {where} documents "
                     "(infonce_distill_loss.cross_device_negatives)")

    def setup(self) -> None:
        super().setup()
        model = unwrap(self.model)
        projection = (f"a projection {embedding_width(model)} -> {model.projected_width}"
                      if model.projection is not None else "no projection (the widths match)")
        mix = " + ".join(f"{w} * {name}" for name, w in self.loss_fn.weights.items())
        self.log(f"distilling from a frozen teacher ({embedding_width(self.teacher)} wide), student with "
                 f"{projection}; loss = {mix}")

    # ---- the loss -----------------------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The weighted distillation loss of the micro-batch, times its query count (the loop divides the step's
        sum by the queries: micro-batches weigh by their size)."""
        student = model(query=batch["query"], document=batch["document"], projected=True)
        with torch.no_grad():
            teacher = self.teacher(query=batch["query"], document=batch["document"])
        nce = self.loss_fn.losses["infonce_distill_loss"]
        ranking = None
        if not nce.use_in_batch_negatives:  # a query's own positive and hard negatives only
            owners = batch["document_owners"]
            ranking = (student[1], teacher[1], None, owners.unsqueeze(0) == batch["labels"].unsqueeze(1))
        elif self.world_size > 1 and nce.cross_device_negatives and torch.is_grad_enabled() \
                and self.loss_fn.weights["infonce_distill_loss"]:  # every rank's documents, as negatives
            keys = batch["document_keys"]
            documents, _, valid, offset = gather_documents(student[1], keys)
            teacher_documents = gather_documents(teacher[1], keys, detach=True)[0]
            ranking = (documents, teacher_documents, batch["labels"] + offset,
                       valid.unsqueeze(0).expand(len(batch["labels"]), -1))
        return self.loss_fn(student, teacher, ranking) * len(batch["labels"])


def _teacher_width_issues(cfg: Config) -> list[ConfigIssue]:
    """Upstream's student names the teacher's embedding width (``model.teacher_hidden_size``); where the teacher's
    config can be read before the build (a local checkpoint, one in the Hugging Face cache), it must be the teacher's
    hidden size (the build checks the built teacher otherwise)."""
    student, teacher = cfg.get("model"), cfg.get("teacher_model")
    if (_expanded(cfg, student), _expanded(cfg, teacher)) != upstream_distill.ENCODERS:
        return []
    width = student.get("teacher_hidden_size")
    config = model_hf_config(cfg, "teacher_model") if isinstance(width, int) else None
    hidden = getattr(config.get_text_config(), "hidden_size", None) if config is not None else None
    if not isinstance(hidden, int) or hidden == width:
        return []
    where = teacher.get("pretrained_model_name_or_path")
    return [ConfigIssue("model.teacher_hidden_size", f"{width}, but the teacher ({where}) embeds {hidden} wide (its "
                        f"hidden_size); set {hidden}")]

