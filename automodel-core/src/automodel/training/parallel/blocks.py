"""Which submodules are a model's repeated transformer blocks; names free of wrapper prefixes; tied tensors."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

# Prefixes wrappers insert into parameter and module names: activation checkpointing, torch.compile.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


class LayerPlaceholder(nn.Module):
    """Stands in for a transformer layer that another pipeline stage holds: it passes the hidden states through,
    so the model's own forward runs this stage's layers only and every layer keeps its index (and its names)."""

    def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden_states


def is_pipeline_stage(model: nn.Module) -> bool:
    """Whether ``model`` is one pipeline stage of a model (the layers of other stages are placeholders)."""
    return any(isinstance(module, LayerPlaceholder) for module in model.modules())


def transformer_blocks(model: nn.Module, skip: Collection[nn.Module] = ()) -> list[nn.Module]:
    """The longest ``ModuleList`` of modules of one type (a transformer's layers), not counting the placeholders of
    a pipeline stage nor lists inside the ``skip`` modules (a vision-language model's towers): each is one FSDP
    unit and one activation-checkpointing region. A model that names its blocks (``transformer_block_names``, the
    dotted names of its submodules: a one-layer draft's layer, say) has those. Empty when it has neither."""
    declared = getattr(model, "transformer_block_names", None)
    if declared:
        return [model.get_submodule(name) for name in declared]
    skipped = {id(inner) for outer in skip for inner in outer.modules()}
    best: list[nn.Module] = []
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or id(module) in skipped:
            continue
        layers = [m for m in module if not isinstance(m, LayerPlaceholder)]
        if len(layers) > len(best) and len({type(m) for m in layers}) == 1:
            best = layers
    return best


def attention_modules(model: nn.Module, skip: Collection[nn.Module] = ()) -> list[nn.Module]:
    """The attention module of each of ``model``'s transformer blocks (not those inside ``skip``), found below
    wrappers (activation checkpointing) too: a child named ``*attn*`` or of a class named ``*Attention``, the
    outermost of a branch only (not its own ``c_attn`` projection)."""
    found = []
    for block in transformer_blocks(model, skip):
        taken: list[str] = []
        for name, child in block.named_modules():
            if not name or any(name.startswith(f"{outer}.") for outer in taken):
                continue
            if "attn" in name.rsplit(".", 1)[-1] or type(child).__name__.endswith("Attention"):
                found.append(child)
                taken.append(name)
    return found


def clean_name(name: str) -> str:
    """``name`` as the unwrapped model spells it (what ``state_dict()`` and the HF files use)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def tied_to(model: nn.Module) -> dict[str, str]:
    """Clean ``state_dict`` key -> the first clean key holding the same tensor (itself when not tied). Decided by
    the module structure, so every rank agrees (storage pointers do not: a rank's shard may be empty)."""
    first: dict[int, str] = {}
    return {clean_name(key): clean_name(first.setdefault(id(tensor), key))
            for key, tensor in model.state_dict(keep_vars=True).items()}
