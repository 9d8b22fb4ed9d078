"""Model entry points for configs: ``AutoModelForCausalLM`` / ``AutoModelForSeq2SeqLM`` ``.from_pretrained`` /
``.from_config``.

transformers is imported inside the methods, so that listing routes and validating configs stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError
from automodel.model_files import HUB_ARGUMENTS, MODEL_KWARGS, fresh_model, pop_hub_arguments, pretrained_or_fresh
from automodel.model_kwargs import (
    apply_config_overrides,
    check_config_keys,
    fresh_model_issues,
    model_issues,
    mtp_model_issues,
    take_model_settings,
)


def _load_config(config: Any, hub: dict[str, Any], **overrides: Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        apply_config_overrides(config, overrides)
        return config
    if isinstance(config, dict):
        data = dict(config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise AutomodelError("model.config: a config mapping needs a 'model_type' (llama, qwen2, ...)")
        check_config_keys(AutoConfig.for_model(model_type, **data), overrides)
        return AutoConfig.for_model(model_type, **{**data, **overrides})  # overrides win over the file's keys
    path = Path(str(config))
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        return _load_config(data, hub, **overrides)
    from automodel.config.model_paths import missing_location

    if missing_location(str(config)):
        raise AutomodelError(f"model.config: '{config}' does not exist")
    loaded = AutoConfig.from_pretrained(str(config), **hub)
    apply_config_overrides(loaded, overrides)  # a key the config lacks is refused, not dropped
    return loaded


def base_checkpoint(config: Any) -> str:
    """The checkpoint whose weights ``from_config(config, load_base_model=True)`` loads: a loaded config's
    ``name_or_path`` (upstream's config nodes give it beside ``pretrained_model_name_or_path``: a config class's
    ``from_pretrained`` leaves it empty), or ``config`` itself as a directory or hub name."""
    from transformers import PretrainedConfig

    found = getattr(config, "name_or_path", None) if isinstance(config, PretrainedConfig) else \
        None if isinstance(config, dict) or Path(str(config)).is_file() else str(config)
    if not found:
        raise AutomodelError("model.load_base_model: true loads the weights of the checkpoint model.config names, "
                             "and this model.config names none: give model.config.name_or_path (the checkpoint, as "
                             "upstream's configs do beside pretrained_model_name_or_path) or model.config as the "
                             "checkpoint's directory or hub name, or set load_base_model: false for a fresh model")
    return found


class _AutoModelFactory:
    """Builds a ``transformers`` model of the Auto class ``auto_class``: from a checkpoint (``from_pretrained``) or a
    config (``from_config``). ``backend`` (upstream's BackendConfig) selects the attention, see
    :mod:`automodel.model_backend`; upstream's other keys (``use_liger_kernel``, ``force_hf``, ``use_sdpa_patching``
    ...): see :mod:`automodel.model_kwargs`. ``mtp``: the recipe trains MTP heads the keys ask for (else refused)."""

    auto_class = "AutoModelForCausalLM"
    mtp = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        dtype: Any = None, torch_dtype: Any = None, **kwargs: Any) -> Any:
        path = pretrained_model_name_or_path or name_or_path
        finish = take_model_settings(kwargs, checkpoint=path, mtp=cls.mtp)
        model = pretrained_or_fresh(cls.auto_for(path, kwargs), path, dtype or torch_dtype, cls.from_config, kwargs)
        return finish(model)

    @classmethod
    def from_config(cls, config: Any, *, dtype: Any = None, torch_dtype: Any = None, seed: int | None = None,
                    load_base_model: bool = False, **kwargs: Any) -> Any:
        """A fresh model of ``config``; with ``load_base_model`` (upstream's key) the model of ``config`` as changed
        here, its weights read from the checkpoint ``config`` was read from (:func:`base_checkpoint`)."""
        base = base_checkpoint(config) if load_base_model else None
        finish = take_model_settings(kwargs, checkpoint=base, mtp=cls.mtp, built_from={"config": config})
        hub = pop_hub_arguments(kwargs)  # to AutoConfig.from_pretrained only: never into the saved config
        model_kwargs = {k: kwargs.pop(k, hub.get(k)) for k in MODEL_KWARGS if k in kwargs or k in hub}
        text_config = kwargs.pop("text_config", None)  # a mapping of the text model's keys: set after loading
        hf_config = _load_config(config, hub, **kwargs)
        if text_config is not None:
            apply_config_overrides(hf_config, {"text_config": text_config})
        if base is not None:
            model = pretrained_or_fresh(cls.auto_for(hf_config), base, dtype or torch_dtype, cls.from_config,
                                        {**hub, **model_kwargs, "config": hf_config})
        else:
            model = fresh_model(cls.auto_for(hf_config).from_config, hf_config, model_kwargs, dtype or torch_dtype,
                                seed)
        return finish(model)

    @classmethod
    def auto_for(cls, config: Any, kwargs: dict[str, Any] | None = None) -> Any:
        """The transformers Auto class that builds ``config`` (a config, or a checkpoint's name or directory read
        with the hub arguments of ``kwargs``)."""
        import transformers

        return getattr(transformers, cls.auto_class)


_AutoModelFactory.from_config.__func__.automodel_config_issues = fresh_model_issues(  # type: ignore[attr-defined]
    _AutoModelFactory.from_config)


class AutoModelForCausalLM(_AutoModelFactory):
    """A ``transformers`` causal LM (``AutoModelForCausalLM``), from a checkpoint or a config. A model type that
    transformers builds only as an image-text-to-text model (Muse Glimmer, a Llava) is built by
    ``AutoModelForImageTextToText``, as upstream's ``NeMoAutoModelForCausalLM`` builds the architecture a checkpoint
    names whatever its kind."""

    automodel_config_issues = staticmethod(mtp_model_issues)

    @classmethod
    def auto_for(cls, config: Any, kwargs: dict[str, Any] | None = None) -> Any:
        import transformers
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        )

        if not isinstance(config, transformers.PretrainedConfig):
            hub = {k: v for k, v in (kwargs or {}).items() if k in HUB_ARGUMENTS or k == "gguf_file"}
            try:
                config = transformers.AutoConfig.from_pretrained(str(config), **hub)
            except Exception:  # noqa: BLE001  (unreadable here: loading it says why, with the key)
                return transformers.AutoModelForCausalLM
        kind = getattr(config, "model_type", None)
        if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return transformers.AutoModelForImageTextToText
        return transformers.AutoModelForCausalLM


class AutoModelForSeq2SeqLM(_AutoModelFactory):
    """A ``transformers`` encoder-decoder LM (``AutoModelForSeq2SeqLM``: T5, BART, ...), from a checkpoint or a
    config (upstream's ``NeMoAutoModelForSeq2SeqLM``). The same model keys act as for a causal LM, but MTP heads
    (next-next-token heads of a decoder-only model) are refused. The recipe feeds it ``decoder_input_ids`` and pairs
    ``logits[i]`` with ``labels[i]`` (see :func:`automodel_llm.datasets.make_seq2seq_dataset`)."""

    auto_class = "AutoModelForSeq2SeqLM"
    mtp = False
    automodel_config_issues = staticmethod(model_issues)


class AutoModelForSequenceClassification(_AutoModelFactory):
    """A ``transformers`` sequence classifier (``AutoModelForSequenceClassification``: an encoder such as BERT /
    RoBERTa with its ``classifier``, or a causal LM with a ``score`` head), from a checkpoint or a config
    (upstream's ``NeMoAutoModelForSequenceClassification``); ``num_labels`` sets the head's width. A base checkpoint
    without the head (``roberta-large``) gets a freshly initialised one, as transformers does."""

    auto_class = "AutoModelForSequenceClassification"
    mtp = False
    automodel_config_issues = staticmethod(model_issues)


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
