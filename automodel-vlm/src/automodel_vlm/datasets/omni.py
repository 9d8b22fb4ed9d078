"""Collation for the omni families on image and text data: upstream's ``nemotron_omni_collate_fn`` and
``qwen3_omni_collate_fn`` (the processor renders, tokenises and batches; labels on the assistant turns only).

Audio and video rows are refused when a batch is made: no audio or video decoder is installed here (upstream reads
video files with decord and audio with its own readers), and the VLM recipe trains on images and text. A row
carries audio or video when a message part has type ``audio``, ``input_audio`` or ``video`` (or the sample an
``audio``, ``audios``, ``video`` or ``videos`` entry).

- Nemotron-H Omni: each message's parts become one string, an image as the processor's image token (``<image>``),
  rendered with the tokenizer's chat template, as upstream does (the family's template reads string content); the
  processor then expands each image token into ``<img>`` + one token per merged patch + ``</img>``.
- Qwen3-Omni: the processor's chat template renders the parts (an image as vision start, image pad, vision end);
  the processor expands the image pads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel_vlm.datasets.collate import Rendered, VLMCollator

MEDIA_PARTS = {"audio": "audio", "input_audio": "audio", "video": "video"}
MEDIA_KEYS = {"audio": "audio", "audios": "audio", "video": "video", "videos": "video"}
_WHY = ("audio and video inputs are not supported here: no audio or video decoder is installed and the VLM recipe "
        "trains on images and text; leave such rows out of the data set")
_NO_FRAMES = ("upstream's frames read per video; no video is read here (no video decoder is installed and the VLM "
              "recipe trains on images and text): remove the key")


def refuse_audio_video(samples: list[dict[str, Any]]) -> None:
    """An error naming the first sample of the batch that carries audio or video."""
    for index, sample in enumerate(samples):
        for key, kind in MEDIA_KEYS.items():
            if sample.get(key) not in (None, [], ()):
                raise AutomodelError(f"collate_fn: sample {index + 1} of the batch carries {kind} (its '{key}' "
                                     f"entry); {_WHY}")
        for message in sample.get("messages") or []:
            content = message.get("content") if isinstance(message, Mapping) else None
            for part in content if isinstance(content, list) else []:
                kind = MEDIA_PARTS.get(part.get("type")) if isinstance(part, Mapping) else None
                if kind is not None:
                    raise AutomodelError(f"collate_fn: sample {index + 1} of the batch carries {kind} (a "
                                         f"{{'type': '{part.get('type')}'}} part in a '{message.get('role')}' "
                                         f"message); {_WHY}")


class Qwen3OmniCollator(VLMCollator):
    """Upstream's ``qwen3_omni_collate_fn`` on images and text: :class:`VLMCollator` (``max_length``,
    ``drop_overlong``, ``pad_to_multiple_of``) refusing audio and video rows. ``use_audio_in_video``: upstream reads
    a video's sound track with it; only ``false`` (no videos, so no sound from them) is accepted."""

    def __init__(self, processor: Any, use_audio_in_video: bool = False, max_length: int | None = None,
                 drop_overlong: bool = False, pad_to_multiple_of: int | None = None):
        if use_audio_in_video:
            raise AutomodelError(f"collate_fn.use_audio_in_video: {_WHY}")
        super().__init__(processor, max_length, drop_overlong, pad_to_multiple_of)

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        if kwargs.get("use_audio_in_video"):
            return {"use_audio_in_video": "true reads the sound track of each video; " + _WHY
                    + ", or set it false"}
        return {}

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        refuse_audio_video(samples)
        return super().__call__(samples)


def flatten_parts(messages: list[dict], image_token: str) -> list[dict]:
    """The messages with list content joined into one string, an image part as ``image_token``."""
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(image_token if part.get("type") == "image" else str(part.get("text", ""))
                              for part in content)
        flat.append({**message, "content": content})
    return flat


class _TokenizerTemplate:
    """The processor seen by :func:`~automodel_vlm.datasets.collate.assistant_mask`: its tokenizer's chat template
    renders (Nemotron-H Omni's reads string content)."""

    def __init__(self, processor: Any):
        self.tokenizer = processor.tokenizer

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


class NemotronOmniCollator(VLMCollator):
    """Upstream's ``nemotron_omni_collate_fn`` on images and text: message parts joined into strings (an image as
    the image token) and rendered with the tokenizer's chat template, then :class:`VLMCollator`'s batching
    (``max_length``: rows padded to it, longer ones cut, as upstream) refusing audio and video rows.
    ``max_video_frames`` (upstream's frames read per video) is refused at validation: no video is read here."""

    def __init__(self, processor: Any, max_length: int | None = None, max_video_frames: int | None = None,
                 drop_overlong: bool = False, pad_to_multiple_of: int | None = None):
        if max_video_frames is not None:
            raise AutomodelError(f"collate_fn.max_video_frames: {_NO_FRAMES}")
        super().__init__(processor, max_length, drop_overlong, pad_to_multiple_of)
        self.image_token = getattr(processor, "image_token", None) or "<image>"
        self.renderer = _TokenizerTemplate(processor)

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        return {"max_video_frames": _NO_FRAMES} if kwargs.get("max_video_frames") is not None else {}

    def _rendered(self, samples: list[dict[str, Any]]) -> list[Rendered]:
        from automodel_vlm.datasets.collate import assistant_mask

        return [assistant_mask(self.renderer, flatten_parts(s["messages"], self.image_token)) for s in samples]

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        refuse_audio_video(samples)
        return super().__call__(samples)
