"""Omni models (image + video + audio + text) trained here on images and text: Nemotron-H Omni and Qwen3-Omni.

transformers ships both families natively (``nemotron_h_omni``, ``qwen3_omni_moe``); nothing runs remote code.

- Model: upstream's ``NeMoAutoModelForMultimodalLM.from_pretrained`` is :class:`AutoModelForMultimodalLM`. A Qwen3-Omni
  checkpoint (``qwen3_omni_moe``: a thinker, and a talker with its code-to-wave decoder that speak) gives its
  *thinker*, ``Qwen3OmniMoeThinkerForConditionalGeneration``, the part that reads text, images (and audio) and
  writes text; the talker is not built. What transformers loads as an image-text-to-text model (Nemotron-H Omni, a
  saved thinker, any VLM) loads as :class:`~automodel_vlm.models.AutoModelForImageTextToText` does. Other
  multimodal-LM families (speech recognisers, Qwen2.5-Omni, Phi-4-multimodal) are refused with the reason.
- Processor: both families' video processors (and Nemotron's image processor) are torchvision-only in transformers;
  without torchvision their processors load here images-only (:func:`omni_processor_class`), the image processor
  being transformers' Pillow Qwen2-VL class or our Nemotron twin (image_processors.py). A call with videos is
  refused; audio still goes through the processor's own feature extractor, but the collators refuse audio rows.
  Gemma 4 (an image-text-to-text model whose processor also has a torchvision-only video processor) loads the same
  way, with transformers' Pillow Gemma 4 image processor.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError
from automodel_vlm.models import AutoModelForImageTextToText

QWEN3_OMNI = "qwen3_omni_moe"
# multimodal-LM families transformers ships but the VLM recipe cannot train, with the reason
_UNSUPPORTED_FAMILIES = {
    "qwen2_5_omni": "Qwen2.5-Omni's thinker is not wired here (only Qwen3-Omni's is)",
    "phi4_multimodal": "Phi-4-multimodal needs audio collation, which is not implemented",
}
# processor class -> its Pillow image processor class (in automodel_vlm.image_processors, else transformers)
OMNI_PROCESSORS = {
    "Qwen3OmniMoeProcessor": "Qwen2VLImageProcessorPil",
    "NemotronH_Omni_Reasoning_V3Processor": "NemotronH_Omni_Reasoning_V3ImageProcessorPil",
    "Gemma4Processor": "Gemma4ImageProcessorPil",
}


def _model_type(path: str, kwargs: dict[str, Any]) -> str | None:
    """The checkpoint's ``model_type`` (None where its config cannot be read: the loader then says why)."""
    from transformers import AutoConfig

    hub = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
    try:
        return AutoConfig.from_pretrained(str(path), **hub).model_type
    except (OSError, ValueError):
        return None


def _refuse_unsupported(model_type: str | None, key: str) -> None:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    )

    if model_type is None or model_type == QWEN3_OMNI or model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return
    if model_type in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        reason = _UNSUPPORTED_FAMILIES.get(model_type, "it is an audio (speech) model; the VLM recipe trains on "
                                                       "images and text")
        raise AutomodelError(f"{key}: model_type '{model_type}' is not supported by the VLM recipe: {reason}; the "
                             "omni families trained here are Qwen3-Omni (its thinker) and Nemotron-H Omni, and "
                             "image-text-to-text models")


class _WholeQwen3Omni(AutoModelForImageTextToText):
    """The whole Qwen3-Omni model (transformers builds it through its multimodal-LM auto class)."""

    auto_class = "AutoModelForMultimodalLM"
    what = " as a Qwen3-Omni model"


class AutoModelForMultimodalLM:
    """Upstream's ``NeMoAutoModelForMultimodalLM``: Qwen3-Omni's thinker from a Qwen3-Omni checkpoint, otherwise an
    image-text-to-text model (Nemotron-H Omni, ...) as :class:`AutoModelForImageTextToText` loads it; the keyword
    arguments are the same (``backend``, ``dtype``, upstream's model keys)."""

    automodel_config_issues = AutoModelForImageTextToText.automodel_config_issues

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        **kwargs: Any) -> Any:
        path = pretrained_model_name_or_path or name_or_path
        model_type = _model_type(str(path), kwargs) if path else None
        _refuse_unsupported(model_type, "model.pretrained_model_name_or_path")
        if model_type != QWEN3_OMNI:
            return AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        # the whole model without its talker (enable_audio_output: false), then its thinker
        return _WholeQwen3Omni.from_pretrained(path, enable_audio_output=False, **kwargs).thinker

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> Any:
        """A randomly initialised model (as :meth:`AutoModelForImageTextToText.from_config`; a Qwen3-Omni config
        gives its thinker)."""
        from automodel_vlm.models import load_config

        model_type = load_config(config).model_type
        _refuse_unsupported(model_type, "model.config")
        if model_type != QWEN3_OMNI:
            return AutoModelForImageTextToText.from_config(config, **kwargs)
        return _WholeQwen3Omni.from_config(config, enable_audio_output=False, **kwargs).thinker


# ---- processors -----------------------------------------------------------------------------------------------------

@functools.cache
def omni_processor_class(name: str) -> type:
    """transformers' processor class ``name`` (one of :data:`OMNI_PROCESSORS`) without its video processor
    (torchvision-only): images, text (and audio) only. It saves as ``name`` (a machine with torchvision loads it back
    as that, videos included)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    base = getattr(transformers, name)

    class _WithoutVideo(ProcessorMixin):
        """Between the family's class and ProcessorMixin (in the method resolution order): the family's own
        ``__init__`` sets its attributes (token names and ids, audio settings) and hands its parts on to this one,
        which leaves the video processor out."""

        def __init__(self, *args: Any, video_processor: Any = None, **kwargs: Any) -> None:
            # the order in which the family's __init__ hands its parts on
            order = (("image_processor", "video_processor", "tokenizer", "feature_extractor")
                     if name.startswith("Nemotron") else
                     ("image_processor", "video_processor", "feature_extractor", "tokenizer"))
            parts = dict(zip(order, args, strict=False))
            parts.pop("video_processor", None)
            ProcessorMixin.__init__(self, **parts, **kwargs)

    class ImagesOnly(base, _WithoutVideo):
        def __init__(self, image_processor: Any = None, feature_extractor: Any = None, tokenizer: Any = None,
                     chat_template: str | None = None, **kwargs: Any) -> None:
            base.__init__(self, image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                          feature_extractor=feature_extractor, chat_template=chat_template, **kwargs)

        def __call__(self, *args: Any, videos: Any = None, **kwargs: Any) -> Any:
            if videos is not None:
                raise ValueError(f"{name} without torchvision takes no videos (transformers' video processor of "
                                 "this family needs torchvision): leave the videos out")
            return super().__call__(*args, **kwargs)

        def to_dict(self) -> dict[str, Any]:
            return {**super().to_dict(), "processor_class": name}

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = name + "ImagesOnly"
    return ImagesOnly


def saved_processor_class(path: str) -> str | None:
    """The ``processor_class`` a local processor directory was saved as (None: not a local directory, or none)."""
    folder = Path(str(path))
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        try:
            value = json.loads((folder / name).read_text(encoding="utf-8")).get("processor_class")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        if value:
            return value
    return None


def omni_loader(path: str) -> Any:
    """For a saved omni processor on a machine without torchvision, a loader of it images-only with its Pillow image
    processor (see :func:`automodel_vlm.processor.open_processor`); None otherwise (transformers loads it)."""
    from automodel_vlm.family_processors import _with_twin, has_torchvision

    name = saved_processor_class(path)
    if name not in OMNI_PROCESSORS or has_torchvision():
        return None
    return _with_twin(omni_processor_class(name), OMNI_PROCESSORS[name])
