"""``trainer_state.json``: the counters of a checkpoint, read back as untrusted input (types and bounds checked).

A resume takes its step, epoch and the data position from here, and new checkpoint names derive from them, so a
damaged or hostile number (a step of 10^30) is refused instead of "resumed".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from automodel.training.checkpoint import MAX_STEP, RESUME_ELSEWHERE, CheckpointError, parse_name

FILE = "trainer_state.json"
FORMAT = 2
# where the weights are: model/ (Hugging Face layout), model_shards/ (sharded), or model/ written by the recipe
WEIGHT_FORMS = ("model", "model_shards", "recipe")
_MAX_WORLD = 1 << 20


def _fix(path: Path) -> str:
    return f"{RESUME_ELSEWHERE}; '{path}' cannot be resumed"


def _integer(file: Path, path: Path, data: dict[str, Any], key: str, low: int, high: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CheckpointError(f"'{file}' is damaged: '{key}' must be an integer from {low} to {high}, found "
                              f"{str(value)[:40]!r}; {_fix(path)}")
    return value


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The checked ``trainer_state.json`` of the checkpoint ``path``."""
    file = path / FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"'{path}' is not a checkpoint ({FILE} is missing); {_fix(path)}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"'{file}' is corrupted ({type(err).__name__}: {str(err)[:200]}); {_fix(path)}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"'{file}' is damaged: it does not hold a JSON object; {_fix(path)}")
    if data.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' was written by an earlier automodel (format {data.get('format', 1)!r}; "
                              f"this one reads format {FORMAT}, which never unpickles); {_fix(path)}")
    step = _integer(file, path, data, "step", 0, MAX_STEP)
    epoch = _integer(file, path, data, "epoch", 0, MAX_STEP)
    world = _integer(file, path, data, "world_size", 1, _MAX_WORLD)
    if "dp_size" in data:  # the data-parallel ranks among them (absent before model parallelism: all of them)
        _integer(file, path, data, "dp_size", 1, world)
    _integer(file, path, data, "skipped_steps", 0, MAX_STEP)
    scheduler = data.get("step_scheduler")
    if not isinstance(scheduler, dict):
        raise CheckpointError(f"'{file}' is damaged: 'step_scheduler' is not an object; {_fix(path)}")
    scheduler_at = (_integer(file, path, scheduler, "step", 0, MAX_STEP),
                    _integer(file, path, scheduler, "epoch", 0, MAX_STEP),
                    _integer(file, path, scheduler, "epoch_step", 0, step))
    # after the step that used up its epoch's data, the scheduler's state is the next epoch's start
    if scheduler_at[:2] != (step, epoch) and scheduler_at != (step, epoch + 1, 0):
        raise CheckpointError(f"'{file}' is damaged: 'step_scheduler' disagrees with step {step} / epoch {epoch}; "
                              f"{_fix(path)}")
    losses = data.get("losses")
    if not isinstance(losses, list) or len(losses) > step or \
            not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in losses):
        raise CheckpointError(f"'{file}' is damaged: 'losses' must be a list of at most {step} numbers; "
                              f"{_fix(path)}")
    if data.get("weights") not in WEIGHT_FORMS:
        raise CheckpointError(f"'{file}' is damaged: 'weights' must be one of {', '.join(WEIGHT_FORMS)}; "
                              f"{_fix(path)}")
    named = parse_name(path.name)
    if named is not None and named != (epoch, step):
        raise CheckpointError(f"'{file}' is damaged: it says epoch {epoch} step {step} but its directory is "
                              f"'{path.name}'; {_fix(path)}")
    return data


def encode_losses(losses: list[float]) -> list[float | None]:
    """The logged losses as JSON numbers (a non-finite loss as null)."""
    return [value if math.isfinite(value) else None for value in losses]
