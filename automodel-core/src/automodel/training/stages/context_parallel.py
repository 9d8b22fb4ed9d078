"""Slot ``context_parallel`` (``distributed.cp_size > 1``): each rank of a ``cp`` group holds a part of every
sequence and causal attention runs as torch's ring attention or the all-gather attention
(``distributed.cp_attention``; ``training/parallel/context_parallel.py``).

The stage makes the attention modules run without the model's mask and says which attention runs; the loop
(``ContextParallelSteps.sequence_parts``) splits each micro-batch and runs its forward and backward inside the
context-parallel region, or, pipelined, splits each batch before the schedule and each stage runs its layers in the
all-gather attention's region (``PipelineStageModel.forward``); FSDP2 shards over ``dp_shard x cp`` (the sharding
slot). Tensor parallelism composes over the mesh's ``tp`` dimension: each rank's attention runs on its
tensor-parallel heads (the keys and values gathered over its ``cp`` group only), the loss is vocabulary-parallel on
the split sequences, and sequence parallelism shards a rank's part further over ``tp``. Validation refuses what the
chosen attention cannot run (ring: not CUDA, sliding windows, recurrent layers; the all-gather attention runs
recurrent mixers on the whole rows, ``recurrent_layers.py``), recurrent model types (RWKV, xLSTM) and the
combinations this path does not handle, each with the reason.
"""

from __future__ import annotations

import torch

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.modules import unwrap
from automodel.training.parallel.blocks import is_pipeline_stage
from automodel.training.parallel.context_parallel import (
    built_attention_issue,
    causal_attention_without_mask,
    cp_attention,
    cp_issues,
    eager_issue,
    recurrent_issue,
    sliding_window_issue,
)
from automodel.training.parallel.multimodal_fsdp import multimodal_modules
from automodel.training.parallel.recurrent_layers import recurrent_mixers, run_on_whole_rows
from automodel.training.parallelism import model_hf_config, validation_device


def select(cfg: Config) -> tuple[str, str] | None:
    dist = cfg.distributed
    return ("cp_attention", "distributed.cp_size") if dist is not None and dist.cp_size > 1 else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    """What the chosen attention needs (ring: CUDA; both: the model's SDPA), and what the path does not compose
    with."""
    dist = cfg.distributed
    if dist is None or dist.cp_size == 1:
        return []
    cp = dist.cp_size
    attention = cfg.model.get("attn_implementation") if cfg.model is not None else None
    config = model_hf_config(cfg)
    chosen = cp_attention(cfg, validation_device(), config)
    found = cp_issues(validation_device(), cp, attention, attention=chosen)
    if dist.strategy != "fsdp2":
        found.append(ConfigIssue("distributed.strategy", f"{dist.strategy}: the {cp} context-parallel ranks of a "
                                 "batch hold partial gradients, which FSDP2 sums over dp x cp ranks; set "
                                 "distributed.strategy: fsdp2"))
    if dist.pp_size > 1 and chosen == "ring":
        found.append(ConfigIssue("distributed.cp_attention", f"ring with pp_size {dist.pp_size}: the pipeline "
                                 "schedule runs each micro-batch's backward outside the stage's forward, where torch's "
                                 "ring attention must hold both; set distributed.cp_attention: all_gather (any "
                                 "device; auto chooses it on CPU) or pp_size: 1"))
    if chosen == "ring" and config is not None and (why := sliding_window_issue(config)) is not None:
        found.append(ConfigIssue("distributed.cp_attention", f"ring: {why}"))
    if config is not None and (why := recurrent_issue(config, chosen)) is not None:
        found.append(ConfigIssue("distributed.cp_size", f"{cp}: {why}"))
    if attention == "eager" and config is not None and (why := eager_issue(config)) is not None:
        found.append(ConfigIssue("model.attn_implementation", why))
    if cfg.compile is not None and cfg.compile.enabled:
        found.append(ConfigIssue("compile.enabled", f"true with cp_size {cp}: the context-parallel region swaps "
                                 "torch.nn.functional.scaled_dot_product_attention for its own attention while it "
                                 "is entered, which a graph traced once does not follow; set it false"))
    return found


def attention(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The attention modules run without the model's mask (ring attention needs ``is_causal``; the all-gather
    attention builds its mask from the whole rows; a mask built from a rank's split positions would be wrong); the
    loop does the rest per micro-batch. A vision-language model's towers keep their attention: they see whole
    images on every rank."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    chosen = cp_attention(ctx.cfg, ctx.device, config)
    cp = ctx.mesh.cp
    # what validation could not read without the built model
    if chosen == "ring" and config is not None and (why := sliding_window_issue(config)) is not None:
        raise AutomodelError(f"distributed.cp_attention: ring: {why}")
    if (why := built_attention_issue(config, chosen)) is not None:
        raise AutomodelError(f"model.attn_implementation: {why}")
    if config is not None and (why := recurrent_issue(config, chosen)) is not None:
        raise AutomodelError(f"distributed.cp_size: {cp}: {why}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(text, "_attn_implementation", None)
    towers = multimodal_modules(inner, ctx.multimodal_names).values()
    mixers = recurrent_mixers(inner, config, towers) if config is not None else []
    hooked = causal_attention_without_mask(inner, [*towers, *mixers], none_is_fine=is_pipeline_stage(inner))
    whole = run_on_whole_rows(mixers)
    how = ("torch's ring attention" if chosen == "ring" else
           "all-gather attention (every rank's keys and values gathered, SDPA with an exact mask)")
    eager = ("; the model's eager attention runs as transformers' SDPA attention there (the same math), eager "
             "outside (validation, generation)" if implementation == "eager" else "")
    mixed = (f"; the {whole} recurrent mixers (Mamba, linear attention) run on the whole rows, gathered over the cp "
             "ranks, each rank keeping its part of their output" if whole else "")
    return model, (f"{hooked} attention modules run as {how} over cp {cp} (each sequence split into {2 * cp} "
                   f"chunks, rank r holding chunks r and {2 * cp - 1} - r){eager}{mixed}")
