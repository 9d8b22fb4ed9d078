"""Model entry points for configs: ``AutoModelForCausalLM.from_pretrained`` / ``.from_config``.

transformers is imported inside the methods, so that listing routes and validating configs stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError
from automodel.model_files import has_weights, parse_dtype, pop_hub_arguments


def _load_config(config: Any, hub: dict[str, Any], **overrides: Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):
        data = dict(config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise AutomodelError("model.config: a config mapping needs a 'model_type' (llama, qwen2, ...)")
        return AutoConfig.for_model(model_type, **{**data, **overrides})  # overrides win over the file's keys
    path = Path(str(config))
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        return _load_config(data, hub, **overrides)
    from automodel_llm.datasets.loading import missing_local_path

    if missing_local_path(str(config)):
        raise AutomodelError(f"model.config: '{config}' does not exist")
    return AutoConfig.from_pretrained(str(config), **hub, **overrides)


class AutoModelForCausalLM:
    """Builds a ``transformers`` causal LM: from a checkpoint (``from_pretrained``) or a config (``from_config``)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        dtype: Any = None, torch_dtype: Any = None, **kwargs: Any) -> Any:
        import transformers

        path = pretrained_model_name_or_path or name_or_path
        if not path:
            raise AutomodelError("model.pretrained_model_name_or_path: missing (a hub name or a local directory)")
        local = Path(str(path))
        if local.is_dir() and (local / "config.json").is_file() and not has_weights(local):
            # A directory with only config.json: a fresh, randomly initialised model of that architecture.
            return cls.from_config(str(local), dtype=dtype or torch_dtype, **kwargs)
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=parse_dtype(dtype or torch_dtype), **kwargs)
        except OSError as err:
            raise AutomodelError(f"model: cannot load '{path}': {err}") from None

    @classmethod
    def from_config(cls, config: Any, *, dtype: Any = None, torch_dtype: Any = None, seed: int | None = None,
                    **kwargs: Any) -> Any:
        import torch
        import transformers

        hub = pop_hub_arguments(kwargs)  # to AutoConfig.from_pretrained only: never into the saved config
        model_kwargs = {k: v for k, v in (("attn_implementation", kwargs.pop("attn_implementation", None)),
                                          ("trust_remote_code", hub.get("trust_remote_code"))) if v is not None}
        hf_config = _load_config(config, hub, **kwargs)
        if seed is not None:
            torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, **model_kwargs)
        chosen = parse_dtype(dtype or torch_dtype)
        return model.to(chosen) if isinstance(chosen, torch.dtype) else model


def nemotron_h_for_causal_lm(name_or_path: str | None = None, pretrained_model_name_or_path: str | None = None,
                             **kwargs: Any) -> Any:
    """The NemotronH architecture through transformers (upstream's ``NemotronHForCausalLM``)."""
    path = pretrained_model_name_or_path or name_or_path
    local = Path(str(path))
    if local.is_dir() and (local / "config.json").is_file():
        config = json.loads((local / "config.json").read_text(encoding="utf-8"))
        if config.get("model_type") != "nemotron_h":
            import warnings

            warnings.warn(f"model.name_or_path: '{path}' holds a '{config.get('model_type')}' model, not NemotronH; "
                          "loading it as its own architecture", stacklevel=2)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)
