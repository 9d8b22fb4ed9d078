"""Per pipeline family: how images become the latents the denoiser learns, how captions are encoded, and how the
denoiser is called — each as the family's own diffusers pipeline does it when it samples, so a trained denoiser
samples through that pipeline unchanged.

:func:`conditioning_for` picks the family from the pipeline's denoiser; ``AutoDiffusionPipeline.forward`` is the
one training step every family shares.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from automodel.errors import AutomodelError, ConfigError, ConfigIssue

SUPPORTED = ("SD3Transformer2DModel (StableDiffusion3Pipeline), FluxTransformer2DModel (FluxPipeline, FLUX.1), "
             "Flux2Transformer2DModel (Flux2Pipeline, FLUX.2), QwenImageTransformer2DModel (QwenImagePipeline, "
             "Qwen-Image; QwenImageEditPlusPipeline, Qwen-Image-Edit), WanTransformer3DModel (WanPipeline, Wan 2.1 "
             "text-to-video; Wan 2.2 A14B one expert per run), LTX2VideoTransformer3DModel (LTX2Pipeline, LTX-2 / "
             "LTX-2.3 text-to-video with its audio stream), HunyuanVideo15Transformer3DModel (HunyuanVideo15Pipeline, "
             "HunyuanVideo 1.5 text-to-video) and UNet2DConditionModel (StableDiffusionPipeline)")
# the denoisers a Conditioning exists for
DENOISER_CLASSES = ("SD3Transformer2DModel", "FluxTransformer2DModel", "Flux2Transformer2DModel",
                    "QwenImageTransformer2DModel", "WanTransformer3DModel", "LTX2VideoTransformer3DModel",
                    "HunyuanVideo15Transformer3DModel", "UNet2DConditionModel")
# the pipeline classes each of these denoisers must come in (others share them: Wan image-to-video...)
DENOISER_PIPELINES = {"QwenImageTransformer2DModel": ("QwenImagePipeline", "QwenImageEditPlusPipeline"),
                      "WanTransformer3DModel": ("WanPipeline",), "Flux2Transformer2DModel": ("Flux2Pipeline",),
                      "LTX2VideoTransformer3DModel": ("LTX2Pipeline",),
                      "HunyuanVideo15Transformer3DModel": ("HunyuanVideo15Pipeline",)}
DEFAULT_GUIDANCE = 3.5  # FluxPipeline's default guidance_scale: what a guidance-distilled FLUX.1 samples with


class Conditioning:
    """How a pipeline family encodes images and captions and calls its denoiser."""

    shared: tuple[str, ...] = ()  # encode()'s outputs that are the same for every caption (no batch dimension)
    # why this family never trains with the transformer alone (its latent cache trains the full pipeline); "": it can
    full_pipeline_only = ""
    edits = False  # whether encode() takes each sample's source images (an image-editing pipeline)

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None, vae_config: Any = None):
        self.pipeline = pipeline
        self.text_kwargs = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
        # the VAE's config (normalisation): the pipeline's VAE's, or given when only the transformer is loaded
        self.vae_config = vae_config if vae_config is not None else pipeline.vae.config

    def vae_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """The images as the VAE's encoder takes them."""
        return pixels

    def vae_encode(self, vae: Any, pixels: torch.Tensor) -> Any:
        """The VAE's encoding of ``vae_input``'s batch (its ``latent_dist``, or ``latents``)."""
        return vae.encode(pixels)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents as the denoiser sees them (the inverse of what the pipeline does before decoding)."""
        config = self.vae_config
        shift = getattr(config, "shift_factor", None) or 0.0
        return (latents - shift) * getattr(config, "scaling_factor", 1.0)

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        raise NotImplementedError

    def split(self, cond: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        """``encode``'s outputs for a batch as one dict per caption (what a latent cache stores)."""
        count = next(v.shape[0] for k, v in cond.items() if k not in self.shared)
        return [{k: v if k in self.shared else v[i] for k, v in cond.items()} for i in range(count)]

    def join(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """The inverse of ``split``: one caption's outputs per row -> a batch's, each padded with zeros to the
        longest row (what the pipelines' ``encode_prompt`` does to a batch of captions of different lengths)."""
        joined = {}
        for key in rows[0]:
            if key in self.shared:
                joined[key] = rows[0][key]
                continue
            values = [row[key] for row in rows]
            longest = max(v.shape[0] for v in values) if values[0].dim() else 0
            joined[key] = torch.stack([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, longest - v.shape[0]))
                                       if v.dim() else v for v in values])
        return joined

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The latents as the denoiser takes them (the objective noises these), and their position inputs."""
        return latents, {}

    def clean_inputs(self, latents: torch.Tensor, generator: torch.Generator | None) -> dict[str, Any]:
        """Denoiser inputs made from the packed clean latents (HunyuanVideo's condition latents); draws from
        ``generator``."""
        return {}

    def denoise(self, denoiser: torch.nn.Module, sample: torch.Tensor, timesteps: torch.Tensor,
                cond: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def noise_streams(self, cond: dict[str, Any], sigmas: torch.Tensor, generator: torch.Generator | None
                      ) -> dict[str, Any]:
        """Inputs of a denoiser's other streams, noised with each sample's flow-matching sigma (LTX-2's audio)."""
        return {}

    def denoise_streams(self, denoiser: torch.nn.Module, sample: torch.Tensor, timesteps: torch.Tensor,
                        cond: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the prediction for ``sample``, the per-sample losses of the denoiser's other streams, None if none)."""
        return self.denoise(denoiser, sample, timesteps, cond), None


class UNetConditioning(Conditioning):
    """StableDiffusionPipeline: one CLIP text encoder; ``unet(sample, t, encoder_hidden_states)``."""

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        embeds, _ = self.pipeline.encode_prompt(captions, device, 1, False)
        return {"encoder_hidden_states": embeds}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(sample, timesteps, encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        return_dict=False)[0]


class SD3Conditioning(Conditioning):
    """StableDiffusion3Pipeline: two CLIP encoders (+ optional T5) give token and pooled embeddings."""

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(prompt=captions, prompt_2=None, prompt_3=None,
                                                           device=device, do_classifier_free_guidance=False,
                                                           **self.text_kwargs)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(hidden_states=sample, timestep=timesteps,
                        encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        pooled_projections=cond["pooled_projections"].to(sample.dtype), return_dict=False)[0]


def per_channel_normalize(latents: torch.Tensor, config: Any) -> torch.Tensor:
    """(batch, channels, frames, height, width) video-VAE latents normalised per channel with the VAE config's
    ``latents_mean`` / ``latents_std`` (the pipelines undo it before decoding: ``latents * std + mean``)."""
    mean = torch.tensor(config.latents_mean, device=latents.device, dtype=latents.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std, device=latents.device, dtype=latents.dtype).view(1, -1, 1, 1, 1)
    return (latents - mean) / std


def check_clip(pixels: torch.Tensor, pipeline: str, family: str, step: int) -> torch.Tensor:
    """Clips (batch, channels, frames, height, width) of 1 + ``step`` k frames, as a video VAE of temporal
    compression ``step`` encodes them."""
    if pixels.dim() != 5:
        raise AutomodelError(f"data: {pipeline} trains on videos (channels, frames, height, width); give clips with "
                             "data.dataloader: build_video_multiresolution_dataloader")
    frames = pixels.shape[2]
    if frames % step != 1 % step:
        raise AutomodelError(f"data: {family}'s VAE encodes clips of 1 + {step}k frames (its temporal compression is "
                             f"{step}); these clips have {frames}: set num_frames (data.dataloader or dataset) to "
                             f"e.g. {max(1, frames - (frames - 1) % step)}")
    return pixels


def patch_grid(latents: torch.Tensor, family: str, pipeline: Any) -> tuple[int, int, int, int]:
    """(batch, channels, height, width) of latents a pipeline packs into 2x2 patches; odd sizes are refused."""
    batch, channels, height, width = latents.shape
    if height % 2 or width % 2:
        raise AutomodelError(f"data: {family} packs its latents into 2x2 patches, but the images encode to "
                             f"{height}x{width} latents; use an image size that is a multiple of "
                             f"{2 * pipeline.vae_scale_factor}")
    return batch, channels, height, width


class GuidedConditioning(Conditioning):
    """A family whose transformer may be guidance-distilled (its config's ``guidance_embeds``): such a transformer is
    fed a guidance value in every call, as its pipeline does when it samples."""

    family = ""  # the family's name in messages
    default_guidance = DEFAULT_GUIDANCE  # what the pipeline samples with by default

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None, vae_config: Any = None):
        super().__init__(pipeline, max_sequence_length, vae_config)
        self.guidance: float | None = None  # fed when the transformer has guidance embeddings (set_guidance)

    def set_guidance(self, use: bool | None, scale: float | None, key: str, default: float | None = None) -> str | None:
        """The guidance the transformer is fed: ``scale`` (None: ``default``, else the pipeline's own default) when
        it has guidance embeddings, none when it has not (a ``scale`` other than 1, no guidance, is refused there).
        ``use`` is upstream's use_guidance_embeds (None: what the transformer has): true on a transformer without
        guidance embeddings is refused; false on one with them is upstream's own FLUX.1-dev form, where upstream
        feeds ``scale`` all the same because that transformer needs a guidance value in every call: so does this,
        and the returned note says so. ``key`` names the setting in errors."""
        embeds = bool(self.pipeline.transformer.config.get("guidance_embeds", False))
        prefix = key.rsplit(".", 1)[0]
        if use and not embeds:
            raise ConfigError(ConfigIssue(f"{prefix}.use_guidance_embeds",
                                          f"true, but this {self.family} transformer has no guidance embeddings (its "
                                          "config's guidance_embeds): set false"))
        if not embeds and scale not in (None, 1, 1.0):
            raise ConfigError(ConfigIssue(key, f"{scale}: this {self.family} transformer has no guidance embeddings "
                                               "(its config's guidance_embeds is false), so no guidance value is "
                                               "fed; remove it"))
        if scale is None:
            scale = self.default_guidance if default is None else default
        self.guidance = float(scale) if embeds else None
        if use is False and embeds:
            return (f"{prefix}.use_guidance_embeds: false, but this {self.family} transformer has guidance "
                    f"embeddings and needs a guidance value in every call: it is fed {self.guidance:g} ({key}), as "
                    "upstream does")
        return None

    def guidance_input(self, sample: torch.Tensor) -> torch.Tensor | None:
        """The guidance value for each sample of the batch (None: the transformer takes none)."""
        if self.guidance is None:
            return None
        return torch.full((sample.shape[0],), self.guidance, device=sample.device, dtype=torch.float32)


class FluxConditioning(GuidedConditioning):
    """FluxPipeline (FLUX.1): CLIP's pooled embedding and T5's token embeddings; the latents go in as 2x2 patches
    (the pipeline's own ``_pack_latents`` / ``_prepare_latent_image_ids``), the timestep as sigma (FluxPipeline's
    ``timestep / 1000``), and a guidance-distilled transformer gets its guidance value."""

    family = "FLUX.1"
    shared = ("txt_ids",)  # FluxPipeline's text position ids: (tokens, 3), the same for every caption

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        embeds, pooled, text_ids = self.pipeline.encode_prompt(prompt=captions, prompt_2=None, device=device,
                                                               **self.text_kwargs)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled, "txt_ids": text_ids}

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        batch, channels, height, width = patch_grid(latents, "FLUX.1", self.pipeline)
        cls = type(self.pipeline)
        packed = cls._pack_latents(latents, batch, channels, height, width)
        ids = cls._prepare_latent_image_ids(batch, height // 2, width // 2, latents.device, latents.dtype)
        return packed, {"img_ids": ids}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(hidden_states=sample, timestep=timesteps.to(sample.dtype) / 1000,
                        guidance=self.guidance_input(sample),
                        pooled_projections=cond["pooled_projections"].to(sample.dtype),
                        encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        txt_ids=cond["txt_ids"], img_ids=cond["img_ids"], return_dict=False)[0]


class Flux2Conditioning(GuidedConditioning):
    """Flux2Pipeline (FLUX.2): the caption through the pipeline's own ``encode_prompt`` (its chat template through
    the Mistral 3 text encoder, the hidden states of ``text_encoder_out_layers`` stacked per token, padded to
    ``max_sequence_length``: by default what ``Flux2Pipeline.__call__`` samples with); the VAE's latents in 2x2
    patches (``_patchify_latents``), normalised with the VAE's batch-norm running statistics — what the pipeline
    undoes before decoding — and flattened to tokens (``_pack_latents``) with the pipeline's 4-D position ids; the
    timestep as sigma (``timestep / 1000``) and, for a guidance-distilled transformer, its guidance value, as
    upstream's flux2 adapter feeds them."""

    family = "FLUX.2"
    full_pipeline_only = "its latents are normalised with VAE weights"  # the batch-norm running statistics

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None, vae_config: Any = None):
        call = inspect.signature(type(pipeline).__call__).parameters
        if max_sequence_length is None:
            max_sequence_length = call["max_sequence_length"].default
        super().__init__(pipeline, max_sequence_length, vae_config)
        self.default_guidance = call["guidance_scale"].default

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        patch_grid(latents, "FLUX.2", self.pipeline)
        patches = type(self.pipeline)._patchify_latents(latents)
        vae = self.pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patches.device,
                                                                                              patches.dtype)
        return (patches - mean) / std

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        embeds, text_ids = self.pipeline.encode_prompt(captions, device=device, **self.text_kwargs)
        return {"encoder_hidden_states": embeds, "txt_ids": text_ids}

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cls = type(self.pipeline)
        return cls._pack_latents(latents), {"img_ids": cls._prepare_latent_ids(latents).to(latents.device)}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(hidden_states=sample, timestep=timesteps.to(sample.dtype) / 1000,
                        guidance=self.guidance_input(sample),
                        encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        txt_ids=cond["txt_ids"], img_ids=cond["img_ids"], return_dict=False)[0]


class QwenImageConditioning(Conditioning):
    """QwenImagePipeline (Qwen-Image): the caption in the pipeline's chat template through its Qwen2.5-VL text
    encoder (its own ``encode_prompt`` drops the template's tokens and gives the padding mask); the VAE is a video
    VAE fed one frame, whose latents the pipeline normalises per channel (``latents_mean`` / ``latents_std``); the
    latents go in as 2x2 patches (its ``_pack_latents``) with ``img_shapes`` (the patch grid the rotary positions
    follow), the timestep as sigma (``timestep / 1000``). No guidance value: diffusers' Qwen-Image transformer
    takes none (its pipeline feeds one only to a guidance-distilled transformer, which is refused)."""

    def vae_input(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.unsqueeze(2)  # (batch, channels, 1 frame, height, width)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        return per_channel_normalize(latents, self.vae_config).squeeze(2)

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        embeds, mask = self.pipeline.encode_prompt(captions, device=device, **self.text_kwargs)
        return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}

    def split(self, cond: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        """Each caption's embeddings cut to its own tokens (the pipeline gives no mask when none is padded)."""
        embeds, mask = cond["encoder_hidden_states"], cond["encoder_hidden_states_mask"]
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        lengths = mask.sum(1).tolist()
        return [{"encoder_hidden_states": e[:n], "encoder_hidden_states_mask": m[:n]}
                for e, m, n in zip(embeds, mask, lengths, strict=True)]

    def join(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        joined = super().join(rows)
        if joined["encoder_hidden_states_mask"].all():  # as encode_prompt: no mask when nothing is padded
            joined["encoder_hidden_states_mask"] = None
        return joined

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        batch, channels, height, width = patch_grid(latents, "Qwen-Image", self.pipeline)
        packed = type(self.pipeline)._pack_latents(latents, batch, channels, height, width)
        return packed, {"img_shapes": [[(1, height // 2, width // 2)]] * batch}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(hidden_states=sample, timestep=timesteps.to(sample.dtype) / 1000,
                        encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
                        encoder_hidden_states_mask=cond["encoder_hidden_states_mask"], img_shapes=cond["img_shapes"],
                        return_dict=False)[0]


class WanConditioning(Conditioning):
    """WanPipeline (Wan 2.1 text-to-video): the caption through the pipeline's own ``encode_prompt`` (UMT5, padded
    with zeros to ``max_sequence_length``, by default what ``WanPipeline.__call__`` samples with); videos
    (batch, channels, frames, height, width) through AutoencoderKLWan, normalised per channel as WanPipeline undoes
    before decoding; the latents go in unpacked (the transformer patchifies them itself), the timestep as the
    scheduler's (sigma * 1000), as upstream's ``simple`` adapter feeds it."""

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None, vae_config: Any = None):
        if max_sequence_length is None:
            max_sequence_length = inspect.signature(type(pipeline).__call__).parameters["max_sequence_length"].default
        super().__init__(pipeline, max_sequence_length, vae_config)

    def vae_input(self, pixels: torch.Tensor) -> torch.Tensor:
        return check_clip(pixels, "a WanPipeline", "Wan", self.pipeline.vae_scale_factor_temporal)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        return per_channel_normalize(latents, self.vae_config)

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        embeds, _ = self.pipeline.encode_prompt(captions, do_classifier_free_guidance=False, device=device,
                                                **self.text_kwargs)
        return {"encoder_hidden_states": embeds}

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        _, patch_h, patch_w = self.pipeline.transformer.config.patch_size
        height, width = latents.shape[-2:]
        if height % patch_h or width % patch_w:
            raise AutomodelError(f"data: the Wan transformer patchifies latents in {patch_h}x{patch_w} patches, but "
                                 f"the clips encode to {height}x{width} latents; use a resolution that is a multiple "
                                 f"of {patch_h * self.pipeline.vae_scale_factor_spatial}")
        return latents, {}

    def denoise(self, denoiser, sample, timesteps, cond):
        return denoiser(hidden_states=sample, timestep=timesteps.to(sample.dtype),
                        encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype), return_dict=False)[0]


def edit_conditioning(pipeline: Any, max_sequence_length: int | None, vae_config: Any) -> Conditioning:
    """Qwen-Image-Edit: its source images go through the VAE and the text encoder in every step, so it trains with
    the full pipeline only."""
    from automodel_diffusion.edit import QwenImageEditConditioning

    if vae_config is not None:
        raise AutomodelError("model: a QwenImageEditPlusPipeline encodes each sample's source images with its VAE and "
                             "text encoder, so it trains with the full pipeline, not the transformer alone on a latent "
                             "cache (remove model.pipeline_spec.load_full_pipeline: false)")
    if max_sequence_length is not None:
        raise AutomodelError(f"model.max_sequence_length: {max_sequence_length}, but QwenImageEditPlusPipeline's "
                             "encode_prompt keeps every prompt token (its __call__ takes the setting and ignores it), "
                             "so it would govern nothing; remove it")
    return QwenImageEditConditioning(pipeline)


def conditioning_for(pipeline: Any, denoiser_name: str, max_sequence_length: int | None = None,
                     vae_config: Any = None) -> Conditioning:
    """The family's conditioning; ``vae_config``: the VAE's config when the pipeline was loaded without its VAE."""
    denoiser = getattr(pipeline, denoiser_name)
    kind = type(denoiser).__name__
    if kind == "SD3Transformer2DModel" and hasattr(pipeline, "text_encoder_2"):
        return SD3Conditioning(pipeline, max_sequence_length, vae_config)
    if kind == "FluxTransformer2DModel" and hasattr(pipeline, "_pack_latents"):
        latent_channels = (vae_config if vae_config is not None else pipeline.vae.config)["latent_channels"]
        packed, channels = 4 * latent_channels, denoiser.config.in_channels
        if channels != packed:
            raise AutomodelError(f"model: the {type(pipeline).__name__}'s transformer takes {channels} input "
                                 f"channels, not the {packed} of its packed latents alone (FLUX.1 Fill / "
                                 "Control conditioning images), which diffusion training does not support here; "
                                 "use a text-to-image FluxPipeline")
        return FluxConditioning(pipeline, max_sequence_length, vae_config)
    if kind == "Flux2Transformer2DModel" and type(pipeline).__name__ != "Flux2Pipeline":
        raise AutomodelError(f"model: a {type(pipeline).__name__} (FLUX.2 [klein] or image-conditioned FLUX.2) is "
                             "not implemented for diffusion training here: only Flux2Pipeline's text-to-image "
                             "prompt encoding (Mistral 3) and guidance are; use a Flux2Pipeline (FLUX.2 [dev])")
    if kind == "Flux2Transformer2DModel":
        if getattr(pipeline, "vae", None) is None:
            raise AutomodelError("model: FLUX.2 normalises its latents with the VAE's batch-norm running statistics, "
                                 "which are weights, not config; load the full pipeline, not the transformer alone "
                                 "(remove model.pipeline_spec.load_full_pipeline: false)")
        return Flux2Conditioning(pipeline, max_sequence_length, vae_config)
    if kind == "QwenImageTransformer2DModel" and type(pipeline).__name__ in DENOISER_PIPELINES[kind]:
        if denoiser.config.get("guidance_embeds", False):
            raise AutomodelError("model: this Qwen-Image transformer's config sets guidance_embeds, but diffusers' "
                                 "QwenImageTransformer2DModel takes no guidance value (QwenImagePipeline would feed "
                                 "it one and fail); set guidance_embeds false in transformer/config.json")
        if type(pipeline).__name__ == "QwenImageEditPlusPipeline":
            return edit_conditioning(pipeline, max_sequence_length, vae_config)
        return QwenImageConditioning(pipeline, max_sequence_length, vae_config)
    if kind == "WanTransformer3DModel" and type(pipeline).__name__ == "WanPipeline":
        if pipeline.config.get("expand_timesteps"):
            raise AutomodelError("model: this WanPipeline takes per-token timesteps (expand_timesteps: Wan 2.2 "
                                 "TI2V), which diffusion training does not support here; use a text-to-video "
                                 "pipeline (Wan 2.1, or Wan 2.2 A14B's two experts with model.stage)")
        return WanConditioning(pipeline, max_sequence_length, vae_config)
    if kind == "LTX2VideoTransformer3DModel" and type(pipeline).__name__ == "LTX2Pipeline":
        from automodel_diffusion import ltx2

        ltx2.check_pipeline(pipeline)
        return ltx2.LTX2Conditioning(pipeline, max_sequence_length, vae_config)
    if kind == "HunyuanVideo15Transformer3DModel" and type(pipeline).__name__ == "HunyuanVideo15Pipeline":
        from automodel_diffusion.hunyuan import HunyuanConditioning

        return HunyuanConditioning(pipeline, max_sequence_length, vae_config)
    if kind == "UNet2DConditionModel" and getattr(denoiser.config, "addition_embed_type", None) is None \
            and hasattr(pipeline, "encode_prompt") and hasattr(pipeline, "text_encoder"):
        return UNetConditioning(pipeline, vae_config=vae_config)
    raise AutomodelError(f"model: training a {type(pipeline).__name__} with a {kind} denoiser is not supported yet; "
                         f"supported: {SUPPORTED}")
