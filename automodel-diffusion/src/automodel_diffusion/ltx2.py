"""LTX-2 (LTX2Pipeline, LTX-2 / LTX-2.3): one transformer that denoises a video stream and an audio stream together,
trained as upstream's ltx2 adapter trains it, with the inputs LTX2Pipeline samples with.

* Text: the pipeline's own ``encode_prompt`` (the Gemma 3 encoder's hidden states of every layer, stacked per token,
  left-padded to ``max_sequence_length``), then its ``connectors``, which give the video stream's and the audio
  stream's text embeddings and the mask both streams attend with — what ``LTX2Pipeline.__call__`` feeds the
  transformer.
* Video: clips through the LTX-2 video VAE, normalised with the VAE's ``latents_mean`` / ``latents_std`` and
  ``scaling_factor`` (the pipeline's ``_normalize_latents``; the statistics are VAE weights, so the VAE is loaded),
  packed into tokens (``_pack_latents``).
* Audio: the clips here (animated GIF / WebP, frame folders) carry no sound, so each clip's audio is silence of the
  clip's duration (``num_frames / fps``), as upstream's LTX-2 preprocessing encodes a clip without an audio track:
  the log-mel spectrogram of silence (``log(1e-5)`` in every bin) through the audio VAE (its mode), normalised per
  channel and mel bin as the pipeline does, packed into tokens (``_pack_audio_latents``).
* Noise: the audio latents are noised with each sample's video sigma and their own noise draw; the transformer is
  called as the pipeline calls it (the scheduler timestep as ``timestep`` and ``sigma``, the latent geometry, the
  frame rate ``fps`` its video positions follow, ``use_cross_timestep``); the loss of a sample is its video
  flow-matching loss plus ``audio_loss_weight`` times its audio one (upstream's ltx2 adapter's auxiliary loss).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel_diffusion.conditioning import Conditioning, check_clip

SILENCE = math.log(1e-5)  # the log-mel value of silence (upstream clamps magnitudes to 1e-5 before the log)
DEFAULT_AUDIO_LOSS_WEIGHT = 1.0  # upstream's ltx2 adapter's default


class LTX2Conditioning(Conditioning):
    """LTX2Pipeline: see the module docstring."""

    full_pipeline_only = "its latents are normalised with VAE weights"  # the VAEs' latents_mean / latents_std

    def __init__(self, pipeline: Any, max_sequence_length: int | None = None, vae_config: Any = None):
        call = inspect.signature(type(pipeline).__call__).parameters
        if max_sequence_length is None:
            max_sequence_length = call["max_sequence_length"].default
        super().__init__(pipeline, max_sequence_length, vae_config)
        self.fps = float(call["frame_rate"].default)  # the frame rate the video positions follow (set_streams)
        self.audio_loss_weight = DEFAULT_AUDIO_LOSS_WEIGHT
        self.silence: dict[tuple[int, str], torch.Tensor] = {}  # (pixel frames, device) -> packed audio latents

    def set_streams(self, fps: float | None = None, audio_loss_weight: float | None = None) -> None:
        """Upstream's ltx2 adapter settings: the frame rate of the clips (the video positions, the audio's
        duration) and the audio loss's weight (None: keep the default)."""
        if fps is not None:
            self.fps = float(fps)
        if audio_loss_weight is not None:
            self.audio_loss_weight = float(audio_loss_weight)
        self.silence.clear()  # its duration follows fps

    def vae_input(self, pixels: torch.Tensor) -> torch.Tensor:
        return check_clip(pixels, "an LTX2Pipeline", "LTX-2", self.pipeline.vae_temporal_compression_ratio)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        return type(self.pipeline)._normalize_latents(latents, vae.latents_mean, vae.latents_std,
                                                      vae.config.scaling_factor)

    def encode(self, captions: list[str], device: torch.device) -> dict[str, Any]:
        pipeline = self.pipeline
        embeds, mask, _, _ = pipeline.encode_prompt(captions, do_classifier_free_guidance=False, device=device,
                                                    **self.text_kwargs)
        video, audio, mask = pipeline.connectors(embeds, mask, padding_side=pipeline.tokenizer.padding_side)
        return {"encoder_hidden_states": video, "audio_encoder_hidden_states": audio, "encoder_attention_mask": mask}

    def pack(self, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        pipeline = self.pipeline
        batch, _, frames, height, width = latents.shape
        packed = type(pipeline)._pack_latents(latents, pipeline.transformer_spatial_patch_size,
                                              pipeline.transformer_temporal_patch_size)
        pixel_frames = (frames - 1) * pipeline.vae_temporal_compression_ratio + 1
        audio = self.silent_audio(pixel_frames, latents.device).to(latents.dtype)
        return packed, {"num_frames": frames, "height": height, "width": width,
                        "audio_latents": audio.expand(batch, -1, -1)}

    def silent_audio(self, pixel_frames: int, device: torch.device) -> torch.Tensor:
        """(1, audio tokens, channels x mel bins): the normalised, packed audio latents of ``pixel_frames`` frames
        of silence at ``fps`` (computed once per clip length)."""
        key = (pixel_frames, str(device))
        if key not in self.silence:
            audio_vae = self.pipeline.audio_vae
            config = audio_vae.config
            samples = round(pixel_frames / self.fps * config.sample_rate)
            mel_frames = samples // config.mel_hop_length + 1  # a centred STFT's frame count
            mel = torch.full((1, config.in_channels, mel_frames, config.mel_bins), SILENCE, device=device,
                             dtype=audio_vae.dtype)
            with torch.no_grad():
                latents = audio_vae.encode(mel).latent_dist.mode()
            packed = type(self.pipeline)._pack_audio_latents(latents.float())
            self.silence[key] = type(self.pipeline)._normalize_audio_latents(packed, audio_vae.latents_mean.float(),
                                                                             audio_vae.latents_std.float())
        return self.silence[key]

    def noise_streams(self, cond: dict[str, Any], sigmas: torch.Tensor, generator: torch.Generator | None
                      ) -> dict[str, Any]:
        """The audio latents noised with each sample's sigma (their own noise draw) and their velocity target."""
        from automodel_diffusion.objectives import randn_like

        audio = cond["audio_latents"].float()
        noise = randn_like(audio, generator)
        s = sigmas.to(audio.device, audio.dtype).view(-1, 1, 1)
        return {"audio_latents": (1 - s) * audio + s * noise, "audio_target": noise - audio}

    def denoise_streams(self, denoiser, sample, timesteps, cond):
        timestep = timesteps.to(sample.dtype)
        audio = cond["audio_latents"].to(sample.dtype)
        video_out, audio_out = denoiser(
            hidden_states=sample, audio_hidden_states=audio,
            encoder_hidden_states=cond["encoder_hidden_states"].to(sample.dtype),
            audio_encoder_hidden_states=cond["audio_encoder_hidden_states"].to(sample.dtype),
            timestep=timestep, sigma=timestep, encoder_attention_mask=cond["encoder_attention_mask"],
            audio_encoder_attention_mask=cond["encoder_attention_mask"], num_frames=cond["num_frames"],
            height=cond["height"], width=cond["width"], fps=self.fps, audio_num_frames=audio.shape[1],
            use_cross_timestep=True, return_dict=False)
        audio_losses = (audio_out.float() - cond["audio_target"].float()).pow(2).flatten(1).mean(1)
        return video_out, self.audio_loss_weight * audio_losses


def check_pipeline(pipeline: Any) -> None:
    """An LTX2Pipeline loaded without its VAEs (a transformer alone) cannot normalise latents: refused."""
    if getattr(pipeline, "vae", None) is None or getattr(pipeline, "audio_vae", None) is None:
        raise AutomodelError("model: LTX-2 normalises its video and audio latents with the VAEs' latents_mean / "
                             "latents_std, which are weights, not config; load the full pipeline, not the "
                             "transformer alone (remove model.pipeline_spec.load_full_pipeline: false); the full "
                             "pipeline trains on a latent cache too")
