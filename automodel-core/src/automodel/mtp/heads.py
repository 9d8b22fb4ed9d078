"""Multi-token prediction (MTP) heads, family-free: the depth loop and the auxiliary loss (DeepSeek-V3's scheme, as
upstream's ``num_nextn_predict_layers`` trains it).

Depth ``k`` (1..D) runs on the hidden states of depth ``k - 1`` (depth 0: the main model's output after its final
norm): its first sublayer fuses them with the embedding of the token ``k`` places ahead
(``eh_proj(cat(enorm(embed), hnorm(hidden)))``), its sublayers run, its last one ends with ``final_layernorm``, and
the shared output head turns position ``t`` into a prediction of token ``t + k + 1``. ``repeated_layer`` (upstream's
``mtp_use_repeated_layer``) runs one physical depth's sublayers for every depth (weight-tied iterations). The loss
adds ``scaling_factor / D`` times the sum over the depths of each depth's summed cross entropy, divided like the
main loss by the step's main label tokens (so the logged loss is ``main + scaling_factor * mean over depths``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel.training.loss import IGNORE_INDEX


@dataclass(frozen=True)
class MTPSettings:
    """The model section's MTP keys: ``num_nextn_predict_layers``, ``mtp_loss_scaling_factor``,
    ``mtp_use_repeated_layer``."""

    depths: int
    scaling_factor: float = 0.1
    repeated_layer: bool = False
    asked_by: str = "model.num_nextn_predict_layers"  # the key that asked for the heads, named in errors

    @property
    def physical_depths(self) -> int:
        """Depths with their own weights (what the checkpoint holds and its config's ``num_nextn_predict_layers``)."""
        return 1 if self.repeated_layer else self.depths


def shift_left(tensor: torch.Tensor, by: int, fill: int) -> torch.Tensor:
    """``tensor`` moved ``by`` places left along the sequence (dim 1), the freed places at the end set to ``fill``."""
    shifted = torch.full_like(tensor, fill)
    if by < tensor.shape[1]:
        shifted[:, :tensor.shape[1] - by] = tensor[:, by:]
    return shifted


class MTPHeads(nn.Module):
    """The heads' sublayers (``layers``: ``physical_depths`` runs of a depth's sublayers, flat, as the HF
    checkpoints name them ``mtp.layers.{i}``) and the depth loop. Each sublayer is called as
    ``layer(hidden, embedded=..., **kwargs)``; ``embedded`` is the shifted tokens' embedding for a depth's first
    sublayer, else None. While training, the model's forward stores each depth's hidden states here
    (:meth:`run`) and the loss takes them (:meth:`loss`)."""

    origin = ""  # where the weights came from, for the run's log (automodel.mtp.attach)

    def __init__(self, settings: MTPSettings, layers: list[nn.Module]):
        super().__init__()
        if settings.depths < 1 or not layers or len(layers) % settings.physical_depths:
            raise ValueError(f"{len(layers)} sublayers do not make {settings.physical_depths} MTP depths")
        self.settings = settings
        self.layers = nn.ModuleList(layers)
        self.per_depth = len(layers) // settings.physical_depths
        self._outputs: list[torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor, embedded: list[torch.Tensor],
                kwargs_for: Callable[[int], dict[str, Any]]) -> list[torch.Tensor]:
        """Each depth's hidden states; ``embedded``: each depth's embedding of the tokens ahead
        (:func:`future_embeddings`), ``kwargs_for(depth)`` gives a depth's sublayers their keyword arguments
        (masks, positions shifted as the tokens are)."""
        outputs = []
        for depth in range(1, self.settings.depths + 1):
            start = 0 if self.settings.repeated_layer else (depth - 1) * self.per_depth
            hidden = self.run_depth(hidden, embedded[depth - 1], self.layers[start:start + self.per_depth],
                                    kwargs_for(depth))
            outputs.append(hidden)
        return outputs

    def run_depth(self, hidden: torch.Tensor, embedded: torch.Tensor, layers: nn.ModuleList,
                  kwargs: dict[str, Any]) -> torch.Tensor:
        """One depth: its sublayers in turn, the first given the shifted tokens' embedding (it fuses them). A
        family whose checkpoints keep the fusion and the final norm outside the sublayers overrides this."""
        for index, layer in enumerate(layers):
            hidden = layer(hidden, embedded=embedded if index == 0 else None, **kwargs)
        return hidden

    def run(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`forward` (through ``__call__``, so module hooks fire), its outputs kept for :meth:`loss`."""
        self._outputs = self(*args, **kwargs)

    def loss(self, labels: torch.Tensor, head: nn.Module, loss_fn: nn.Module, loss_head: Any = None,
             position_ids: torch.Tensor | None = None, offset: int = 1) -> torch.Tensor:
        """``scaling_factor / D`` x the sum over depths of depth ``k``'s summed loss (``loss_fn``, reduction sum)
        of position ``t`` against ``labels[t + k + offset]`` (``offset`` 0: the labels are the next tokens
        already), from the outputs of the last training forward; only the
        positions with a label go through the output ``head`` (``loss_head``: the loss computed inside it). Packed
        rows (``position_ids`` restarting at 0 where a sample starts): a target in the next sample is none."""
        outputs, self._outputs = self._outputs, None
        if outputs is None:
            raise RuntimeError("the MTP heads did not run in this forward (the model was not in training mode)")
        return self.outputs_loss(outputs, labels, head, loss_fn, loss_head, position_ids, offset)

    def outputs_loss(self, outputs: list[torch.Tensor], labels: torch.Tensor, head: nn.Module, loss_fn: nn.Module,
                     loss_head: Any = None, position_ids: torch.Tensor | None = None, offset: int = 1
                     ) -> torch.Tensor:
        """:meth:`loss` of the depths' hidden states ``outputs`` (a pipeline's last stage returns them)."""
        if position_ids is not None and position_ids.dim() == 3:  # multi-axis rotary positions: the text axis first
            position_ids = position_ids[0]
        sample = (position_ids == 0).cumsum(dim=1) if position_ids is not None else None
        total = outputs[0].new_zeros((), dtype=torch.float32)
        for depth, hidden in enumerate(outputs, start=1):
            targets = shift_left(labels, depth + offset, IGNORE_INDEX)
            if sample is not None:  # the target's sample must be the position's
                targets = targets.masked_fill(shift_left(sample, depth + offset, -1) != sample, IGNORE_INDEX)
            targets = targets.reshape(-1)
            index = (targets != IGNORE_INDEX).nonzero().squeeze(1)
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
            kept = targets.index_select(0, index)
            with loss_head.targets(kept) if loss_head is not None else contextlib.nullcontext():
                logits = head(rows)
                if loss_head is not None:
                    logits = loss_head.checked(logits)
            total = total + loss_fn(logits, kept).float()
        return total * (self.settings.scaling_factor / len(outputs))


def stack_expert_tensors(tensors: dict[str, torch.Tensor], pattern: re.Pattern[str]
                         ) -> tuple[dict[str, torch.Tensor], dict[tuple[str, str], torch.Tensor]]:
    """A checkpoint's ``mtp.*`` tensors with one tensor per expert (the families' files) gathered as transformers
    holds a MoE layer's: the tensors ``pattern`` does not match, and per (experts module, projection), the
    pattern's groups 1 and 3 (group 2 is the expert's index), the experts' tensors stacked in index order."""
    others: dict[str, torch.Tensor] = {}
    found: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = pattern.match(name)
        if match is None:
            others[name] = tensor
        else:
            found.setdefault((match[1], match[3]), {})[int(match[2])] = tensor
    stacked = {}
    for (owner, projection), experts in found.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{owner}: the checkpoint holds {projection} of experts {sorted(experts)}, not "
                             f"0..{len(experts) - 1}")
        stacked[(owner, projection)] = torch.stack([experts[index] for index in range(len(experts))])
    return others, stacked


def future_embeddings(input_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                      depths: int) -> list[torch.Tensor]:
    """Depth ``k``'s input (k = 1..``depths``): the embedding of the token ``k`` places ahead of each position (0
    past the row's end; a packed row's next sample there carries no label, :meth:`MTPHeads.outputs_loss`)."""
    return [embed(shift_left(input_ids, depth, 0)) for depth in range(1, depths + 1)]


def find_heads(model: nn.Module) -> MTPHeads | None:
    """The model's MTP heads (inside LoRA / DDP / compile wrappers), or None."""
    return next((module for module in model.modules() if isinstance(module, MTPHeads)), None)
