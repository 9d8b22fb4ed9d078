"""Next-token logits at the positions that carry a label only (``logits.label_positions_only``).

A next-token loss needs logits only where a label is: in supervised fine-tuning that is the answer, often a few
percent of a batch's positions, yet a causal LM computes ``[batch, sequence, vocab]`` logits, for a large
vocabulary the biggest activation of a step and a large share of its FLOPs. Here the model's output head
(``get_output_embeddings()``) is made to project only the labelled hidden states. Each kept row is computed exactly
as before, so the loss and the gradients are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.linear_ce import LinearCrossEntropy, LinearLossHead
from automodel.training.loss import IGNORE_INDEX
from automodel.training.modules import unwrap
from automodel.training.parallel.context_parallel import ContextParallelBatch, cp_attention
from automodel.training.parallel.pipeline_stages import last_stage

LABEL_POSITIONS = "label_positions"  # batch key: flat indices of the positions whose next token has a label


def label_positions(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX, offset: int = 1) -> torch.Tensor:
    """Flat indices into ``batch x sequence`` of the positions whose target carries a label.

    Position ``i`` of a row predicts label ``i + offset``: 1 in a causal LM (the next token), 0 where the labels
    are the next tokens already (pre-shifted data) and in an encoder-decoder, whose decoder inputs are the labels
    shifted right in the batch. The logits a loss needs are
    those at the flat indices returned here, and their targets are ``labels.view(-1)[index + offset]``.
    """
    keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    keep[:, :labels.shape[1] - offset] = labels[:, offset:] != ignore_index
    return keep.view(-1).nonzero().squeeze(1)


class HeadOnPositions:
    """Lets a causal LM's output head project only chosen positions instead of every one.

    A forward pre-hook on the output embeddings gathers the chosen rows of the hidden states, so the model returns
    ``[positions, vocab]`` logits and still applies its own post-processing (soft-capping, logit scaling) to them.
    """

    def __init__(self, head: nn.Module):
        self._index: torch.Tensor | None = None
        # first of the head's hooks: it picks rows of the plain hidden states, before tensor parallelism's input hook
        # turns them into a DTensor
        head.register_forward_pre_hook(self._gather, prepend=True)

    @classmethod
    def attach(cls, model: nn.Module) -> HeadOnPositions | None:
        """The hook on ``model``'s output head, or None when the model has no separate head module."""
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        return cls(head) if isinstance(head, nn.Module) else None

    def _gather(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._index is None or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
            return None
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self._index), *args[1:])

    @contextlib.contextmanager
    def only(self, index: torch.Tensor) -> Iterator[None]:
        """Within the block the head projects only the flat positions ``index`` (see :func:`label_positions`)."""
        self._index = index
        try:
            yield
        finally:
            self._index = None


@dataclass
class LogitsConfig:
    label_positions_only: bool = field(default=True, metadata={
        "help": "compute the LM head's logits only where a label is (the same loss; less compute and memory, "
                "most of all for SFT with a large vocabulary; with pipeline parallelism the last stage computes "
                "every position and a note says so)"})


def next_token_logits(model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor,
                      index: torch.Tensor | None, head: HeadOnPositions | None,
                      loss_head: LinearLossHead | None = None, offset: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, targets)``, one row per predicted token: the positions ``index`` (see :func:`label_positions`,
    ``offset`` as there) when given, else every position but each row's last ``offset`` (whose targets may be
    ``IGNORE_INDEX``). With ``loss_head`` the "logits" are each row's loss, computed inside the output head
    (``[rows, 1]``)."""
    if index is None:
        # the head sees every position: a causal row's last has no next token
        length = labels.shape[1] - offset
        with loss_head.targets(next_targets(labels, offset)) if loss_head is not None else contextlib.nullcontext():
            logits = model(**inputs).logits
            if loss_head is not None:
                logits = loss_head.checked(logits)
        return logits[:, :length].reshape(-1, logits.shape[-1]), labels[:, offset:].reshape(-1)
    targets = labels.reshape(-1)[index + offset]
    with loss_head.targets(targets) if loss_head is not None else contextlib.nullcontext():
        return logits_at(model, inputs, index, head, loss_head), targets


def next_targets(labels: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """The target of every position: the label ``offset`` positions on, ``IGNORE_INDEX`` where a row has none."""
    return torch.cat([labels[:, offset:], torch.full_like(labels[:, :offset], IGNORE_INDEX)], dim=1)


def logits_at(model: nn.Module, inputs: dict[str, Any], index: torch.Tensor, head: HeadOnPositions | None,
              loss_head: LinearLossHead | None = None) -> torch.Tensor:
    """The logits of the flat positions ``index`` only (the head projects only them where it can)."""
    with head.only(index) if head is not None else contextlib.nullcontext():
        logits = model(**inputs).logits
    if loss_head is not None:
        return loss_head.checked(logits)  # the head got the positions' rows: their losses, in that order
    if logits.dim() == 3:  # the model did not project through its output-embeddings module
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, index)
    return logits


def split_next_token_logits(model: nn.Module, batch: ContextParallelBatch, head: HeadOnPositions | None,
                            loss_head: LinearLossHead | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, targets)`` of a rank's part of a context-parallel batch: its targets are already the next
    tokens' labels (shifted before the split), so they pair with the logits of the same positions, unshifted; with
    ``head`` only the positions whose target is a label are projected; with ``loss_head`` the "logits" are the
    rows' losses against those targets, computed inside the output head (``[rows, 1]``)."""
    inputs = batch.model_inputs()
    targets = batch.targets.reshape(-1)
    if head is None:
        with loss_head.targets(targets) if loss_head is not None else contextlib.nullcontext():
            logits = model(**inputs).logits
            if loss_head is not None:
                logits = loss_head.checked(logits)
        return logits.reshape(-1, logits.shape[-1]), targets
    index = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    kept = targets.index_select(0, index)
    with loss_head.targets(kept) if loss_head is not None else contextlib.nullcontext():
        return logits_at(model, inputs, index, head, loss_head), kept


def shifted_labels(train: Any, validation: list[Any]) -> bool:
    """Whether the run's data sets hold labels that are the next tokens already (a data set class's
    ``labels_shifted = True``, as upstream's Megatron and nanogpt samples: ``seq_length`` tokens in, the
    ``seq_length`` that follow each as labels), so that no loss shifts them again. A run has one loss form: a
    validation set whose labels differ from the training set's is an error (validation refuses it earlier for
    the config's data set sections)."""
    want = bool(getattr(train, "labels_shifted", False))
    for dataset in validation:
        if dataset is not None and bool(getattr(dataset, "labels_shifted", False)) != want:
            which = (type(train).__name__, type(dataset).__name__)
            raise AutomodelError(shifted_mismatch(*(which if want else which[::-1])))
    return want


def shifted_mismatch(shifted: str, unshifted: str) -> str:
    """Why data sets of the two label forms cannot share a run (``shifted``: the class whose labels are the next
    tokens already)."""
    return (f"{shifted}'s labels are the next tokens already (the model reads seq_length tokens, each labelled with "
            f"the one after it) while {unshifted}'s are the input tokens themselves (the loss shifts them); one run "
            "computes its loss one way: train and validate on data sets of one kind (for MegatronPretraining, a "
            "validation section with splits_to_build: validation)")


def pipeline_logits_note(pp_size: int) -> str:
    """The run-start note that ``logits.label_positions_only: true`` (the default) is inert under pipeline
    parallelism: torch's stages exchange tensors of one shape, set up once per sequence length, while the count of
    label positions changes from batch to batch."""
    return (f"note: logits.label_positions_only: true governs nothing this run: with pipeline parallelism (pp_size "
            f"{pp_size}) the last stage computes the logits at every position (its output keeps one shape per "
            "sequence length; the loss is the same)")


class NextTokenLogits:
    """Recipe mixin (before ``TrainRecipe`` in the bases): the ``logits`` section, the output-head hook, and
    batches that carry their label positions, found on the host before the copy so the device never waits."""

    sections = {"logits": LogitsConfig}
    head_positions: HeadOnPositions | None = None
    loss_head: LinearLossHead | None = None  # loss_fn computes the loss inside the output head
    label_offset = 1  # position i predicts label i + 1; 0: logits[i] pairs with labels[i] (see setup)
    labels_shifted = False  # the data sets' labels are the next tokens already (their ``labels_shifted``)

    def setup(self) -> None:
        super().setup()
        validation = [getattr(loader, "dataset", None) for loader in getattr(self, "val_dataloaders", {}).values()]
        self.labels_shifted = shifted_labels(getattr(self, "train_dataset", None), validation)
        # an encoder-decoder's decoder reads the labels shifted right (the batch's decoder_input_ids); pre-shifted
        # labels are each position's next token already
        if self.labels_shifted or getattr(getattr(unwrap(self.model), "config", None), "is_encoder_decoder", False):
            self.label_offset = 0
        if getattr(self, "pipelines", None) is not None:
            self.pipelines.labels_shifted = self.labels_shifted
        if isinstance(self.loss_fn, LinearCrossEntropy):
            self.loss_head = self.attach_loss_head()
        if not self.cfg.logits.label_positions_only:
            return
        pp = self.cfg.distributed.pp_size if self.cfg.distributed is not None else 1
        if pp > 1:
            self.log(pipeline_logits_note(pp))
        else:
            self.head_positions = self.attach_head(self.model)

    def attach_loss_head(self) -> LinearLossHead | None:
        """The output head that computes the loss (FusedLinearCrossEntropy): the model's, or under pipeline
        parallelism the last stage's where this rank runs it (that stage then returns its final hidden states, and
        :meth:`pipeline_loss` applies the head); None on the other pipeline ranks."""
        if getattr(self, "pipelines", None) is None:
            return LinearLossHead.attach(unwrap(self.model), self.loss_fn)
        stage = last_stage(unwrap(self.model))
        if stage is None:
            return None
        stage.head_in_loss = True
        return LinearLossHead.attach(stage, self.loss_fn, stage.output_head)

    def attach_head(self, model: nn.Module) -> HeadOnPositions | None:
        """The hook on ``model``'s output head (inside DDP / compile wrappers), or None where it has none."""
        return HeadOnPositions.attach(unwrap(model))

    def move_to_device(self, batch: Any) -> Any:
        if self.cfg.logits.label_positions_only and isinstance(batch, dict) and "labels" in batch:
            batch = {**batch, LABEL_POSITIONS: label_positions(batch["labels"], offset=self.label_offset)}
        return super().move_to_device(batch)

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The model's keyword arguments, taken from a batch."""
        raise NotImplementedError

    def pipeline_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Pipeline parallelism: the next-token loss on the last stage's logits, summed over the label tokens; with
        FusedLinearCrossEntropy the last stage returned its final hidden states, which the head projects here, a
        chunk of rows at a time (:meth:`LinearLossHead.summed`). With context parallelism the targets of this
        rank's part are the next tokens' already: no shift."""
        offset = 0 if self.ctx.mesh.cp > 1 else self.label_offset
        if self.loss_head is not None:
            return self.loss_head.summed(output, next_targets(targets, offset))
        kept = output.shape[1] - offset
        return self.loss_fn(output[:, :kept].reshape(-1, output.shape[-1]), targets[:, offset:].reshape(-1))

    def next_token_logits(self, model: nn.Module, batch: dict[str, Any] | ContextParallelBatch,
                          head: HeadOnPositions | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, targets)`` of ``batch`` through ``model`` (see :func:`next_token_logits`), or of a rank's
        part of a context-parallel batch (:func:`split_next_token_logits`)."""
        if isinstance(batch, ContextParallelBatch):
            return split_next_token_logits(model, batch, head, self.loss_head)
        return next_token_logits(model, self.model_inputs(batch), batch["labels"], batch.get(LABEL_POSITIONS), head,
                                 self.loss_head, self.label_offset)

    def context_parallel_batch(self, batch: dict[str, Any]) -> ContextParallelBatch:
        """Token ids, positions and next-token targets: what context parallelism splits over its ranks, and the
        whole rows' attention mask (the all-gather attention's mask reads it, padding wherever it is; the model gets
        none). Ring attention runs without a mask, which hides only padding after a row's last real token."""
        mask = batch.get("attention_mask")
        if (mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any())
                and cp_attention(self.cfg, self.device, getattr(unwrap(self.model), "config", None)) == "ring"):
            raise AutomodelError("context parallelism's ring attention (distributed.cp_attention: ring) runs causal "
                                 "attention without a mask, which keeps padding at the end of a row out of every real "
                                 "token's attention, but this batch has padding before real tokens (left padding); "
                                 "pad on the right (the recipe's default collate_fn does) or set "
                                 "distributed.cp_attention: all_gather, whose mask hides padding anywhere")
        return ContextParallelBatch.from_labels(batch["input_ids"], batch["labels"], batch.get("position_ids"), mask,
                                                shifted=self.labels_shifted)
