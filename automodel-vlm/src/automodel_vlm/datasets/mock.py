"""Synthetic image conversations (upstream's ``build_mock_vlm_dataset``): random-noise pictures and filler text, to
try a model, a parallel layout or a sequence length with no data to download.

A sample is a user turn with the image(s) and the prompt, then an assistant turn with the response, in the form of
:class:`~automodel_vlm.datasets.ImageTextChatDataset`'s samples (``{messages, images}``), so the recipe's collation
and loss apply unchanged. The responses are made when the data set is built (given ones cycled over the samples,
else words drawn at random); the images are drawn when a sample is read, from a generator seeded by ``seed`` and the
sample's index, so the same seed gives the same samples whatever order or worker reads them.

``max_length`` sizes every sample to at most that many tokens as the processor counts them (chat template and
expanded image tokens included): a generated response has ``max_length`` words and is cut to what the prompt and
images leave, so each sample fills ``max_length`` to within a few tokens; a given response longer than that room is
cut the same way. (Upstream cuts its pre-tokenized samples to ``max_length``; here samples stay conversations that
the collator tokenises, so the response is cut instead.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from automodel.errors import AutomodelError
from automodel_vlm.datasets.collate import render

# Filler for generated responses; any words do, the model only has to see text of the asked length.
WORDS = ("a small red boat drifts past the old stone harbour wall while gulls circle above grey water and a "
         "fisherman mends his nets beside crates of fresh silver fish under a pale morning sky full of low "
         "clouds that promise rain before noon reaches the quiet town").split()
# Words in a generated response when no max_length sizes it (upstream's length).
DEFAULT_WORDS = 256


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """What is wrong with the arguments, by name: checked at validation and again when built directly."""
    issues = {}
    for name in ("num_samples", "num_images_per_sample"):
        if name in kwargs and not _is_int(kwargs[name], 1):
            issues[name] = f"must be a whole number >= 1, found {kwargs[name]!r}"
    size = kwargs.get("image_size", (1, 1))
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(_is_int(v, 1) for v in size)):
        issues["image_size"] = f"must be [width, height], two whole numbers >= 1, found {size!r}"
    if not isinstance(kwargs.get("prompt", ""), str):
        issues["prompt"] = f"must be text, found {kwargs['prompt']!r}"
    responses = kwargs.get("responses")
    if responses is not None and not (isinstance(responses, (list, tuple)) and responses
                                      and all(isinstance(r, str) for r in responses)):
        issues["responses"] = (f"must be a non-empty list of texts (cycled over the samples), or null for generated "
                               f"ones; found {responses!r}")
    if kwargs.get("max_length") is not None and not _is_int(kwargs["max_length"], 1):
        issues["max_length"] = (f"must be a whole number >= 1 (tokens per sample) or null, found "
                                f"{kwargs['max_length']!r}")
    if "seed" in kwargs and not _is_int(kwargs["seed"], 0):
        issues["seed"] = f"must be a whole number >= 0, found {kwargs['seed']!r}"
    if kwargs.get("pretokenize"):
        issues["pretokenize"] = ("true pre-tokenizes samples for upstream's sequence packing, which is not "
                                 "implemented: the collator tokenises each batch (collate_fn.max_length pads or cuts "
                                 "it to a fixed length); remove pretokenize or set it false")
    if "processor" in kwargs:
        issues["processor"] = "the recipe passes its own processor: set it in the processor: section, not here"
    return issues


class MockVLMDataset(Dataset):
    """``num_samples`` conversations about ``num_images_per_sample`` random-noise RGB images of ``image_size``
    ([width, height]) each; ``processor`` (the recipe's) measures samples when ``max_length`` is set.

    ``pretokenize`` is upstream's switch for its pre-tokenizing wrapper: false (nothing is pre-tokenized here) is
    accepted, true refused (see :func:`config_issues`).
    """

    def __init__(self, num_samples: int = 10, num_images_per_sample: int = 1,
                 image_size: list[int] | tuple[int, int] = (256, 256), prompt: str = "Describe this image.",
                 responses: list[str] | None = None, max_length: int | None = None, seed: int = 0,
                 pretokenize: bool = False, processor: Any = None, config_key: str = "dataset"):
        given = dict(num_samples=num_samples, num_images_per_sample=num_images_per_sample, image_size=image_size,
                     prompt=prompt, responses=responses, max_length=max_length, seed=seed, pretokenize=pretokenize)
        issues = config_issues(given)
        if issues:
            name, message = next(iter(issues.items()))
            raise AutomodelError(f"{config_key}.{name}: {message}")
        if max_length is not None and processor is None:
            raise AutomodelError(f"{config_key}.max_length: sizing samples in tokens needs the processor (the VLM "
                                 "recipe passes its own); give processor=... or leave max_length out")
        self.num_samples, self.num_images, self.image_size = num_samples, num_images_per_sample, tuple(image_size)
        self.prompt, self.seed = prompt, seed
        texts = [responses[i % len(responses)] if responses else self._words(i, max_length or DEFAULT_WORDS)
                 for i in range(num_samples)]
        if max_length is not None:
            texts = _Sizer(processor, self.conversation, self.images(0), max_length, config_key).fit_all(texts)
        self.responses = texts

    def _words(self, index: int, count: int) -> str:
        rng = np.random.default_rng((self.seed, index, 1))
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=count))

    def images(self, index: int) -> list[Any]:
        """The sample's random-noise images, the same for the same seed and index."""
        from PIL import Image

        width, height = self.image_size
        rng = np.random.default_rng((self.seed, index, 0))
        return [Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))
                for _ in range(self.num_images)]

    def conversation(self, response: str) -> list[dict[str, Any]]:
        user = [{"type": "image"} for _ in range(self.num_images)] + [{"type": "text", "text": self.prompt}]
        return [{"role": "user", "content": user},
                {"role": "assistant", "content": [{"type": "text", "text": response}]}]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"messages": self.conversation(self.responses[index]), "images": self.images(index)}

    automodel_config_issues = staticmethod(config_issues)


class _Sizer:
    """Cuts responses so that their samples are at most ``max_length`` tokens as the collator will see them: the
    rendered conversation's tokens plus what expanding the image placeholders adds (the same for every sample, as
    every image has the same size)."""

    def __init__(self, processor: Any, conversation: Any, images: list[Any], max_length: int, key: str):
        self.processor, self.tokenizer, self.conversation = processor, processor.tokenizer, conversation
        self.max_length, self.key, self.num_images = max_length, key, len(images)
        text = render(processor, conversation(""))
        expanded = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
        self.image_tokens = expanded["input_ids"].shape[1] - self._count(text)
        self.room = max_length - self.length("")

    def _count(self, text: str) -> int:
        return len(self._ids(text))

    def _ids(self, text: str) -> list[int]:
        # verbose=False: a long response is measured here to be cut, not fed to the model as it is
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def length(self, response: str) -> int:
        return self._count(render(self.processor, self.conversation(response))) + self.image_tokens

    def fit_all(self, responses: list[str]) -> list[str]:
        if self.room < 1:
            raise AutomodelError(f"{self.key}.max_length: {self.max_length} tokens leave no room for a response: the "
                                 f"prompt and {self.num_images} image(s) already take {self.length('')}; raise "
                                 "max_length, or use a smaller image_size or fewer images")
        fitted: dict[str, str] = {}  # given responses repeat: each is cut once
        for response in responses:
            if response not in fitted:
                fitted[response] = self.fit(response)
        return [fitted[r] for r in responses]

    def fit(self, response: str) -> str:
        ids = self._ids(response)[: self.room]
        text = self.tokenizer.decode(ids)
        while (over := self.length(text) - self.max_length) > 0:  # the cut re-tokenised may differ by a token
            ids = ids[: max(len(ids) - over, 0)]
            text = self.tokenizer.decode(ids)
        return text
