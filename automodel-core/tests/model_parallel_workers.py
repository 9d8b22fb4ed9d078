"""Scenarios of model parallelism (tensor, sequence, pipeline, context parallel; mixed with FSDP2) that the tests
run on 2 and 4 gloo ranks (``model_parallel_ranks`` in conftest.py), and the engine-like training step they share
with the single-process side of each comparison.

The step is the engine's (training/loop.py ``train_step``): the loss summed over label tokens (the LLM recipe's
``next_token_logits`` + ``MaskedCrossEntropy``), divided by the step's label tokens counted over the data-parallel
ranks, the data-parallel size undoing FSDP2's gradient average; the ranks of one tensor-parallel group or pipeline
read the same rows. AdamW runs at ``LR`` 1e-3: Adam turns tensor parallelism's different summation order into
update differences of the order of the learning rate where a gradient is near zero; at 1e-3 the weights stay within
1e-5 of the single process after six steps (at 1e-2 some drift to 8e-5). Run as ``python model_parallel_workers.py
<scenario> <json args> <result file>``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from parallel_workers import device, full_state, main, meta_model, sharded_model, tiny_config

from automodel.training.linear_ce import LinearCrossEntropy, LinearLossHead
from automodel.training.loss import IGNORE_INDEX, MaskedCrossEntropy
from automodel.training.next_token import next_targets, next_token_logits
from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing
from automodel.training.parallel.context_parallel import (
    ContextParallelBatch,
    causal_attention_without_mask,
    context_parallel_region,
    fsdp_mesh,
)
from automodel.training.parallel.fsdp import apply_fsdp2
from automodel.training.parallel.grad_norm import clip_grad_norm_
from automodel.training.parallel.hf_export import export_hf
from automodel.training.parallel.materialize import materialize
from automodel.training.parallel.mesh import build_device_mesh, data_parallel_mesh, plan_mesh
from automodel.training.parallel.pipeline_parallel import Pipeline, PipelineSettings, StagePipelines, split_for_pipeline
from automodel.training.parallel.pipeline_static import StaticShapes
from automodel.training.parallel.sharded_checkpoint import load_sharded_state, save_sharded_state
from automodel.training.parallel.tensor_parallel import apply_tensor_parallel, local_loss

VOCAB, SEQ, ROWS, STEPS, RESUMED = 96, 16, 4, 6, 2  # a vocabulary and heads that two ranks divide
SMALL_FILES = 20_000
LR = 1e-3


def mp_config(tied: bool = True):
    return tiny_config(tied=tied, layers=4, vocab=VOCAB)


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels, about a third of the labels ignored (rows carry different token counts)."""
    generator = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels = ids.masked_fill(torch.rand(ROWS, SEQ, generator=generator) < 0.35, IGNORE_INDEX)
    return ids, labels


def loss_sum(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The LLM recipe's ``compute_loss``: the next-token loss summed over the label tokens."""
    logits, targets = next_token_logits(model, {"input_ids": ids}, labels, None, None)
    return MaskedCrossEntropy()(logits, targets)


def logits_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same on a pipeline's last-stage logits."""
    return MaskedCrossEntropy()(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


@dataclass
class Place:
    """Where this rank reads data and reduces: its data-parallel group (None: one process) and pipeline group."""

    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Any = None
    pp_group: Any = None


def train(run, params: list, optimizers: list, place: Place, steps: int, first_step: int = 0,
          micro_batches: int = 1) -> dict[str, list[float]]:
    """``steps`` optimizer steps; ``run(ids, labels, scale)`` does forward and backward of one micro-batch and
    returns its summed loss. Losses and gradient norms of every step."""
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        ids, labels = lm_batch(step)
        rows = slice(place.dp_rank * ROWS // place.dp_size, (place.dp_rank + 1) * ROWS // place.dp_size)
        ids, labels = ids[rows].to(device()), labels[rows].to(device())
        tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        if place.dp_group is not None:
            dist.all_reduce(tokens, group=place.dp_group)
        scale = place.dp_size / tokens.item()
        total = torch.zeros((), device=device())
        for part_ids, part_labels in zip(ids.chunk(micro_batches), labels.chunk(micro_batches), strict=True):
            total += run(part_ids, part_labels, scale)
        if place.dp_group is not None:
            dist.all_reduce(total, group=place.dp_group)
        norms.append(clip_grad_norm_(params, math.inf, pp_group=place.pp_group).item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(total.item() / tokens.item())
    return {"losses": losses, "norms": norms}


def assert_like_one_process(ranks: list[dict[str, list[float]]], expected: dict[str, list[float]],
                            steps: int = STEPS, rtol: float = 1e-4) -> None:
    """Every rank reports the same losses, and the first ``steps`` losses and gradient norms equal the
    single-process run's."""
    assert all(rank["losses"] == ranks[0]["losses"] for rank in ranks)
    for key in ("losses", "norms"):
        assert len(ranks[0][key]) == steps and ranks[0][key] == pytest.approx(expected[key][:steps], rel=rtol), key


def model_runner(model: torch.nn.Module, tp: Any = None):
    def run(ids: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        with tp.loss_context() if tp is not None else contextlib.nullcontext():
            loss = local_loss(loss_sum(model, ids, labels))
            (loss * scale).backward()
        return loss.detach().float()

    return run


def reference(config, steps: int = STEPS + RESUMED) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """One process, two micro-batches per step (the accumulation dp=2 replaces); the weights after ``STEPS``."""
    from parallel_workers import local_model

    model = local_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    result = train(model_runner(model), list(model.parameters()), [optimizer], Place(), min(steps, STEPS),
                   micro_batches=2)
    state = full_state(model)
    more = train(model_runner(model), list(model.parameters()), [optimizer], Place(), max(0, steps - STEPS), STEPS, 2)
    return {key: result[key] + more[key] for key in result}, state


def _mesh(**sizes: int):
    layout = plan_mesh(dist.get_world_size(), **sizes)
    return layout, build_device_mesh(layout, device().type)


def _place(mesh, layout, pp: bool = False) -> Place:
    dp = mesh["dp"]
    return Place(layout.dp, dp.get_local_rank(), dp.get_group() if layout.dp > 1 else None,
                 mesh["pp"].get_group() if pp else None)


def tp_model(config, mesh, layout, sequence_parallel: bool = False, fsdp: bool = False, checkpointing: bool = False):
    """The build order: meta -> TP -> activation checkpointing -> FSDP2 -> materialise."""
    model = meta_model(config)
    tp = apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
    if checkpointing:
        apply_activation_checkpointing(model)
    if fsdp:
        apply_fsdp2(model, data_parallel_mesh(mesh, layout))
    materialize(model, device(), 7)
    return model, tp


def train_tp(config, mesh, layout, out: Path | None = None, **options: Any) -> dict[str, Any]:
    """Six steps under TP (and FSDP2 over dp); with ``out`` a sharded checkpoint and its HF export after them."""
    model, tp = tp_model(config, mesh, layout, **options)
    seen: list[int] = []
    model.model.layers[1].input_layernorm.register_forward_pre_hook(  # before SP's hook: the local tensor
        lambda m, args: seen.append(args[0].shape[1]), prepend=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    place = _place(mesh, layout)
    result = train(model_runner(model, tp), list(model.parameters()), [optimizer], place, STEPS)
    result.update(norm_sequence=seen[0], plan=tp.describe(), vocab_parallel=tp.vocab_parallel,
                  q_proj=[repr(p) for p in model.model.layers[0].self_attn.q_proj.weight.placements],
                  tied=model.lm_head.weight is model.model.embed_tokens.weight)
    if out is not None:
        save_sharded_state(out, model, optimizer, max_file_bytes=SMALL_FILES)
        export_hf(out, out.with_name(out.name + "_model"), max_file_bytes=SMALL_FILES)
    return result


def resume_fsdp(checkpoint: Path, mesh, layout) -> dict[str, list[float]]:
    """A checkpoint of another layout loaded into FSDP2 over every rank (dp = world), trained on."""
    model = sharded_model(mp_config(), seed=99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    load_sharded_state(checkpoint, model, optimizer)
    return train(model_runner(model), list(model.parameters()), [optimizer], _place(mesh, layout), RESUMED, STEPS)


# ---- scenarios ------------------------------------------------------------------------------------------------


def scenario_two(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """On 2 ranks: tp=2 (with a checkpoint resumed by dp=2), tp=2 with sequence parallelism, Qwen3 under tp=2,
    pp=2 with each schedule (with a checkpoint resumed by pp=2), pp=2 with static stage shapes (with
    MaskedCrossEntropy and with FusedLinearCrossEntropy), context-parallel sharding."""
    layout, mesh = _mesh(tp_size=2)
    result = {"tp": train_tp(mp_config(), mesh, layout, out / "tp_ckpt"),
              "tp_sp": train_tp(mp_config(), mesh, layout, sequence_parallel=True)}
    qwen, qwen_tp = tp_model(qwen3_config(), mesh, layout)
    qwen_optimizer = torch.optim.AdamW(qwen.parameters(), lr=LR)
    result["tp_qwen3"] = train(model_runner(qwen, qwen_tp), list(qwen.parameters()), [qwen_optimizer], Place(), 3)
    dp_layout, dp_mesh = _mesh()
    result["tp_to_dp2"] = resume_fsdp(out / "tp_ckpt", dp_mesh, dp_layout)
    pp_layout, pp_mesh = _mesh(pp_size=2)
    for schedule, micro_batches in (("gpipe", 2), ("1f1b", 1), ("interleaved1f1b", 1), ("loopedbfs", 1)):
        checkpoint = out / "pp_ckpt" if schedule == "1f1b" else None
        result[f"pp_{schedule}"] = train_pp(pp_mesh, pp_layout, schedule, micro_batches, checkpoint)
    result["pp_static"] = train_pp(pp_mesh, pp_layout, "gpipe", 2, static=True, each_length=True)
    result["pp_fused"] = train_pp(pp_mesh, pp_layout, "gpipe", 2, static=True, fused=True)
    result["cp"] = context_parallel_split(_mesh(cp_size=2)[1])
    return result


def scenario_four(args: dict[str, Any], out: Path) -> dict[str, Any]:
    """On 4 ranks: dp=2 x tp=2 (with and without sequence parallelism, the latter with activation checkpointing; a
    checkpoint resumed by dp=4), pp=2 x dp=2 (with activation checkpointing), pp=2 x tp=2 (interleaved, sequence
    parallel; with MaskedCrossEntropy and with FusedLinearCrossEntropy), pp=2 x cp=2 (1F1B; interleaved with static
    shapes)."""
    layout, mesh = _mesh(tp_size=2)
    result = {"dp2_tp2": train_tp(mp_config(), mesh, layout, out / "dp2_tp2_ckpt", fsdp=True),
              "dp2_tp2_sp": train_tp(mp_config(), mesh, layout, sequence_parallel=True, fsdp=True, checkpointing=True)}
    dp_layout, dp_mesh = _mesh()
    result["dp2_tp2_to_dp4"] = resume_fsdp(out / "dp2_tp2_ckpt", dp_mesh, dp_layout)
    pp_layout, pp_mesh = _mesh(pp_size=2)
    result["pp2_dp2"] = train_pp(pp_mesh, pp_layout, "1f1b", 1, fsdp=True)
    result["pp2_dp2_deferred"] = train_pp(pp_mesh, pp_layout, "gpipe", 2, fsdp=True, defer=True)
    pp_tp_layout, pp_tp_mesh = _mesh(pp_size=2, tp_size=2)
    result["pp2_tp2"] = train_pp(pp_tp_mesh, pp_tp_layout, "interleaved1f1b", 1, tp=True)
    result["pp2_tp2_fused"] = train_pp(pp_tp_mesh, pp_tp_layout, "interleaved1f1b", 1, tp=True, fused=True)
    pp_cp_layout, pp_cp_mesh = _mesh(pp_size=2, cp_size=2)
    result["pp2_cp2"] = train_pp_cp(pp_cp_mesh, pp_cp_layout, "1f1b")
    result["pp2_cp2_static"] = train_pp_cp(pp_cp_mesh, pp_cp_layout, "interleaved1f1b", static=True)
    return result


def pp_stages(mesh, layout, settings: PipelineSettings, seed: int = 7, fsdp: bool = False, tp: bool = False
              ) -> list:
    """The stages as the build pipeline makes them; with ``fsdp`` checkpointed and sharded over ``dp_shard`` (x
    ``cp``, whose recomputation re-enters the context-parallel region of the forward), their attention then run
    without the model's mask in that region."""
    stages = split_for_pipeline(meta_model(mp_config(tied=False)), mesh["pp"], settings)
    for stage in stages:
        if tp:
            apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=True)
        if fsdp:
            apply_activation_checkpointing(stage, split_region=layout.cp > 1)
            apply_fsdp2(stage, fsdp_mesh(mesh, layout))
        materialize(stage, device(), seed)
        if layout.cp > 1:
            causal_attention_without_mask(stage)
    return stages


def train_pp(mesh, layout, schedule: str, micro_batches: int, checkpoint: Path | None = None,
             fsdp: bool = False, tp: bool = False, defer: bool = False, static: bool = False,
             fused: bool = False, each_length: bool = False) -> dict[str, Any]:
    """Six steps through the pipeline; with ``checkpoint``: saved, exported, resumed by fresh stages; ``defer``:
    FSDP2 reduces the gradients after each step's last micro-batch only, the parameters kept gathered until then
    (what was seen after the other micro-batches in ``result["deferred"]``); ``static``: the stages built with
    static shapes (``pp_seq_len``), the mode torch's stages ran in in ``result["modes"]``, and the stages' final
    weights in ``result["weights"]``; ``each_length``: the shapes of each batch's own length (``dtype`` without
    ``pp_seq_len``), through the recipe's ``StagePipelines``; ``fused``: FusedLinearCrossEntropy as the LLM recipe
    runs it pipelined."""
    settings = PipelineSettings(pp_schedule=schedule)
    rows = ROWS // layout.dp // micro_batches
    stages = pp_stages(mesh, layout, settings, fsdp=fsdp, tp=tp)
    hidden = mp_config().hidden_size
    length = None if each_length else SEQ
    shapes = StaticShapes(length, hidden, VOCAB, torch.float32, torch.float32, head_in_loss=fused) if static else None
    loss_sum = fused_loss_sum(stages) if fused else logits_loss_sum
    pipes = StagePipelines(stages, mesh["pp"], device(), settings, loss_sum, shapes) if each_length else None
    pipe = None if each_length else Pipeline(stages, mesh["pp"], device(), settings, rows, loss_sum, shapes)
    optimizers = [torch.optim.AdamW(stage.parameters(), lr=LR) for stage in stages]
    params = [p for stage in stages for p in stage.parameters()]
    place = _place(mesh, layout, pp=True)
    seen: list[dict[str, bool]] = []
    run = _deferring(pipe, params, micro_batches, seen) if defer else (pipes or pipe).step
    result = train(run, params, optimizers, place, STEPS, micro_batches=micro_batches)
    result["deferred"] = seen
    result["layers"] = [list(stage.layer_range) for stage in stages]
    built = list(pipes._pipelines.values()) if each_length else [pipe]
    result["modes"] = [each._inference_mode.name for one in built for each in one.runs]
    if static:
        result["weights"] = {name: value.tolist() for stage in stages for name, value in full_state(stage).items()}
    if checkpoint is None:
        return result
    save_sharded_state(checkpoint, stages, optimizers, max_file_bytes=SMALL_FILES)
    export_hf(checkpoint, checkpoint.with_name(checkpoint.name + "_model"), max_file_bytes=SMALL_FILES)
    result["names"] = sorted(stages[0].state_dict())
    fresh = pp_stages(mesh, layout, settings, seed=99)
    fresh_optimizers = [torch.optim.AdamW(stage.parameters(), lr=LR) for stage in fresh]
    load_sharded_state(checkpoint, fresh, fresh_optimizers)
    fresh_pipe = Pipeline(fresh, mesh["pp"], device(), settings, rows, logits_loss_sum)
    resumed = train(fresh_pipe.step, [p for s in fresh for p in s.parameters()], fresh_optimizers, place, RESUMED,
                    STEPS, micro_batches)
    result["resumed"] = resumed["losses"]
    return result


def train_pp_cp(mesh, layout, schedule: str, static: bool = False) -> dict[str, Any]:
    """Six steps of pp=2 x cp=2 as the engine runs them: each batch split over the cp ranks before the schedule
    (``StagePipelines`` with the cp mesh), each stage's attention gathered over its cp group, FSDP2 over ``dp_shard
    x cp``; the loss of the rank's part of the next-token targets (no shift) scaled by ``cp / tokens`` (FSDP2
    averages over the cp ranks) and summed over the cp ranks. ``static``: the stages' static shapes of each
    batch's own length, the rank's part of it. The stages' final weights in ``result["weights"]``; the
    validation loss of the first step's batch (whole sequences) before training in ``result["evaluated"]``."""
    settings = PipelineSettings(pp_schedule=schedule)
    stages = pp_stages(mesh, layout, settings, fsdp=True)
    cp = mesh["cp"]
    shapes = StaticShapes(None, mp_config().hidden_size, VOCAB, torch.float32, torch.float32, cp=2) if static else None
    pipes = StagePipelines(stages, mesh["pp"], device(), settings, split_loss_sum, shapes, cp)

    def run(ids: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        loss = pipes.step(ids, labels, scale * cp.size())
        dist.all_reduce(loss, group=cp.get_group())
        return loss

    ids, labels = lm_batch(0)  # validation before training: whole sequences, the first step's loss
    evaluated = pipes.evaluate(ids.to(device()), labels.to(device())) / (labels[:, 1:] != IGNORE_INDEX).sum()
    optimizers = [torch.optim.AdamW(stage.parameters(), lr=LR) for stage in stages]
    params = [p for stage in stages for p in stage.parameters()]
    result = train(run, params, optimizers, _place(mesh, layout, pp=True), STEPS)
    result["evaluated"] = evaluated.item()
    result["modes"] = [each._inference_mode.name for (training, _), one in pipes._pipelines.items() if training
                       for each in one.runs]
    result["weights"] = {name: value.tolist() for stage in stages for name, value in full_state(stage).items()}
    return result


def split_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The pipelined loss of a rank's part of the sequences: its targets are the next tokens' already."""
    return MaskedCrossEntropy()(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def fused_loss_sum(stages: list):
    """The LLM recipe's pipelined FusedLinearCrossEntropy (``NextTokenLogits.attach_loss_head`` and
    ``pipeline_loss``): the last stage returns its final hidden states and the loss projects them through its head,
    5 rows at a time."""
    last = next((stage for stage in stages if stage.is_last), None)
    head = None
    if last is not None:
        last.head_in_loss = True
        head = LinearLossHead.attach(last, LinearCrossEntropy(chunk_len=5), last.output_head)

    def loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return head.summed(hidden, next_targets(labels))

    return loss


def _deferring(pipe: Pipeline, params: list, micro_batches: int, seen: list[dict[str, bool]]):
    """``pipe.step`` reducing FSDP2's gradients at a step's last micro-batch only, keeping the parameters gathered
    before it; after each other micro-batch, whether the (sharded) parameters got gradients (they must not yet) and
    whether the stage's parameters are the gathered ones (FSDP2 swaps them in while unsharded)."""
    from torch.distributed.tensor import DTensor

    calls = iter(range(10**6))

    def run(ids: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        last = next(calls) % micro_batches == micro_batches - 1
        loss = pipe.step(ids, labels, scale, reduce_grads=last, keep_gathered=not last)
        if not last:
            held = [p for stage in pipe.stages for p in stage.parameters()]
            seen.append({"reduced": any(p.grad is not None for p in params),
                         "gathered": not any(isinstance(p, DTensor) for p in held)})
        return loss

    return run


def context_parallel_split(mesh) -> dict[str, Any]:
    """Each cp rank's part of a batch (tokens, positions, targets), and whether torch's ring attention runs on
    this device."""
    ids, labels = lm_batch(0)
    batch = ContextParallelBatch.from_labels(ids, labels)
    result: dict[str, Any] = {"global_tokens": batch.label_tokens(), "fsdp_mesh": fsdp_mesh(mesh, plan_mesh(
        2, cp_size=2)).mesh_dim_names}
    model = meta_model(tiny_config(layers=1, vocab=VOCAB))
    materialize(model, device(), 7)
    result["hooked"] = causal_attention_without_mask(model)
    with context_parallel_region(mesh["cp"], batch):
        result.update(ids=batch.input_ids.tolist(), positions=batch.position_ids.tolist(),
                      targets=batch.targets.tolist(), tokens=batch.label_tokens())
        try:
            model(input_ids=batch.input_ids, position_ids=batch.position_ids)
            result["forward"] = "ran"
        except NotImplementedError as err:
            result["forward"] = str(err)
    return result


if __name__ == "__main__":
    main(globals())
