"""Writing one checkpoint with every rank: each rank writes only its own shards, nobody holds the whole state.

```
epoch_<E>_step_<S>/
  model/              checkpoint.save_consolidated: true (and final, in the run's last checkpoint) — the Hugging
                      Face layout, the weights' only copy, streamed from the shards by every rank (hf_export); a
                      resume reads each rank's slices of it
  model_shards/       save_consolidated: false or model_save_format: torch_save (and final, before the last) —
                      the weights as DCP shards (automodel export makes model/ of it)
  optim/              the optimizer as DCP shards (shard-*.safetensors, tensors.json, optimizer.json);
                      lr_scheduler.json (rank 0)
  rng/ dataloader/    rank_<r>.json (+ .safetensors): each rank's generators and data position
  extra/              rank_<r>.json of every further stateful attribute the recipe declares
  trainer_state.json  config.yaml    (rank 0)
```
A recipe whose ``save_model`` writes ``model/`` in a layout of its own (a diffusers pipeline, a bi-encoder) gets
the whole weights gathered for it and rank 0 writes them; its optimizer is still sharded.

Phases, so that a rank that fails never leaves the others waiting in a collective: (1) collectives that gather
state, (2) each rank's own small files (every rank then agrees whether all succeeded), (3) the DCP writes and
the streaming export on the checkpoint group — inline, or with ``async_save`` on the background writer thread
from host copies while training goes on — and ``finish``: every rank agrees the files are complete, then rank 0
fsyncs the tree, renames it into place and writes ``LATEST``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from automodel.training.checkpoint import Checkpointer, CheckpointError, is_write_error
from automodel.training.dist import any_rank, barrier
from automodel.training.durable import write_durable
from automodel.training.modules import is_fsdp2
from automodel.training.parallel.checkpoint_metadata import Metadata
from automodel.training.parallel.hf_export import HF_FILES, export_hf
from automodel.training.parallel.sharded_checkpoint import (
    sharded_tensors,
    stage_on_cpu,
    write_sharded_metadata,
    write_sharded_tensors,
)
from automodel.training.parallel.writer import PendingSave, checkpoint_group, run_in_background
from automodel.training.parallel.writer import barrier as group_barrier
from automodel.training.state_files import write_state
from automodel.training.trainer_state import FILE as TRAINER_STATE

SHARED_STATES = {"lr_scheduler": "optim"}  # the same on every rank: rank 0 writes it
RANK_STATES = {"rng": "rng", "dataloader": "dataloader"}  # one file per rank; anything else goes to extra/


def state_file(directory: Path, name: str, rank: int) -> Path:
    """The stem of attribute ``name``'s state file (``write_state`` adds .json / .safetensors)."""
    if name in SHARED_STATES:
        return directory / SHARED_STATES[name] / name
    return directory / RANK_STATES.get(name, f"extra/{name}") / f"rank_{rank}"


@dataclass
class CheckpointParts:
    """What one checkpoint holds, taken by the loop between two steps."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    states: dict[str, Any]  # attribute name -> object with state_dict() (lr_scheduler, dataloader, rng, ...)
    trainer_state: dict[str, Any]
    save_artifacts: Callable[[Path], None]  # tokenizer / processor files beside the weights (rank 0)
    save_model: Callable[[Path, dict[str, torch.Tensor] | None], None] | None = None  # a recipe's own layout


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's weights gathered from every rank under FSDP2 (a collective there); None otherwise.

    Only for a recipe whose ``save_model`` writes a layout of its own (the engine's layout never gathers)."""
    if not is_fsdp2(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def sharded_only_message(checkpoint: Path) -> str:
    """What a run says about its final checkpoint when the weights are only the sharded form (no model/)."""
    return (f"Trained model in {checkpoint / 'model_shards'} (the sharded form only, as the checkpoint settings ask): "
            f"`automodel export {checkpoint} out/` writes it as a Hugging Face model directory")


class CheckpointWrite:
    """One checkpoint being written by every rank; ``finish()`` publishes it once every file is complete."""

    def __init__(self, checkpointer: Checkpointer, parts: CheckpointParts, rank: int, device: torch.device,
                 async_save: bool = False, last: bool = True):
        """``last``: the run's last checkpoint (``save_consolidated: final`` writes model/ only there)."""
        self.checkpointer, self.rank, self.device = checkpointer, rank, device
        self.started = time.perf_counter()
        self.seconds: float | None = None  # from the start to the publish, set by finish()
        state = parts.trainer_state
        self.staging, self.final = checkpointer.staging_path(state["epoch"], state["step"])
        own_layout = parts.save_model is not None
        consolidated = checkpointer.config.consolidated()
        whole = consolidated is True or (consolidated == "final" and last)
        # where the weights go (trainer_state.json records it for the resume)
        self.weights = "recipe" if own_layout else "model" if whole else "model_shards"
        self.group = checkpoint_group()
        self.pending: PendingSave | None = None
        if rank == 0:
            checkpointer.open_staging(self.staging)
        barrier()
        gathered = self._gather(parts)  # collectives first: no rank may fail out of one
        self._agree(self._attempt(lambda: self._write_small_files(parts, gathered)))
        if async_save:
            gathered["shards"] = {name: (stage_on_cpu(tensors), metadata)
                                  for name, (tensors, metadata) in gathered["shards"].items()}
            self.pending = run_in_background(lambda: self._write_tensors(gathered["shards"]))
        else:
            self._agree(self._attempt(lambda: self._write_tensors(gathered["shards"])))

    def _gather(self, parts: CheckpointParts) -> dict[str, Any]:
        """Directory name -> (this rank's tensors, the metadata of every rank's), and the full weights for a
        recipe's own layout."""
        own_layout = self.weights == "recipe"
        shards = {} if own_layout else {"model_shards": sharded_tensors(parts.model)}
        shards["optim"] = sharded_tensors(parts.model, parts.optimizer, weights=False)
        return {"shards": shards, "full": full_model_state(parts.model) if own_layout else None}

    def _write_small_files(self, parts: CheckpointParts, gathered: dict[str, Any]) -> None:
        staging, rank = self.staging, self.rank
        for name, obj in parts.states.items():
            if name not in SHARED_STATES or rank == 0:
                stem = state_file(staging, name, rank)
                stem.parent.mkdir(parents=True, exist_ok=True)
                write_state(stem, obj.state_dict(), f"'{name}'")
        if rank != 0:
            return
        state = {**parts.trainer_state, "weights": self.weights}
        write_durable(staging / TRAINER_STATE, json.dumps(state, indent=2))
        write_durable(staging / "config.yaml", self.checkpointer.config_yaml)
        write_sharded_metadata(staging / "optim", parts.model, gathered["shards"]["optim"][1])
        if parts.save_model is not None:
            parts.save_model(staging / "model", gathered["full"])
            return
        shards = staging / "model_shards"
        write_sharded_metadata(shards, parts.model, gathered["shards"]["model_shards"][1])
        parts.save_artifacts(shards / HF_FILES)  # export copies hf/ (model config, tokenizer) into model/

    def _write_tensors(self, shards: dict[str, tuple[dict[str, torch.Tensor], Metadata]]) -> None:
        """The big writes, every rank on the checkpoint group (inline or on the background writer thread)."""
        for name, (tensors, metadata) in shards.items():
            write_sharded_tensors(self.staging / name, tensors, metadata["bytes"], group=self.group)
        if self.weights == "model":
            export_hf(self.staging / "model_shards", self.staging / "model", group=self.group)
            if self.rank == 0:  # every rank has finished exporting (export_hf ends with a barrier)
                shutil.rmtree(self.staging / "model_shards")
            group_barrier(self.group)

    # ---- completion -------------------------------------------------------------------------------------------

    def done(self) -> bool:
        """Whether this rank's part is written (always, for a synchronous save)."""
        return self.pending is None or self.pending.done()

    def finish(self) -> Path:
        """Wait for every rank's files, then rank 0 publishes; every rank raises if any part failed."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._agree(self._attempt(pending.wait))
        self._agree(self._attempt(lambda: self.checkpointer.publish(self.staging, self.final))
                    if self.rank == 0 else None)
        self.seconds = time.perf_counter() - self.started
        return self.final

    def _attempt(self, work: Callable[[], Any]) -> BaseException | None:
        try:
            work()
        except Exception as err:
            return err
        return None

    def _agree(self, failure: BaseException | None) -> None:
        """Every rank learns whether any failed; the one that failed says why, rank 0 removes the staging."""
        if not any_rank(failure is not None, self.device):
            return
        if self.rank == 0:
            self.checkpointer.discard(self.staging)
        if failure is None:
            raise CheckpointError(f"writing checkpoint '{self.final}' failed on another rank (see its error)")
        if is_write_error(failure):
            raise self.checkpointer.write_failed(failure, self.final) from failure
        raise failure
