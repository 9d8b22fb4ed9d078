"""Slot ``sharding``: data parallelism across torchrun ranks, as ``distributed.strategy`` says (ddp, fsdp2,
megatron_fsdp), over the device mesh's data-parallel dimension; acts only with more than one process.

FSDP2 shards a model built on the meta device and then materialises it, each rank only its shards
(``training/model_init.py``); a model its factory built in full (a factory without meta-device support) is sharded
as it is. HSDP (``dp_replicate_size > 1``) shards over the mesh's ``(dp_replicate, dp_shard)`` dimensions; with context
parallelism (``cp_size > 1``) ``dp_shard`` is joined with ``cp`` (``parallel/context_parallel.fsdp_mesh``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import replace

import torch

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel.gate_precision import routers_in_precision
from automodel.training.context import BuildContext
from automodel.training.dist import expected_world_size, world_size_source
from automodel.training.distributed_section import moe_head_fp32, moe_inner_root
from automodel.training.model_init import materialize_model, on_meta
from automodel.training.multimodal_section import frozen_sharding
from automodel.training.parallel.context_parallel import fsdp_mesh
from automodel.training.parallel.expert_parallel import expert_parameters
from automodel.training.parallel.fsdp import apply_fsdp2, inner_root_issue, kept_dtype_modules
from automodel.training.parallel.mesh import DP
from automodel.training.parallel.multimodal_fsdp import place_multimodal
from automodel.training.parallel.offload import offload_issues, offload_policy
from automodel.training.parallelism import parallel_issues, shards_with_fsdp2


def select(cfg: Config) -> tuple[str, str] | None:
    if cfg.distributed is None or expected_world_size() <= 1:
        return None
    return (cfg.distributed.strategy, "distributed.strategy")


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    """The mesh, precision and parallel sizes (training/parallelism.py), and (for the core's strategies) what a
    strategy needs that this machine lacks."""
    settings = cfg.distributed
    if settings is None:
        return []
    fsdp2 = shards_with_fsdp2(cfg, implementation, expected_world_size())
    found = parallel_issues(cfg, implementation) + offload_issues(cfg, implementation, fsdp2, world_size_source())
    if implementation is None and settings.strategy == "megatron_fsdp":
        missing = [what for what, ok in (("CUDA", torch.cuda.is_available()),
                                         ("the megatron_fsdp package", importlib.util.find_spec("megatron_fsdp")))
                   if not ok]
        if missing:
            found.append(ConfigIssue("distributed.strategy", f"megatron_fsdp needs {' and '.join(missing)}, which "
                                                             "this machine lacks; use fsdp2 or ddp"))
    return found


def wrap_ddp(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    from torch.nn.parallel import DistributedDataParallel

    model.to(ctx.device)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    group = ctx.device_mesh[DP].get_group() if ctx.device_mesh is not None else None
    options = ctx.cfg.distributed.ddp_options()
    given = ctx.cfg.distributed.ddp_options_given()
    described = f" ({', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""
    return (DistributedDataParallel(model, device_ids=device_ids, process_group=group, **options),
            f"DDP over {ctx.mesh.dp} ranks{described}")


def wrap_fsdp2(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``fully_shard`` per transformer block and at the root with the run's precision; then the meta-device model
    gets its values (each rank its shards only)."""
    meta = on_meta(model)
    offload = offload_policy(ctx.cfg, ctx.device)
    offloaded = offload is not None
    if not meta and not offloaded:  # offloaded shards stay in host memory (FSDP2 copies them for each gather)
        model.to(ctx.device)
    layout = ctx.mesh
    settings = ctx.cfg.distributed
    prefetch = ((settings.fsdp2_forward_prefetch_depth, settings.fsdp2_backward_prefetch_depth)
                if settings.enable_fsdp2_prefetch else None)
    experts = expert_parameters(model)
    head = fp32_head(model) if moe_head_fp32(settings) else None
    routers = routers_in_precision(model)
    kept = kept_dtype_modules(model, experts)
    own_dtype = {**kept, **routers, **({head: torch.float32} if head is not None else {})}
    outer_root = not moe_inner_root(settings)
    if not outer_root and inner_root_issue(model):
        raise AutomodelError(f"distributed.moe.wrap_outer_model: false: {inner_root_issue(model)}, so the inner "
                             "model cannot be the FSDP2 root alone; set it true")
    multimodal = place_multimodal(model, ctx.multimodal_names, frozen_sharding(ctx.cfg))
    blocks = apply_fsdp2(model, fsdp_mesh(ctx.device_mesh, layout), ctx.precision, prefetch,
                         settings.reshard_after_forward, ignored=experts or None, own_dtype=own_dtype,
                         outer_root=outer_root, multimodal=multimodal, offload=offload)
    how = (f"HSDP: {layout.dp_replicate} replicas x FSDP2 over {layout.dp_shard} ranks" if layout.dp_replicate > 1
           else f"FSDP2 over {layout.dp_shard} ranks")
    if layout.cp > 1:
        how += f" x context parallel over {layout.cp} (FSDP2 shards over dp_shard x cp)"
    if layout.tp > 1:
        how += (f" x tensor parallel over {layout.tp}" if ctx.splits_run_model
                else f", whole on each of the {layout.tp} tensor-parallel ranks (they read the same batch)")
    if experts:
        how += f", expert parameters ({len(experts)}) split by expert parallelism instead"
    gates = f"{len(routers)} routers in {_dtype_names(routers.values())} (model.backend.gate_precision)"
    details = [f"{blocks} blocks sharded"] + [f"{len(kept)} modules the model keeps in "
                                              f"{_dtype_names(kept.values())} as units of their own"] * bool(kept) \
        + ["the output head in fp32"] * (head is not None) + [gates] * bool(
        routers) + ["the inner model as root, the outer unsharded"] * (not outer_root) + multimodal.describe() \
        + ([f"shards offloaded to host memory{' (pinned)' if offload.pin_memory else ''}"] if offloaded else [])
    message = f"{how} ({', '.join(details)})"
    if meta:
        message += "; " + materialize_model(replace(ctx, device=torch.device("cpu")) if offloaded else ctx, model)
    return model, message


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))


def fp32_head(model: torch.nn.Module) -> torch.nn.Module:
    """The output head ``distributed.moe.lm_head_precision: float32`` keeps in fp32 (refused where it shares its
    weight with the input embeddings, which then run in the model's precision)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise AutomodelError(f"distributed.moe.lm_head_precision: {type(model).__name__} has no output head to keep "
                             "in float32; remove the key")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and embeddings.weight is head.weight:
        raise AutomodelError("distributed.moe.lm_head_precision: float32: the output head shares its weight with the "
                             "input embeddings (tie_word_embeddings), so it cannot run in its own precision; remove "
                             "the key or untie the embeddings")
    return head


wrap_fsdp2.shards_meta_models = True  # the pipeline leaves a meta-device model to it (it materialises after sharding)


def wrap_megatron_fsdp(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    import megatron_fsdp  # validated present before anything is built

    model.to(ctx.device)
    return megatron_fsdp.fully_shard(model), f"Megatron-FSDP over {ctx.mesh.dp} ranks"
