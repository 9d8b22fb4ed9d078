"""Looking inside a model: the wrappers the pipeline puts around it (DDP, torch.compile, FSDP2), its attention."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) sharded any module of ``model``."""
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())


@contextmanager
def root_gathered(model: torch.nn.Module) -> Iterator[None]:
    """Within it, an FSDP2 root's own parameters are gathered on every rank (a collective: every rank enters it).

    FSDP2 gathers a unit's parameters when that unit's forward runs; a submodule of the root called outside the
    root's forward (transformers' ``generate`` runs a vision-language model's image encoder first, through
    ``get_image_features``) would otherwise see its weights as shards. Another model passes through.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def is_decoder(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention is built causal (its attention modules say ``is_causal``), whatever its config
    says now: a decoder, whose config's ``is_causal: false`` transformers 5 reads as attention both ways, as opposed
    to an encoder such as BERT (or a model of its own code, which attends as it was built)."""
    return any(getattr(module, "is_causal", False) is True for module in model.modules() if module is not model)
