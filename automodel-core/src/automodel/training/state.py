"""Restoring a checkpoint (see checkpoint_write.py for its layout): weights, optimizer and every tracked state.

Everything is read from safetensors and JSON (``state_files``, DCP's safetensors reader), never unpickled, and
resharded to this run: model and optimizer by ``torch.distributed.checkpoint``, each rank reading only its slices.
Written by N ranks and resumed on M, each rank takes the RNG state of its own rank (rank 0's where the checkpoint
has none) and the data position is recomputed: the loader starts the current epoch again and skips the steps
already trained (exact where the data order does not depend on the number of ranks: unshuffled data, or
checkpoints at the end of an epoch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel.training.checkpoint import RESUME_ELSEWHERE, CheckpointError
from automodel.training.checkpoint_write import RANK_STATES, SHARED_STATES, state_file
from automodel.training.parallel.hf_export import load_hf_weights
from automodel.training.parallel.sharded_checkpoint import load_sharded_state
from automodel.training.state_files import read_state
from automodel.training.step_scheduler import StepScheduler
from automodel.training.trainer_state import read_trainer_state

NOT_STATES = ("model", "optimizer", "step_scheduler")  # written by DCP / into trainer_state.json


def small_states(stateful: dict[str, Any]) -> dict[str, Any]:
    """The tracked attributes saved as state files (everything but weights, optimizer and step counter)."""
    return {name: obj for name, obj in stateful.items() if name not in NOT_STATES}


@contextlib.contextmanager
def reading(path: Path, what: str) -> Iterator[None]:
    """A file that does not hold what it should: exit 1 naming it and what to do, never a traceback."""
    try:
        yield
    except CheckpointError:
        raise
    except AutomodelError as err:
        raise CheckpointError(f"{err}; {RESUME_ELSEWHERE}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, StopIteration) as err:
        raise CheckpointError(f"'{path}' does not hold a valid {what} ({type(err).__name__}: {str(err)[:300]}); "
                              f"{RESUME_ELSEWHERE}") from None


def restore_weights(path: Path, model: torch.nn.Module, trainer_state: dict[str, Any]) -> None:
    """The engine's weights into the (sharded) model; a recipe's own layout was loaded by the checkpoint stage."""
    form = trainer_state["weights"]
    if form == "model":
        with reading(path / "model", "Hugging Face model"):
            load_hf_weights(path / "model", model)
    elif form == "model_shards":
        with reading(path / "model_shards", "sharded model"):
            load_sharded_state(path / "model_shards", model)


def _check_position(loader: Any, state: Any, file: Path) -> None:
    """A data position past the end of the data (a changed data set, or damage) is refused before training."""
    batches = len(loader) if hasattr(loader, "__len__") else None
    samples = len(loader.dataset) if hasattr(getattr(loader, "dataset", None), "__len__") else None
    if not isinstance(state, dict):
        return
    sampler = state.get("_sampler_iter_state")
    counts = [v for k, v in sampler.items() if k in ("samples_yielded", "yielded")] if isinstance(sampler, dict) \
        else []
    position = state.get("_num_yielded")
    if (batches is not None and isinstance(position, int) and position > batches) or \
            (samples is not None and any(isinstance(c, int) and c > samples for c in counts)):
        raise CheckpointError(f"'{file}': its data position is past the end of the data ({batches} batches, "
                              f"{samples} samples per epoch): the data set changed since the checkpoint, or the file "
                              f"is damaged; {RESUME_ELSEWHERE}")


def restore_states(path: Path, model: torch.nn.Module, stateful: dict[str, Any], rank: int, world_size: int,
                   log: Callable[[str], None], dp_size: int | None = None) -> dict[str, Any]:
    """Load optimizer, step counter and every tracked state from ``path``; returns its trainer_state. Each rank's
    data position is its own only when the world and its data-parallel size (``dp_size``, default: the world) are
    those that wrote the checkpoint; else the loader replays the epoch's data order up to the step."""
    trainer_state = read_trainer_state(path)
    optimizer = stateful.get("optimizer")
    if optimizer is not None:
        with reading(path / "optim", "optimizer state"):
            load_sharded_state(path / "optim", model, optimizer, weights=False)
    saved_world = trainer_state["world_size"]
    saved_dp = trainer_state.get("dp_size", saved_world)
    steps: StepScheduler = stateful["step_scheduler"]
    for name, obj in small_states(stateful).items():
        if name == "dataloader" and (saved_world, saved_dp) != (world_size, dp_size or world_size):
            at = trainer_state["step_scheduler"]
            steps.skip_trained_steps(at["epoch_step"])
            change = f"written by {saved_world} ranks, resuming on {world_size}" if saved_world != world_size else \
                f"written with data parallel over {saved_dp} of {saved_world} ranks, resuming with {dp_size}"
            log(f"restore: {change}: the data loader starts epoch {at['epoch']} again and skips the "
                f"{at['epoch_step']} steps trained in it")
            continue
        stem = state_file(path, name, rank if rank < saved_world or name in SHARED_STATES else 0)
        if name not in SHARED_STATES and name not in RANK_STATES and not stem.with_suffix(".json").exists():
            raise CheckpointError(f"'{path}' has no saved state for '{name}' ({stem}.json); it was written by a "
                                  "recipe that does not track it")
        with reading(stem.with_suffix(".json"), f"'{name}' state"):
            state = read_state(stem)
            if name == "dataloader":
                _check_position(obj, state, stem.with_suffix(".json"))
            obj.load_state_dict(state)
    steps.load_state_dict(trainer_state["step_scheduler"])
    log(f"resumed from {path} at step {steps.step}")
    return trainer_state
