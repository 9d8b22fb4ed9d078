"""``parallel_scheme``: each pipeline component's data-parallel strategy (DDP or FSDP2) and its options.

```yaml
parallel_scheme:
  transformer: {strategy: fsdp2, reshard_after_forward: true}   # the trained denoiser
  vae: {strategy: ddp}                                           # frozen: replicated on every rank
  text_encoder: fsdp2                                            # frozen, sharded (a large T5, say)
```
FSDP2's ``dp_replicate_size: R`` (> 1) is HSDP: the ranks form ``R`` groups that each hold whole shards, each
parameter sharded over ``world / R`` ranks within a group and replicated across the groups.
Validation (``scheme_issues``) runs before anything is built; the sharding stage (``shard_components``) applies
the scheme under torchrun. Import-light: torch is imported inside the stage only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from automodel.errors import AutomodelError, ConfigIssue
from automodel.suggest import did_you_mean

if TYPE_CHECKING:
    import torch

    from automodel.training.context import BuildContext

STRATEGIES = ("ddp", "fsdp2")
OPTIONS = {
    "ddp": ("find_unused_parameters", "broadcast_buffers", "gradient_as_bucket_view", "bucket_cap_mb",
            "static_graph"),
    "fsdp2": ("reshard_after_forward", "shard_blocks", "param_dtype", "reduce_dtype", "forward_prefetch_depth",
              "backward_prefetch_depth", "dp_replicate_size"),
}
UNSUPPORTED = "megatron_fsdp"
UNSUPPORTED_MESSAGE = "megatron_fsdp is not supported: diffusion supports DDP and FSDP2 only (strategy: ddp or fsdp2)"


def example_scheme(components: list[str] | None = None, denoiser: str = "transformer") -> str:
    """A YAML snippet of a valid scheme (for the components of this pipeline when known)."""
    names = sorted(components or [denoiser, "vae", "text_encoder"], key=lambda n: n != denoiser)
    lines = ["parallel_scheme:"]
    for name in names:
        lines.append(f"  {name}: {{strategy: {'fsdp2' if name == denoiser else 'ddp'}}}")
    return "\n".join(lines)


def parse_entry(value: Any) -> dict[str, Any]:
    """``fsdp2`` or ``{strategy: fsdp2, ...}`` -> ``{"strategy": "fsdp2", ...}``."""
    if isinstance(value, str):
        return {"strategy": value}
    return dict(value) if isinstance(value, dict) else {}


def _find_unsupported(value: Any, key: str) -> list[str]:
    """Dotted keys under ``key`` where megatron_fsdp appears, as a value or as a key."""
    found = []
    if isinstance(value, str) and value.strip().lower() == UNSUPPORTED:
        found.append(key)
    elif isinstance(value, dict):
        for k, v in value.items():
            if str(k).strip().lower() == UNSUPPORTED:
                found.append(f"{key}.{k}")
            else:
                found += _find_unsupported(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _find_unsupported(v, f"{key}[{i}]")
    return found


def scheme_issues(scheme: Any, components: list[str] | None, trainable: list[str] | None,
                  denoiser: str = "transformer") -> list[ConfigIssue]:
    """Everything wrong with a ``parallel_scheme`` value (``components``/``trainable`` when known)."""
    example = example_scheme(components, denoiser)
    if scheme is None:
        return [ConfigIssue("parallel_scheme", "required section is missing: diffusion needs each pipeline "
                                               "component's data-parallel strategy (ddp or fsdp2), or upstream's "
                                               "fsdp: / ddp: section, for example:\n" + example)]
    unsupported = _find_unsupported(scheme, "parallel_scheme")
    issues = [ConfigIssue(key, UNSUPPORTED_MESSAGE) for key in unsupported]
    if not isinstance(scheme, dict) or not scheme:
        if not unsupported:
            issues.append(ConfigIssue("parallel_scheme", f"expected a mapping from component name to its strategy, "
                                                         f"found {scheme!r}; for example:\n{example}"))
        return issues
    strategies: dict[str, str] = {}
    for name, value in scheme.items():
        key = f"parallel_scheme.{name}"
        if components is not None and name not in components:
            issues.append(ConfigIssue(key, f"not a component of this pipeline (it has: {', '.join(components)})",
                                      did_you_mean(str(name), components)))
        if not isinstance(value, (str, dict)):
            issues.append(ConfigIssue(key, f"expected a strategy (ddp, fsdp2) or {{strategy: ..., options}}, found "
                                           f"{value!r}"))
            continue
        entry = parse_entry(value)
        strategy = entry.get("strategy")
        if any(k.startswith(key) for k in unsupported):
            continue
        if strategy is None:
            issues.append(ConfigIssue(f"{key}.strategy", "required key is missing (ddp or fsdp2)"))
            continue
        if strategy not in STRATEGIES:
            issues.append(ConfigIssue(f"{key}.strategy" if isinstance(value, dict) else key,
                                      f"'{strategy}' is not a strategy; diffusion supports ddp and fsdp2",
                                      did_you_mean(str(strategy), STRATEGIES)))
            continue
        strategies[name] = strategy
        for option, setting in entry.items():
            if option == "strategy":
                continue
            if option not in OPTIONS[strategy]:
                issues.append(ConfigIssue(f"{key}.{option}", f"not an option of {strategy} (it accepts: "
                                                             f"{', '.join(OPTIONS[strategy])})",
                                          did_you_mean(str(option), OPTIONS[strategy])))
            elif option in ("param_dtype", "reduce_dtype") and setting not in ("float32", "bfloat16", "float16"):
                issues.append(ConfigIssue(f"{key}.{option}", f"expected float32, bfloat16 or float16, found "
                                                             f"{setting!r}"))
            elif option == "dp_replicate_size" and (isinstance(setting, bool) or not isinstance(setting, int)
                                                    or setting < 1):
                issues.append(ConfigIssue(f"{key}.{option}", f"expected a whole number >= 1 (HSDP's replica "
                                                             f"groups), found {setting!r}"))
    if trainable is not None:
        for name in trainable:
            if name not in scheme and (components is None or name in components):
                issues.append(ConfigIssue("parallel_scheme", f"no strategy for the trained component '{name}'; "
                                                             f"add `{name}: {{strategy: fsdp2}}` (or ddp)"))
        used = {strategies[n] for n in trainable if n in strategies}
        if len(used) > 1:
            issues.append(ConfigIssue("parallel_scheme", "the trained components must share one strategy (found "
                                                         + ", ".join(f"{n}: {strategies[n]}" for n in trainable
                                                                     if n in strategies) + ")"))
    return issues


# ---- the sharding stage (runs under torchrun only) ---------------------------------------------------------------


def _fully_shard(module: torch.nn.Module, entry: dict[str, Any], mesh: Any) -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kwargs: dict[str, Any] = {"mesh": mesh}  # 2-D (dp_replicate, dp_shard): HSDP
    if "reshard_after_forward" in entry:
        kwargs["reshard_after_forward"] = bool(entry["reshard_after_forward"])
    if "param_dtype" in entry or "reduce_dtype" in entry:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, entry["param_dtype"]) if "param_dtype" in entry else None,
            reduce_dtype=getattr(torch, entry["reduce_dtype"]) if "reduce_dtype" in entry else None)
    if entry.get("shard_blocks", True):
        from automodel.training.parallel.blocks import transformer_blocks

        blocks = transformer_blocks(module)
        for block in blocks:
            fully_shard(block, **kwargs)
        _prefetch(blocks, entry.get("forward_prefetch_depth"), entry.get("backward_prefetch_depth"))
    fully_shard(module, **kwargs)
    for method in ("encode", "decode"):  # a VAE is called through these, not forward()
        if callable(getattr(module, method, None)):
            register_fsdp_forward_method(module, method)


def _prefetch(blocks: list[Any], forward: int | None, backward: int | None) -> None:
    """FSDP2 all-gathers the next ``forward`` blocks ahead in forward and the previous ``backward`` in backward
    (FSDP2 itself prefetches one block implicitly; explicit depths overlap more communication with compute)."""
    for index, block in enumerate(blocks):
        if forward:
            block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + forward])
        if backward:
            block.set_modules_to_backward_prefetch(blocks[max(0, index - backward):index][::-1])


def shard_components(ctx: BuildContext, model: Any) -> tuple[Any, str]:
    """Apply ``parallel_scheme``: FSDP2 components are sharded (trained or frozen); trained DDP components are
    wrapped (one DDP over the trained module); frozen DDP components are replicated on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from automodel_diffusion.upstream import effective_scheme

    written = effective_scheme(ctx.cfg, model.trainable_components, model.denoiser_name) or {}
    scheme = {name: parse_entry(value) for name, value in written.items()}
    world = dist.get_world_size()
    meshes: dict[int, Any] = {}

    def mesh(entry: dict[str, Any]) -> Any:
        """The entry's mesh: all ranks, or HSDP's (replica groups x shards) for dp_replicate_size > 1."""
        replicas = entry.get("dp_replicate_size", 1)
        if world % replicas:
            raise AutomodelError(f"parallel_scheme: dp_replicate_size {replicas} does not divide the {world} "
                                 "processes; launch a multiple of it or change it")
        if replicas not in meshes:
            meshes[replicas] = init_device_mesh(ctx.device.type, (world,)) if replicas == 1 else init_device_mesh(
                ctx.device.type, (replicas, world // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))
        return meshes[replicas]

    model.to(ctx.device)
    idle = model.idle_experts()  # a two-expert stage's other transformer: kept on the CPU, never sharded
    frozen = {name: component for name, component in model.frozen_components().items() if name not in idle}
    for component in frozen.values():
        component.to(ctx.device)
    done = [f"{name}: idle expert (frozen, on the CPU)" for name in idle]
    for name, component in frozen.items():
        entry = scheme.get(name, {"strategy": "ddp"})
        if entry["strategy"] == "fsdp2":
            _fully_shard(component, entry, mesh(entry))
        done.append(f"{name}: {_described(entry)} (frozen)")
    trained = {name: scheme.get(name, {"strategy": "ddp"}) for name in model.trainable_components}
    strategy = next(iter(trained.values()))["strategy"]
    if strategy == "fsdp2":
        for name in model.trainable_components:
            _fully_shard(model.components[name], trained[name], mesh(trained[name]))
    else:
        options = {k: v for entry in trained.values() for k, v in entry.items() if k != "strategy"}
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, **options)
    done += [f"{name}: {_described(entry)}" for name, entry in trained.items()]
    return model, f"over {world} ranks: " + ", ".join(done)


def _described(entry: dict[str, Any]) -> str:
    replicas = entry.get("dp_replicate_size", 1)
    return entry["strategy"] + (f" (HSDP: {replicas} replica groups)" if replicas > 1 else "")
