"""Which submodules are a model's repeated transformer blocks, and module names free of wrapper prefixes."""

from __future__ import annotations

from torch import nn

# Prefixes wrappers insert into parameter and module names: activation checkpointing, torch.compile.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The longest ``ModuleList`` of modules of one type (a transformer's layers): each is one FSDP unit and one
    activation-checkpointing region. Empty when the model has no such list."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and len({type(m) for m in module}) == 1:
            best = list(module)
    return best


def clean_name(name: str) -> str:
    """``name`` as the unwrapped model spells it (what ``state_dict()`` and the HF files use)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
