"""Where FSDP2 puts a model's multimodal modules (vision / audio towers, projectors), by
``distributed.multimodal.frozen_sharding`` (:mod:`automodel.training.multimodal_section`).

The recipe names these modules (``TrainRecipe.multimodal_module_names``); the outermost module of each name is one.
They are never searched for the transformer blocks (the language model's are; a tower with as many layers, or more,
would be taken otherwise). A fully frozen one goes by the setting: ``root`` leaves its parameters to the outer unit,
``per_layer`` makes each of its blocks (the module itself when it has none) a unit, ``replicate`` leaves its
parameters out of FSDP2, plain full tensors on every rank. One with a trainable parameter has its blocks sharded as
units whatever the setting, like the language model's.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from torch import nn

from automodel.training.parallel.blocks import clean_name, transformer_blocks


@dataclass
class MultimodalPlacement:
    modules: dict[str, nn.Module] = field(default_factory=dict)  # name -> module: all kept out of the block search
    units: list[nn.Module] = field(default_factory=list)  # their modules made FSDP2 units, each before the root
    ignored: set[nn.Parameter] = field(default_factory=set)  # parameters FSDP2 leaves as they are (replicate)
    policy: str = "root"

    def describe(self) -> list[str]:
        """What FSDP2 made of each module (read from the sharded model): its units and sharded parameters."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        lines = []
        for name, module in self.modules.items():
            params = list(module.parameters())
            trains = any(p.requires_grad for p in params)
            units = sum(isinstance(m, FSDPModule) for m in module.modules())
            sharded = sum(isinstance(p, DTensor) for p in params)
            why = "trains: sharded by blocks whatever frozen_sharding says" if trains else f"frozen: {self.policy}"
            lines.append(f"{name} {why}, {units} units, {sharded} of {len(params)} parameter tensors sharded")
        return lines


def multimodal_modules(model: nn.Module, names: Collection[str]) -> dict[str, nn.Module]:
    """Clean name -> module, for the outermost modules of ``model`` whose own name is one of ``names``."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name and name.rsplit(".", 1)[-1] in names and not any(name.startswith(f"{o}.") for o in found):
            found[name] = module
    return {clean_name(name): module for name, module in found.items()}


def place_multimodal(model: nn.Module, names: Collection[str], policy: str) -> MultimodalPlacement:
    """How FSDP2 shards ``model``'s multimodal modules (those with parameters) under ``frozen_sharding: policy``."""
    placement = MultimodalPlacement(policy=policy)
    for name, module in multimodal_modules(model, names).items():
        params = list(module.parameters())
        if not params:
            continue
        placement.modules[name] = module
        if any(p.requires_grad for p in params) or policy == "per_layer":
            placement.units += transformer_blocks(module) or [module]
        elif policy == "replicate":
            placement.ignored.update(params)
    return placement
