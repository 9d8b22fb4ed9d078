"""Which submodules are a model's repeated transformer blocks; names free of wrapper prefixes; tied tensors."""

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


def tied_to(model: nn.Module) -> dict[str, str]:
    """Clean ``state_dict`` key -> the first clean key holding the same tensor (itself when not tied). Decided by
    the module structure, so every rank agrees (storage pointers do not: a rank's shard may be empty)."""
    first: dict[int, str] = {}
    return {clean_name(key): clean_name(first.setdefault(id(tensor), key))
            for key, tensor in model.state_dict(keep_vars=True).items()}
