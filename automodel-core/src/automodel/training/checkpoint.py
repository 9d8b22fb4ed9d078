"""Checkpoints as DESIGN §10 lays them out, written aside and renamed so only complete ones ever appear.

```
<checkpoint_dir>/epoch_<E>_step_<S>/{model/, optim/, rng/, dataloader/, trainer_state.json, config.yaml}
<checkpoint_dir>/LATEST      # name of the newest complete checkpoint, replaced atomically, written last
```
Weights are safetensors; everything else is loaded back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from automodel.errors import AutomodelError
from automodel.training.sections import CheckpointConfig

LATEST = "LATEST"
_NAME = re.compile(r"^epoch_(\d+)_step_(\d+)$")
_STAGING = ".incomplete-"

# Where each tracked attribute goes; anything else tracked lands in extra/<name>.pt.
_ROLE_DIRS = {"optimizer": "optim", "lr_scheduler": "optim", "rng": "rng", "dataloader": "dataloader"}


class CheckpointError(AutomodelError):
    pass


# What a failed write looks like from the libraries that write checkpoints: an OSError from Python, a
# SafetensorError ("I/O error: No space left on device (os error 28)") from safetensors, a RuntimeError from
# torch.save's stream writer ("PytorchStreamWriter failed writing file", "unexpected pos", "iostream error").
_WRITE_ERROR_TEXT = ("os error", "i/o error", "pytorchstreamwriter", "inline_container", "iostream error",
                     "no space left", "file too large", "disk quota", "read-only file system")


def _error_chain(err: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def is_write_error(err: BaseException) -> bool:
    """Whether ``err`` (raised while writing a checkpoint) is the file system refusing the write."""
    for link in _error_chain(err):
        if isinstance(link, OSError):
            return True
        if (isinstance(link, RuntimeError) or type(link).__name__ == "SafetensorError") and \
                any(text in str(link).lower() for text in _WRITE_ERROR_TEXT):
            return True
    return False


def describe_write_error(err: BaseException) -> str:
    return "; ".join(f"{type(link).__name__}: {str(link).strip() or '(no message)'}" for link in _error_chain(err))


def checkpoint_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch}_step_{step}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(2)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def read_latest(root: Path) -> Path | None:
    marker = root / LATEST
    if not marker.is_file():
        return None
    target = root / marker.read_text(encoding="utf-8").strip()
    return target if target.is_dir() else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete_all(directories: list[Path]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def save_state_dict_safetensors(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Plain safetensors for models that are not HF ``PreTrainedModel``s (shared storage cloned)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, {}
    for key, tensor in state.items():
        ptr = (tensor.data_ptr(), tensor.shape)
        tensors[key] = tensor.detach().clone().contiguous() if ptr in seen else tensor.detach().contiguous()
        seen[ptr] = key
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in '{directory}'")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def mismatch_message(source: Path, mismatched: list[str], unexpected: list[str], missing: list[str],
                     question: str = "is restore_from.path the same architecture?") -> str:
    """What differs between a checkpoint's weights and the model: shapes, then keys on either side."""
    lines = [f"checkpoint '{source}' does not match the model ({question})"]
    for title, items in (("shape mismatches", mismatched), ("keys only in the checkpoint", unexpected),
                         ("keys missing from the checkpoint", missing)):
        if items:
            lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
    return "\n".join(lines)


def load_weights_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Copy saved weights into ``model``; a different architecture fails with the mismatched keys and shapes."""
    own = model.state_dict()
    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and own[k].shape != v.shape]
    unexpected = [k for k in state if k not in own]
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded_ptrs]
    if mismatched or unexpected or missing:
        raise CheckpointError(mismatch_message(source, mismatched, unexpected, missing))
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value)


class Checkpointer:
    """Saves and restores every tracked attribute of a recipe."""

    def __init__(self, config: CheckpointConfig, config_yaml: str):
        self.config = config
        self.root = Path(config.checkpoint_dir)
        self.config_yaml = config_yaml
        self._deleting: threading.Thread | None = None

    # ---- saving -------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the directory (a clear error if it cannot be written) and clear staging left by a crash."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise CheckpointError(f"checkpoint.checkpoint_dir: '{self.root}' is not writable: {err.strerror or err}; "
                                  "choose a directory you can write to") from None
        for stale in self.root.glob(f"{_STAGING}*"):
            shutil.rmtree(stale, ignore_errors=True)

    def save(self, states: dict[str, Any], save_model: Callable[[Path], None], trainer_state: dict[str, Any],
             epoch: int, step: int) -> Path:
        """Write one checkpoint: weights through ``save_model``, every other state dict in ``states``."""
        self.wait()  # one retired checkpoint being deleted at a time
        name = checkpoint_name(epoch, step)
        final = self.root / name
        staging = self.root / f"{_STAGING}{name}-{os.getpid()}"
        try:
            staging.mkdir(parents=True)
            save_model(staging / "model")
            self._save_states(staging, states)
            (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2), encoding="utf-8")
            (staging / "config.yaml").write_text(self.config_yaml, encoding="utf-8")
            self._publish(staging, final)
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            if is_write_error(err):
                raise CheckpointError(f"writing checkpoint '{final}' failed: {describe_write_error(err)}; the "
                                      f"previous checkpoint is intact ({read_latest(self.root) or 'none yet'}). "
                                      "Is the disk full, or a quota or file-size limit reached?") from err
            raise
        self._apply_retention(final)
        return final

    def _save_states(self, directory: Path, states: dict[str, Any]) -> None:
        for name, state in states.items():
            sub = directory / _ROLE_DIRS.get(name, "extra")
            sub.mkdir(exist_ok=True)
            torch.save(state, sub / f"{name}.pt")

    def _publish(self, staging: Path, final: Path) -> None:
        trash = None
        if final.exists():  # re-running over an old directory: move the old one aside first
            trash = final.with_name(f"{_STAGING}old-{final.name}-{os.getpid()}")
            os.replace(final, trash)
        os.replace(staging, final)
        _fsync_dir(self.root)
        _write_atomic(self.root / LATEST, final.name + "\n")
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def _apply_retention(self, latest: Path) -> None:
        """Retire checkpoints beyond ``keep_last``: renamed out of sight now, their files deleted in the background.

        Unlinking a big checkpoint's files takes as long as writing a small one, and training need not wait for it.
        A deletion cut short (the process killed) leaves an ``.incomplete-`` directory that ``prepare`` removes."""
        keep = self.config.keep_last
        if not keep:
            return
        checkpoints = [p for p in list_checkpoints(self.root) if p.resolve() != latest.resolve()]
        doomed = []
        for old in checkpoints[: max(0, len(checkpoints) - (keep - 1))]:
            doomed.append(old.with_name(f"{_STAGING}delete-{old.name}"))
            os.replace(old, doomed[-1])  # never a half-deleted directory under a checkpoint's name
        if doomed:
            self._deleting = threading.Thread(target=_delete_all, args=(doomed,), name="checkpoint-retention",
                                              daemon=True)
            self._deleting.start()

    def wait(self) -> None:
        """Until the retired checkpoints are deleted (the loop calls it before it returns)."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    # ---- restoring ----------------------------------------------------------------------------------------

    def resolve(self, spec: str) -> Path:
        """A checkpoint path, a directory name under checkpoint_dir, or 'latest'."""
        if spec == "latest":
            found = read_latest(self.root)
            if found is None:
                raise CheckpointError(f"restore_from.path: latest: no complete checkpoint under '{self.root}' "
                                      f"(no {LATEST} file); train without restore_from first")
            return found
        candidates = list(dict.fromkeys((Path(spec), self.root / spec)))  # one, when spec is absolute
        for candidate in candidates:
            if candidate.is_dir() and (candidate / "trainer_state.json").is_file():
                return candidate
        looked = " and ".join(f"'{c}'" for c in candidates)
        raise CheckpointError(f"restore_from.path: '{spec}' is not a checkpoint (looked for {looked} containing "
                              "trainer_state.json)")

    @staticmethod
    def read_states(path: Path, names: list[str]) -> dict[str, Any]:
        """The saved state dicts of ``names``, loaded with ``weights_only=True`` (no pickle code runs)."""
        states = {}
        for name in names:
            file = path / _ROLE_DIRS.get(name, "extra") / f"{name}.pt"
            if not file.is_file():
                raise CheckpointError(f"restore_from.path: '{path}' has no saved state for '{name}' ({file})")
            states[name] = torch.load(file, weights_only=True, map_location="cpu")
        return states

    @staticmethod
    def read_trainer_state(path: Path) -> dict[str, Any]:
        return json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
