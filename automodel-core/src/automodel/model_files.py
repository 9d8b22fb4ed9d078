"""What every domain's model entry points share: dtype names, "does this folder hold weights", and loading a
transformers Auto class from a checkpoint or a config — on the meta device when the engine asks for it
(``automodel.meta_build``). Torch and transformers are imported on first use."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError
from automodel.model_kwargs import apply_config_overrides, dtype_issue, dtype_name

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")

# ``from_pretrained`` keyword arguments that say how to fetch a model (a token among them), never what the model is.
# A constructor must not copy them into the model's config, where ``save_pretrained`` would write them.
HUB_ARGUMENTS = ("token", "use_auth_token", "cache_dir", "revision", "local_files_only", "force_download",
                 "proxies", "subfolder", "resume_download", "trust_remote_code")


def pop_hub_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the hub arguments in ``kwargs``: they go to ``AutoConfig.from_pretrained`` (a hub name or
    directory) and nowhere else; a config file or mapping has nothing to fetch."""
    return {name: kwargs.pop(name) for name in HUB_ARGUMENTS if name in kwargs}


def parse_dtype(value: Any, key: str = "model.dtype") -> Any:
    """``"bfloat16"`` / ``"bf16"`` / ``"torch.float16"`` (upstream's names, any case) -> the torch dtype; None,
    ``"auto"`` and dtypes pass through."""
    issue = dtype_issue(value)
    if issue is not None:
        raise AutomodelError(f"{key}: {issue}")
    if value is None or value == "auto" or not isinstance(value, str):
        return value
    import torch

    return getattr(torch, dtype_name(value))


def has_weights(directory: str | Path) -> bool:
    """Whether a local directory holds weight files (else it is a config-only, freshly initialised model)."""
    directory = Path(directory)
    return directory.is_dir() and any(any(directory.glob(p)) for p in WEIGHT_PATTERNS)


# ``from_pretrained``'s own keyword arguments (transformers 5); every other key of a model section is a config key
FROM_PRETRAINED_ARGUMENTS = (*HUB_ARGUMENTS, "config", "ignore_mismatched_sizes", "use_safetensors", "weights_only",
                             "state_dict", "output_loading_info", "dtype", "torch_dtype", "device_map", "max_memory",
                             "offload_folder", "offload_buffers", "quantization_config", "variant", "adapter_kwargs",
                             "adapter_name", "generation_config", "gguf_file", "distributed_config", "device_mesh",
                             "tp_plan", "tp_size", "use_kernels", "kernel_config", "key_mapping", "attn_implementation",
                             "experts_implementation")

# Keyword arguments of a model's construction, not of its config (``from_config`` passes them to the Auto class).
MODEL_KWARGS = ("attn_implementation", "trust_remote_code")


def pretrained_or_fresh(auto_class: Any, path: str | None, dtype: Any, from_config: Callable[..., Any],
                        kwargs: dict[str, Any], errors: tuple[type[Exception], ...] = (OSError,),
                        what: str = "") -> Any:
    """``auto_class.from_pretrained(path)``; a local directory holding only config.json gives a fresh, randomly
    initialised model of that architecture (``from_config``). Errors name the config key. When the engine asks
    (``automodel.meta_build``) and the weights are safetensors, the model is built on the meta device instead and
    its parameters are read later, each rank its own slices."""
    if not path:
        raise AutomodelError("model.pretrained_model_name_or_path: missing (a hub name or a local directory)")
    local = Path(str(path))
    if local.is_dir() and (local / "config.json").is_file() and not has_weights(local):
        own = {k: v for k, v in kwargs.items() if k in inspect.signature(from_config).parameters}  # seed, ...
        rest = _with_config(str(local), {k: v for k, v in kwargs.items() if k not in own}, errors, what)
        return from_config(rest.pop("config", str(local)), dtype=dtype, **own, **rest)
    on_meta = _pretrained_on_meta(auto_class, str(path), dtype, kwargs, errors)
    if on_meta is not None:
        return on_meta
    kwargs = _with_config(str(path), kwargs, errors, what)
    try:
        model = auto_class.from_pretrained(str(path), dtype=parse_dtype(dtype), **kwargs)
    except errors as err:
        raise AutomodelError(f"model: cannot load '{path}'{what}: {err}") from None
    return unpacked_gguf(model) if kwargs.get("gguf_file") else model


def unpacked_gguf(model: Any) -> Any:
    """A model read from a GGUF file (``gguf_file``) whose weights transformers unpacked into plain float tensors,
    without the GGUF ``quantization_config`` and quantizer transformers leaves on it.

    Left there, the model trained here would be saved with a config claiming GGUF quantization: the reloaded model
    is then refused by ``save_pretrained`` and by transformers' training as a quantized one, though its weights are
    ordinary. A model whose weights stay in GGUF blocks (non-float parameters) keeps both."""
    if any(not p.is_floating_point() for p in model.parameters()):
        return model
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _with_config(path: str, kwargs: dict[str, Any], errors: tuple[type[Exception], ...],
                 what: str) -> dict[str, Any]:
    """``kwargs`` with the config keys among them applied to the checkpoint's config, which is passed instead:
    transformers would hand a key its config lacks to the model's ``__init__`` (a TypeError), and a
    ``text_config`` mapping of a plain config too (:func:`automodel.model_kwargs.apply_config_overrides`)."""
    overrides = {k: v for k, v in kwargs.items() if k not in FROM_PRETRAINED_ARGUMENTS}
    if not overrides:
        return kwargs
    from transformers import AutoConfig

    hub = {k: v for k, v in kwargs.items() if k in HUB_ARGUMENTS}
    try:
        config = AutoConfig.from_pretrained(path, **hub)
    except errors as err:
        raise AutomodelError(f"model: cannot load '{path}'{what}: {err}") from None
    apply_config_overrides(config, overrides)
    return {**{k: v for k, v in kwargs.items() if k not in overrides}, "config": config}


def _pretrained_on_meta(auto_class: Any, path: str, dtype: Any, kwargs: dict[str, Any],
                        errors: tuple[type[Exception], ...]) -> Any | None:
    """The model of ``path`` on the meta device with its weights' directory recorded, when the engine asked for
    it and the weights can be read in slices; None otherwise (``from_pretrained`` then loads it whole). Config
    keys among ``kwargs`` are set on the checkpoint's config first; ``trust_remote_code`` is no obstacle where the
    checkpoint ships no code (a model transformers implements, as upstream's configs often ask for it)."""
    from automodel.meta_build import build_on_meta, local_weights, meta_request, pretrained_dtype

    request = meta_request()
    if request is None:
        return None
    from transformers import AutoConfig, PretrainedConfig

    given = kwargs.get("config")  # a config read from the checkpoint and changed (from_config's load_base_model)
    loading = set(kwargs) & set(FROM_PRETRAINED_ARGUMENTS) - {"attn_implementation", "trust_remote_code"} \
        - ({"config"} if isinstance(given, PretrainedConfig) else set())
    if loading:  # a revision, a subfolder, quantization, ...: left to from_pretrained
        request.declined = f"from_pretrained loads it with {', '.join(sorted(loading))}"
        return None
    weights = local_weights(path)
    if weights is None:
        request.declined = f"{path} has no safetensors weights here to read in slices"
        return None
    try:
        config = given if isinstance(given, PretrainedConfig) else AutoConfig.from_pretrained(str(weights))
    except (*errors, ValueError):
        request.declined = f"the config in {weights} names a model type only the checkpoint's own code knows"
        return None
    if kwargs.get("trust_remote_code") and getattr(config, "auto_map", None):
        request.declined = f"the checkpoint in {weights} runs its own code (auto_map, trust_remote_code)"
        return None
    apply_config_overrides(config, {k: v for k, v in kwargs.items() if k not in FROM_PRETRAINED_ARGUMENTS})
    chosen = parse_dtype(dtype) if dtype not in (None, "auto") else pretrained_dtype(config, weights)
    build = {k: v for k, v in kwargs.items() if k == "attn_implementation"}
    return build_on_meta(request, lambda: auto_class.from_config(config, dtype=chosen, **build),
                         f"{auto_class.__name__}.from_pretrained", weights=weights)


def fresh_model(build: Callable[..., Any], hf_config: Any, model_kwargs: dict[str, Any], dtype: Any,
                seed: int | None) -> Any:
    """``build(hf_config, **model_kwargs)`` (an Auto class's ``from_config``), cast to ``dtype`` when one is given.

    With a ``seed`` the weights are initialised module by module from it
    (``automodel.training.parallel.module_init.init_module_by_module``): the same values the engine gives a run
    whose ``model.seed`` (else ``rng.seed``) is that seed, on one process or on N ranks. When the engine asks
    (``automodel.meta_build``) the model is returned on the meta device and the engine initialises it so, each rank
    only its shards. Without either, transformers initialises it from torch's global generator."""
    import torch

    from automodel.meta_build import build_on_meta, meta_request

    chosen = parse_dtype(dtype)

    def construct() -> Any:
        model = build(hf_config, **model_kwargs)
        return model.to(chosen) if isinstance(chosen, torch.dtype) else model

    request = meta_request()
    if request is not None:
        owner = getattr(build, "__self__", None)  # transformers.AutoModel*.from_config is a bound classmethod
        name = f"{owner.__name__}.{build.__name__}" if isinstance(owner, type) else build.__qualname__
        return build_on_meta(request, construct, name, seed=seed)
    if seed is None:
        return construct()
    from automodel.training.parallel.materialize import materialize, parameters_on_meta

    with parameters_on_meta():
        model = construct()
    materialize(model, "cpu", seed)
    return model


def saved_names(model: Any) -> dict[str, str]:
    """The model's own state-dict key -> the key ``save_pretrained`` writes it under, for the keys transformers
    renames: some architectures (Llava among them) are saved under their original hub names
    (``language_model.model.layers...`` for ``model.language_model.layers...``). Learnt by running transformers' own
    save-time renaming on placeholder tensors, so it is exactly what the save does (and, inverted, the way back from
    such files). Empty when nothing is renamed (or the mapping converts tensors rather than renaming them)."""
    import torch

    if not hasattr(model, "config"):
        return {}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {}
    probes = {key: torch.empty(0) for key in model.state_dict()}
    key_of = {id(t): key for key, t in probes.items()}
    try:
        with _unsharded_classes(model):
            reverted = revert_weight_conversion(model, dict(probes))
    except Exception:  # noqa: BLE001 - a converting (not renaming) mapping: keys stay as they are
        return {}
    return {key_of[id(t)]: saved for saved, t in reverted.items() if id(t) in key_of and saved != key_of[id(t)]}


@contextlib.contextmanager
def _unsharded_classes(model: Any) -> Iterator[None]:
    """Within the block ``model``'s FSDP2 units have their own classes back: transformers finds an architecture's
    renaming by class name, which FSDP2's subclasses (``FSDPLlavaForConditionalGeneration``) hide, and it then
    renamed a sharded Llava's keys wrongly (``model.language_model.model.x``), which no resume could read."""
    from torch.distributed.fsdp import FSDPModule

    swapped = [(module, type(module)) for module in model.modules() if isinstance(module, FSDPModule)]
    for module, cls in swapped:
        module.__class__ = next(base for base in cls.__bases__ if base is not FSDPModule)
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
