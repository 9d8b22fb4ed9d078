"""The checkpoint directory (DESIGN §10): one run at a time, checkpoints that appear only complete, ``LATEST``.

```
<checkpoint_dir>/.lock        the run holding the directory (flock; pid and host inside)
<checkpoint_dir>/LATEST       the newest complete checkpoint's name, replaced atomically, written last
<checkpoint_dir>/epoch_<E>_step_<S>/   written as .incomplete-epoch_<E>_step_<S>, fsynced, then renamed
```
What a checkpoint holds is written by ``checkpoint_write``; this module names, publishes, retires and finds them.
Re-saving a step that exists swaps the two directories in one rename, so ``LATEST`` never names a missing or
partial directory. ``LATEST`` and ``trainer_state.json`` are untrusted input: a name that is not a direct child, a
number out of range or a damaged file is refused with the file and what to do.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import torch

from automodel.errors import AutomodelError
from automodel.training.durable import RunLock, exchange, fsync_file, fsync_tree, write_atomic
from automodel.training.parallel.shard_files import mismatch_report
from automodel.training.sections import CheckpointConfig

LATEST = "LATEST"
STAGING = ".incomplete-"
MAX_STEP = 10**12  # far beyond any run; a larger number in a checkpoint is damage, not progress
# what to do about a checkpoint that cannot be resumed
RESUME_ELSEWHERE = ("resume from another checkpoint (--restore_from.path <checkpoint directory>), or use a new "
                    "checkpoint.checkpoint_dir to start over")
_NAME = re.compile(r"^epoch_(\d{1,13})_step_(\d{1,13})$")


class CheckpointError(AutomodelError):
    pass


# What a failed write looks like from the libraries that write checkpoints: an OSError from Python, a
# SafetensorError ("I/O error: No space left on device (os error 28)") from safetensors, a RuntimeError or
# CheckpointException from torch.distributed.checkpoint wrapping one of those.
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
        if any(text in str(link).lower() for text in _WRITE_ERROR_TEXT):
            return True
    return False


def describe_write_error(err: BaseException) -> str:
    return "; ".join(f"{type(link).__name__}: {str(link).strip()[:500] or '(no message)'}"
                     for link in _error_chain(err))


def checkpoint_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch}_step_{step}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(epoch, step) of a checkpoint directory name; None for any other name or a number out of range."""
    match = _NAME.match(name)
    if match is None:
        return None
    epoch, step = int(match.group(1)), int(match.group(2))
    return (epoch, step) if epoch <= MAX_STEP and step <= MAX_STEP else None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(parsed[1], p) for p in root.iterdir() if p.is_dir() and (parsed := parse_name(p.name))]
    return [p for _, p in sorted(found)]


def read_latest(root: Path) -> Path | None:
    """The checkpoint ``LATEST`` names (None without ``LATEST``); a name that is not a checkpoint directory inside
    ``root`` is refused."""
    marker = root / LATEST
    try:
        text = marker.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"'{marker}' cannot be read ({err}); delete it and pass --restore_from.path "
                              "<checkpoint directory> to choose the checkpoint to resume") from None
    name = text.strip()
    if parse_name(name) is None:
        shown = name[:80] + ("..." if len(name) > 80 else "")
        raise CheckpointError(f"'{marker}' names {shown!r}, which is not a checkpoint directory inside '{root}' "
                              "(LATEST holds one name such as epoch_0_step_100); fix it, or delete it and pass "
                              "--restore_from.path <checkpoint directory>")
    target = root / name
    if not target.is_dir():
        raise CheckpointError(f"'{marker}' names '{name}', which does not exist in '{root}'; write the name of an "
                              "existing checkpoint into it, or delete it and pass --restore_from.path "
                              "<checkpoint directory>")
    return target


def _delete_all(directories: list[Path]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def load_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in '{directory}'")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own error type for a truncated or foreign file
            raise CheckpointError(f"'{file}' is corrupted ({err}); {RESUME_ELSEWHERE}") from None
    return state


def mismatch_message(source: Path, mismatched: list[str], unexpected: list[str], missing: list[str],
                     question: str = "is restore_from.path the same architecture?") -> str:
    """What differs between a checkpoint's weights and the model: shapes, then keys on either side."""
    return mismatch_report(f"checkpoint '{source}' does not match the model ({question})",
                           {"shape mismatches": mismatched, "keys only in the checkpoint": unexpected,
                            "keys missing from the checkpoint": missing})


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
    """The checkpoint directory of one run: its lock, staging, publishing, retention and lookup."""

    def __init__(self, config: CheckpointConfig, config_yaml: str):
        self.config = config
        self.root = Path(config.checkpoint_dir)
        self.config_yaml = config_yaml
        self._lock = RunLock(self.root)
        self._deleting: threading.Thread | None = None

    def naming(self, recipe: type, named: bool) -> Checkpointer:
        """This checkpointer, its checkpoints' config.yaml naming ``recipe`` where the run's config did not
        (``named``: it has a ``recipe:`` key), so that a checkpoint says which recipe wrote it (``automodel export``
        rebuilds a LoRA adapter's base with it)."""
        if not named:
            self.config_yaml = f"recipe: {recipe.__module__}.{recipe.__qualname__}\n{self.config_yaml}"
        return self

    # ---- the run's hold on the directory (rank 0) -------------------------------------------------------------

    def prepare(self) -> None:
        """Create and lock the directory (clear errors when it cannot be written or another run holds it), finish
        a re-save a crash interrupted, and clear staging and deletions left behind."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            holder = self._lock.acquire()
        except OSError as err:
            raise CheckpointError(f"checkpoint.checkpoint_dir: '{self.root}' is not writable: {err.strerror or err}; "
                                  "choose a directory you can write to") from None
        if holder is not None:
            raise CheckpointError(f"checkpoint.checkpoint_dir: '{self.root}' is in use by another run ({holder}); "
                                  "wait for it to finish, or give this run another checkpoint.checkpoint_dir")
        self._recover_swap()
        for stale in [*self.root.glob(f"{STAGING}*"), *self.root.glob(f"{LATEST}.tmp-*")]:
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

    def _recover_swap(self) -> None:
        """Where exchanging directories is impossible, a re-save moves the old copy aside first; a crash in that
        instant leaves LATEST naming nothing, and the old copy comes back under its name."""
        try:
            name = (self.root / LATEST).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return
        old = self.root / f"{STAGING}old-{name}"
        if parse_name(name) and not (self.root / name).exists() and old.is_dir():
            os.replace(old, self.root / name)
            fsync_file(self.root)

    def release(self) -> None:
        self._lock.release()

    # ---- saving -------------------------------------------------------------------------------------------------

    def staging_path(self, epoch: int, step: int) -> tuple[Path, Path]:
        """(where checkpoint ``epoch``/``step`` is written, its final name); every rank computes the same."""
        name = checkpoint_name(epoch, step)
        return self.root / f"{STAGING}{name}", self.root / name

    def open_staging(self, staging: Path) -> None:
        """An empty staging directory (rank 0, before every rank writes into it)."""
        self.wait()  # one retired checkpoint being deleted at a time
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)

    def publish(self, staging: Path, final: Path) -> Path:
        """Make the complete ``staging`` checkpoint ``final`` and name it in LATEST (rank 0)."""
        fsync_tree(staging)
        if final.exists():
            self._replace(staging, final)
        else:
            os.replace(staging, final)
            fsync_file(self.root)
        write_atomic(self.root / LATEST, final.name + "\n")
        self._apply_retention(final)
        return final

    def _replace(self, staging: Path, final: Path) -> None:
        """Re-saving a step: swap the new copy in, delete the old one last; LATEST stays valid throughout."""
        if exchange(staging, final):
            fsync_file(self.root)
            shutil.rmtree(staging, ignore_errors=True)  # now the old copy
            return
        old = self.root / f"{STAGING}old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)  # a crash between these two renames is repaired by prepare() (_recover_swap)
        os.replace(staging, final)
        fsync_file(self.root)
        shutil.rmtree(old, ignore_errors=True)

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def write_failed(self, err: BaseException, final: Path) -> CheckpointError:
        """The error to raise for a checkpoint write that failed, saying what is intact."""
        try:
            intact = read_latest(self.root) or "none yet"
        except CheckpointError:
            intact = "none"
        return CheckpointError(f"writing checkpoint '{final}' failed: {describe_write_error(err)}; the previous "
                               f"checkpoint is intact ({intact}). Is the disk full, or a quota or file-size limit "
                               "reached?")

    def _apply_retention(self, latest: Path) -> None:
        """Retire checkpoints beyond ``keep_last``: renamed out of sight now, their files deleted in the background.

        Only checkpoints older than ``latest`` are candidates (newer ones are a resumed run's future, re-saved as
        it gets there). A deletion cut short (the process killed) leaves an ``.incomplete-`` directory that
        ``prepare`` removes."""
        keep = self.config.keep_last
        latest_step = parse_name(latest.name)[1]
        if not keep:
            return
        older = [p for p in list_checkpoints(self.root) if parse_name(p.name)[1] < latest_step]
        doomed = []
        for old in older[: max(0, len(older) - (keep - 1))]:
            doomed.append(old.with_name(f"{STAGING}delete-{old.name}"))
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

    # ---- finding a checkpoint to resume ------------------------------------------------------------------------

    def latest(self) -> Path | None:
        return read_latest(self.root)

    def resolve(self, spec: str) -> Path:
        """A checkpoint path or a directory name under checkpoint_dir (``latest`` is the caller's to decide)."""
        candidates = list(dict.fromkeys((Path(spec), self.root / spec)))  # one, when spec is absolute
        for candidate in candidates:
            if candidate.is_dir() and (candidate / "trainer_state.json").is_file():
                return candidate
        looked = " and ".join(f"'{c}'" for c in candidates)
        raise CheckpointError(f"restore_from.path: '{spec}' is not a checkpoint (looked for {looked} containing "
                              f"trainer_state.json){''.join(map(_upstream_checkpoint_hint, candidates))}")


def _upstream_checkpoint_hint(path: Path) -> str:
    """What to do with a checkpoint upstream NeMo AutoModel wrote (its training state is pickles: never read here)."""
    consolidated = path / "model" / "consolidated"
    if (consolidated / "config.json").is_file():
        return (f". It is an upstream NeMo AutoModel checkpoint: its training state (torch.save / DCP pickles) is "
                f"never read here, but its Hugging Face model is: start a run from it with "
                f"model.pretrained_model_name_or_path: {consolidated}")
    if path.is_dir() and (any(path.glob("model/*.distcp")) or (path / "model" / ".metadata").is_file()):
        return (". It is an upstream NeMo AutoModel checkpoint in torch.distributed.checkpoint's pickle format "
                "(model/.metadata, *.distcp: upstream's torch_save), which is never read here: convert its model "
                "to a Hugging Face directory with upstream's tools and start a run from it "
                "(model.pretrained_model_name_or_path)")
    return ""
