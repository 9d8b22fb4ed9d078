"""torch.distributed plumbing: process group, token-weighted reductions, data sharding, sharding stages."""

from __future__ import annotations

import datetime
import importlib.util
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from automodel.errors import ConfigIssue

if TYPE_CHECKING:
    from automodel.training.recipe import TrainRecipe


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_process_group(backend: str | None, timeout_minutes: int, log: Any) -> None:
    """Join the torchrun job (nccl on CUDA, gloo on CPU; a configured nccl without CUDA falls back to gloo)."""
    if world_size() <= 1 or dist.is_initialized():
        return
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl" and not torch.cuda.is_available():
        log("dist_env.backend: nccl needs CUDA; using gloo on this CPU machine")
        chosen = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(chosen, timeout=datetime.timedelta(minutes=timeout_minutes))


def all_reduce_sum(*values: float | int | torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Sum scalars over ranks in one collective (identity in a single process)."""
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if is_distributed():
        dist.all_reduce(tensor)
    return list(tensor.unbind())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any (so all ranks stop at the same step)."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def distributed_sampler(dataset: Any, shuffle: bool, seed: int) -> Any:
    """Each rank reads its own shard; resumable (torchdata's stateful sampler)."""
    if not is_distributed():
        return None
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    return StatefulDistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                      shuffle=shuffle, seed=seed, drop_last=True)


# ---- sharding stages --------------------------------------------------------------------------------------


def wrap_ddp(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    from torch.nn.parallel import DistributedDataParallel

    model.to(recipe.device)
    device_ids = [recipe.device.index] if recipe.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids), f"DDP over {dist.get_world_size()} ranks"


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Repeated transformer blocks (a ModuleList of identical layer types): each becomes one FSDP unit."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            if len({type(m) for m in module}) == 1:
                best = list(module)
    return best


def wrap_fsdp2(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.to(recipe.device)
    mesh = init_device_mesh(recipe.device.type, (dist.get_world_size(),))
    blocks = _blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, f"FSDP2 over {dist.get_world_size()} ranks ({len(blocks)} blocks sharded)"


def wrap_megatron_fsdp(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    import megatron_fsdp  # validated present before anything is built

    model.to(recipe.device)
    return megatron_fsdp.fully_shard(model), f"Megatron-FSDP over {dist.get_world_size()} ranks"


def strategy_issues(strategy: str) -> list[ConfigIssue]:
    """What a strategy needs that this machine lacks (checked at validation)."""
    if strategy == "megatron_fsdp":
        missing = [what for what, ok in (("CUDA", torch.cuda.is_available()),
                                         ("the megatron_fsdp package", importlib.util.find_spec("megatron_fsdp")))
                   if not ok]
        if missing:
            return [ConfigIssue("distributed.strategy", f"megatron_fsdp needs {' and '.join(missing)}, which this "
                                                        "machine lacks; use fsdp2 or ddp")]
    return []


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pipeline_issues(cfg: Any) -> list[ConfigIssue]:
    """Stages configured on a machine that cannot run them: refused before anything is built."""
    issues = []
    cuda = torch.cuda.is_available()
    if cfg.fp8 is not None and cfg.fp8.enabled:
        capable = cuda and torch.cuda.get_device_capability() >= (8, 9)
        if not capable or not _has("torchao"):
            need = [w for w, ok in (("a CUDA GPU with compute capability >= 8.9 (H100, L40S, RTX 4090)", capable),
                                    ("torchao (pip install torchao)", _has("torchao"))) if not ok]
            issues.append(ConfigIssue("fp8.enabled", f"FP8 training needs {' and '.join(need)}; this machine has "
                                                     f"{'no GPU' if not cuda else torch.cuda.get_device_name()}"))
    if cfg.qat is not None and cfg.qat.enabled:
        from automodel.training.stages import QAT_QUANTIZERS

        if not _has("torchao"):
            issues.append(ConfigIssue("qat.enabled", "QAT needs torchao: pip install torchao"))
        if cfg.qat.quantizer not in QAT_QUANTIZERS:
            issues.append(ConfigIssue("qat.quantizer", f"'{cfg.qat.quantizer}' is not one of "
                                                       f"{', '.join(QAT_QUANTIZERS)}"))
        if cfg.peft is not None:
            issues.append(ConfigIssue("qat.enabled", "QAT together with peft (LoRA) is not supported: the fake-"
                                                     "quantised layers would sit under the adapters; use one"))
    dist = cfg.distributed
    if dist is not None and dist.cp_size > 1:
        issues.append(ConfigIssue("distributed.cp_size", f"{dist.cp_size}: context parallelism is not supported "
                                                         "by this build; use cp_size: 1"))
    if cfg.compile is not None and cfg.compile.enabled and (cfg.compile.backend or "inductor") == "inductor" \
            and not cuda and not _has_compiler():
        issues.append(ConfigIssue("compile.backend", "inductor on CPU needs a C++ compiler (gcc/clang) on PATH; "
                                                     "install one or use backend: aot_eager"))
    return issues


def _has_compiler() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def is_fsdp2(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())
