"""HunyuanVideo 1.5 text-to-video (HunyuanVideo15Pipeline): how its clips, captions and transformer call are trained.

As the pipeline samples: the caption through its own ``encode_prompt`` (the Qwen2.5-VL text encoder's hidden states
after the chat template, cropped to the caption's tokens and masked, and the glyph byT5 encoder's embedding of the
caption's quoted text, masked), the clip's VAE latents times the VAE's ``scaling_factor`` (what the pipeline divides
by before decoding), and the transformer fed the noisy latents concatenated with condition latents and their mask
channel (zeros: text-to-video), zero image embeddings (masked out: no reference image) and the timestep sigma * 1000.

Upstream's hunyuan adapter adds image-to-video batches: with probability ``i2v_prob`` a micro-batch of clips is
conditioned on its first clean latent frame (the condition latents carry it, the mask channel marks it), as that
adapter does when its cache holds no image embeddings (this text-to-video pipeline has no image encoder).
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel_diffusion.conditioning import Conditioning, check_clip


class HunyuanConditioning(Conditioning):
    """HunyuanVideo15Pipeline: two text encoders with masks, condition latents, zero image embeddings."""

    full_pipeline_only = "diffusers' HunyuanVideo15Pipeline cannot be built without its VAE"

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None, vae_config: Any = None):
        if max_sequence_length is not None:
            raise AutomodelError("model.max_sequence_length: HunyuanVideo15Pipeline encodes every caption at its own "
                                 f"lengths ({pipeline.tokenizer_max_length} Qwen tokens, "
                                 f"{pipeline.tokenizer_2_max_length} byT5 bytes, masked) and samples with those; "
                                 "remove it")
        super().__init__(pipeline, None, vae_config)
        config = pipeline.transformer.config
        channels = self.vae_config["latent_channels"]
        if config.in_channels != 2 * channels + 1:
            raise AutomodelError(f"model: this HunyuanVideo 1.5 transformer takes {config.in_channels} input channels, "
                                 f"not the {2 * channels + 1} of the noisy latents, condition latents and mask that "
                                 "HunyuanVideo15Pipeline feeds it")
        # the zero image embeddings' (tokens, width): what the pipeline feeds (upstream: default_image_embed_shape)
        self.image_embed_shape = (pipeline.vision_num_semantic_tokens, config.image_embed_dim)
        self.i2v_prob = 0.0  # upstream's flow_matching.i2v_prob (set by upstream.apply_adapter)

    def set_image_embed_shape(self, shape: Any) -> None:
        """Upstream's ``adapter_kwargs.default_image_embed_shape``: its width must be the transformer's."""
        tokens, width = (int(v) for v in shape)
        wanted = self.pipeline.transformer.config.image_embed_dim
        if width != wanted:
            raise AutomodelError(f"flow_matching.adapter_kwargs.default_image_embed_shape: [{tokens}, {width}], but "
                                 f"this transformer's image embeddings are {wanted} wide (its image_embed_dim); set "
                                 f"[{tokens}, {wanted}]")
        self.image_embed_shape = (tokens, width)

    def vae_input(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dim() == 4:
            pixels = pixels.unsqueeze(2)  # images train as one-frame clips
        return check_clip(pixels, "a HunyuanVideo15Pipeline", "HunyuanVideo 1.5",
                          self.pipeline.vae_scale_factor_temporal)

    def vae_encode(self, vae: Any, pixels: torch.Tensor) -> Any:
        """One clip at a time: diffusers' AutoencoderKLHunyuanVideo15 builds its causal attention mask for one clip
        (a batch of several fails in its mid-block attention)."""
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        parameters = [vae.encode(clip.unsqueeze(0)).latent_dist.parameters for clip in pixels]
        return AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(torch.cat(parameters)))

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        embeds, mask, glyph, glyph_mask = self.pipeline.encode_prompt(captions, device=device,
                                                                      batch_size=len(captions))
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask, "encoder_hidden_states_2": glyph,
                "encoder_attention_mask_2": glyph_mask}

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        config = self.pipeline.transformer.config
        size, height, width = config.patch_size, *latents.shape[-2:]
        if height % size or width % size or latents.shape[2] % config.patch_size_t:
            raise AutomodelError(f"data: the HunyuanVideo 1.5 transformer patchifies latents in {size}x{size} "
                                 f"patches, but the clips encode to {height}x{width} latents; use a resolution that "
                                 f"is a multiple of {size * self.pipeline.vae_scale_factor_spatial}")
        return latents, {}

    def clean_inputs(self, latents: torch.Tensor, generator: torch.Generator | None) -> dict[str, Any]:
        """The condition latents and their mask channel: zeros (text-to-video, as the pipeline samples), or with
        probability ``i2v_prob`` for a batch of clips the first clean latent frame, marked in the mask."""
        batch, channels, frames, height, width = latents.shape
        condition = torch.zeros(batch, channels + 1, frames, height, width, dtype=latents.dtype,
                                device=latents.device)
        if self.i2v_prob > 0 and frames > 1 and float(torch.rand(1, generator=generator)) < self.i2v_prob:
            condition[:, :channels, :1] = latents[:, :, :1]
            condition[:, channels, 0] = 1
        return {"condition": condition}

    def denoise(self, denoiser, sample, timesteps, cond):
        dtype = sample.dtype
        image_embeds = torch.zeros(sample.shape[0], *self.image_embed_shape, dtype=dtype, device=sample.device)
        hidden = torch.cat([sample, cond["condition"].to(dtype)], dim=1)
        return denoiser(hidden_states=hidden, image_embeds=image_embeds,
                        timestep=timesteps.to(dtype), encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
                        encoder_attention_mask=cond["encoder_attention_mask"],
                        encoder_hidden_states_2=cond["encoder_hidden_states_2"].to(dtype),
                        encoder_attention_mask_2=cond["encoder_attention_mask_2"], return_dict=False)[0]
