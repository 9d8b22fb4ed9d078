"""The ``processor:`` section: a transformers processor (image processor + tokenizer + chat template).

Either ``AutoProcessor.from_pretrained`` of a directory / hub name (``load_processor``, the default), or one built
from its parts (``build_processor``): an image processor config, a tokenizer and the processor class's own
settings, for a model whose processor was never saved as one.
"""

from __future__ import annotations

import importlib.util
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


def is_pixtral_checkpoint(path: str, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether AutoProcessor would build transformers' ``PixtralProcessor`` for ``path``: the processor class its
    processor / preprocessor config names, else its config.json's ``model_type`` (Mistral 3's processor)."""
    kwargs = kwargs or {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        named = _checkpoint_json(path, name, kwargs).get("processor_class")
        if named:
            return named == "PixtralProcessor"
    return _checkpoint_json(path, "config.json", kwargs).get("model_type") == "mistral3"


def _checkpoint_video_processor(path: str) -> str | None:
    """The video processor class a checkpoint names (in ``video_preprocessor_config.json`` or
    ``processor_config.json``)."""
    import json

    from transformers.utils import cached_file

    for name, inner in (("video_preprocessor_config.json", None), ("processor_config.json", "video_processor")):
        try:
            found = cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
        except Exception:  # noqa: BLE001 - a path transformers cannot read names none (loading it says why)
            found = None
        if found:
            data = json.loads(Path(found).read_text())
            data = data.get(inner) or {} if inner else data
            if isinstance(data, dict) and data.get("video_processor_type"):
                return str(data["video_processor_type"])
    return None


def _has_video_twin(path: str) -> bool:
    """Whether the checkpoint names a video processor that has a Pillow twin (the twins' module, which needs a
    recent transformers, is imported only for a checkpoint with a video processor)."""
    named = _checkpoint_video_processor(path)
    if named is None:
        return False
    from automodel_vlm.video_processors import TWINS

    return named in TWINS


def _processor_class(path: str, kwargs: dict[str, Any]) -> type:
    """The processor class AutoProcessor would build for ``path`` (its ``processor_class``, else the model type's)."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.processing_utils import ProcessorMixin

    processor_dict, _ = ProcessorMixin.get_processor_dict(path, **kwargs)
    name = processor_dict.get("processor_class")
    if not name:
        config = transformers.AutoConfig.from_pretrained(path, **kwargs)
        name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    cls = getattr(transformers, str(name), None) if name else None
    if not isinstance(cls, type):
        raise ValueError(f"cannot tell its processor class (found {name!r})")
    return cls


def _with_video_processor(video_processor: Any) -> Callable[..., Any]:
    """A loader like ``AutoProcessor.from_pretrained`` whose video processor is ``video_processor`` (None: the
    checkpoint's, on our Pillow twin), its other parts loaded by transformers' Auto classes."""
    def load(path: str, **kwargs: Any) -> Any:
        import transformers

        from automodel_vlm.video_processors import PendingVideoProcessor
        from automodel_vlm.video_processors import video_processor as load_video_processor

        video = video_processor
        if video is None:  # the checkpoint's, given the processor's settings (as transformers gives every part)
            plain = {k: v for k, v in kwargs.items() if k != "trust_remote_code"}  # the twin is ours
            video = load_video_processor(_checkpoint_video_processor(path) or "", path, **plain)
        elif isinstance(video, PendingVideoProcessor):  # its own section's settings, from this path
            video = video.build(path)
        cls = _processor_class(path, kwargs)
        loaders = {"image_processor": lambda: transformers.AutoImageProcessor.from_pretrained(path, **kwargs),
                   "tokenizer": lambda: transformers.AutoTokenizer.from_pretrained(path, **kwargs),
                   "video_processor": lambda: video}
        missing = [name for name in cls.get_attributes() if name not in loaders]
        if missing:
            raise ValueError(f"{cls.__name__} has parts ({', '.join(missing)}) this loader does not build")
        processor_dict, init_kwargs = cls.get_processor_dict(path, **kwargs)
        return cls.from_args_and_dict([loaders[name]() for name in cls.get_attributes()], processor_dict,
                                      **init_kwargs)

    return load


def load_processor(pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                   video_processor: Any = None, **kwargs: Any) -> Any:
    """``transformers.AutoProcessor.from_pretrained`` with errors that name the config key (upstream's
    ``transformers.AutoProcessor.from_pretrained`` is this).

    A Kimi K2.5 checkpoint loads transformers' own ``Kimi_K25Processor`` (family_processors.kimi_k25_processor):
    the hub's names its remote-code processor, which AutoProcessor would follow or refuse. Without torchvision, a
    saved Qwen3-Omni or Nemotron-H Omni processor loads images-only with a Pillow image processor (omni.py), and a
    checkpoint whose video processor has a Pillow twin (automodel_vlm.video_processors) gets the twin, its settings
    read from the checkpoint; a Pixtral / Mistral 3 one (transformers' ``PixtralProcessor`` needs torchvision) gets
    our twin of that processor (family_processors.pixtral_processor). ``video_processor``: one built from its own
    section (upstream's ``processor.video_processor``; without a path of its own it loads from this one)."""
    from automodel_vlm.omni import omni_loader

    path = pretrained_model_name_or_path or name_or_path
    if path and video_processor is None and is_kimi_k25_checkpoint(str(path), kwargs):
        from automodel_vlm.family_processors import kimi_k25_processor

        return kimi_k25_processor(str(path), **kwargs)
    if path and video_processor is None and not has_torchvision() and is_pixtral_checkpoint(str(path), kwargs):
        from automodel_vlm.family_processors import pixtral_processor

        return pixtral_processor(str(path), **kwargs)
    loader = omni_loader(path) if path and video_processor is None else None
    if video_processor is not None:
        loader = _with_video_processor(video_processor)
    elif loader is None and not has_torchvision() and path and _has_video_twin(str(path)):
        loader = _with_video_processor(None)
    return finish_processor(open_processor("AutoProcessor", path, kwargs, loader=loader))


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


def has_torchvision() -> bool:
    """Whether torchvision imports here (transformers' torchvision-backed processors need it; our Pillow twins
    stand in without it)."""
    return importlib.util.find_spec("torchvision") is not None


def _pil_fallback(cls: Any, kind: str, key: str) -> Any:
    """The class named ``kind``, or its Pillow-backed twin when the torchvision one cannot run here."""
    import transformers

    if cls is None or not isinstance(cls, type):
        raise AutomodelError(f"{key}.image_processor_type: '{kind}' is not a transformers image processor class")
    if not has_torchvision():
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
    if processor_class == "PixtralProcessor" and not has_torchvision():  # transformers' class needs torchvision
        from automodel_vlm.family_processors import pixtral_processor_class

        cls = pixtral_processor_class()
    if not isinstance(cls, type) or not str(processor_class).endswith("Processor"):
        raise AutomodelError(f"{PROCESSOR_KEY}.processor_class: '{processor_class}' is not a transformers processor "
                             "class (LlavaProcessor, Qwen2VLProcessor, ...)")
    if "video_processor" in kwargs:  # the twins' module needs a recent transformers: imported only when asked
        from automodel_vlm.video_processors import PendingVideoProcessor

        if isinstance(kwargs["video_processor"], PendingVideoProcessor):
            raise AutomodelError(f"{PROCESSOR_KEY}.video_processor: give it a pretrained_model_name_or_path (a "
                                 "processor built from its parts has no checkpoint to load the video processor's "
                                 "settings from)")
    tok = _tokenizer(tokenizer)
    template = chat_template or getattr(tok, "chat_template", None)
    try:
        processor = cls(image_processor=_image_processor(image_processor), tokenizer=tok, chat_template=template,
                        **kwargs)
    except (TypeError, ValueError, IndexError) as err:
        raise AutomodelError(f"{PROCESSOR_KEY}: cannot build {processor_class}: {err}") from None
    return finish_processor(processor)
