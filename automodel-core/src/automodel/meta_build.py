"""Building a model on the meta device when the engine asks for it, and saying where its weights are.

The engine (``TrainRecipe.setup``) builds the model inside :func:`building_on_meta`. A model factory that can build
on the meta device (the shared ``model_files.pretrained_or_fresh`` / ``fresh_model`` behind
``automodel_llm.AutoModelForCausalLM`` and ``automodel_vlm.AutoModelForImageTextToText``) then constructs the model
with its parameters on the meta device (no memory; buffers such as rotary caches stay real) and fills in the
:class:`MetaBuild` it finds through :func:`meta_request`: the safetensors directory holding the weights, or None for
a fresh model initialised from the run's seed. The pipeline applies LoRA, freezing and FSDP2 to the meta model and
then materialises it: each rank allocates only its shards and reads only its slices of the files
(``automodel.training.parallel.materialize``). A factory that knows nothing of this builds as usual and the engine
takes the model as it is (a full build on every rank, said in a log line).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_REQUEST: ContextVar[MetaBuild | None] = ContextVar("automodel_meta_build", default=None)
_WEIGHT_PATTERNS = ["*.json", "*.safetensors"]


@dataclass
class MetaBuild:
    """What a factory that built on the meta device reports (``built`` stays False when none did)."""

    built: bool = False
    factory: str = ""  # which factory built it, for the log line
    weights: Path | None = None  # the safetensors directory the parameters are read from (None: fresh init)
    checkpoint_key: Callable[[str], str] | None = None  # model state-dict key -> key in those files
    seed: int | None = None  # the model section's own seed for a fresh init (None: the run's rng.seed)
    declined: str = ""  # why a factory that can build on the meta device loaded the whole model instead


@contextlib.contextmanager
def building_on_meta() -> Iterator[MetaBuild]:
    """Within the block, a factory that supports it builds on the meta device and fills the yielded request."""
    request = MetaBuild()
    token = _REQUEST.set(request)
    try:
        yield request
    finally:
        _REQUEST.reset(token)


@contextlib.contextmanager
def building_whole() -> Iterator[None]:
    """Within the block factories build as usual, whatever the engine asked: for a model that assembles others
    (a base model and its drafter, loaded from two directories), which the engine's meta-device materialisation,
    reading one directory into one model, cannot fill."""
    token = _REQUEST.set(None)
    try:
        yield
    finally:
        _REQUEST.reset(token)


def meta_request() -> MetaBuild | None:
    """The engine's pending request, for a factory to fill; None when the model is built normally. Consumed:
    a factory that builds another model inside (a wrapper around ours, say) does not see it twice."""
    request = _REQUEST.get()
    return request if request is not None and not request.built else None


def saved_key_function(model: Any) -> Callable[[str], str]:
    """Model state-dict key -> the key ``save_pretrained`` writes it under (``model_files.saved_names``), peft's
    prefix removed: how both a pretrained directory and a saved ``model/`` name the tensors."""
    from automodel.model_files import saved_names
    from automodel.training.parallel.materialize import hf_checkpoint_key

    to_saved = saved_names(model)

    def key(name: str) -> str:
        base = hf_checkpoint_key(name)
        return to_saved.get(base, base)

    return key


def build_on_meta(request: MetaBuild, build: Callable[[], Any], factory: str, weights: Path | None = None,
                  seed: int | None = None) -> Any | None:
    """``build()`` with its parameters on the meta device, ``request`` filled; None (nothing recorded) when
    ``weights`` do not hold every tensor of the model under the saved names (a checkpoint needing conversion)."""
    from automodel.training.parallel.materialize import parameters_on_meta

    with parameters_on_meta():
        model = build()
    key = saved_key_function(model)
    if weights is not None and not _covers(model, weights, key):
        request.declined = (f"the tensors in {weights} are not stored under the model's own names (a checkpoint "
                            f"{factory} converts while loading)")
        return None
    request.built, request.factory, request.weights, request.checkpoint_key, request.seed = \
        True, factory, weights, key, seed
    return model


def _covers(model: Any, weights: Path, key: Callable[[str], str]) -> bool:
    """Whether the files under ``weights`` hold every (untied) parameter and persistent buffer of ``model``."""
    from automodel.training.parallel.materialize import compare_keys

    return not compare_keys(model, weights, key)[0]


def local_weights(name_or_path: str) -> Path | None:
    """The local directory of safetensors weights for a local path or hub name (downloaded into the hub cache as
    ``from_pretrained`` would); None when there is none to read slices from (only ``.bin`` files, say)."""
    local = Path(name_or_path)
    if local.is_dir():
        return local if any(local.glob("*.safetensors")) else None
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(name_or_path, allow_patterns=_WEIGHT_PATTERNS))
    except Exception:  # noqa: BLE001 - no such repository, offline, ...: from_pretrained reports it properly
        return None
    return snapshot if any(snapshot.glob("*.safetensors")) else None


def pretrained_dtype(config: Any, weights: Path) -> Any:
    """The dtype ``from_pretrained(dtype="auto")`` picks: the config's, else the first floating tensor's."""
    import torch

    from automodel.training.parallel.materialize import weight_files

    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    from safetensors import safe_open

    for name, file in weight_files(weights).items():
        with safe_open(str(file), framework="pt") as handle:
            found = getattr(torch, _SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype(), ""), None)
        if isinstance(found, torch.dtype) and found.is_floating_point:
            return found
    return None


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
