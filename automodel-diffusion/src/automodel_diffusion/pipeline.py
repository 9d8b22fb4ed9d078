"""``AutoDiffusionPipeline``: a diffusers pipeline as the module the engine trains.

``from_pretrained`` / ``from_config`` load every component of a diffusers pipeline (denoiser — transformer or
UNet —, VAE, text encoders, tokenizers, scheduler). The result is a ``torch.nn.Module`` whose parameters are
those of the *trained* components only (the denoiser unless ``trainable_components`` says otherwise), so the
engine's optimizer, freezing, sharding, device placement and checkpoint tracking act on exactly those; the full
diffusers pipeline stays reachable as ``.pipeline`` (frozen components live there, outside the tracked state).

Its ``forward(pixel_values, captions, generator=None)`` is one diffusion training step's loss: images through
the frozen VAE to latents, captions through the frozen text encoder(s), noise and timesteps drawn by the
objective, the denoiser's prediction compared with the objective's target. It returns the loss of each sample.
With ``cached`` (a batch of a latent cache, ``automodel_diffusion.latents``) the VAE's latent distributions and
the text encoders' outputs come from the cache instead, so ``load_transformer_only`` needs no VAE or text encoder.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel.model_files import has_weights, parse_dtype
from automodel_diffusion import stages
from automodel_diffusion.conditioning import (
    DENOISER_CLASSES,
    DENOISER_PIPELINES,
    SUPPORTED,
    GuidedConditioning,
    conditioning_for,
)

DENOISERS = ("transformer", "unet")
# The libraries a model_index.json may name for a component. The file is data from the model directory: importing
# whatever module it names would run a local `<name>.py` (the working directory is on sys.path under torchrun).
COMPONENT_LIBRARIES = ("diffusers", "transformers")


def index_issue(index: dict[str, Any]) -> str | None:
    """Why a pipeline directory's model_index.json names a pipeline this recipe cannot train (None: it can)."""
    components = pipeline_components(index)
    denoiser = next((components[name][1] for name in DENOISERS if name in components), None)
    other = denoiser in DENOISER_PIPELINES and index.get("_class_name") not in DENOISER_PIPELINES[denoiser]
    if denoiser in DENOISER_CLASSES and not other:
        return None
    return (f"the pipeline is a {index.get('_class_name')} with a {denoiser or 'no'} denoiser, which diffusion "
            f"training does not support here; supported: {SUPPORTED}")


def read_model_index(path: str | Path) -> dict[str, Any] | None:
    """A local pipeline directory's ``model_index.json`` (None when ``path`` is not one)."""
    index = Path(str(path)) / "model_index.json"
    if not index.is_file():
        return None
    return json.loads(index.read_text(encoding="utf-8"))


def pipeline_components(index: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """component name -> (library, class name) of the components a model index names (nulls left out)."""
    return {name: (value[0], value[1]) for name, value in index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] and value[1]}


def _load_component(library: str, class_name: str, directory: Path, dtype: torch.dtype | None) -> Any:
    """One component from its subfolder: weights when it has them, a fresh initialisation from its config if not."""
    import diffusers
    import transformers

    if library not in COMPONENT_LIBRARIES:
        raise AutomodelError(f"model: component '{directory.name}' names the library '{library}'; only "
                             f"{' and '.join(COMPONENT_LIBRARIES)} components are loaded")
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError) as err:
        raise AutomodelError(f"model: component '{directory.name}' names {library}.{class_name}, which cannot be "
                             f"imported: {err}") from None
    if isinstance(cls, type) and issubclass(cls, diffusers.SchedulerMixin):
        return cls.from_pretrained(str(directory))
    if isinstance(cls, type) and issubclass(cls, (diffusers.ModelMixin, transformers.PreTrainedModel)):
        if has_weights(directory):
            return cls.from_pretrained(str(directory), torch_dtype=dtype) if library == "diffusers" else \
                cls.from_pretrained(str(directory), dtype=dtype)
        if issubclass(cls, diffusers.ModelMixin):
            model = cls.from_config(cls.load_config(str(directory)))
        else:
            model = cls(transformers.AutoConfig.from_pretrained(str(directory)))
        return model.to(dtype) if dtype is not None else model
    if video_processor_unavailable(library, class_name):
        return images_only_processor(cls, directory)
    if hasattr(cls, "from_pretrained"):  # tokenizers, processors, feature extractors
        return cls.from_pretrained(str(directory))
    raise AutomodelError(f"model: component '{directory.name}' ({library}.{class_name}) is neither a model, a "
                         "scheduler nor a tokenizer/processor; cannot load it")


def video_processor_unavailable(library: str, class_name: str) -> bool:
    """Whether a transformers processor has a video processor, which needs torchvision, and torchvision is absent."""
    import importlib.util

    import transformers

    cls = getattr(transformers, class_name, None) if library == "transformers" else None
    return (isinstance(cls, type) and issubclass(cls, transformers.ProcessorMixin)
            and "video_processor" in cls.get_attributes() and importlib.util.find_spec("torchvision") is None)


@functools.cache
def _images_only(cls: type) -> type:
    """``cls`` without its video processor (same name and module, so a saved pipeline still names ``cls``)."""

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def images_only_processor(cls: type, directory: Path) -> Any:
    """A processor (Qwen2-VL's: what QwenImageEditPlusPipeline shows the text encoder its images with) from its image
    processor and tokenizer, without the video processor transformers would also load, which needs torchvision (not
    installed here); image pipelines never pass it videos."""
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        images, tokenizer = AutoImageProcessor.from_pretrained(str(directory)), AutoTokenizer.from_pretrained(
            str(directory))
    except (OSError, ValueError) as err:
        raise AutomodelError(f"model: cannot load the {cls.__name__} in '{directory}': {err}") from None
    return _images_only(cls)(images, tokenizer, getattr(tokenizer, "chat_template", None))


def load_pipeline(path: str | Path, dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """A diffusers pipeline from a hub name or a directory.

    A directory where some model component has only its ``config.json`` is assembled component by component
    (those are freshly initialised); anything else goes through ``diffusers.DiffusionPipeline.from_pretrained``
    (``kwargs``: its options, e.g. ``variant``).
    """
    import diffusers

    index = read_model_index(path)
    root = Path(str(path))
    models = {name: spec for name, spec in (pipeline_components(index) if index else {}).items()
              if (root / name / "config.json").is_file()}
    images_only = any(video_processor_unavailable(*spec) for spec in (pipeline_components(index) if index else {}
                                                                      ).values())
    if index is None or (all(has_weights(root / name) for name in models) and not images_only):
        try:
            return diffusers.DiffusionPipeline.from_pretrained(str(path), torch_dtype=dtype, **kwargs)
        except (OSError, ValueError) as err:
            raise AutomodelError(f"model: cannot load the diffusers pipeline '{path}': {err}") from None
    if kwargs:
        raise AutomodelError(f"model: {', '.join(sorted(kwargs))}: not accepted for '{path}', which is assembled "
                             "component by component (some have no weights yet, or a processor is loaded without its "
                             "video processor)")
    components = {name: None for name, value in index.items() if not name.startswith("_") and isinstance(value, list)}
    for name, (library, class_name) in pipeline_components(index).items():
        components[name] = _load_component(library, class_name, root / name, dtype)
    pipeline_cls = getattr(diffusers, index.get("_class_name", ""), None)
    if pipeline_cls is None:
        raise AutomodelError(f"model: '{root / 'model_index.json'}' names pipeline class "
                             f"'{index.get('_class_name')}', which diffusers does not have")
    extra = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
    return pipeline_cls(**components, **extra)


def model_class(module: Any) -> type:
    """The module's own class (FSDP2's ``fully_shard`` swaps in a ``FSDP<Class>`` subclass)."""
    return next(k for k in type(module).__mro__ if not k.__name__.startswith("FSDP"))


def _denoiser_name(pipeline: Any) -> str:
    for name in DENOISERS:
        if isinstance(getattr(pipeline, name, None), torch.nn.Module):
            return name
    raise AutomodelError(f"model: the {type(pipeline).__name__} has no denoiser (a 'transformer' or 'unet' "
                         f"component); supported: {SUPPORTED}")


class AutoDiffusionPipeline(torch.nn.Module):
    """The trainable part of a diffusers pipeline as one module; the pipeline itself is ``.pipeline``."""

    def __init__(self, pipeline: Any, trainable_components: Iterable[str] | None = None,
                 max_sequence_length: int | None = None, guidance_scale: float | None = None,
                 vae_config: Any = None, stage: str | None = None, boundary_ratio: float | None = None):
        super().__init__()
        self.pipeline = pipeline  # not a Module: a plain attribute, outside parameters() and state_dict()
        boundary = stages.check_pipeline(pipeline, stage, boundary_ratio)
        # a two-expert stage: the flow-matching sigmas its expert trains on (None: the objective's own range)
        self.sigma_range = None if boundary is None else stages.sigma_range(stage, boundary)
        self.denoiser_name = stages.EXPERTS[stage] if stage else _denoiser_name(pipeline)
        if stage and trainable_components and list(trainable_components) != [self.denoiser_name]:
            raise AutomodelError(f"model.trainable_components: model.stage {stage} trains {self.denoiser_name}; "
                                 "remove trainable_components")
        modules = {n: c for n, c in pipeline.components.items() if isinstance(c, torch.nn.Module)}
        names = list(trainable_components or [self.denoiser_name])
        for name in names:
            if name not in modules:
                raise AutomodelError(f"model.trainable_components: '{name}' is not a model component of this "
                                     f"{type(pipeline).__name__} (it has: {', '.join(modules)})")
        self.trainable_components = names
        self.components = torch.nn.ModuleDict({n: modules[n] for n in names})
        for name, module in modules.items():
            module.requires_grad_(name in names)
            if name not in names:
                module.eval()
        self.objective: Any = None  # set by the recipe (automodel_diffusion.objectives)
        self.autocast_dtype: torch.dtype | None = None  # the trained denoiser computes in this dtype (autocast)
        self.max_sequence_length = max_sequence_length
        self.transformer_only = vae_config is not None  # loaded without VAE and text encoders (a latent cache)
        self.conditioning = conditioning_for(pipeline, self.denoiser_name, max_sequence_length, vae_config)
        if isinstance(self.conditioning, GuidedConditioning):
            self.conditioning.set_guidance(None, guidance_scale, "model.guidance_scale")
        elif guidance_scale is not None:
            raise AutomodelError(f"model.guidance_scale: applies to FLUX.1 (FluxPipeline) and FLUX.2 (Flux2Pipeline) "
                                 f"only; this is a "
                                 f"{type(pipeline).__name__}: remove it")

    # ---- construction (what configs name) -----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        trainable_components: list[str] | None = None, dtype: Any = None, torch_dtype: Any = None,
                        max_sequence_length: int | None = None, guidance_scale: float | None = None,
                        stage: str | None = None, boundary_ratio: float | None = None,
                        **kwargs: Any) -> AutoDiffusionPipeline:
        """Load a diffusers pipeline (hub name or directory); only ``trainable_components`` train (the denoiser).

        ``max_sequence_length``: text tokens of the T5 slot of SD3-style and FLUX.1 pipelines, of the prompt
        embeddings of Qwen-Image, FLUX.2, Wan and LTX-2 (None: the pipeline's default, 256 / 512 / 1024 / 512 / 512 /
        1024); pass the same
        value to the pipeline when sampling from the trained checkpoint. ``guidance_scale``: the guidance value a
        guidance-distilled FLUX.1 / FLUX.2 transformer (its config's ``guidance_embeds``) is fed in training (None:
        the pipeline's default, 3.5 for FluxPipeline, 4 for Flux2Pipeline); refused for other denoisers. ``stage``
        (``high_noise`` / ``low_noise``) and ``boundary_ratio`` (None: the pipeline config's): which expert of a
        two-transformer Wan 2.2 pipeline trains, on which sigmas (``automodel_diffusion.stages``).
        """
        path = pretrained_model_name_or_path or name_or_path
        if not path:
            raise AutomodelError("model.pretrained_model_name_or_path: missing (a hub name or a pipeline directory)")
        pipeline = load_pipeline(path, parse_dtype(dtype or torch_dtype), **kwargs)
        return cls(pipeline, trainable_components, max_sequence_length, guidance_scale, stage=stage,
                   boundary_ratio=boundary_ratio)

    @classmethod
    def from_config(cls, config: str, *, trainable_components: list[str] | None = None, dtype: Any = None,
                    torch_dtype: Any = None, max_sequence_length: int | None = None,
                    guidance_scale: float | None = None, seed: int | None = None, stage: str | None = None,
                    boundary_ratio: float | None = None) -> AutoDiffusionPipeline:
        """A pipeline directory of configs (``model_index.json`` + one folder per component), freshly initialised
        where a component has no weights; tokenizers and the scheduler are read from their folders (``stage``,
        ``boundary_ratio``: as in ``from_pretrained``)."""
        if read_model_index(config) is None:
            raise AutomodelError(f"model.config: '{config}' is not a pipeline directory (no model_index.json)")
        if seed is not None:
            torch.manual_seed(seed)
        return cls(load_pipeline(config, parse_dtype(dtype or torch_dtype)), trainable_components, max_sequence_length,
                   guidance_scale, stage=stage, boundary_ratio=boundary_ratio)

    @classmethod
    def load_transformer_only(cls, path: str, transformer_cls: str, subfolder: str = "transformer",
                              pretrained: bool = True, dtype: Any = None, max_sequence_length: int | None = None,
                              guidance_scale: float | None = None, **kwargs: Any) -> AutoDiffusionPipeline:
        """The pipeline ``path`` with only its transformer (``subfolder``, a diffusers ``transformer_cls``: its
        weights, or with ``pretrained`` false fresh ones from its config) and its scheduler; the VAE is its config
        alone and there are no text encoders: it trains on a latent cache. ``kwargs``: download options
        (``cache_dir``)."""
        import diffusers
        from diffusers.configuration_utils import FrozenDict

        try:
            index = dict(diffusers.DiffusionPipeline.load_config(path, **kwargs))
        except (OSError, ValueError) as err:
            raise AutomodelError(f"model: cannot read the model_index.json of '{path}': {err}") from None
        parts = pipeline_components(index)
        for name in (subfolder, "scheduler", "vae"):
            if name not in parts or parts[name][0] != "diffusers":
                raise AutomodelError(f"model: '{path}' has no diffusers '{name}' component; training on a latent "
                                     "cache loads the transformer, the scheduler and the VAE's config from it")
        if index.get("_class_name") == "HunyuanVideo15Pipeline":
            raise AutomodelError("model.pipeline_spec.load_full_pipeline: false is not available for HunyuanVideo 1.5: "
                                 "diffusers' HunyuanVideo15Pipeline cannot be built without its VAE (it reads the "
                                 "VAE's config when built); load the full pipeline (a latent cache trains it too)")
        if parts[subfolder][1] != transformer_cls:
            raise AutomodelError(f"model.pipeline_spec.transformer_cls: '{transformer_cls}', but the pipeline's "
                                 f"'{subfolder}' is a {parts[subfolder][1]}")
        pipeline_cls, transformer_type = (getattr(diffusers, n, None) for n in (index.get("_class_name"),
                                                                                transformer_cls))
        if pipeline_cls is None or transformer_type is None:
            raise AutomodelError(f"model: '{path}' names {index.get('_class_name')} / {transformer_cls}, which "
                                 "diffusers does not have")
        torch_dtype = parse_dtype(dtype)
        if pretrained:
            transformer = transformer_type.from_pretrained(path, subfolder=subfolder, torch_dtype=torch_dtype,
                                                           **kwargs)
        else:
            transformer = transformer_type.from_config(transformer_type.load_config(path, subfolder=subfolder,
                                                                                    **kwargs))
            transformer = transformer.to(torch_dtype) if torch_dtype is not None else transformer
        scheduler = getattr(diffusers, parts["scheduler"][1]).from_pretrained(path, subfolder="scheduler", **kwargs)
        vae_config = FrozenDict(getattr(diffusers, parts["vae"][1]).load_config(path, subfolder="vae", **kwargs))
        components = {name: None for name, value in index.items() if not name.startswith("_")
                      and isinstance(value, list)}
        extra = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
        pipeline = pipeline_cls(**{**components, subfolder: transformer, "scheduler": scheduler}, **extra)
        return cls(pipeline, [subfolder], max_sequence_length, guidance_scale, vae_config)

    # ---- the components --------------------------------------------------------------------------------------

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.denoiser_name)

    def frozen_components(self) -> dict[str, torch.nn.Module]:
        return {n: c for n, c in self.pipeline.components.items()
                if isinstance(c, torch.nn.Module) and n not in self.trainable_components}

    def idle_experts(self) -> dict[str, torch.nn.Module]:
        """A two-expert stage's other transformer: frozen and never run in training, so it stays off the training
        device (as upstream drops it) and joins it only while samples are drawn (``experts_on``)."""
        if self.sigma_range is None:
            return {}
        return {n: c for n, c in self.frozen_components().items() if n in stages.EXPERTS.values()}

    @contextlib.contextmanager
    def experts_on(self, device: torch.device) -> Iterator[None]:
        """The idle expert on ``device`` for the duration (the pipeline's sampling runs both experts)."""
        idle = self.idle_experts()
        homes = {name: next(module.parameters()).device for name, module in idle.items()}
        for module in idle.values():
            module.to(device)
        try:
            yield
        finally:
            for name, module in idle.items():
                module.to(homes[name])

    # ---- the training loss -----------------------------------------------------------------------------------

    def encode_pixels(self, pixel_values: torch.Tensor) -> Any:
        """The VAE's encoding of the images: its ``latent_dist`` (or ``latents``, for a deterministic VAE)."""
        vae = self.pipeline.vae
        with torch.set_grad_enabled(torch.is_grad_enabled() and "vae" in self.trainable_components):
            return self.conditioning.vae_encode(vae, self.conditioning.vae_input(pixel_values.to(vae.dtype)))

    def encode_images(self, pixel_values: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if getattr(self.pipeline, "vae", None) is None:
            return pixel_values  # a pixel-space pipeline
        encoded = self.encode_pixels(pixel_values)
        with torch.set_grad_enabled(torch.is_grad_enabled() and "vae" in self.trainable_components):
            dist = getattr(encoded, "latent_dist", None)
            latents = dist.sample(generator=generator) if dist is not None else encoded.latents
        return self.conditioning.normalize(latents)

    def cached_inputs(self, cached: dict[str, Any], captions: list[str], generator: torch.Generator | None
                      ) -> tuple[torch.Tensor, dict[str, Any]]:
        """(latents, text conditioning) of a latent cache's batch: a latent drawn from each cached distribution as
        ``encode_images`` draws it, and each caption's cached encoding (a dropped caption's: the empty one's)."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        dist = DiagonalGaussianDistribution(cached["latent_parameters"])
        latents = self.conditioning.normalize(dist.sample(generator=generator))
        rows = [cached["empty_conditions"] if caption == "" else row
                for caption, row in zip(captions, cached["conditions"], strict=True)]
        return latents, self.conditioning.join(rows)

    def denoiser_precision(self, device: torch.device) -> Any:
        """torch.autocast to ``autocast_dtype`` around the denoiser (parameters stay in their stored dtype)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def forward(self, pixel_values: torch.Tensor | None, captions: list[str],
                generator: torch.Generator | None = None, cached: dict[str, Any] | None = None,
                source_images: list[list[Any]] | None = None,
                source_sizes: list[list[tuple[int, int]]] | None = None) -> torch.Tensor:
        """Per-sample losses of one micro-batch (noise and timesteps from ``generator``, else torch's global RNG);
        ``cached``: the batch of a latent cache, in place of ``pixel_values`` and the captions' encoding;
        ``source_images``: per sample, the images an image-editing pipeline edits (Pillow); ``source_sizes``: the
        (width, height) each has for the VAE (its aspect-ratio bucket's), else the pipeline's own sizing."""
        if self.objective is None:
            raise AutomodelError("AutoDiffusionPipeline: no objective set (the diffusion recipe sets one)")
        captions = self.objective.drop_captions(captions, generator)
        if cached is not None:
            latents, cond = self.cached_inputs(cached, captions, generator)
            latents = latents.float()
        elif self.transformer_only:
            raise AutomodelError("data: this transformer was loaded without its VAE and text encoders "
                                 "(model.pipeline_spec.load_full_pipeline: false); it trains on a latent cache only")
        else:
            latents = self.encode_images(pixel_values, generator).float()
            text_trains = any(n.startswith("text_encoder") or n == "connectors" for n in self.trainable_components)
            sources = {"sources": source_images, "source_sizes": source_sizes} if self.conditioning.edits else {}
            if source_images is not None and not sources:
                raise AutomodelError(f"data: the batches hold source images (image-editing data), but a "
                                     f"{type(self.pipeline).__name__} does not edit images; use a "
                                     "QwenImageEditPlusPipeline, or text-to-image data")
            with torch.set_grad_enabled(torch.is_grad_enabled() and text_trains):
                cond = self.conditioning.encode(captions, latents.device, **sources)
        latents, positions = self.conditioning.pack(latents)
        positions.update(self.conditioning.clean_inputs(latents, generator))
        noisy, timesteps, target = self.objective.noise(latents, generator)
        cond = {**cond, **positions}
        cond.update(self.conditioning.noise_streams(cond, timesteps / self.objective.num_train_timesteps, generator))
        denoiser = self.components[self.denoiser_name] if self.denoiser_name in self.components else self.denoiser
        with self.denoiser_precision(latents.device):
            prediction, streams = self.conditioning.denoise_streams(denoiser, noisy.to(self.denoiser.dtype),
                                                                    timesteps, cond)
        losses = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
        weights = self.objective.loss_weights(timesteps)
        losses = losses if weights is None else losses * weights.to(losses.device, losses.dtype)
        return losses if streams is None else losses + streams.to(losses.dtype)
