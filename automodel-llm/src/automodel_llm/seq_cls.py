"""Sequence classification fine-tuning (upstream's ``TrainFinetuneRecipeForSequenceClassification``): a text or a
text pair in, one class out, on the core's loop.

The model is a ``transformers`` ``*ForSequenceClassification`` (an encoder's ``classifier`` or a causal LM's
``score`` head over ``num_labels`` classes); the loss is the ``loss_fn`` section (cross-entropy by default) on the
head's logits, summed over the samples. Validation reports the loss, accuracy and F1 (the positive class's with two
labels, the mean over the classes with more) from the same forward passes. With ``peft:`` the LoRA adapters train
with the whole head (peft's sequence-classification task keeps a trainable copy of it), and the adapter directory
holds both, as ``peft.PeftModel.from_pretrained`` loads them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from automodel.config import Config, ConfigNode, Target
from automodel.errors import AutomodelError, ConfigIssue
from automodel.hf import align_special_tokens, check_vocab, is_sequence_classifier, model_source
from automodel.meta_build import MetaBuild, local_weights, saved_key_function
from automodel.training.context import BuildContext
from automodel.training.dist import all_reduce_sum
from automodel.training.modules import unwrap
from automodel.training.parallel.materialize import weight_files
from automodel.training.recipe import TrainRecipe
from automodel.training.sections import CheckpointConfig
from automodel_llm.datasets.collate import IGNORE_INDEX, pad_collate
from automodel_llm.tokenizer import VOCAB_PROBLEM, build_tokenizer, tokenizer_issues

DATASETS = ("automodel_llm.datasets.SequenceClassificationDataset", "automodel_llm.datasets.seq_cls.glue_mrpc",
            "automodel_llm.datasets.MockSequenceClassificationDataset")
MODEL = "automodel_llm.AutoModelForSequenceClassification"


def _dataset_section(help: str, required: bool = False) -> Target:
    return Target(help, required=required, runtime_args=("tokenizer",), documented_targets=DATASETS)


def class_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[3, C]`` counts per class of true positives, predictions and labels (labels ``IGNORE_INDEX`` left out)."""
    classes = logits.shape[-1]
    kept = labels != IGNORE_INDEX
    predicted, labels = logits.argmax(-1)[kept], labels[kept]
    hits = torch.bincount(labels[predicted == labels], minlength=classes)
    return torch.stack([hits, torch.bincount(predicted, minlength=classes), torch.bincount(labels, minlength=classes)])


def classification_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Accuracy and F1 from :func:`class_counts` summed over the data: with two classes class 1's F1 (GLUE's
    MRPC / QQP figure), with more the mean of the classes' F1 (macro)."""
    hits, predicted, actual = counts.double()
    total = actual.sum().item()
    f1 = torch.where(predicted + actual > 0, 2 * hits / (predicted + actual).clamp(min=1), torch.zeros_like(hits))
    return {"accuracy": hits.sum().item() / max(total, 1),
            "f1": f1[1].item() if len(hits) == 2 else f1.mean().item()}


_SKIP_HEAD = "skip_task_head_prefixes_for_base_model"


@dataclass
class SequenceClassificationCheckpointConfig(CheckpointConfig):
    """The checkpoint section with upstream's key for a task head over a base model."""

    upstream_refused = {k: v for k, v in CheckpointConfig.upstream_refused.items() if k != _SKIP_HEAD}
    skip_task_head_prefixes_for_base_model: list[str] | None = field(default=None, metadata={"help": (
        "parameter-name prefixes of the task head (['classifier.'] / ['score.']) that start from their fresh "
        "initialisation instead of the base checkpoint: checked against the model (every prefix must name "
        "parameters) and the base's files (a base that holds such tensors is refused: transformers would load "
        "them)")})


def task_head_note(cfg: Config, model: torch.nn.Module, prefixes: list[str]) -> str:
    """What ``checkpoint.skip_task_head_prefixes_for_base_model`` does for ``model``: each prefix must name some of
    its parameters, and a local (or cached) base checkpoint must hold none of them (transformers loads every tensor
    a checkpoint has; a fresh head is what the key asks for). Returns the run's log line."""
    key = f"checkpoint.{_SKIP_HEAD}"
    names = [name for name, _ in model.named_parameters()]
    head = [name for name in names if name.startswith(tuple(prefixes))]
    for prefix in prefixes:
        if not any(name.startswith(prefix) for name in names):
            tops = sorted({name.split(".", 1)[0] + "." for name in names})
            raise AutomodelError(f"{key}: no parameter of {type(model).__name__} starts with '{prefix}' (its "
                                 f"top-level modules: {', '.join(tops)}); name the task head's prefix")
    source = model_source(cfg.model.to_dict()) if isinstance(cfg.model, ConfigNode) else None
    weights = local_weights(source[0]) if source is not None else None
    if weights is None:
        return (f"{key}: {', '.join(prefixes)} ({len(head)} tensors) start from their fresh initialisation (no "
                "base checkpoint in safetensors files to read them from)")
    saved = saved_key_function(model)
    present = sorted({saved(name) for name in head} & set(weight_files(weights)))
    if present:
        raise AutomodelError(f"{key}: the base checkpoint in {weights} holds {len(present)} tensors of the head "
                             f"({', '.join(present[:4])}), which loading it reads; start from a base without the "
                             "head (or remove the key to fine-tune the checkpoint's own head)")
    return (f"{key}: {', '.join(prefixes)} ({len(head)} tensors) start from their fresh initialisation (the base "
            f"checkpoint in {weights} has none of them)")


class SequenceClassificationRecipe(TrainRecipe):
    """Fine-tunes a ``*ForSequenceClassification`` model on labelled texts or text pairs."""

    domain = "seq-cls"
    sections = {
        "tokenizer": Target("tokenizer (default: the model's): {pretrained_model_name_or_path: ...}", plain=True,
                            default_target="transformers.AutoTokenizer.from_pretrained"),
        "model": Target("the classifier: {_target_: automodel_llm.AutoModelForSequenceClassification.from_pretrained "
                        "| .from_config, num_labels: N, ...} (upstream's NeMoAutoModelForSequenceClassification)",
                        required=True),
        "dataset": _dataset_section("the training rows: a text (pair) and a class label each", required=True),
        "validation_dataset": _dataset_section("validation rows (loss, accuracy, F1)"),
        "validation_dataset_*": _dataset_section("more validation data sets, reported by name"),
        "checkpoint": SequenceClassificationCheckpointConfig,
    }

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg)) + tokenizer_issues(cfg)
        model = cfg.model
        target = cfg.resolver.expand(model.target) if isinstance(model, ConfigNode) and model.target else None
        if isinstance(target, str) and not target.startswith(MODEL + ".") and target.startswith("automodel_llm."):
            issues.append(ConfigIssue("model._target_", f"{model.target} builds a language model, not a sequence "
                                      f"classifier; use {MODEL}.from_pretrained (or .from_config) with num_labels"))
        return issues

    # ---- building -------------------------------------------------------------------------------------------

    def setup_domain(self) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        self.tokenizer = build_tokenizer(self.cfg)

    def dataset_runtime_args(self, node: Any) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer}

    def collate_runtime_args(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer}

    def default_collate_fn(self, train: bool = True) -> Any:
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        return functools.partial(pad_collate, pad_token_id=pad)

    def after_model_built(self, ctx: BuildContext, model: torch.nn.Module, meta: MetaBuild) -> BuildContext:
        prefixes = self.cfg.checkpoint.skip_task_head_prefixes_for_base_model
        if prefixes:
            self.log(task_head_note(self.cfg, model, prefixes))
        return super().after_model_built(ctx, model, meta)

    def setup(self) -> None:
        super().setup()
        model = unwrap(self.model)
        classifier = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's LoRA
        config = getattr(classifier, "config", None)
        labels = getattr(config, "num_labels", None)
        if not is_sequence_classifier(type(classifier).__name__):
            raise AutomodelError(f"model: built {type(classifier).__name__}, which has no classification head; use "
                                 f"{MODEL}.from_pretrained (or .from_config) with num_labels")
        if not isinstance(labels, int) or labels < 2:
            raise AutomodelError(f"model.num_labels: the model's head has {labels} output(s); this recipe trains a "
                                 "classifier over 2 or more classes (cross-entropy): set model.num_labels")
        self._check_labels(labels)
        if self.tokenizer is not None:
            check_vocab(self.tokenizer, config, "tokenizer: " + VOCAB_PROBLEM)
            changes = align_special_tokens(classifier, self.tokenizer)
            if changes:  # a causal LM's score head reads the last token that is not the pad id
                self.log(f"special tokens: the model's {', '.join(changes)} (the tokenizer's; saved in config.json)")
        self.class_counts: torch.Tensor | None = None
        self.log(f"sequence classification: {type(classifier).__name__}, {labels} classes")

    def _check_labels(self, classes: int) -> None:
        loaders = {"dataset": self.dataloader, **{f"validation_dataset ({name})": loader
                                                  for name, loader in self.val_dataloaders.items()}}
        for key, loader in loaders.items():
            largest = getattr(loader.dataset, "largest_label", None)
            if isinstance(largest, int) and largest >= classes:
                raise AutomodelError(f"{key}: a row's label is {largest}, but the model's head has {classes} classes "
                                     f"(0 .. {classes - 1}); set model.num_labels: {largest + 1} or fix the labels")

    # ---- the loss and its counts ------------------------------------------------------------------------------

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in batch.items() if k != "labels"}

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed loss of the batch's samples; in evaluation also the counts validation reports."""
        logits = model(**self.model_inputs(batch)).logits
        labels = batch["labels"].reshape(-1)
        if not model.training:
            counts = class_counts(logits.detach(), labels)
            self.class_counts = counts if self.class_counts is None else self.class_counts + counts
        return self.loss_fn(logits, labels)

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def count_input_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else batch["input_ids"].numel()

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        """Accuracy and F1 of the validation pass just run, over every data-parallel rank's share."""
        counts, self.class_counts = self.class_counts, None
        if counts is None:
            return {}
        if self.ctx.mesh.dp > 1:
            flat = all_reduce_sum(*counts.flatten().tolist(), device=self.device, group=self.data_parallel_group())
            counts = torch.stack(flat).reshape(counts.shape)
        return classification_metrics(counts)

    def on_train_end(self, final_checkpoint: Any) -> None:
        if final_checkpoint is not None:
            model_dir = final_checkpoint / "model"
            how = ("peft.PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(<base>), "
                   f"'{model_dir}')" if self.cfg.peft is not None
                   else f"transformers.AutoModelForSequenceClassification.from_pretrained('{model_dir}')")
            self.log(f"Trained classifier in {model_dir}: load it with {how} and AutoTokenizer")
