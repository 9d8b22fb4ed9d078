"""The next-token cross entropy computed inside the output head, a chunk of rows at a time, so the ``[tokens, vocab]``
logits are never materialised (upstream's ``FusedLinearCrossEntropy``, there through cut-cross-entropy's Triton
kernels on CUDA; here in plain torch on any device).

While the model runs, :class:`LinearLossHead` swaps its output head's forward for one that returns, for each row of
hidden states, that row's loss against its target (0 where the target is ignored): ``chunk_len`` rows are projected
onto the vocabulary at a time, soft-capped where asked, reduced to their log-normaliser and target logit, and
dropped; the backward recomputes each chunk's softmax to form the gradients of the hidden states, the head's weight
and bias. The model's ``logits`` are then those per-row losses (``[..., 1]``), which :class:`LinearCrossEntropy`
sums. The head stays the module FSDP2 / DDP wrapped, so its weight is gathered and its gradient reduced as for the
usual head; under tensor parallelism each rank projects onto its slice of the vocabulary and the log-normaliser
and target logit are reduced over the tensor-parallel group. The model must return what its head returned (a model
that scales or soft-caps its logits after the head is refused with the reason when it runs). Under pipeline
parallelism the last stage returns its final hidden states instead of logits and the schedule's loss calls the head
(:meth:`LinearLossHead.summed`): the same per-row losses, no logits between the stage and the loss.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.loss import IGNORE_INDEX


class LinearCrossEntropy(nn.Module):
    """The loss of :class:`LinearLossHead`'s per-row losses: their sum (``reduction='sum'``, what the engine uses) or
    their mean over the label tokens. ``logit_softcapping`` (0: none) caps the logits as ``c * tanh(z / c)`` before
    the softmax; ``chunk_len``: rows projected onto the vocabulary at a time."""

    sums_in_fp32 = True  # as_sum_loss uses it as it is: the rows are fp32 losses

    def __init__(self, ignore_index: int = IGNORE_INDEX, logit_softcapping: float = 0, reduction: str = "sum",
                 chunk_len: int = 1024):
        super().__init__()
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', found {reduction!r}")
        if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"chunk_len must be a positive integer (rows projected at a time), found {chunk_len!r}")
        if isinstance(logit_softcapping, bool) or not isinstance(logit_softcapping, (int, float)) or \
                logit_softcapping < 0:
            raise ValueError(f"logit_softcapping must be a number >= 0 (0: no capping), found {logit_softcapping!r}")
        self.ignore_index, self.reduction, self.chunk_len = ignore_index, reduction, chunk_len
        self.logit_softcapping = float(logit_softcapping)

    def forward(self, row_losses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = row_losses.float().sum()
        if self.reduction == "sum":
            return total
        return total / (targets != self.ignore_index).sum().clamp(min=1)


class LinearLossHead:
    """Makes a causal LM's output head (an ``nn.Linear``) return per-row losses while :meth:`targets` is active."""

    def __init__(self, head: nn.Linear, loss: LinearCrossEntropy, tensor_parallel: Any = None):
        self.head, self.loss, self.tensor_parallel = head, loss, tensor_parallel
        self.rows: torch.Tensor | None = None

    @classmethod
    def attach(cls, model: nn.Module, loss: LinearCrossEntropy, head: nn.Module | None = None) -> LinearLossHead:
        """The loss head of ``model`` (unwrapped): its output embeddings, or ``head`` (a pipeline's last stage names
        its own, ``PipelineStageModel.output_head``); refused unless that is a plain linear layer."""
        if head is None:
            get_head = getattr(model, "get_output_embeddings", None)
            head = get_head() if callable(get_head) else None
        if not isinstance(head, nn.Linear) or hasattr(head, "base_layer"):
            raise AutomodelError(f"loss_fn: FusedLinearCrossEntropy computes the loss inside the output head, which "
                                 f"must be a linear layer; this model's is {type(head).__name__} (a LoRA-adapted or "
                                 "missing head); use MaskedCrossEntropy or ChunkedCrossEntropy")
        from automodel.training.parallel.tensor_parallel import tensor_parallel_of

        return cls(head, loss, tensor_parallel_of(model))

    @contextlib.contextmanager
    def targets(self, targets: torch.Tensor) -> Iterator[None]:
        """Within the block the head returns, for each row of hidden states it gets, that row's loss against
        ``targets`` (one per row, in the order the head sees the rows)."""
        self.head.forward = functools.partial(self._row_losses, targets)
        try:
            yield
        finally:
            del self.head.forward  # the module's own forward again
            self.rows = None

    def checked(self, logits: torch.Tensor) -> torch.Tensor:
        """The per-row losses the head returned (this rank's, as a plain tensor), which the model's ``logits`` must
        be: a model that changes its logits after the head cannot be followed."""
        from torch.distributed.tensor import DTensor

        local = logits.to_local() if isinstance(logits, DTensor) else logits
        rows = self.rows
        if rows is None or local.shape != rows.shape or local.data_ptr() != rows.data_ptr():
            raise AutomodelError("loss_fn: FusedLinearCrossEntropy computes the loss inside the output head, but this "
                                 "model changes the head's output afterwards (logit scaling or soft-capping); use "
                                 "MaskedCrossEntropy or ChunkedCrossEntropy")
        return local

    def summed(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the head applied to ``hidden`` (final hidden states, one row per target), summed as
        :class:`LinearCrossEntropy` sums: the pipeline's form, whose last stage returns those hidden states and whose
        schedule's loss calls the head here (no ``[tokens, vocab]`` logits leave the stage)."""
        with self.targets(targets):
            rows = self.checked(self.head(hidden))
        return self.loss(rows, targets)

    def _row_losses(self, targets: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        weight, bias, loss = self.head.weight, self.head.bias, self.loss
        if isinstance(hidden, DTensor):  # tensor parallelism's input hook: replicated over the tp ranks
            hidden = hidden.to_local()
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.shape[0] != targets.numel():
            raise AutomodelError(f"loss_fn: the output head got {flat.shape[0]} rows of hidden states for "
                                 f"{targets.numel()} targets")
        settings = (targets.reshape(-1), loss.ignore_index, loss.logit_softcapping, loss.chunk_len)
        if not isinstance(weight, DTensor):
            self.rows = _RowLosses.apply(flat, weight, bias, *settings).view(*hidden.shape[:-1], 1)
            return self.rows
        # tensor parallelism: this rank holds a slice of the vocabulary (the head's rows); the per-row log-normaliser
        # and target logit are reduced over the tp group, and the rows returned as the DTensor the head's
        # tensor-parallel output hook expects (sharded over the vocabulary, or replicated)
        mesh = weight.device_mesh
        first = sum(len(part) for part in torch.arange(weight.shape[0]).chunk(mesh.size())[:mesh.get_local_rank()])
        rows = _RowLosses.apply(flat, weight.to_local(), bias.to_local() if bias is not None else None,
                                *settings, mesh.get_group(), first)
        self.rows = rows.view(*hidden.shape[:-1], 1)
        return DTensor.from_local(self.rows, mesh, [self.output_placement()], run_check=False)

    def output_placement(self) -> Any:
        """How the head's tensor-parallel output hook wants its output: sharded over the vocabulary (the
        vocabulary-parallel loss) or replicated (logits gathered)."""
        from torch.distributed.tensor import Replicate, Shard

        applied = self.tensor_parallel
        return Shard(-1) if applied is not None and applied.vocab_parallel else Replicate()


def _capped(logits: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Soft-capped logits and the derivative of the capping (None: no capping)."""
    if not cap:
        return logits, None
    tanh = torch.tanh(logits / cap)
    return cap * tanh, 1 - tanh * tanh


class _RowLosses(torch.autograd.Function):
    """Per-row cross entropy of ``hidden @ weight.T + bias`` against ``targets``, ``chunk_len`` rows at a time.

    With a process ``group`` (tensor parallelism) ``weight`` holds this rank's rows ``first ..`` of the vocabulary:
    each row's log-normaliser and target logit are reduced over the group (a max and two sums per chunk), and the
    hidden states' gradient is summed over it in backward (they are replicated). Without one, ``first`` is 0 and
    ``weight`` the whole vocabulary."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, ignore_index: int, cap: float, chunk_len: int, group: Any = None,
                first: int = 0) -> torch.Tensor:
        kept = targets != ignore_index
        local = targets - first
        mine = kept & (local >= 0) & (local < weight.shape[0])
        local = local.masked_fill(~mine, 0)
        lse = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        picked = torch.zeros_like(lse)
        for rows in torch.arange(hidden.shape[0], device=hidden.device).split(chunk_len):
            logits, _ = _capped(nn.functional.linear(hidden[rows], weight, bias).float(), cap)
            top = _reduced(logits.max(dim=-1).values, group, max_=True)
            lse[rows] = top + torch.log(_reduced(torch.exp(logits - top.unsqueeze(1)).sum(-1), group))
            picked[rows] = logits.gather(1, local[rows].unsqueeze(1)).squeeze(1) * mine[rows]
        picked = _reduced(picked, group)
        ctx.save_for_backward(hidden, weight, bias, local, mine, kept, lse)
        ctx.cap, ctx.chunk_len, ctx.group = cap, chunk_len, group
        return (lse - picked) * kept

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, local, mine, kept, lse = ctx.saved_tensors
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        for rows in torch.arange(hidden.shape[0], device=hidden.device).split(ctx.chunk_len):
            logits, slope = _capped(nn.functional.linear(hidden[rows], weight, bias).float(), ctx.cap)
            grad = torch.exp(logits - lse[rows].unsqueeze(1))  # the softmax (this rank's part of it)
            grad[torch.arange(len(rows), device=grad.device), local[rows]] -= mine[rows].float()
            grad *= (grad_rows[rows] * kept[rows]).unsqueeze(1)
            if slope is not None:
                grad *= slope
            grad_hidden[rows] = grad @ weight.float()
            if grad_weight is not None:
                grad_weight += grad.T @ hidden[rows].float()
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        grad_hidden = _reduced(grad_hidden, ctx.group)
        return (grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None, None, None, None)


def _reduced(tensor: torch.Tensor, group: Any, max_: bool = False) -> torch.Tensor:
    """``tensor`` summed (or its maximum taken) over ``group`` in place; as it is without a group."""
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if max_ else dist.ReduceOp.SUM, group=group)
    return tensor
