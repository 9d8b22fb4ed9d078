"""``AutoDiffusionPipeline``: a diffusers pipeline as the module the engine trains.

``from_pretrained`` / ``from_config`` load every component of a diffusers pipeline (denoiser — transformer or
UNet —, VAE, text encoders, tokenizers, scheduler). The result is a ``torch.nn.Module`` whose parameters are
those of the *trained* components only (the denoiser unless ``trainable_components`` says otherwise), so the
engine's optimizer, freezing, sharding, device placement and checkpoint tracking act on exactly those; the full
diffusers pipeline stays reachable as ``.pipeline`` (frozen components live there, outside the tracked state).

Its ``forward(pixel_values, captions, generator=None)`` is one diffusion training step's loss: images through
the frozen VAE to latents, captions through the frozen text encoder(s), noise and timesteps drawn by the
objective, the denoiser's prediction compared with the objective's target. It returns the loss of each sample.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError, ConfigError, ConfigIssue
from automodel.model_files import has_weights, parse_dtype

DENOISERS = ("transformer", "unet")
# The libraries a model_index.json may name for a component. The file is data from the model directory: importing
# whatever module it names would run a local `<name>.py` (the working directory is on sys.path under torchrun).
COMPONENT_LIBRARIES = ("diffusers", "transformers")
_SUPPORTED = ("SD3Transformer2DModel (StableDiffusion3Pipeline), FluxTransformer2DModel (FluxPipeline, FLUX.1) and "
              "UNet2DConditionModel (StableDiffusionPipeline)")
# the denoisers a Conditioning exists for
DENOISER_CLASSES = ("SD3Transformer2DModel", "FluxTransformer2DModel", "UNet2DConditionModel")
DEFAULT_GUIDANCE = 3.5  # FluxPipeline's default guidance_scale: what a guidance-distilled FLUX.1 samples with


def index_issue(index: dict[str, Any]) -> str | None:
    """Why a pipeline directory's model_index.json names a pipeline this recipe cannot train (None: it can)."""
    components = pipeline_components(index)
    denoiser = next((components[name][1] for name in DENOISERS if name in components), None)
    if denoiser in DENOISER_CLASSES:
        return None
    return (f"the pipeline is a {index.get('_class_name')} with a {denoiser or 'no'} denoiser, which diffusion "
            f"training does not support here; supported: {_SUPPORTED}")


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
    if hasattr(cls, "from_pretrained"):  # tokenizers, processors, feature extractors
        return cls.from_pretrained(str(directory))
    raise AutomodelError(f"model: component '{directory.name}' ({library}.{class_name}) is neither a model, a "
                         "scheduler nor a tokenizer/processor; cannot load it")


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
    if index is None or all(has_weights(root / name) for name in models):
        try:
            return diffusers.DiffusionPipeline.from_pretrained(str(path), torch_dtype=dtype, **kwargs)
        except (OSError, ValueError) as err:
            raise AutomodelError(f"model: cannot load the diffusers pipeline '{path}': {err}") from None
    if kwargs:
        raise AutomodelError(f"model: {', '.join(sorted(kwargs))}: not accepted for '{path}', whose components "
                             f"{', '.join(n for n in models if not has_weights(root / n))} have no weights yet")
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
                         f"component); supported: {_SUPPORTED}")


class AutoDiffusionPipeline(torch.nn.Module):
    """The trainable part of a diffusers pipeline as one module; the pipeline itself is ``.pipeline``."""

    def __init__(self, pipeline: Any, trainable_components: Iterable[str] | None = None,
                 max_sequence_length: int | None = None, guidance_scale: float | None = None):
        super().__init__()
        self.pipeline = pipeline  # not a Module: a plain attribute, outside parameters() and state_dict()
        self.denoiser_name = _denoiser_name(pipeline)
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
        self.conditioning = conditioning_for(pipeline, self.denoiser_name, max_sequence_length)
        if isinstance(self.conditioning, FluxConditioning):
            self.conditioning.set_guidance(None, guidance_scale, "model.guidance_scale")
        elif guidance_scale is not None:
            raise AutomodelError(f"model.guidance_scale: applies to FLUX.1 (FluxPipeline) only; this is a "
                                 f"{type(pipeline).__name__}: remove it")

    # ---- construction (what configs name) -----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        trainable_components: list[str] | None = None, dtype: Any = None, torch_dtype: Any = None,
                        max_sequence_length: int | None = None, guidance_scale: float | None = None,
                        **kwargs: Any) -> AutoDiffusionPipeline:
        """Load a diffusers pipeline (hub name or directory); only ``trainable_components`` train (the denoiser).

        ``max_sequence_length``: text tokens of the T5 slot of SD3-style and FLUX.1 pipelines (None: the
        pipeline's default, 256 / 512); pass the same value to the pipeline when sampling from the trained
        checkpoint. ``guidance_scale``: the guidance value a guidance-distilled FLUX.1 transformer (its config's
        ``guidance_embeds``) is fed in training (None: 3.5, FluxPipeline's default); refused for other denoisers.
        """
        path = pretrained_model_name_or_path or name_or_path
        if not path:
            raise AutomodelError("model.pretrained_model_name_or_path: missing (a hub name or a pipeline directory)")
        pipeline = load_pipeline(path, parse_dtype(dtype or torch_dtype), **kwargs)
        return cls(pipeline, trainable_components, max_sequence_length, guidance_scale)

    @classmethod
    def from_config(cls, config: str, *, trainable_components: list[str] | None = None, dtype: Any = None,
                    torch_dtype: Any = None, max_sequence_length: int | None = None,
                    guidance_scale: float | None = None, seed: int | None = None) -> AutoDiffusionPipeline:
        """A pipeline directory of configs (``model_index.json`` + one folder per component), freshly initialised
        where a component has no weights; tokenizers and the scheduler are read from their folders."""
        if read_model_index(config) is None:
            raise AutomodelError(f"model.config: '{config}' is not a pipeline directory (no model_index.json)")
        if seed is not None:
            torch.manual_seed(seed)
        return cls(load_pipeline(config, parse_dtype(dtype or torch_dtype)), trainable_components, max_sequence_length,
                   guidance_scale)

    # ---- the components --------------------------------------------------------------------------------------

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.denoiser_name)

    def frozen_components(self) -> dict[str, torch.nn.Module]:
        return {n: c for n, c in self.pipeline.components.items()
                if isinstance(c, torch.nn.Module) and n not in self.trainable_components}

    # ---- the training loss -----------------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        vae = getattr(self.pipeline, "vae", None)
        if vae is None:
            return pixel_values  # a pixel-space pipeline
        with torch.set_grad_enabled(torch.is_grad_enabled() and "vae" in self.trainable_components):
            encoded = vae.encode(pixel_values.to(vae.dtype))
            dist = getattr(encoded, "latent_dist", None)
            latents = dist.sample(generator=generator) if dist is not None else encoded.latents
        config = vae.config
        shift = getattr(config, "shift_factor", None) or 0.0
        return (latents - shift) * getattr(config, "scaling_factor", 1.0)

    def denoiser_precision(self, device: torch.device) -> Any:
        """torch.autocast to ``autocast_dtype`` around the denoiser (parameters stay in their stored dtype)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def forward(self, pixel_values: torch.Tensor, captions: list[str],
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-sample losses of one micro-batch (noise and timesteps from ``generator``, else torch's global RNG)."""
        if self.objective is None:
            raise AutomodelError("AutoDiffusionPipeline: no objective set (the diffusion recipe sets one)")
        captions = self.objective.drop_captions(captions, generator)
        latents = self.encode_images(pixel_values, generator).float()
        text_trains = any(n.startswith("text_encoder") for n in self.trainable_components)
        with torch.set_grad_enabled(torch.is_grad_enabled() and text_trains):
            cond = self.conditioning.encode(captions, latents.device)
        latents, positions = self.conditioning.pack(latents)
        noisy, timesteps, target = self.objective.noise(latents, generator)
        denoiser = self.components[self.denoiser_name] if self.denoiser_name in self.components else self.denoiser
        with self.denoiser_precision(latents.device):
            prediction = self.conditioning.denoise(denoiser, noisy.to(self.denoiser.dtype), timesteps,
                                                   {**cond, **positions})
        losses = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
        weights = self.objective.loss_weights(timesteps)
        return losses if weights is None else losses * weights.to(losses.device, losses.dtype)


# ---- text conditioning and the denoiser's call, per pipeline family ---------------------------------------------


class Conditioning:
    """How a pipeline family encodes captions and calls its denoiser."""

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None):
        self.pipeline = pipeline
        self.text_kwargs = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}

    def encode(self, captions: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The latents as the denoiser takes them (the objective noises these), and their position inputs."""
        return latents, {}

    def denoise(self, denoiser: torch.nn.Module, sample: torch.Tensor, timesteps: torch.Tensor,
                cond: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class UNetConditioning(Conditioning):
    """StableDiffusionPipeline: one CLIP text encoder; ``unet(sample, t, encoder_hidden_states)``."""

    def encode(self, captions: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipeline.encode_prompt(captions, device, 1, False)
        return {"encoder_hidden_states": embeds}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(sample, timesteps, encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        return_dict=False)[0]


class SD3Conditioning(Conditioning):
    """StableDiffusion3Pipeline: two CLIP encoders (+ optional T5) give token and pooled embeddings."""

    def encode(self, captions: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(prompt=captions, prompt_2=None, prompt_3=None,
                                                           device=device, do_classifier_free_guidance=False,
                                                           **self.text_kwargs)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(hidden_states=sample, timestep=timesteps,
                        encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        pooled_projections=cond["pooled_projections"].to(sample.dtype), return_dict=False)[0]


class FluxConditioning(Conditioning):
    """FluxPipeline (FLUX.1): CLIP's pooled embedding and T5's token embeddings; the latents go in as 2x2 patches
    (the pipeline's own ``_pack_latents`` / ``_prepare_latent_image_ids``), the timestep as sigma (FluxPipeline's
    ``timestep / 1000``), and a guidance-distilled transformer gets its guidance value."""

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None):
        super().__init__(pipeline, max_sequence_length)
        self.guidance: float | None = None  # fed when the transformer has guidance embeddings (set_guidance)

    def set_guidance(self, use: bool | None, scale: float | None, key: str) -> str | None:
        """The guidance the transformer is fed: ``scale`` (None: 3.5) when it has guidance embeddings, none when it
        has not (a ``scale`` other than 1, no guidance, is refused there). ``use`` is upstream's
        use_guidance_embeds (None: what the transformer has): true on a transformer without guidance embeddings is
        refused; false on one with them is upstream's own FLUX.1-dev form, where upstream feeds ``scale`` all the
        same because that transformer needs a guidance value in every call: so does this, and the returned note says
        so. ``key`` names the setting in errors."""
        embeds = bool(self.pipeline.transformer.config.get("guidance_embeds", False))
        prefix = key.rsplit(".", 1)[0]
        if use and not embeds:
            raise ConfigError(ConfigIssue(f"{prefix}.use_guidance_embeds",
                                          "true, but this FLUX.1 transformer has no guidance embeddings (its "
                                          "config's guidance_embeds): set false"))
        if not embeds and scale not in (None, 1, 1.0):
            raise ConfigError(ConfigIssue(key, f"{scale}: this FLUX.1 transformer has no guidance embeddings (its "
                                               "config's guidance_embeds is false), so no guidance value is fed; "
                                               "remove it"))
        self.guidance = (DEFAULT_GUIDANCE if scale is None else float(scale)) if embeds else None
        if use is False and embeds:
            return (f"{prefix}.use_guidance_embeds: false, but this FLUX.1 transformer has guidance embeddings and "
                    f"needs a guidance value in every call: it is fed {self.guidance:g} ({key}), as upstream does")
        return None

    def encode(self, captions: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, pooled, text_ids = self.pipeline.encode_prompt(prompt=captions, prompt_2=None, device=device,
                                                               **self.text_kwargs)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled, "txt_ids": text_ids}

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, channels, height, width = latents.shape
        if height % 2 or width % 2:
            raise AutomodelError(f"data: FLUX.1 packs its latents into 2x2 patches, but the images encode to "
                                 f"{height}x{width} latents; use an image size that is a multiple of "
                                 f"{2 * self.pipeline.vae_scale_factor}")
        cls = type(self.pipeline)
        packed = cls._pack_latents(latents, batch, channels, height, width)
        ids = cls._prepare_latent_image_ids(batch, height // 2, width // 2, latents.device, latents.dtype)
        return packed, {"img_ids": ids}

    def denoise(self, denoiser, sample, timesteps, cond):
        guidance = None if self.guidance is None else \
            torch.full((sample.shape[0],), self.guidance, device=sample.device, dtype=torch.float32)
        return denoiser(hidden_states=sample, timestep=timesteps.to(sample.dtype) / 1000, guidance=guidance,
                        pooled_projections=cond["pooled_projections"].to(sample.dtype),
                        encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        txt_ids=cond["txt_ids"], img_ids=cond["img_ids"], return_dict=False)[0]


def conditioning_for(pipeline: Any, denoiser_name: str, max_sequence_length: int | None = None) -> Conditioning:
    denoiser = getattr(pipeline, denoiser_name)
    kind = type(denoiser).__name__
    if kind == "SD3Transformer2DModel" and hasattr(pipeline, "text_encoder_2"):
        return SD3Conditioning(pipeline, max_sequence_length)
    if kind == "FluxTransformer2DModel" and hasattr(pipeline, "_pack_latents"):
        packed, channels = 4 * pipeline.vae.config.latent_channels, denoiser.config.in_channels
        if channels != packed:
            raise AutomodelError(f"model: the {type(pipeline).__name__}'s transformer takes {channels} input "
                                 f"channels, not the {packed} of its packed latents alone (FLUX.1 Fill / "
                                 "Control conditioning images), which diffusion training does not support here; "
                                 "use a text-to-image FluxPipeline")
        return FluxConditioning(pipeline, max_sequence_length)
    if kind == "UNet2DConditionModel" and getattr(denoiser.config, "addition_embed_type", None) is None \
            and hasattr(pipeline, "encode_prompt") and hasattr(pipeline, "text_encoder"):
        return UNetConditioning(pipeline)
    raise AutomodelError(f"model: training a {type(pipeline).__name__} with a {kind} denoiser is not supported yet; "
                         f"supported: {_SUPPORTED}")
