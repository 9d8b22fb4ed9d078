"""The loop's context-parallel step (``TrainingLoop._train_step`` with ``sequence_parts``) on CPU gloo ranks with the
all-gather attention (``distributed.cp_attention: all_gather``), against one process: a tiny Qwen2 (Llama's layers
with a sliding-window first layer and grouped key/value heads) built from its config, on padded rows (the attention
mask's zeros at the end of some rows, at the start of the others) and on packed rows (positions restarting at each
document, no mask). Every part the engine runs for context parallelism — the split inside the region, the positions
that travel with the tokens, the targets shifted before the split, the gathered keys and values with their mask
(causal, padding, documents, the layer's window), the loss without a second shift, the label tokens counted before
the split, the scale ``dp * cp / tokens``, the loss summed over the ``cp`` group, FSDP2 over ``dp_shard x cp`` — is
compared, number for number, with one process running transformers' own masks; with the loss inside the output head
(FusedLinearCrossEntropy) too, and on cp 2 x tp 2 (the attention on each rank's tensor-parallel heads, the loss
vocabulary-parallel; with sequence parallelism for two of the losses).

Run as ``python context_parallel_workers.py <scenario> <json args> <result file>`` (``parallel_testing.launch``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from parallel_workers import full_state, main
from torch import nn

from automodel.training.linear_ce import LinearCrossEntropy, LinearLossHead
from automodel.training.loop import TrainingLoop
from automodel.training.loss import IGNORE_INDEX, MaskedCrossEntropy
from automodel.training.next_token import HeadOnPositions, NextTokenLogits
from automodel.training.parallel.context_parallel import causal_attention_without_mask, fsdp_mesh
from automodel.training.parallel.fsdp import apply_fsdp2
from automodel.training.parallel.mesh import MeshLayout, build_device_mesh, plan_mesh
from automodel.training.parallel.precision import Precision
from automodel.training.parallel.tensor_parallel import apply_tensor_parallel

VOCAB, SEQ, ROWS, STEPS, MICRO_BATCHES, WINDOW = 32, 16, 4, 3, 2, 5


def tiny_model() -> nn.Module:
    """Two layers: the first sees only the last ``WINDOW`` tokens (shorter than a rank's part), the second all."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=WINDOW, max_window_layers=2,
                         layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


class Step(NextTokenLogits, TrainingLoop):
    """The engine's step as the LLM recipe runs it (its compute_loss and label count), the rest the core's."""

    def __init__(self, model: nn.Module, layout: MeshLayout, device_mesh: Any, label_positions_only: bool,
                 fused: bool):
        self.model, self.device, self.world_size = model, torch.device("cpu"), layout.world_size
        self.ctx = SimpleNamespace(mesh=layout, device_mesh=device_mesh, precision=Precision(),
                                   fsdp2=device_mesh is not None)
        self.cfg = SimpleNamespace(distributed=SimpleNamespace(cp_size=layout.cp, cp_attention="all_gather",
                                                               defer_fsdp_grad_sync=True), model=None,
                                   clip_grad_norm=SimpleNamespace(max_norm=None, norm_type=2.0),
                                   logits=SimpleNamespace(label_positions_only=label_positions_only))
        self.head_positions = HeadOnPositions.attach(model) if label_positions_only else None
        self.grad_scaler = self.pipelines = self.lr_scheduler = None
        self.trainable_params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.trainable_params, lr=1e-2)
        self.loss_fn = LinearCrossEntropy(chunk_len=5) if fused else MaskedCrossEntropy()
        self.loss_head = LinearLossHead.attach(model, self.loss_fn) if fused else None

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch},
                "use_cache": False}

    def compute_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.loss_fn(*self.next_token_logits(model, batch, self.head_positions))

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    count_input_tokens = count_label_tokens


def micro_batches(step: int, dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """A step's micro-batches, this data-parallel rank's rows, about a third of the labels ignored (so the ranks and
    micro-batches carry different token counts): padded rows first (every other one on the left), then packed rows
    (documents of 1 to 8 tokens, positions restarting at each, its first label ignored as packing does)."""
    generator = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, VOCAB, (MICRO_BATCHES, ROWS, SEQ), generator=generator)
    labels = ids.masked_fill(torch.rand(ids.shape, generator=generator) < 0.35, IGNORE_INDEX)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (ROWS, 1), generator=generator)
    mask = (torch.arange(SEQ) < lengths).long()
    mask[1::2] = mask[1::2].flip(-1)  # left padding
    # a row's first real token has no label (a collator's rows start with a prompt): one process would predict it
    # from the padding before it, whose query sees no key there (a query sees itself here)
    opening = torch.nn.functional.pad(mask, (1, 0))[:, :-1] < mask
    starts = torch.rand(ROWS, SEQ, generator=generator) < 0.2
    starts[:, 0] = True
    documents = starts.cumsum(-1)
    first = torch.stack([(documents[r, :, None] == documents[r]).float().argmax(-1) for r in range(ROWS)])
    positions = torch.arange(SEQ) - first
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    padded = {"input_ids": ids[0, rows], "labels": labels[0].masked_fill((mask == 0) | opening, IGNORE_INDEX)[rows],
              "attention_mask": mask[rows]}
    packed = {"input_ids": ids[1, rows], "labels": labels[1].masked_fill(starts, IGNORE_INDEX)[rows],
              "position_ids": positions[rows]}
    return [padded, packed]


# how the loss runs: (the head projects only the labelled positions, FusedLinearCrossEntropy)
LOSSES = {"head": (True, False), "all_positions": (False, False), "fused_head": (True, True),
          "fused_all_positions": (False, True)}


def run(layout: MeshLayout, label_positions_only: bool, fused: bool, sequence_parallel: bool = False
        ) -> dict[str, Any]:
    """``STEPS`` engine steps: the loss and gradient norm of each (the norm shows the gradients' scale, which
    AdamW's update hides) and the weights after them. Where the layout has ``tp`` the model is sharded over it
    first, as the sharding stage does (TP, then FSDP2); what a rank's attention projects (its heads' features) and
    how many positions a layer's norm gets show the sharding."""
    model, device_mesh = tiny_model(), None
    if layout.world_size > 1:
        device_mesh = build_device_mesh(layout, "cpu")
        if layout.tp > 1:
            apply_tensor_parallel(model, device_mesh["tp"], sequence_parallel=sequence_parallel)
        causal_attention_without_mask(model)  # as the context_parallel stage does
        apply_fsdp2(model, fsdp_mesh(device_mesh, layout))
    seen: dict[str, int] = {}
    layer = model.model.layers[1]
    layer.self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.update(q_features=out.shape[-1]))
    layer.input_layernorm.register_forward_pre_hook(  # before sequence parallelism's hook: the local tensor
        lambda m, args: seen.update(norm_positions=args[0].shape[1]), prepend=True)
    step = Step(model, layout, device_mesh, label_positions_only, fused)
    rank = dist.get_rank() if dist.is_initialized() else 0
    results = [step._train_step(micro_batches(s, layout.dp_rank(rank), layout.dp)) for s in range(STEPS)]
    return {"losses": [loss.item() for loss, _, _ in results], "norms": [norm.item() for _, norm, _ in results],
            "state": {k: v.tolist() for k, v in full_state(model).items()}, **seen}


def scenario_cp(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """Context parallelism over every rank (cp = world size), or dp 2 x cp 2 on four and then cp 2 x tp 2 on the
    same four (``tp``; with sequence parallelism for two of the losses); the one-process reference without a process
    group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = plan_mesh(world, dp_size=args["dp"], cp_size=world // args["dp"]) if world > 1 else MeshLayout(1)
    result = {name: run(layout, *how) for name, how in LOSSES.items()}
    if args.get("tp"):
        tp_layout = plan_mesh(world, dp_size=1, cp_size=2, tp_size=2)
        result["tp2"] = {name: run(tp_layout, *how) for name, how in LOSSES.items()}
        result["tp2_sp"] = {name: run(tp_layout, *LOSSES[name], sequence_parallel=True)
                            for name in ("head", "fused_all_positions")}
    return result


if __name__ == "__main__":
    main(globals())
