"""``automodel precompute diffusion``: a pipeline's VAE and text encoders run once over a data set, into a latent cache
(``automodel_diffusion.latents``) that training with ``model.pipeline_spec.load_full_pipeline: false`` reads.

The images (clips) and captions go through the same code as training encodes them on the fly
(``AutoDiffusionPipeline.encode_pixels`` and the family's conditioning), one sample at a time; each image's latent
*distribution* is stored, so training draws the same latents encoding on the fly would.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from automodel.config import Target, require_positive
from automodel.errors import AutomodelError
from automodel.recipe import BaseRecipe


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class PrecomputeModelConfig:
    pretrained_model_name_or_path: str = field(metadata=_help(
        "the diffusers pipeline whose VAE and text encoders encode the data (a hub name or directory): the one the "
        "transformer will train with"))
    torch_dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata=_help(
        "the dtype the VAE and text encoders run in (and the cache stores)"))
    max_sequence_length: int | None = field(default=None, metadata=_help(
        "text tokens per caption, as model.max_sequence_length of the training run (null: the pipeline's default)"))
    cache_dir: str | None = field(default=None, metadata=_help("the hub download cache"))


@dataclass
class CacheOutputConfig:
    cache_dir: str = field(metadata=_help("the latent cache folder written (training's data.dataloader.cache_dir)"))
    shard_size: int = field(default=256, metadata=_help("samples per safetensors shard"))

    def __post_init__(self) -> None:
        require_positive(self, "shard_size")


class PrecomputeRecipe(BaseRecipe):
    """Encode a data set of images (or clips) and captions into a latent cache."""

    sections = {
        "model": PrecomputeModelConfig,
        "dataset": Target("the images and captions: {_target_: automodel_diffusion.datasets.ImageCaptionDataset, "
                          "path: ..., resolution: ...} (clips: VideoCaptionDataset, num_frames)", required=True),
        "output": CacheOutputConfig,
    }

    @classmethod
    def describe_plan(cls, cfg: Any) -> list[str]:
        return [*super().describe_plan(cfg), f"pipeline: {cfg.model.pretrained_model_name_or_path}",
                f"latent cache: {cfg.output.cache_dir}"]

    def log(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def setup(self) -> None:
        import torch

        from automodel_diffusion.pipeline import AutoDiffusionPipeline

        model = self.cfg.model
        kwargs = {"cache_dir": model.cache_dir} if model.cache_dir else {}
        self.model = AutoDiffusionPipeline.from_pretrained(model.pretrained_model_name_or_path,
                                                           torch_dtype=model.torch_dtype,
                                                           max_sequence_length=model.max_sequence_length, **kwargs)
        if self.model.conditioning.edits:
            raise AutomodelError(f"model: a {type(self.model.pipeline).__name__} encodes each sample's source images "
                                 "with its VAE and text encoder in every training step; it has no latent cache (train "
                                 "it on the image edits directly)")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        for component in self.model.frozen_components().values():
            component.to(self.device)
        self.dataset = self.cfg.dataset.instantiate()
        if getattr(self.dataset, "random_flip", False):
            raise AutomodelError("dataset.random_flip: a cache stores one encoding per image, so a random flip would "
                                 "be drawn once, not per epoch; set false")

    def run_train_validation_loop(self) -> None:
        import torch

        from automodel_diffusion.latents import CacheWriter

        model, conditioning = self.model, self.model.conditioning
        if getattr(model.pipeline, "vae", None) is None:
            raise AutomodelError("model: this pipeline has no VAE; a latent cache holds a VAE's latents")
        with torch.no_grad():
            empty = conditioning.split(conditioning.encode([""], self.device))[0]
            writer = CacheWriter(Path(self.cfg.output.cache_dir), self.cfg.output.shard_size, empty)
            for index in range(len(self.dataset)):
                sample = self.dataset[index]
                encoded = model.encode_pixels(sample["pixel_values"].unsqueeze(0).to(self.device))
                dist = getattr(encoded, "latent_dist", None)
                if dist is None:
                    raise AutomodelError(f"model: the {type(model.pipeline.vae).__name__} gives no latent "
                                         "distribution; the cache stores a VAE's latent distribution")
                cond = conditioning.split(conditioning.encode([sample["caption"]], self.device))[0]
                writer.add(dist.parameters[0], cond, sample["caption"])
                if (index + 1) % 100 == 0:
                    self.log(f"precompute: {index + 1}/{len(self.dataset)} samples")
        manifest = writer.finish({
            "pipeline_class": type(model.pipeline).__name__,
            "transformer_class": type(model.denoiser).__name__,
            "source": self.cfg.model.pretrained_model_name_or_path,
            "max_sequence_length": model.max_sequence_length,
            "resolution": getattr(self.dataset, "resolution", None),
            "num_frames": getattr(self.dataset, "num_frames", None),
            "vae_config": json.loads(json.dumps(dict(conditioning.vae_config))),
        })
        why = conditioning.full_pipeline_only
        how = (f"with the full pipeline ({why})" if why
               else "with the transformer alone (and model.pipeline_spec.load_full_pipeline: false)")
        self.log(f"Latent cache of {manifest['count']} samples ({manifest['pipeline_class']}) in "
                 f"{self.cfg.output.cache_dir}: train on it {how}, data.dataloader.cache_dir: "
                 f"{self.cfg.output.cache_dir}")
