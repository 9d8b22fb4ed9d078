"""Instruction-based image editing (Qwen-Image-Edit): the conditioning of diffusers' ``QwenImageEditPlusPipeline``
and the data set of (source images, target image, instruction) it trains on.

The conditioning does what the pipeline's ``__call__`` does with its ``image`` argument, through the pipeline's own
functions, so that a transformer trained here edits through that pipeline unchanged: each source image is resized to
the pipeline's condition area (``CONDITION_IMAGE_SIZE``) and put in the prompt the Qwen2.5-VL text encoder sees
("Picture 1: <image>" before the instruction, ``encode_prompt``), and resized to its VAE area (``VAE_IMAGE_SIZE``),
encoded to the VAE latents' mode (``_encode_vae_image``), packed in 2x2 patches and appended to the noisy target's
tokens along the sequence; ``img_shapes`` lists the target's patch grid then each source's. The denoiser's prediction
for the target's tokens alone is trained.

For training, the data set sizes the images as upstream's image-edit preprocessing does (``buckets``): the target
and each source keep their aspect ratios within the pixel budget ``resolution`` (sides multiples of 32), and batches
are drawn within a bucket of samples whose images share those sizes; the sources reach the VAE at their bucket's
sizes (``source_sizes``), and the text encoder sees each original source resized as the pipeline resizes it.

The data set reads upstream's image-edit manifest (``hf_image_edit_manifest.jsonl``, what its ``image-edit``
preprocessing reads): rows ``{"id", "prompt", "media": [{"role": "target" | "context" | "condition", "file_name"}],
"metadata"}``, with media paths relative to the manifest. The ``context`` images are the sources; diffusers'
pipeline shows the text encoder the same images it encodes with the VAE, so a row's ``condition`` images must be
its ``context`` images (in order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import torch

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel.training.bucket_sampler import BucketBatchSampler
from automodel_diffusion.buckets import ALIGN, fit_area
from automodel_diffusion.conditioning import QwenImageConditioning
from automodel_diffusion.datasets import jsonl_rows

MANIFEST = "hf_image_edit_manifest.jsonl"  # upstream's name for the manifest its image-edit export writes
ROLES = ("target", "context", "condition")


class QwenImageEditConditioning(QwenImageConditioning):
    """QwenImageEditPlusPipeline (Qwen-Image-Edit 2509 / 2511): Qwen-Image's latents, timestep and denoiser call,
    conditioned on each sample's source images as the pipeline conditions on its ``image`` argument (see the module
    docstring)."""

    edits = True

    def encode(self, captions: list[str], device: torch.device, sources: list[list[Any]] | None = None,
               source_sizes: list[list[tuple[int, int]]] | None = None) -> dict[str, Any]:
        """The instructions (each seeing its sample's source images) and the sources' packed latents;
        ``sources``: per sample, its source images (Pillow); ``source_sizes``: per sample, the (width, height) each
        source is resized to for the VAE (its bucket's), else the pipeline's VAE_IMAGE_SIZE area."""
        if sources is None or len(sources) != len(captions) or not all(sources):
            raise AutomodelError("data: a QwenImageEditPlusPipeline trains on image edits (source images, a target "
                                 "image and an instruction); give data.dataloader: {_target_: nemo_automodel.components"
                                 ".datasets.diffusion.image_edit_dataset.ImageEditDataloaderConfig, cache_dir: <a "
                                 "folder with hf_image_edit_manifest.jsonl>}")
        rows, latents, shapes = [], [], []
        sizes = source_sizes or [None] * len(sources)
        for caption, images, vae_sizes in zip(captions, sources, sizes, strict=True):
            condition_images, vae_images = self.resize(images, vae_sizes)
            embeds, mask = self.pipeline.encode_prompt(prompt=[caption], image=condition_images, device=device)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=device) if mask is None else mask
            rows.append({"encoder_hidden_states": embeds[0], "encoder_hidden_states_mask": mask[0]})
            packed = [self.source_latents(image.to(device)) for image in vae_images]
            latents.append(torch.cat([p for p, _ in packed], dim=1))
            shapes.append([shape for _, shape in packed])
        if len({tuple(x.shape) for x in latents}) > 1:
            raise AutomodelError("data: the source images of one batch encode to different latent sizes (their "
                                 "aspect ratios differ, and the pipeline sizes each source by its own); use "
                                 "step_scheduler.local_batch_size 1, or ImageEditDataset, which batches within "
                                 "buckets of equal sizes")
        return {**self.join(rows), "source_latents": torch.cat(latents), "source_shapes": shapes}

    def resize(self, images: list[Any], vae_sizes: list[tuple[int, int]] | None = None
               ) -> tuple[list[Any], list[torch.Tensor]]:
        """Each source as the pipeline's ``__call__`` resizes it: (condition images for the text encoder, VAE
        inputs (1, 3, 1, height, width)); ``vae_sizes``: (width, height) per source for the VAE instead."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

        processor = self.pipeline.image_processor
        condition, vae = [], []
        for index, image in enumerate(images):
            ratio = image.size[0] / image.size[1]
            width, height = edit_plus.calculate_dimensions(edit_plus.CONDITION_IMAGE_SIZE, ratio)
            condition.append(processor.resize(image, height, width))
            width, height = (vae_sizes[index] if vae_sizes is not None
                             else edit_plus.calculate_dimensions(edit_plus.VAE_IMAGE_SIZE, ratio))
            vae.append(processor.preprocess(image, height, width).unsqueeze(2))
        return condition, vae

    def source_latents(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One source's latents (the mode of the VAE's distribution, normalised), packed, and its patch grid."""
        vae = self.pipeline.vae
        with torch.no_grad():
            latents = self.pipeline._encode_vae_image(pixels.to(vae.dtype), generator=None).squeeze(2).float()
        batch, channels, height, width = latents.shape
        packed = type(self.pipeline)._pack_latents(latents, batch, channels, height, width)
        return packed, (1, height // 2, width // 2)

    def denoise(self, denoiser, sample, timesteps, cond):
        hidden = torch.cat([sample, cond["source_latents"].to(sample.dtype)], dim=1)
        shapes = [target + sources for target, sources in zip(cond["img_shapes"], cond["source_shapes"],
                                                               strict=True)]
        prediction = denoiser(hidden_states=hidden, timestep=timesteps.to(sample.dtype) / 1000,
                              encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                              encoder_hidden_states_mask=cond["encoder_hidden_states_mask"], img_shapes=shapes,
                              return_dict=False)[0]
        return prediction[:, : sample.shape[1]]


# ---- the data set ----------------------------------------------------------------------------------------------


def _row_issue(row: Any) -> str | None:
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("media"), list):
        return "needs a text 'prompt' and a 'media' list"
    for item in row["media"]:
        if not isinstance(item, dict) or item.get("role") not in ROLES or not isinstance(item.get("file_name"), str):
            return f"each media entry needs a 'role' ({' / '.join(ROLES)}) and a 'file_name', found {item!r}"
    roles = [item["role"] for item in row["media"]]
    if roles.count("target") != 1 or "context" not in roles:
        return "needs exactly one 'target' image and at least one 'context' (source) image"
    context = [item["file_name"] for item in row["media"] if item["role"] == "context"]
    condition = [item["file_name"] for item in row["media"] if item["role"] == "condition"]
    if condition and condition != context:
        return (f"its 'condition' images {condition} differ from its 'context' images {context}: diffusers' "
                "QwenImageEditPlusPipeline shows the text encoder the same images it encodes with the VAE")
    return None


def read_manifest(path: Path, bad_rows: BadRows) -> list[dict[str, Any]]:
    """Rows ``{"prompt", "target": Path, "sources": [Path, ...]}`` of an image-edit manifest."""
    rows = []
    for number, row in jsonl_rows(path, "data.dataloader.cache_dir"):
        problem = _row_issue(row)
        files = {} if problem else {item["file_name"]: path.parent / item["file_name"] for item in row["media"]}
        missing = [name for name, file in files.items() if not file.is_file()]
        if problem or missing:
            bad_rows.bad(number - 1, f"(line {number}) " + (problem or f"its image '{missing[0]}' does not exist "
                                                                      f"(looked for '{files[missing[0]]}')"))
            continue
        rows.append({"prompt": row["prompt"],
                     "target": next(files[i["file_name"]] for i in row["media"] if i["role"] == "target"),
                     "sources": [files[i["file_name"]] for i in row["media"] if i["role"] == "context"]})
    return rows


def manifest_path(cache_dir: str) -> Path:
    """The manifest ``cache_dir`` names: a folder holding ``hf_image_edit_manifest.jsonl``, or a .jsonl file."""
    source = Path(cache_dir)
    if source.is_file() and source.suffix == ".jsonl":
        return source
    if (source / MANIFEST).is_file():
        return source / MANIFEST
    raise AutomodelError(f"data.dataloader.cache_dir: '{cache_dir}' is neither an image-edit manifest (.jsonl) nor a "
                         f"folder holding {MANIFEST} (upstream's image-edit manifest: rows {{id, prompt, media: "
                         "[{role: target | context | condition, file_name}], metadata}})")


class ImageEditDataset(torch.utils.data.Dataset):
    """Image edits from an upstream image-edit manifest (see the module docstring), sized as upstream's image-edit
    preprocessing sizes them: the target and each source keep their aspect ratios within ``resolution`` (a side:
    that square's pixels; or [height, width]: that many pixels), with sides in multiples of 32. Each sample is the
    target at its size, its source images as they are, the (width, height) each source has for the VAE, and its
    instruction; ``batch_sampler`` draws each batch within one bucket of equal sizes. A bad row is refused, or
    skipped with ``on_bad_row: skip``."""

    def __init__(self, path: str, resolution: int | list[int] = 512, on_bad_row: OnBadRow = "error"):
        sides = list(resolution) if isinstance(resolution, (list, tuple)) else [resolution, resolution]
        if len(sides) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sides):
            raise AutomodelError(f"data.dataloader.base_resolution: expected a side or [height, width] in pixels, "
                                 f"found {resolution!r}")
        height, width = sides
        if height * width < ALIGN * ALIGN:
            raise AutomodelError(f"data.dataloader.base_resolution: {resolution} is too small (at least "
                                 f"{ALIGN}x{ALIGN} pixels: images are sized in multiples of {ALIGN})")
        manifest = manifest_path(path)
        bad_rows = BadRows(on_bad_row, str(manifest), "data.dataloader")
        self.rows = read_manifest(manifest, bad_rows)
        bad_rows.report()
        if not self.rows:
            raise AutomodelError(f"data.dataloader.cache_dir: '{manifest}' has no usable rows")
        self.resolution, self.area = (height, width), height * width  # samples are drawn at (height, width)
        self.sizes = [self._sizes(row) for row in self.rows]  # per row: (target, sources...) as (width, height)

    def _sizes(self, row: dict[str, Any]) -> tuple[tuple[int, int], ...]:
        from PIL import Image

        sizes = []
        for file in [row["target"], *row["sources"]]:
            with Image.open(file) as image:  # reads the header only
                sizes.append(fit_area(*image.size, self.area))
        return tuple(sizes)

    @property
    def buckets(self) -> dict[tuple[tuple[int, int], ...], list[int]]:
        """(target size, source sizes...) -> the rows of that size, smallest total area first."""
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for index, sizes in enumerate(self.sizes):
            groups.setdefault(sizes, []).append(index)
        return dict(sorted(groups.items(), key=lambda item: (sum(w * h for w, h in item[0]), item[0])))

    def batch_sampler(self, batch_size: int, shuffle: bool, drop_last: bool, seed: int, replicas: int = 1,
                      rank: int = 0) -> BucketBatchSampler:
        """Batches within buckets (the data loader's ``batch_sampler``; ``automodel_diffusion.buckets``)."""
        return BucketBatchSampler(list(self.buckets.values()), batch_size, shuffle, drop_last, seed, replicas, rank)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from PIL import Image

        row, (target_size, *source_sizes) = self.rows[int(index)], self.sizes[int(index)]
        with Image.open(row["target"]) as target:
            pixels = target.convert("RGB").resize(target_size, Image.Resampling.LANCZOS)
        array = numpy.asarray(pixels, dtype=numpy.float32) / 127.5 - 1.0
        sources = []
        for file in row["sources"]:
            with Image.open(file) as image:
                sources.append(image.convert("RGB"))
        return {"pixel_values": torch.from_numpy(array).permute(2, 0, 1).contiguous(), "caption": row["prompt"],
                "source_images": sources, "source_sizes": source_sizes}

    @property
    def captions(self) -> list[str]:
        return [row["prompt"] for row in self.rows]

    def edits(self, count: int) -> list[tuple[str, list[Any]]]:
        """The first ``count`` rows as (instruction, source images): what training samples are drawn from."""
        return [(self[i]["caption"], self[i]["source_images"]) for i in range(min(count, len(self)))]


def collate_image_edits(samples: list[dict[str, Any]]) -> dict[str, Any]:
    sizes = {(tuple(s["pixel_values"].shape), tuple(s["source_sizes"])) for s in samples}
    if len(sizes) > 1:
        raise AutomodelError("data: a batch of image edits holds images of different sizes (their aspect ratios "
                             "differ); ImageEditDataset's batch_sampler draws each batch within one bucket of equal "
                             "sizes: build the loader with it, or use a batch size of 1")
    return {"pixel_values": torch.stack([s["pixel_values"] for s in samples]),
            "captions": [s["caption"] for s in samples], "source_images": [s["source_images"] for s in samples],
            "source_sizes": [s["source_sizes"] for s in samples]}
