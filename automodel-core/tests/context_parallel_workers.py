"""The loop's context-parallel step (``TrainingLoop._train_step`` with ``sequence_parts``) on CPU gloo ranks, where
torch's ring attention cannot run (no CP strategy for the CPU SDPA kernel): the model here has no attention, each
position's logits depend on its token and its position only, so splitting the sequences over ranks is exact and
everything else the engine does for context parallelism — the split inside torch's context-parallel region, the
positions that travel with the tokens, the targets shifted before the split, the loss without a second shift, the
label tokens counted before the split, the scale ``dp * cp / tokens``, the loss summed over the ``cp`` group,
FSDP2 over ``dp_shard x cp`` — can be compared, number for number, with one process.

Run as ``python context_parallel_workers.py <scenario> <json args> <result file>`` (``parallel_testing.launch``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from parallel_workers import full_state, main
from torch import nn

from automodel.training.loop import TrainingLoop
from automodel.training.loss import IGNORE_INDEX, MaskedCrossEntropy
from automodel.training.next_token import HeadOnPositions, NextTokenLogits
from automodel.training.parallel.context_parallel import fsdp_mesh
from automodel.training.parallel.fsdp import apply_fsdp2
from automodel.training.parallel.mesh import MeshLayout, build_device_mesh, plan_mesh
from automodel.training.parallel.precision import Precision

VOCAB, WIDTH, SEQ, ROWS, STEPS, MICRO_BATCHES = 32, 16, 16, 4, 3, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.mlp(self.norm(hidden)))


class PositionwiseLM(nn.Module):
    """A causal LM's interface without attention: a wrong position or a target shifted twice changes the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **_: Any) -> Any:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        hidden = self.embed(input_ids) + self.positions(position_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return SimpleNamespace(logits=self.lm_head(hidden))

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


class Step(NextTokenLogits, TrainingLoop):
    """The engine's step as the LLM recipe runs it (its compute_loss and label count), the rest the core's."""

    def __init__(self, model: nn.Module, layout: MeshLayout, device_mesh: Any, label_positions_only: bool):
        self.model, self.device, self.world_size = model, torch.device("cpu"), layout.world_size
        self.ctx = SimpleNamespace(mesh=layout, device_mesh=device_mesh, precision=Precision(),
                                   fsdp2=device_mesh is not None)
        self.cfg = SimpleNamespace(distributed=None, clip_grad_norm=SimpleNamespace(max_norm=None, norm_type=2.0),
                                   logits=SimpleNamespace(label_positions_only=label_positions_only))
        self.head_positions = HeadOnPositions.attach(model) if label_positions_only else None
        self.grad_scaler = self.pipelines = self.lr_scheduler = None
        self.trainable_params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.trainable_params, lr=1e-2)
        self.loss_fn = MaskedCrossEntropy()

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {"input_ids": batch["input_ids"], "use_cache": False}

    def compute_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.loss_fn(*self.next_token_logits(model, batch, self.head_positions))

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    count_input_tokens = count_label_tokens


def micro_batches(step: int, dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """A step's micro-batches, this data-parallel rank's rows: right-padded rows (the attention mask's zeros at the
    end), about a third of the labels ignored, so the ranks and micro-batches carry different token counts."""
    generator = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, VOCAB, (MICRO_BATCHES, ROWS, SEQ), generator=generator)
    labels = ids.masked_fill(torch.rand(ids.shape, generator=generator) < 0.35, IGNORE_INDEX)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (MICRO_BATCHES, ROWS, 1), generator=generator)
    mask = (torch.arange(SEQ) < lengths).long()
    labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    return [{"input_ids": ids[m, rows], "labels": labels[m, rows], "attention_mask": mask[m, rows]}
            for m in range(MICRO_BATCHES)]


def run(layout: MeshLayout, label_positions_only: bool) -> dict[str, Any]:
    """``STEPS`` engine steps: the loss and gradient norm of each (the norm shows the gradients' scale, which
    AdamW's update hides) and the weights after them."""
    model, device_mesh = PositionwiseLM(), None
    if layout.world_size > 1:
        device_mesh = build_device_mesh(layout, "cpu")
        apply_fsdp2(model, fsdp_mesh(device_mesh, layout))
    step = Step(model, layout, device_mesh, label_positions_only)
    rank = dist.get_rank() if dist.is_initialized() else 0
    results = [step._train_step(micro_batches(s, layout.dp_rank(rank), layout.dp)) for s in range(STEPS)]
    return {"losses": [loss.item() for loss, _, _ in results], "norms": [norm.item() for _, norm, _ in results],
            "state": {k: v.tolist() for k, v in full_state(model).items()}}


def scenario_cp(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """Context parallelism over every rank (cp = world size), or dp 2 x cp 2 on four; the one-process reference
    without a process group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = plan_mesh(world, dp_size=args["dp"], cp_size=world // args["dp"]) if world > 1 else MeshLayout(1)
    return {"head": run(layout, True), "all_positions": run(layout, False)}


if __name__ == "__main__":
    main(globals())
