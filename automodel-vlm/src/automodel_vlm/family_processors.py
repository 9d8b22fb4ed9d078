"""Upstream's own processor builders for the VLM families transformers now ships itself: Inkling, MiniMax-M3-VL and
Step3.7 (upstream's ``build_inkling_processor``, ``build_minimax_m3_vl_processor``,
``Step3VLProcessor.from_pretrained``, see plugin.py), and Kimi K2.5's processor (:func:`kimi_k25_processor`, which
``AutoProcessor.from_pretrained`` of a Kimi K2.5 checkpoint loads here instead of the checkpoint's remote code).

Each loads transformers' own processor class of the family from the checkpoint (hub checkpoints name upstream's
remote-code class in ``processor_class``, which AutoProcessor would follow) and applies what upstream's builder adds
that transformers' class does not do itself. The keyword arguments are ``from_pretrained``'s; ``trust_remote_code:
true`` is refused as everywhere unless the command line trusts it (transformers then runs the checkpoint's own code
for its tokenizer and image processor where it ships some). Upstream's MiniMax builder re-attaches
``chat_template.jinja``, which the checkpoint's remote-code class dropped; transformers' class keeps it, so it only
loads.

The four families' image processors are torchvision-backed in transformers. Without torchvision (this project's
machines: PyPI's torchvision does not work with the pinned CPU torch) the builders load the checkpoint's image
processor settings into our Pillow twin of the class (image_processors.py; never the checkpoint's own image
processor code), and the tokenizer (and Inkling's audio feature extractor) as transformers would; MiniMax's and
Kimi K2.5's video processors are torchvision-only, so their processors are then images-only
(:func:`images_only_minimax_class`, :func:`images_only_kimi_k25_class`). The recipe
says so in its log (:func:`pillow_twin_note`).

Pixtral (Mistral 3 family) differs: transformers ships a Pillow image processor for it but gates the processor class
itself on torchvision, so without torchvision :func:`pixtral_processor` (which ``load_processor`` routes a Pixtral
checkpoint to) loads our twin of ``PixtralProcessor`` (:func:`pixtral_processor_class`) around transformers'
``PixtralImageProcessorPil``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from automodel_vlm.processor import finish_processor, has_torchvision, open_processor

# Inkling's end-of-sampling token: upstream's end-of-sequence (and so padding) token for a tokenizer without one
INKLING_END_OF_SAMPLING = "<|content_model_end_sampling|>"
# transformers' Kimi_K25Processor's placeholders (a tokenizer may name others as image_token / video_token)
KIMI_K25_IMAGE_TOKEN, KIMI_K25_VIDEO_TOKEN = "<|media_pad|>", "<|kimi_k25_video_placeholder|>"
# the processor classes a Kimi K2.5 checkpoint may name: transformers' own and the hub checkpoint's remote-code one
KIMI_K25_PROCESSORS = ("Kimi_K25Processor", "KimiK25Processor")
TWINS_MODULE = "automodel_vlm.image_processors"
VIDEO_TWINS_MODULE = "automodel_vlm.video_processors"


@functools.cache
def images_only_minimax_class() -> type:
    """transformers' ``MiniMaxM3VLProcessor`` without its video processor (torchvision-only): images and text only.
    It saves as ``MiniMaxM3VLProcessor`` (a machine with torchvision loads it back as that, video included)."""
    from transformers import MiniMaxM3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class MiniMaxM3VLImagesProcessor(MiniMaxM3VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any) -> None:
            self.image_token, self.video_token = self.IMAGE_TOKEN, self.VIDEO_TOKEN
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.IMAGE_TOKEN)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.VIDEO_TOKEN)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.VISION_START_TOKEN)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.VISION_END_TOKEN)

        def __call__(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any) -> Any:
            if videos is not None:  # transformers' processor would drop them silently, their tokens left in text
                raise ValueError("MiniMaxM3VLProcessor without torchvision takes no videos (transformers' MiniMax "
                                 "video processor needs torchvision): install torchvision or leave the videos out")
            return super().__call__(images=images, text=text, **kwargs)

        def to_dict(self) -> dict[str, Any]:
            return {**super().to_dict(), "processor_class": MiniMaxM3VLProcessor.__name__}

    return MiniMaxM3VLImagesProcessor


@functools.cache
def images_only_kimi_k25_class() -> type:
    """transformers' ``Kimi_K25Processor`` without its video processor (torchvision-only): images and text only.
    It saves as ``Kimi_K25Processor`` (a machine with torchvision loads it back as that, video included)."""
    from transformers import Kimi_K25Processor
    from transformers.processing_utils import ProcessorMixin

    class Kimi_K25ImagesProcessor(Kimi_K25Processor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any) -> None:
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.image_token = getattr(tokenizer, "image_token", None) or KIMI_K25_IMAGE_TOKEN
            self.video_token = getattr(tokenizer, "video_token", None) or KIMI_K25_VIDEO_TOKEN
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

        def __call__(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any) -> Any:
            if videos is not None:
                raise ValueError("Kimi_K25Processor without torchvision takes no videos (transformers' Kimi K2.5 "
                                 "video processor needs torchvision): install torchvision or leave the videos out")
            return super().__call__(images=images, text=text, **kwargs)

        def to_dict(self) -> dict[str, Any]:
            return {**super().to_dict(), "processor_class": Kimi_K25Processor.__name__}

    return Kimi_K25ImagesProcessor


def pixtral_rows(height: int, width: int, patch: int, image: str = "[IMG]", row_break: str = "[IMG_BREAK]",
                 end: str = "[IMG_END]") -> str:
    """The placeholder text of a ``height`` x ``width`` image (its ``image_sizes``, multiples of ``patch``: the vision
    patch times the spatial merge): each row of merged patches one ``image`` token a patch then ``row_break``, the
    last row's break ``end`` instead; ``(width / patch + 1) * height / patch`` tokens in all."""
    rows, columns = height // patch, width // patch
    return ((image * columns + row_break) * rows).removesuffix(row_break) + end


@functools.cache
def pixtral_processor_class() -> type:
    """A twin of transformers' ``PixtralProcessor`` (Mistral 3 family, Pixtral), which transformers gates on
    torchvision even with its Pillow image processor (``PixtralImageProcessorPil``). It builds the same inputs:
    the image processor's ``pixel_values`` and ``image_sizes`` (sizes in multiples of ``patch_size *
    spatial_merge_size``) and each image's placeholder expanded to :func:`pixtral_rows`. It saves as
    ``PixtralProcessor`` (a machine with torchvision loads it back as transformers' class)."""
    from transformers.processing_utils import ProcessorMixin

    class PixtralProcessorPil(ProcessorMixin):
        text_kwargs = {"return_tensors": "pt"}  # Pixtral's default: tensors unless asked otherwise
        images_kwargs = {"return_tensors": "pt"}

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, patch_size: int = 16,
                     spatial_merge_size: int = 1, chat_template: str | None = None,
                     image_token: str = "[IMG]", image_break_token: str = "[IMG_BREAK]",
                     image_end_token: str = "[IMG_END]", **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, chat_template=chat_template)
            self.patch_size, self.spatial_merge_size = patch_size, spatial_merge_size
            self.image_token, self.image_break_token, self.image_end_token = (image_token, image_break_token,
                                                                              image_end_token)
            ids = tokenizer.convert_tokens_to_ids([image_token, image_break_token, image_end_token])
            self.image_token_id, self.image_break_token_id, self.image_end_token_id = ids

        @property
        def image_token_ids(self) -> list[int]:
            return [self.image_token_id, self.image_break_token_id, self.image_end_token_id]

        @property
        def merged_patch(self) -> int:
            return self.patch_size * self.spatial_merge_size

        def _process_images(self, images: Any, **kwargs: Any) -> Any:
            # the image processor sizes images in merged patches, not in the tower's own
            return super()._process_images(images, **{**kwargs, "patch_size": self.merged_patch})

        def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs: Any) -> str:
            height, width = (int(v) for v in image_inputs["image_sizes"][image_idx])
            return pixtral_rows(height, width, self.merged_patch, self.image_token, self.image_break_token,
                                self.image_end_token)

        @property
        def model_input_names(self) -> list[str]:
            return [*self.tokenizer.model_input_names, *self.image_processor.model_input_names]

        def to_dict(self) -> dict[str, Any]:
            return {**super().to_dict(), "processor_class": "PixtralProcessor"}

    return PixtralProcessorPil


def pixtral_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``PixtralProcessor`` from a checkpoint; without torchvision our twin of it
    (:func:`pixtral_processor_class`) with transformers' ``PixtralImageProcessorPil``, both given the checkpoint's
    settings. :func:`automodel_vlm.processor.load_processor` routes a checkpoint naming ``PixtralProcessor`` here."""
    if has_torchvision():
        return finish_processor(open_processor("PixtralProcessor", pretrained_model_name_or_path, kwargs))
    return finish_processor(open_processor("PixtralProcessor", pretrained_model_name_or_path, kwargs,
                                           loader=_with_twin(pixtral_processor_class(), "PixtralImageProcessorPil")))


def _with_twin(processor_class: str | type, twin: str) -> Any:
    """A loader like ``processor_class.from_pretrained`` whose image processor is our Pillow ``twin`` (the
    checkpoint's image processor settings), its other parts loaded by transformers' Auto classes."""
    def load(path: str, **kwargs: Any) -> Any:
        import transformers

        from automodel_vlm import image_processors

        cls = getattr(transformers, processor_class) if isinstance(processor_class, str) else processor_class
        plain = {k: v for k, v in kwargs.items() if k != "trust_remote_code"}  # the twin is ours, no remote code
        twin_class = getattr(image_processors, twin, None) or getattr(transformers, twin)  # ours, or transformers'
        loaders = {"image_processor": lambda: twin_class.from_pretrained(path, **plain),
                   "tokenizer": lambda: transformers.AutoTokenizer.from_pretrained(path, **kwargs),
                   "feature_extractor": lambda: transformers.AutoFeatureExtractor.from_pretrained(path, **kwargs)}
        processor_dict, init_kwargs = cls.get_processor_dict(path, **kwargs)
        parts = [loaders[name]() for name in cls.get_attributes()]
        return cls.from_args_and_dict(parts, processor_dict, **init_kwargs)

    return load


def _open(processor_class: str, twin: str, path: str | None, kwargs: dict[str, Any],
          without_torchvision: Callable[[], type] | None = None) -> Any:
    """transformers' ``processor_class`` from ``path``; without torchvision, the same class (or the one
    ``without_torchvision`` gives) with our Pillow ``twin`` as its image processor."""
    if has_torchvision():
        return open_processor(processor_class, path, kwargs)
    cls = without_torchvision() if without_torchvision is not None else processor_class
    return open_processor(processor_class, path, kwargs, loader=_with_twin(cls, twin))


def pillow_twin_note(processor: Any) -> str | None:
    """The log line of a processor whose image or video processor is our Pillow twin (None for any other)."""
    video = getattr(processor, "video_processor", None)
    if type(video).__module__ == VIDEO_TWINS_MODULE:
        name = type(video).__name__
        return (f"processor: torchvision is not installed, so the video processor is {VIDEO_TWINS_MODULE}.{name}, "
                f"our Pillow twin of transformers' {name.removesuffix('Pil')} (same outputs up to Pillow's "
                "resampling)")
    if type(processor) is pixtral_processor_class():
        return ("processor: torchvision is not installed (transformers' PixtralProcessor needs it), so the processor "
                f"is {__name__}.PixtralProcessorPil, our twin of it, with transformers' PixtralImageProcessorPil "
                "(same outputs up to Pillow's resampling)")
    image_processor = getattr(processor, "image_processor", None)
    if type(image_processor).__module__ != TWINS_MODULE:
        return None
    name = type(image_processor).__name__
    note = (f"processor: torchvision is not installed, so the image processor is {TWINS_MODULE}.{name}, our Pillow "
            f"twin of transformers' {name.removesuffix('Pil')} (same outputs up to Pillow's resampling)")
    if getattr(processor, "video_token", None) and not hasattr(processor, "video_processor"):
        note += "; the processor takes no videos (transformers' video processors need torchvision)"
    return note


def inkling_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``InklingProcessor``; a tokenizer without an end-of-sequence token gets Inkling's
    end-of-sampling token as it (and as the pad token), as upstream's builder does."""
    processor = _open("InklingProcessor", "InklingImageProcessorPil", pretrained_model_name_or_path, kwargs)
    if processor.tokenizer.eos_token_id is None:
        processor.tokenizer.eos_token = INKLING_END_OF_SAMPLING
    return finish_processor(processor)


def minimax_m3_vl_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``MiniMaxM3VLProcessor`` (its chat template from the checkpoint's ``chat_template.jinja``)."""
    return finish_processor(_open("MiniMaxM3VLProcessor", "MiniMaxM3VLImageProcessorPil",
                                  pretrained_model_name_or_path, kwargs, without_torchvision=images_only_minimax_class))


def step3p7_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``Step3p7Processor`` (global view plus local patch crops per image)."""
    return finish_processor(_open("Step3p7Processor", "Step3p7ImageProcessorPil", pretrained_model_name_or_path,
                                  kwargs))


def kimi_k25_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``Kimi_K25Processor`` (one ``<|media_pad|>`` per merged patch of an image), whatever processor
    class the checkpoint names: the hub's Kimi-K2.5 names its remote-code ``KimiK25Processor``, which
    :func:`automodel_vlm.processor.load_processor` routes here; its image processor settings are read by
    transformers' class (or our Pillow twin) from the checkpoint's ``preprocessor_config.json``."""
    return finish_processor(_open("Kimi_K25Processor", "Kimi_K25ImageProcessorPil", pretrained_model_name_or_path,
                                  kwargs, without_torchvision=images_only_kimi_k25_class))
