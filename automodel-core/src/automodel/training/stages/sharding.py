"""Slot ``sharding``: data parallelism across torchrun ranks, as ``distributed.strategy`` says (ddp, fsdp2,
megatron_fsdp); acts only under torchrun with more than one process."""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.dist import world_size


def select(cfg: Config) -> tuple[str, str] | None:
    if cfg.distributed is None or world_size() <= 1:
        return None
    return (cfg.distributed.strategy, "distributed.strategy")


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    """Unsupported sizes, and (for the core's strategies) what a strategy needs that this machine lacks."""
    settings = cfg.distributed
    if settings is None:
        return []
    found = [ConfigIssue(f"distributed.{name}", f"{getattr(settings, name)} is not supported yet; only data "
                                                "parallelism (dp_size) is")
             for name in ("tp_size", "pp_size") if getattr(settings, name) > 1]
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
    return DistributedDataParallel(model, device_ids=device_ids), f"DDP over {dist.get_world_size()} ranks"


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest ModuleList of identical layer types (transformer blocks): each becomes one FSDP unit."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best) and len({type(m) for m in module}) == 1:
            best = list(module)
    return best


def wrap_fsdp2(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (dist.get_world_size(),))
    blocks = repeated_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, f"FSDP2 over {dist.get_world_size()} ranks ({len(blocks)} blocks sharded)"


def wrap_megatron_fsdp(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    import megatron_fsdp  # validated present before anything is built

    model.to(ctx.device)
    return megatron_fsdp.fully_shard(model), f"Megatron-FSDP over {dist.get_world_size()} ranks"
