"""What the pipeline does to a model between freezing and sharding: pipeline stages, tensor parallelism, activation
checkpointing, and materialising a model built on the meta device (``automodel.meta_build``) where its sharding stage
does not do it itself.

A meta-device model gets its values in ``materialize_model``, on every rank, each rank only its shards: read in
slices from the checkpoint being resumed (its ``model/`` directory: full weights, or a LoRA adapter over the base
model's), then from the pretrained safetensors the model factory named, and whatever neither holds is initialised
module by module from the seed (``automodel.training.parallel.materialize``): one process and N ranks start from
the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from automodel.errors import AutomodelError, ConfigError
from automodel.fused_experts import expert_count, experts_modules
from automodel.hf import is_adapter_dir
from automodel.mtp.pipeline import carry_heads
from automodel.training.checkpoint import RESUME_ELSEWHERE, CheckpointError, mismatch_message
from automodel.training.context import BuildContext
from automodel.training.distributed_section import moe_saves_routing
from automodel.training.memory_fit import check_fits
from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing
from automodel.training.parallel.expert_parallel import (
    apply_expert_parallel,
    build_expert_mesh,
    experts_issues,
)
from automodel.training.parallel.hf_export import export_names
from automodel.training.parallel.materialize import (
    WeightSource,
    compare_keys,
    hf_checkpoint_key,
    materialize,
)
from automodel.training.parallel.multimodal_fsdp import multimodal_modules
from automodel.training.parallel.pipeline_parallel import PipelineSettings, pp_issues, split_for_pipeline
from automodel.training.parallel.pipeline_stages import PipelineStageModel
from automodel.training.parallel.pipeline_tied import TiedHead, frozen_embedding_key, head_copy_sources, untie_head
from automodel.training.parallel.tensor_parallel import apply_tensor_parallel, tp_issues


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is still on the meta device (no values yet)."""
    return any(p.is_meta for p in model.parameters())


def checkpoint_activations(ctx: BuildContext, model: torch.nn.Module) -> str:
    """``distributed.activation_checkpointing``: wrap every transformer block; a model without any is an error."""
    saves_routing = moe_saves_routing(ctx.cfg.distributed)
    selective = ctx.cfg.distributed.activation_checkpointing == "selective"
    count = apply_activation_checkpointing(model, save_routing=saves_routing, selective=selective,
                                           skip=multimodal_modules(model, ctx.multimodal_names).values(),
                                           split_region=ctx.mesh.pp > 1 and ctx.mesh.cp > 1)
    if count == 0:
        raise AutomodelError(f"distributed.activation_checkpointing: {type(model).__name__} has no repeated "
                             "transformer blocks (a ModuleList of layers of one type) to checkpoint; set it to "
                             "false for this model")
    if selective:
        return (f"selective activation checkpointing on {count} transformer blocks (attention and every other "
                "matmul kept, the rest recomputed)")
    routing = " (the routing top-k saved, not recomputed)" if saves_routing else ""
    return f"activation checkpointing on {count} transformer blocks{routing}"


def tensor_parallelize(ctx: BuildContext, model: torch.nn.Module, vocab_parallel: bool = True) -> str:
    """``distributed.tp_size > 1``: shard the model's projections over the mesh's ``tp`` dimension (before
    activation checkpointing and FSDP2); its sizes are checked first, as validation does where it could not read
    the model's config. ``vocab_parallel``: False for a model whose whole logits are read (a draft recipe's
    target)."""
    settings = ctx.cfg.distributed
    config = getattr(model, "config", None)
    if config is not None:
        found = tp_issues(config, settings.tp_size, settings.sequence_parallel)
        if found:
            raise ConfigError(found)
    applied = apply_tensor_parallel(model, ctx.device_mesh["tp"], sequence_parallel=settings.sequence_parallel,
                                    vocab_parallel=vocab_parallel)
    return "\n".join(applied.describe())


def pipeline_stages(ctx: BuildContext, model: torch.nn.Module) -> tuple[list[PipelineStageModel], str]:
    """``distributed.pp_size > 1``: this rank's stages of the (meta-device) model (several with an interleaved
    schedule), under the model's own names; the rest of the pipeline (tensor parallelism, FSDP2 over ``dp``,
    materialisation) treats each as a whole model."""
    settings = ctx.cfg.distributed
    pipeline = PipelineSettings.from_section(settings.pipeline)
    config = getattr(model, "config", None)
    if config is not None:
        found = pp_issues(config, settings.pp_size, pipeline, ctx.batch.micro_batch_size)
        if found:
            raise ConfigError(found)
    # a tied head: a weight of its own on the last stage, trained where the embedding is (see tie_stages)
    untied = untie_head(model, trainable=frozen_embedding_key(ctx.cfg) is None)
    stages = split_for_pipeline(model, ctx.device_mesh["pp"], pipeline)
    if untied:  # the pair, for tie_stages, the checkpoint loaders and the training step
        tied = TiedHead(stages, dist.get_process_group_ranks(ctx.device_mesh["pp"].get_group()), ctx.device)
        for stage in stages:
            stage.tied_head = tied
    carry_heads(model, stages)  # MTP heads: the first stage's future-token embeddings travel to the last
    described = []
    for stage in stages:
        first, last = stage.layer_range.start, stage.layer_range.stop - 1
        media = [name.rsplit(".", 1)[-1] for name in stage.media_modules]  # a composite model's vision tower, ...
        held = media + ["embedding"] * stage.is_first + [f"layers {first}-{last}"] + ["norm, head"] * stage.is_last
        described.append((stage.index, " + ".join(held)))
    total = stages[0].num_stages
    if len(stages) == 1:
        (index, held), = described
        where = f"stage {index} of {total} on this rank ({held})"
    else:
        where = f"stages {', '.join(f'{index} ({held})' for index, held in described)} of {total} on this rank"
    return stages, f"pipeline {where}, {pipeline.schedule} schedule"


def tie_stages(stages: list[PipelineStageModel]) -> str | None:
    """Once the stages hold values: the last stage's copy of a tied output head (the stages' ``tied_head``, made
    at the cut) made the first stage's input embedding (``pipeline_tied``); every rank of the pipeline calls it.
    The log line, None where nothing is tied."""
    tied = getattr(stages[0], "tied_head", None)
    if tied is None:
        return None
    tied.copy_weight()
    kept = "both train, their gradients summed at each step" if tied.trains else "both frozen"
    return f"the output head (tied to the input embedding) is the first stage's embedding, sent to the last stage " \
        f"({kept})"


def expert_parallelize(ctx: BuildContext, model: torch.nn.Module) -> str:
    """``distributed.ep_size > 1``: split the experts of every MoE layer over the ep groups of the data- (and
    context-) parallel ranks (before activation checkpointing and FSDP2, which then leaves them alone); the model's
    experts are checked first, as validation does where it could not build the model."""
    ep_size = ctx.cfg.distributed.ep_size
    stage_without_experts = ctx.mesh.pp > 1 and not experts_modules(model)  # say, a stage of dense first layers
    found = [] if stage_without_experts else experts_issues(model, ep_size)
    if found:
        raise ConfigError(found)
    mesh = build_expert_mesh(ctx.world_size, ep_size, ctx.device.type, ctx.mesh.pp)  # collective: every stage
    if stage_without_experts:
        return f"expert parallel over ep {ep_size}: no experts module in this pipeline stage"
    reduced_over = ctx.mesh.dp * ctx.mesh.cp  # the ranks FSDP2 averages the other gradients over
    names = apply_expert_parallel(model, mesh, reduced_over)
    experts = expert_count(model.get_submodule(names[0]))
    groups = reduced_over // ep_size
    stage = " of this pipeline stage" if ctx.mesh.pp > 1 else ""
    return (f"expert parallel over ep {ep_size} ({groups} group{'s' if groups > 1 else ''} of consecutive ranks"
            f"{stage}): {len(names)} experts modules, each rank holds {experts // ep_size} of {experts} experts")


def _restore_source(ctx: BuildContext, model: torch.nn.Module) -> WeightSource | None:
    """The resumed checkpoint's ``model/`` as a weight source, checked to fit the model exactly."""
    directory = ctx.restore_path / "model" if ctx.restore_path is not None else None
    if directory is None or not any(directory.glob("*.safetensors")):
        return None  # a sharded-only checkpoint: its weights are restored with the rest of the state
    meta = ctx.meta_build
    if is_adapter_dir(directory):
        if not hasattr(model, "peft_config"):
            raise AutomodelError(f"restore_from.path: '{directory}' holds a LoRA adapter but this config has no "
                                 "peft: section; add the same peft: settings as the run that wrote it")
        saved = export_names(model)[1]  # model key -> its key in peft's adapter file, by peft's own naming

        def adapter_key(name: str) -> str:
            return saved.get(name, name)

        missing, unexpected, mismatched = compare_keys(model, directory, adapter_key, include=saved.__contains__)
        source: WeightSource = (directory, adapter_key)
        question = "is restore_from.path the same architecture with the same peft: settings?"
    else:
        key = meta.checkpoint_key if meta is not None and meta.checkpoint_key else hf_checkpoint_key
        missing, unexpected, mismatched = compare_keys(model, directory, key)
        source = (directory, key)
        question = "is restore_from.path the same architecture?"
    if ctx.mesh.pp > 1:
        unexpected = []  # a pipeline stage holds only its own layers of the model/ that holds them all
        copies = head_copy_sources(model)  # a tied model's checkpoint: the head copy is sent the embedding's values
        missing = [name for name in missing if name not in copies]
    if missing or unexpected or mismatched:
        raise AutomodelError(mismatch_message(directory, mismatched, unexpected, missing, question))
    return source


def _checkpoint_error(ctx: BuildContext, err: AutomodelError) -> None:
    """Re-raise ``err``; a damaged file of the checkpoint being resumed also says how to go on."""
    if ctx.restore_path is not None and str(ctx.restore_path) in str(err) and not isinstance(err, CheckpointError):
        raise CheckpointError(f"{err}; {RESUME_ELSEWHERE}") from None
    raise err


def _optimizer_section(ctx: BuildContext) -> tuple[str | None, dict]:
    """The optimizer's target and settings the run will build: its section, else the recipe's default."""
    node = ctx.cfg.get("optimizer")
    if node is not None:
        return node.target, node.to_dict()
    default = dict(getattr(ctx.sections.get("optimizer"), "default", None) or {})
    return default.get("_target_"), default


def materialize_model(ctx: BuildContext, model: torch.nn.Module) -> str:
    """Give a meta-device ``model`` its values on ``ctx.device`` (see the module docstring); returns the log line."""
    meta = ctx.meta_build
    try:
        sources = [s for s in (_restore_source(ctx, model),) if s is not None]
    except AutomodelError as err:
        _checkpoint_error(ctx, err)
    if meta is not None and meta.weights is not None:
        sources.append((meta.weights, meta.checkpoint_key or hf_checkpoint_key))
    seed = meta.seed if meta is not None and meta.seed is not None else ctx.seed
    check_fits(model, ctx.device, *_optimizer_section(ctx))
    try:
        report = materialize(model, ctx.device, seed, sources)
    except AutomodelError as err:
        _checkpoint_error(ctx, err)
    read = ", ".join(str(Path(d)) for d, _ in sources) or "no files"
    line = (f"materialised on {ctx.device}: {len(report.loaded)} tensors read from {read}, "
            f"{len(report.initialised)} initialised module by module from seed {seed}")
    if ctx.world_size > 1:
        line += " (each rank only its own shards)"
    if report.unused:
        line += f"; {len(report.unused)} tensors of the files are not used ({', '.join(report.unused[:3])}"
        line += ", ...)" if len(report.unused) > 3 else ")"
    return line
