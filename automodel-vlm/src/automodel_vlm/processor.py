"""The ``processor:`` section: a transformers processor (image processor + tokenizer + chat template).

Either ``AutoProcessor.from_pretrained`` of a directory / hub name (``load_processor``, the default), or one built
from its parts (``build_processor``): an image processor config, a tokenizer and the processor class's own
settings, for a model whose processor was never saved as one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError

PROCESSOR_KEY = "processor"


def finish_processor(processor: Any, key: str = PROCESSOR_KEY) -> Any:
    """The recipe's needs of a loaded processor: a tokenizer, a pad token (the end-of-sequence one when it has
    none) and a chat template (the tokenizer's when the processor has none)."""
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None:
        raise AutomodelError(f"{key}: built {type(processor).__name__}, which has no tokenizer; a vision-language "
                             "model needs a processor with one (AutoProcessor of the model's directory)")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(processor, "chat_template", None):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise AutomodelError(f"{key}: the processor has no chat_template (nor has its tokenizer); add "
                                 f"{key}.chat_template or use a processor that ships one")
        processor.chat_template = template
    return processor


def open_processor(processor_class: str, path: str | None, kwargs: dict[str, Any],
                   loader: Callable[..., Any] | None = None) -> Any:
    """``transformers.<processor_class>.from_pretrained(path, **kwargs)`` (or ``loader(path, **kwargs)``, which
    loads that class otherwise) with errors that name the config key; not yet finished (:func:`finish_processor`)."""
    import transformers

    key = f"{PROCESSOR_KEY}.pretrained_model_name_or_path"
    if not path:
        raise AutomodelError(f"{key}: missing (a processor directory or hub name)")
    if Path(str(path)).is_absolute() and not Path(str(path)).exists():
        raise AutomodelError(f"{key}: '{path}' does not exist")
    try:
        return (loader or getattr(transformers, processor_class).from_pretrained)(str(path), **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError/ValueError/KeyError for a bad directory
        raise AutomodelError(f"{key}: cannot load {processor_class} from '{path}': {type(err).__name__}: "
                             f"{err}") from None


def _checkpoint_json(path: str, name: str, kwargs: dict[str, Any]) -> dict:
    """``name`` of a checkpoint directory or (already downloaded / reachable) hub repository; {} if it has none."""
    local = Path(path) / name
    if Path(path).is_dir():
        found: str | None = str(local) if local.is_file() else None
    else:
        from transformers.utils import cached_file

        hub = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
        try:
            found = cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False, **hub)
        except OSError:
            found = None
    try:
        return json.loads(Path(found).read_text(encoding="utf-8")) if found else {}
    except (OSError, json.JSONDecodeError):
        return {}


def is_kimi_k25_checkpoint(path: str, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` holds a Kimi K2.5 model or processor: its config.json's ``model_type``, or the processor
    class its processor / preprocessor config names (transformers' ``Kimi_K25Processor`` or the hub checkpoint's
    remote-code ``KimiK25Processor``)."""
    from automodel_vlm.family_processors import KIMI_K25_PROCESSORS

    kwargs = kwargs or {}
    if _checkpoint_json(path, "config.json", kwargs).get("model_type") == "kimi_k25":
        return True
    for name in ("processor_config.json", "preprocessor_config.json"):
        data = _checkpoint_json(path, name, kwargs)
        named = [data.get("processor_class"), str(data.get("auto_map", {}).get("AutoProcessor", ""))]
        if any(str(n).rsplit(".", 1)[-1] in KIMI_K25_PROCESSORS for n in named if n):
            return True
    return False


def load_processor(pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                   **kwargs: Any) -> Any:
    """``transformers.AutoProcessor.from_pretrained`` with errors that name the config key (upstream's
    ``transformers.AutoProcessor.from_pretrained`` is this). A Kimi K2.5 checkpoint loads transformers' own
    ``Kimi_K25Processor`` (family_processors.kimi_k25_processor): the hub's names its remote-code processor, which
    AutoProcessor would follow or refuse. Without torchvision, a saved Qwen3-Omni or Nemotron-H Omni processor loads
    images-only with a Pillow image processor (omni.py)."""
    from automodel_vlm.omni import omni_loader

    path = pretrained_model_name_or_path or name_or_path
    if path and is_kimi_k25_checkpoint(str(path), kwargs):
        from automodel_vlm.family_processors import kimi_k25_processor

        return kimi_k25_processor(str(path), **kwargs)
    return finish_processor(open_processor("AutoProcessor", path, kwargs, loader=omni_loader(path) if path else None))


def _image_processor(value: Any) -> Any:
    from transformers import AutoImageProcessor

    key = f"{PROCESSOR_KEY}.image_processor"
    if isinstance(value, dict):
        settings = dict(value)
        kind = settings.pop("image_processor_type", None)
        if not kind:
            raise AutomodelError(f"{key}: a mapping needs 'image_processor_type' (CLIPImageProcessor, ...)")
        import transformers

        cls = _pil_fallback(getattr(transformers, kind, None), kind, key)
        return cls(**settings)
    path = Path(str(value))
    if path.is_file():  # a preprocessor_config.json itself
        path = path.parent
    try:
        return AutoImageProcessor.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001
        raise AutomodelError(f"{key}: cannot load an image processor from '{value}': {type(err).__name__}: "
                             f"{err}") from None


def _pil_fallback(cls: Any, kind: str, key: str) -> Any:
    """The class named ``kind``, or its Pillow-backed twin when the torchvision one cannot run here."""
    import importlib.util

    import transformers

    if cls is None or not isinstance(cls, type):
        raise AutomodelError(f"{key}.image_processor_type: '{kind}' is not a transformers image processor class")
    if importlib.util.find_spec("torchvision") is None:
        twin = getattr(transformers, kind + "Pil", None)
        if isinstance(twin, type):
            return twin
    return cls


def _tokenizer(value: Any) -> Any:
    from transformers import AutoTokenizer

    key = f"{PROCESSOR_KEY}.tokenizer"
    settings = dict(value) if isinstance(value, dict) else {"pretrained_model_name_or_path": value}
    path = settings.pop("pretrained_model_name_or_path", None) or settings.pop("name_or_path", None)
    if not path:
        raise AutomodelError(f"{key}: a tokenizer directory or hub name is needed")
    try:
        return AutoTokenizer.from_pretrained(str(path), **settings)
    except Exception as err:  # noqa: BLE001
        raise AutomodelError(f"{key}: cannot load a tokenizer from '{path}': {type(err).__name__}: {err}") from None


def build_processor(image_processor: Any, tokenizer: Any, processor_class: str = "LlavaProcessor",
                    chat_template: str | None = None, **kwargs: Any) -> Any:
    """A processor from its parts: ``processor_class(image_processor, tokenizer, chat_template, **kwargs)``.

    ``image_processor`` is a directory / preprocessor_config.json or a mapping with ``image_processor_type``;
    ``tokenizer`` a directory / hub name (or ``{pretrained_model_name_or_path, ...}``); ``chat_template``
    defaults to the tokenizer's. Other keys are the processor class's own (Llava: ``patch_size``,
    ``vision_feature_select_strategy``, ``num_additional_image_tokens``, ``image_token``).
    """
    import transformers

    cls = getattr(transformers, str(processor_class), None)
    if not isinstance(cls, type) or not str(processor_class).endswith("Processor"):
        raise AutomodelError(f"{PROCESSOR_KEY}.processor_class: '{processor_class}' is not a transformers processor "
                             "class (LlavaProcessor, Qwen2VLProcessor, ...)")
    tok = _tokenizer(tokenizer)
    template = chat_template or getattr(tok, "chat_template", None)
    try:
        processor = cls(image_processor=_image_processor(image_processor), tokenizer=tok, chat_template=template,
                        **kwargs)
    except (TypeError, ValueError, IndexError) as err:
        raise AutomodelError(f"{PROCESSOR_KEY}: cannot build {processor_class}: {err}") from None
    return finish_processor(processor)
