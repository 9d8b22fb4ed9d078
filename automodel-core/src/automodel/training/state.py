"""The training state a checkpoint holds besides the weights: gathered for a save, restored on resume.

The optimizer's state is keyed by parameter name (torch.distributed.checkpoint's full form, gathered from every
rank under FSDP2), so a checkpoint written by N ranks resumes on M.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from automodel.training.checkpoint import Checkpointer
from automodel.training.modules import is_fsdp2

NOT_STATES = ("model", "step_scheduler")  # the weights go to model/, the step counter to trainer_state.json


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's weights gathered from every rank under FSDP2 (a collective there); None otherwise."""
    if not is_fsdp2(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def gather_states(model: torch.nn.Module, stateful: dict[str, Any]) -> dict[str, Any]:
    """The state dicts of the stateful attributes but the weights and step counter (collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    states = {}
    for name, obj in stateful.items():
        if name in NOT_STATES:
            continue
        if name == "optimizer":
            states[name] = get_optimizer_state_dict(model, obj, options=_options(cpu_offload=True))
        else:
            states[name] = obj.state_dict()
    return states


def restore_states(path: Path, model: torch.nn.Module, stateful: dict[str, Any], world_size: int,
                   log: Callable[[str], None]) -> list[float]:
    """Load every stateful attribute's state from the checkpoint at ``path``; returns its logged step losses."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    trainer_state = Checkpointer.read_trainer_state(path)
    targets = {k: v for k, v in stateful.items() if k not in NOT_STATES}
    saved_world = trainer_state.get("world_size", 1)
    if saved_world != world_size and "dataloader" in targets:
        log(f"restore: written by {saved_world} ranks, resuming on {world_size}: the data order restarts at the "
            "current epoch's beginning")
        targets.pop("dataloader")
    for name, state in Checkpointer.read_states(path, list(targets)).items():
        if name == "optimizer":
            # strict=False: a trainable parameter that never received a gradient (a VLM's unused vision head,
            # say) has no optimizer state in the checkpoint, and the uninterrupted run had none either.
            set_optimizer_state_dict(model, targets[name], state, options=_options(strict=False))
        else:
            targets[name].load_state_dict(state)
    stateful["step_scheduler"].load_state_dict(trainer_state["step_scheduler"])
    log(f"resumed from {path} at step {stateful['step_scheduler'].step}")
    return list(trainer_state.get("losses", []))
