"""Static pipeline stage shapes (``distributed.pipeline.pp_seq_len`` and / or ``dtype``).

torch's ``PipelineStage`` learns what it sends and receives from the first batch it runs: a real forward and
backward of it, stage after stage, its gradients then dropped. Given example tensors of every input and output it
skips that (its STATIC mode). With ``pp_seq_len`` every training batch is padded to that length, so the shapes are
known before the first step; with ``dtype`` alone they are set from each training batch's own length (upstream's
``update_seq_len``): :class:`StaticShapes` makes the examples (meta tensors) and :class:`StaticStage`
checks the first micro-batch's outputs against them, so a wrong dtype stops the run with the numbers instead of
sending a tensor into a buffer of another dtype.

The dtypes follow what the stages return under FSDP2 (pipeline parallelism runs on it): its ``output_dtype`` casts
a stage's outputs; without it the hidden states stay in the parameters' compute dtype (``param_dtype``, else the
stored dtype; ``autocast_dtype`` changes the matmuls, not the residual stream), and the logits come from the output
head's matmul (the autocast dtype under ``autocast_dtype``, fp32 with ``distributed.moe.lm_head_precision``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from automodel.errors import ConfigIssue
from automodel.training.parallel.precision import Precision, dtype_name, parse_dtype_name

if TYPE_CHECKING:
    from automodel.training.parallel.pipeline_parallel import PipelineSettings


def activations_dtype(precision: Precision, storage: torch.dtype | None) -> torch.dtype | None:
    """The dtype of the hidden states one stage sends the next (None: the stored dtype, unknown)."""
    return precision.output_dtype or precision.param_dtype or storage


def static_shapes_unsupported(tp_size: int, cp_size: int, sequence_parallel: bool,
                              pp_seq_len: int | None = None) -> str | None:
    """Why static stage shapes cannot describe what the stages exchange in this layout (None: they can).

    Tensor parallelism alone keeps what the stages return plain and whole on every tensor-parallel rank (the
    row-wise projections all-reduce the hidden states; a stage's output head gathers the logits over the
    vocabulary), which :class:`StaticShapes` describes; context parallelism sends each rank's part of the
    sequences, ``pp_seq_len / cp_size`` positions (``pp_seq_len`` then a multiple of the ``2 cp_size`` chunks of
    its split). Sequence parallelism sends sequence-sharded DTensors, which it does not describe."""
    if cp_size > 1 and pp_seq_len is not None and pp_seq_len % (2 * cp_size):
        return (f"cp_size {cp_size}: context parallelism splits each sequence into {2 * cp_size} chunks, which "
                f"{pp_seq_len} tokens do not divide into; use a multiple of {2 * cp_size}")
    if tp_size > 1 and sequence_parallel:
        return (f"sequence_parallel with tp_size {tp_size}: the stages exchange sequence-sharded hidden states, which "
                "static shapes are not set up for")
    return None


def static_shape_issues(pipeline: PipelineSettings, precision: Precision, storage: torch.dtype | None,
                        unsupported: str | None, key: str = "distributed.pipeline") -> list[ConfigIssue]:
    """``pp_seq_len``: a layout static shapes describe (``unsupported``: why not, from
    :func:`static_shapes_unsupported`), and ``dtype`` the activations' dtype of the run's ``precision`` (where the
    config names it, ``storage`` the model's dtype or None; else the first micro-batch checks it)."""
    issues = []
    name = "pp_seq_len" if pipeline.pp_seq_len is not None else "dtype"
    if unsupported is not None:
        issues.append(ConfigIssue(f"{key}.{name}", f"{getattr(pipeline, name)!r} with {unsupported}; remove {name} "
                                  "(the shapes are then found on the first batch) or change that setting"))
    given = parse_dtype_name(pipeline.dtype) if pipeline.dtype is not None else None
    runs = activations_dtype(precision, storage)
    if given is not None and runs is not None and given != runs:
        issues.append(ConfigIssue(f"{key}.dtype", f"{dtype_name(given)}, but the stages exchange {dtype_name(runs)} "
                                  "activations in this run (distributed.mp_policy output_dtype, else param_dtype, "
                                  f"else model.dtype); set dtype: {dtype_name(runs)} or remove it"))
    return issues


def logits_dtype(precision: Precision, storage: torch.dtype, head_fp32: bool) -> torch.dtype:
    """The dtype of the last stage's logits (``head_fp32``: the output head is its own fp32 FSDP2 unit)."""
    return (precision.output_dtype or precision.autocast_dtype or (torch.float32 if head_fp32 else None)
            or precision.param_dtype or storage)


@dataclass(frozen=True)
class StaticShapes:
    """What every training stage takes and returns with ``pp_seq_len``: token ids ``[rows, seq_len]`` into the
    first stage, hidden states ``[rows, seq_len, hidden]`` in ``activations`` between stages, logits
    ``[rows, seq_len, vocab]`` in ``logits`` out of the last (``rows``: a pipeline micro-batch); with
    ``head_in_loss`` (the loss applies the output head) the last stage's final hidden states instead. With
    context parallelism over ``cp`` ranks each rank's stages exchange its part: ``seq_len / cp`` positions."""

    seq_len: int | None  # None: each training batch's own length (of_length)
    hidden: int
    vocab: int
    activations: torch.dtype
    logits: torch.dtype
    head_in_loss: bool = False
    cp: int = 1
    carried: int = 0  # MTP depths: their embeddings travel beside the hidden states (automodel.mtp.pipeline)

    @property
    def part(self) -> int:
        """The positions of a sequence one rank's stages exchange."""
        return self.seq_len // self.cp

    def of_length(self, seq_len: int) -> StaticShapes:
        """These shapes for a batch of ``seq_len`` tokens (itself when the length is fixed)."""
        return self if self.seq_len is not None else dataclasses.replace(self, seq_len=seq_len)

    def examples(self, stage: Any, rows: int) -> dict[str, Any]:
        """``PipelineStage``'s ``input_args`` and ``output_args`` for ``stage`` (meta tensors); with MTP depths
        (``carried``) the hidden states travel with each depth's embedding, and the last stage returns each depth's
        hidden states and the rows' positions after its output; the tensors a stage's ``beside`` takes and sends
        (``[rows, positions, hidden]`` each, or the last dimensions its ``widths(stage)`` gives) follow the hidden
        states likewise."""
        def hidden(width: int | None = None) -> torch.Tensor:
            return torch.empty(rows, self.part, width or self.hidden, dtype=self.activations, device="meta",
                               requires_grad=True)

        carried = tuple(hidden() for _ in range(self.carried))
        beside = getattr(stage, "beside", None)  # tensors beside the hidden states (DeepStack maps, Gemma 4's)
        taken, sent = beside.counts(stage) if beside is not None else (0, 0)
        # their last dimensions (taken, sent) where the beside names them (else the hidden size)
        across = beside.widths(stage) if hasattr(beside, "widths") else ((None,) * taken, (None,) * sent)
        if stage.is_first:  # a composite model's first stage takes the whole rows (it splits after the merge)
            length = self.seq_len if getattr(stage, "takes_whole_rows", False) else self.part
            inputs: tuple[torch.Tensor, ...] = (torch.empty(rows, length, dtype=torch.long, device="meta"),)
        else:
            inputs = (hidden(), *carried, *(hidden(width) for width in across[0]))
        logits = stage.is_last and not self.head_in_loss
        width, dtype = (self.vocab, self.logits) if logits else (self.hidden, self.activations)
        outputs = (torch.empty(rows, self.part, width, dtype=dtype, device="meta", requires_grad=True), *carried,
                   *(hidden(width) for width in across[1]))
        if stage.is_last and self.carried:
            outputs += (torch.empty(rows, self.part, dtype=torch.long, device="meta"),)
        return {"input_args": inputs if len(inputs) > 1 else inputs[0],
                "output_args": outputs if len(outputs) > 1 else outputs[0]}

    def describe(self, rows: int, whole_rows: bool = False) -> str:
        """The run-start line: the shapes, and that no shape-finding pass runs (``whole_rows``: the first stage
        takes the whole rows' token ids, a composite model's, which splits them after merging its media)."""
        whole = f"{self.seq_len or 'length'}"
        length = (f"{self.part}" if self.seq_len else f"length / {self.cp}") if self.cp > 1 else whole
        size = f"{rows}, {length}"
        last = "the last stage's too (the loss applies the output head)" if self.head_in_loss else \
            f"logits [{size}, {self.vocab}] {dtype_name(self.logits)}"
        origin = f"pp_seq_len {self.seq_len}" if self.seq_len else "distributed.pipeline.dtype, each batch's length"
        origin += f"; this rank's part of the sequences, cp {self.cp}" if self.cp > 1 else ""
        ids = f"[{rows}, {whole}] (the whole rows: the first stage splits them after merging the media)" \
            if whole_rows and self.cp > 1 else f"[{size}]"
        return (f"pipeline stage shapes: static ({origin}): token ids {ids}, hidden states "
                f"[{size}, {self.hidden}] {dtype_name(self.activations)}, {last}; no shape-finding pass on the first "
                "batch")

