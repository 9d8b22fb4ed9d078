"""Model entry points for configs: ``AutoModelForImageTextToText.from_pretrained`` / ``.from_config``.

They wrap transformers' ``AutoModelForImageTextToText`` (Llava, Qwen2-VL, Gemma 3, ...). transformers is imported
inside the methods, so that listing routes and validating configs stays light.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError
from automodel.model_files import MODEL_KWARGS, fresh_model, pop_hub_arguments, pretrained_or_fresh
from automodel.model_kwargs import check_config_keys, composite_model_issues, fresh_model_issues, take_model_settings

_SUB_CONFIGS = ("vision_config", "text_config")


def _read_json(path: Path, key: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise AutomodelError(f"{key}: cannot read '{path}': {err}") from None


def _config_dict(value: Any, key: str) -> dict | None:
    """A config as a plain dict: from a mapping, a config.json file or a directory holding one (None: neither)."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    path = Path(str(value))
    if path.is_file():
        return _read_json(path, key)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise AutomodelError(f"{key}: '{path}' holds no config.json")
        return _read_json(path / "config.json", key)
    return None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(config: Any, vision_config: Any = None, text_config: Any = None, **overrides: Any) -> Any:
    """A transformers config from a path / mapping / hub name; ``vision_config``/``text_config`` (a mapping merged
    into the one in ``config``, or a path to a config.json that replaces it) and top-level overrides win."""
    from transformers import AutoConfig, PretrainedConfig

    hub = pop_hub_arguments(overrides)  # to AutoConfig.from_pretrained only: never into the saved config
    if isinstance(config, PretrainedConfig) and vision_config is None and text_config is None and not overrides:
        return config
    data = _config_dict(config, "model.config")
    if data is None:  # a hub name
        try:
            data = AutoConfig.from_pretrained(str(config), **hub).to_dict()
        except OSError as err:
            raise AutomodelError(f"model.config: cannot load '{config}': {err}") from None
    for name, value in (("vision_config", vision_config), ("text_config", text_config)):
        if value is None:
            continue
        if isinstance(value, dict):
            data[name] = _merge(data.get(name) or {}, value)
        else:
            sub = _config_dict(value, f"model.{name}")
            if sub is None:
                raise AutomodelError(f"model.{name}: '{value}' is neither a mapping nor an existing config file")
            data[name] = sub
    base = {k: v for k, v in data.items() if k != "model_type"}
    data = _merge(data, overrides)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise AutomodelError("model.config: a config needs a 'model_type' (llava, qwen2_vl, ...)")
    for name in _SUB_CONFIGS:
        if isinstance(data.get(name), dict) and "model_type" not in data[name]:
            raise AutomodelError(f"model.{name}: needs a 'model_type' (clip_vision_model, llama, ...)")
    try:
        if overrides:  # a key the config lacks would be kept, read by nothing
            check_config_keys(AutoConfig.for_model(model_type, **base), overrides)
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as err:
        raise AutomodelError(f"model.config: model_type '{model_type}': {err}") from None


class AutoModelForImageTextToText:
    """Builds a ``transformers`` image-text-to-text model from a checkpoint or from a config; ``backend`` (upstream's
    BackendConfig) selects the attention (the language model's where ``attn_implementation`` gives the towers
    another), see :mod:`automodel.model_backend`; upstream's other keys
    (``use_liger_kernel``, ``force_hf``, ``use_sdpa_patching`` ...): see :mod:`automodel.model_kwargs`."""

    automodel_config_issues = staticmethod(composite_model_issues)
    auto_class = "AutoModelForImageTextToText"  # transformers' auto class that builds the model
    what = " as an image-text-to-text model"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        dtype: Any = None, torch_dtype: Any = None, **kwargs: Any) -> Any:
        import transformers

        path = pretrained_model_name_or_path or name_or_path
        finish = take_model_settings(kwargs, checkpoint=path, mtp=True)
        model = pretrained_or_fresh(getattr(transformers, cls.auto_class), path, dtype or torch_dtype,
                                    cls.from_config, kwargs, (OSError, ValueError), cls.what)
        return finish(model)

    @classmethod
    def from_config(cls, config: Any, *, vision_config: Any = None, text_config: Any = None, dtype: Any = None,
                    torch_dtype: Any = None, seed: int | None = None, **kwargs: Any) -> Any:
        """A randomly initialised model (``seed`` makes the initialisation reproducible)."""
        import transformers

        finish = take_model_settings(kwargs, mtp=True, built_from={"config": config, "text_config": text_config})
        model_kwargs = {k: kwargs.pop(k) for k in MODEL_KWARGS if k in kwargs}
        hf_config = load_config(config, vision_config, text_config, **kwargs)
        try:
            model = fresh_model(getattr(transformers, cls.auto_class).from_config, hf_config, model_kwargs,
                                dtype or torch_dtype, seed)
        except ValueError as err:
            raise AutomodelError(f"model.config: {err}") from None
        return finish(model)


AutoModelForImageTextToText.from_config.__func__.automodel_config_issues = fresh_model_issues(  # type: ignore
    AutoModelForImageTextToText.from_config)
