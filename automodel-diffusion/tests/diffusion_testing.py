"""Helpers for the diffusion domain's tests: the shipped examples, trained in-process, and their outputs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from automodel import testing
from automodel.testing import OFFLINE

for _name, _value in OFFLINE.items():
    os.environ.setdefault(_name, _value)

PKG_DIR = Path(importlib.util.find_spec("automodel_diffusion").submodule_search_locations[0])
EXAMPLES = PKG_DIR / "examples"
ASSETS = EXAMPLES / "assets"
SHAPES = ASSETS / "tiny_shapes"


def load_config(config: Path, *overrides: Any, route: tuple[str, str] = ("finetune", "diffusion")):
    """Validate a config for a route as the CLI does; returns (recipe class, config)."""
    return testing.load_config(config, *overrides, route=route)


def train_inprocess(config: Path, *overrides: Any, before_run=None):
    """Validate and run ``finetune diffusion`` in this process; returns the recipe after training."""
    return testing.train_inprocess(config, *overrides, route=("finetune", "diffusion"), before_run=before_run)


def assert_denoiser_equal_with_adapter(trained: Any, loaded: Any, base: Any, inputs: dict[str, Any]) -> None:
    """The adapter ``loaded`` from a checkpoint computes what the ``trained`` denoiser does, unlike the ``base``."""
    import torch

    with torch.no_grad():
        ours = trained(**inputs, return_dict=False)[0]
        theirs = loaded(**inputs, return_dict=False)[0]
        plain = base(**inputs, return_dict=False)[0]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (plain - ours).abs().max() > 1e-3, "the adapter does not change the denoiser's output"


def cli(*args: Any) -> int:
    from automodel.cli.main import main

    return main([str(a) for a in args])




# A tiny FLUX.1 transformer over the shipped tiny VAE's 4 latent channels (16 once packed into 2x2 patches), the
# tiny CLIP's 32-wide pooled output and the tiny T5's 64-wide tokens; rotary axes sum to the head size.
TINY_FLUX_TRANSFORMER = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16, "num_layers": 1,
                         "num_single_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2,
                         "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": [2, 2, 4]}
# FluxPipeline's slots -> the shipped tiny SD3-style pipeline's folders they reuse (configs, tokenizers, VAE weights)
TINY_FLUX_PARTS = {"vae": ("diffusers", "AutoencoderKL", "vae"),
                   "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler"),
                   "text_encoder": ("transformers", "CLIPTextModel", "text_encoder"),
                   "tokenizer": ("transformers", "CLIPTokenizer", "tokenizer"),
                   "text_encoder_2": ("transformers", "T5EncoderModel", "text_encoder_3"),
                   "tokenizer_2": ("transformers", "T5TokenizerFast", "tokenizer_3")}


def tiny_flux(directory: Path, guidance_embeds: bool = False, seed: int = 0) -> Path:
    """A tiny FluxPipeline saved with weights in ``directory``: the transformer from TINY_FLUX_TRANSFORMER, the
    other components from the shipped tiny_flow assets, freshly initialised with ``seed`` where they have none."""
    import json
    import shutil

    from automodel_diffusion import AutoDiffusionPipeline

    configs = directory.with_name(directory.name + "_configs")
    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
    for slot, (library, cls, folder) in TINY_FLUX_PARTS.items():
        shutil.copytree(ASSETS / "tiny_flow" / folder, configs / slot)
        index[slot] = [library, cls]
    (configs / "transformer").mkdir(parents=True)
    transformer = {**TINY_FLUX_TRANSFORMER, "guidance_embeds": guidance_embeds}
    (configs / "transformer" / "config.json").write_text(json.dumps(transformer))
    (configs / "model_index.json").write_text(json.dumps(index))
    AutoDiffusionPipeline.from_config(str(configs), seed=seed).pipeline.save_pretrained(str(directory))
    shutil.rmtree(configs)
    return directory


# A tiny Flux2Pipeline. Its text encoder is a Mistral 3 of 30 layers (Flux2Pipeline stacks the hidden states of
# layers 10, 20 and 30: 3 x 16 = 48 features per token, the transformer's joint_attention_dim); its tokenizer is the
# shipped tiny T5 tokenizer with a text-only chat template (Flux2Pipeline only calls apply_chat_template, so no
# Pixtral image processor is needed). The VAE's 3 blocks downsample 32x32 images to 8x8 latents of 4 channels, 4x4
# patches of 16 channels once patchified, which its batch-norm statistics (set to non-trivial values) normalise.
TINY_FLUX2_CHAT_TEMPLATE = ("{% for message in messages %}[{{ message['role'] }}]{% for part in message['content'] %}"
                            "{{ part['text'] }}{% endfor %}{% endfor %}")
TINY_MISTRAL3 = {"text_config": {"model_type": "mistral", "hidden_size": 16, "intermediate_size": 32,
                                 "num_hidden_layers": 30, "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "head_dim": 8, "max_position_embeddings": 128},
                 "vision_config": {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32,
                                   "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8, "image_size": 32,
                                   "patch_size": 8},
                 "image_token_index": 3, "spatial_merge_size": 1}
TINY_FLUX2_VAE = {"block_out_channels": [8, 8, 16], "down_block_types": ["DownEncoderBlock2D"] * 3,
                  "up_block_types": ["UpDecoderBlock2D"] * 3, "layers_per_block": 1, "latent_channels": 4,
                  "norm_num_groups": 4, "sample_size": 32}
TINY_FLUX2_TRANSFORMER = {"in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
                          "num_attention_heads": 2, "joint_attention_dim": 48, "timestep_guidance_channels": 16,
                          "axes_dims_rope": [2, 2, 2, 2]}


def tiny_flux2(directory: Path, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """A tiny Flux2Pipeline saved with weights in ``directory`` (the configs above), freshly initialised with
    ``seed``; ``guidance_embeds``: whether the transformer is guidance-distilled (FLUX.2 [dev] is)."""
    import diffusers
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, T5TokenizerFast

    torch.manual_seed(seed)
    tokenizer = T5TokenizerFast.from_pretrained(str(ASSETS / "tiny_flow" / "tokenizer_3"))
    tokenizer.chat_template = TINY_FLUX2_CHAT_TEMPLATE
    config = Mistral3Config(**{**TINY_MISTRAL3, "text_config": {**TINY_MISTRAL3["text_config"],
                                                                "vocab_size": len(tokenizer)}})
    vae = diffusers.AutoencoderKLFlux2(**TINY_FLUX2_VAE)
    vae.bn.running_mean.uniform_(-0.5, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    pipeline = diffusers.Flux2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=vae,
        text_encoder=Mistral3ForConditionalGeneration(config), tokenizer=tokenizer,
        transformer=diffusers.Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER, guidance_embeds=guidance_embeds))
    pipeline.save_pretrained(str(directory))
    return directory


# A tiny Qwen-Image pipeline. The tokenizer is a byte-level BPE in Qwen2's pre-tokenisation, learned from the words of
# QwenImagePipeline's prompt template (and the shapes captions), so that the template's prefix is 34 tokens as with
# Qwen's own tokenizer: the pipeline drops exactly those (prompt_template_encode_start_idx).
QWEN_TEMPLATE_WORDS = ("system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                       "spatial relationships of the objects and background:\nuser\nassistant\n")
QWEN_CAPTION_WORDS = "a an red blue green yellow white black orange purple circle square triangle on background"
TINY_QWEN_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "max_position_embeddings": 256,
                  "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
TINY_QWEN_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                    "patch_size": 2, "spatial_merge_size": 1, "temporal_patch_size": 1, "window_size": 4,
                    "fullatt_block_indexes": [0]}
# 4 latent channels (16 once packed into 2x2 patches), two spatial downsamplings (32x32 images -> 8x8 latents)
TINY_QWEN_VAE = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2], "num_res_blocks": 1,
                 "temperal_downsample": [False, False], "latents_mean": [0.1, -0.2, 0.3, 0.0],
                 "latents_std": [1.5, 0.8, 2.0, 1.2]}
TINY_QWEN_TRANSFORMER = {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 1,
                         "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 32,
                         "axes_dims_rope": [2, 2, 4]}
# QwenImagePipeline's scheduler settings (resolution-dependent shift, as Qwen-Image ships them)
TINY_QWEN_SCHEDULER = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 8192,
                       "base_shift": 0.5, "max_shift": 0.9, "shift_terminal": 0.02, "time_shift_type": "exponential"}


def tiny_qwen_tokenizer(*words: str) -> Any:
    """A Qwen2Tokenizer whose merges spell the prompt template's and the captions' words (and ``words``)."""
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([QWEN_TEMPLATE_WORDS, QWEN_CAPTION_WORDS, *words], trainer)
    learned = json.loads(bpe.to_str())["model"]
    return Qwen2Tokenizer(vocab=learned["vocab"], merges=[tuple(m) for m in learned["merges"]],
                          extra_special_tokens=["<|im_start|>", "<|im_end|>"])


def tiny_qwen_image(directory: Path, seed: int = 0, **transformer: Any) -> Path:
    """A tiny QwenImagePipeline saved with weights in ``directory``, every component from the dict configs above
    (``transformer``: overrides of its config), freshly initialised with ``seed``."""
    import diffusers
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer()
    text = {**TINY_QWEN_TEXT, "vocab_size": len(tokenizer), "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id}
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=TINY_QWEN_VISION,
                                                                  bos_token_id=None,
                                                                  eos_token_id=tokenizer.eos_token_id))
    pipeline = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**TINY_QWEN_SCHEDULER),
        vae=diffusers.AutoencoderKLQwenImage(**TINY_QWEN_VAE), text_encoder=encoder, tokenizer=tokenizer,
        transformer=diffusers.QwenImageTransformer2DModel(**{**TINY_QWEN_TRANSFORMER, **transformer}))
    pipeline.save_pretrained(str(directory))
    return directory


# A tiny Qwen-Image-Edit (QwenImageEditPlusPipeline): the tiny Qwen-Image components, a Qwen2-VL processor whose
# Pillow image processor cuts every picture to at most 16x16 pixels in 2x2 patches (the tiny vision tower's), and
# Qwen's vision tokens in the tokenizer and the text encoder's config.
QWEN_EDIT_WORDS = ("system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
                   "background), then explain how the user's text instruction should alter or modify the image. "
                   "Generate a new image that meets the user's requirements while maintaining consistency with the "
                   "original input where appropriate.\nuser\nPicture 1: \nassistant\nmake turn into")
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def tiny_qwen_image_edit(directory: Path, seed: int = 0) -> Path:
    """A tiny QwenImageEditPlusPipeline saved with weights in ``directory`` (its processor without the video
    processor, which needs torchvision: as the recipe loads it)."""
    import diffusers
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from automodel_diffusion.pipeline import _images_only

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer(QWEN_EDIT_WORDS)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_VISION_TOKENS), strict=True))
    text = {**TINY_QWEN_TEXT, "vocab_size": len(tokenizer), "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id, "max_position_embeddings": 2048}
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=TINY_QWEN_VISION,
                                                                  bos_token_id=None,
                                                                  eos_token_id=tokenizer.eos_token_id, **ids))
    images = Qwen2VLImageProcessorPil(min_pixels=8 * 8, max_pixels=16 * 16, patch_size=2, merge_size=1,
                                      temporal_patch_size=1)
    processor = _images_only(__import__("transformers").Qwen2VLProcessor)(images, tokenizer)
    pipeline = diffusers.QwenImageEditPlusPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**TINY_QWEN_SCHEDULER),
        vae=diffusers.AutoencoderKLQwenImage(**TINY_QWEN_VAE), text_encoder=encoder, tokenizer=tokenizer,
        processor=processor, transformer=diffusers.QwenImageTransformer2DModel(**TINY_QWEN_TRANSFORMER))
    pipeline.save_pretrained(str(directory))
    return directory


# A tiny Wan 2.1 text-to-video pipeline: AutoencoderKLWan with Wan's 8x spatial and 4x temporal compression (32x32
# clips of 5 frames -> 2 latent frames of 4x4, 4 channels), a one-block WanTransformer3DModel over 2x2 patches, a
# one-layer UMT5 encoder with the shipped tiny T5 tokenizer (tiny_flow/tokenizer_3), Wan's UniPC flow scheduler.
TINY_WAN_VAE = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                "temperal_downsample": [False, True, True], "latents_mean": [0.1, -0.2, 0.3, 0.0],
                "latents_std": [1.5, 0.8, 2.0, 1.2]}
TINY_WAN_TRANSFORMER = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
                        "out_channels": 4, "text_dim": 32, "freq_dim": 16, "ffn_dim": 32, "num_layers": 1,
                        "rope_max_seq_len": 32}
TINY_UMT5 = {"d_model": 32, "d_ff": 32, "d_kv": 8, "num_layers": 1, "num_heads": 4, "relative_attention_num_buckets": 8,
             "relative_attention_max_distance": 16, "feed_forward_proj": "gelu", "pad_token_id": 0, "eos_token_id": 1,
             "decoder_start_token_id": 0}
# WanPipeline's scheduler as Wan 2.1 ships it (UniPC over flow sigmas, shift 3)
TINY_WAN_SCHEDULER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0,
                      "num_train_timesteps": 1000}


def tiny_wan(directory: Path, seed: int = 0) -> Path:
    """A tiny WanPipeline saved with weights in ``directory`` (the configs above), freshly initialised with ``seed``."""
    import diffusers
    import torch
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = T5TokenizerFast.from_pretrained(str(ASSETS / "tiny_flow" / "tokenizer_3"))
    pipeline = diffusers.WanPipeline(
        tokenizer=tokenizer, text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TINY_UMT5)),
        vae=diffusers.AutoencoderKLWan(**TINY_WAN_VAE),
        transformer=diffusers.WanTransformer3DModel(**TINY_WAN_TRANSFORMER),
        scheduler=diffusers.UniPCMultistepScheduler(**TINY_WAN_SCHEDULER))
    pipeline.save_pretrained(str(directory))
    return directory


WAN22_BOUNDARY = 0.875  # what the tiny two-expert pipeline's config carries (Wan 2.2 A14B's)


def tiny_wan22(directory: Path) -> Path:
    """A tiny two-transformer WanPipeline (Wan 2.2 A14B's layout): the tiny Wan 2.1 one plus a differently
    initialised transformer_2, with boundary_ratio in its config."""
    import diffusers
    import torch

    one = diffusers.WanPipeline.from_pretrained(str(tiny_wan(directory.with_name(directory.name + "-one"))))
    torch.manual_seed(1)
    second = type(one.transformer).from_config(one.transformer.config)
    two = diffusers.WanPipeline(one.tokenizer, one.text_encoder, one.vae, one.scheduler, one.transformer,
                                transformer_2=second, boundary_ratio=WAN22_BOUNDARY)
    two.save_pretrained(str(directory))
    return directory


# A tiny LTX2Pipeline in LTX-2.3's layout (per-modality text projections in the connectors, gated attention and
# cross-attention modulation in both streams, no caption projection in the transformer): a two-layer Gemma 3 text
# encoder with the shipped tiny T5 tokenizer (tiny_flow/tokenizer_3; the pipeline left-pads whatever tokenizer it
# has), a video VAE with 2x spatial and 2x temporal compression (32x32 clips of 5 frames -> 3 latent frames of 16x16,
# 4 channels), an audio VAE that compresses 4x in time and mel bins (8 bins -> 2, 2 channels: 4 per audio token), a
# one-block transformer, LTX-2's flow-match scheduler and a small vocoder.
TINY_GEMMA3_TEXT = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "head_dim": 8, "intermediate_size": 32, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"]}
TINY_GEMMA3_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "image_size": 16, "patch_size": 4}
TINY_LTX2_CONNECTORS = {"caption_channels": 16, "text_proj_in_factor": 3, "video_connector_num_attention_heads": 2,
                        "video_connector_attention_head_dim": 8, "video_connector_num_layers": 1,
                        "video_connector_num_learnable_registers": None, "audio_connector_num_attention_heads": 2,
                        "audio_connector_attention_head_dim": 8, "audio_connector_num_layers": 1,
                        "audio_connector_num_learnable_registers": None, "connector_rope_base_seq_len": 32,
                        "rope_double_precision": False, "rope_type": "split", "per_modality_projections": True,
                        "video_hidden_dim": 16, "audio_hidden_dim": 16}
TINY_LTX2_TRANSFORMER = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
                         "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4,
                         "audio_num_attention_heads": 2, "audio_attention_head_dim": 8,
                         "audio_cross_attention_dim": 16, "num_layers": 1, "caption_channels": 16,
                         "rope_double_precision": False, "rope_type": "split", "gated_attn": True,
                         "cross_attn_mod": True, "audio_gated_attn": True, "audio_cross_attn_mod": True,
                         "use_prompt_embeddings": False}
TINY_LTX2_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (8,),
                 "decoder_block_out_channels": (8,), "layers_per_block": (1,), "decoder_layers_per_block": (1, 1),
                 "spatio_temporal_scaling": (True,), "decoder_spatio_temporal_scaling": (True,),
                 "decoder_inject_noise": (False, False), "downsample_type": ("spatiotemporal",),
                 "upsample_residual": (False,), "upsample_factor": (1,), "timestep_conditioning": False,
                 "patch_size": 1, "patch_size_t": 1, "encoder_causal": True, "decoder_causal": False}
TINY_LTX2_AUDIO_VAE = {"base_channels": 4, "output_channels": 2, "ch_mult": (1, 1, 1), "num_res_blocks": 1,
                       "attn_resolutions": None, "in_channels": 2, "resolution": 32, "latent_channels": 2,
                       "norm_type": "pixel", "causality_axis": "height", "dropout": 0.0,
                       "mid_block_add_attention": False, "sample_rate": 16000, "mel_hop_length": 160,
                       "is_causal": True, "mel_bins": 8}
TINY_LTX2_VOCODER = {"in_channels": 16, "hidden_channels": 32, "out_channels": 2, "upsample_kernel_sizes": [4, 4],
                     "upsample_factors": [2, 2], "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]],
                     "leaky_relu_negative_slope": 0.1, "output_sampling_rate": 16000}


def tiny_ltx2(directory: Path, seed: int = 0) -> Path:
    """A tiny LTX2Pipeline saved with weights in ``directory`` (the configs above), freshly initialised with
    ``seed``; the VAEs' normalising statistics are set away from 0 / 1 so that a test sees them act."""
    import diffusers
    import torch
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, T5TokenizerFast

    torch.manual_seed(seed)
    tokenizer = T5TokenizerFast.from_pretrained(str(ASSETS / "tiny_flow" / "tokenizer_3"))
    encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={**TINY_GEMMA3_TEXT, "vocab_size": len(tokenizer)}, vision_config=TINY_GEMMA3_VISION,
        mm_tokens_per_image=4))
    vae = diffusers.AutoencoderKLLTX2Video(**TINY_LTX2_VAE)
    audio_vae = diffusers.AutoencoderKLLTX2Audio(**TINY_LTX2_AUDIO_VAE)
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
        vae.latents_std.copy_(torch.tensor([1.5, 0.8, 2.0, 1.2]))
        audio_vae.latents_mean.copy_(torch.tensor([0.2, 0.0, -0.1, 0.3]))
        audio_vae.latents_std.copy_(torch.tensor([0.5, 1.5, 1.0, 2.0]))
    pipeline = diffusers.LTX2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=encoder,
        tokenizer=tokenizer, connectors=LTX2TextConnectors(**TINY_LTX2_CONNECTORS),
        transformer=diffusers.LTX2VideoTransformer3DModel(**TINY_LTX2_TRANSFORMER),
        vocoder=LTX2Vocoder(**TINY_LTX2_VOCODER))
    pipeline.save_pretrained(str(directory))
    return directory


# A tiny HunyuanVideo 1.5 text-to-video pipeline: AutoencoderKLHunyuanVideo15 with 8x spatial and 4x temporal
# compression (32x32 clips of 5 frames -> 2 latent frames of 4x4, 4 channels), a two-block transformer (more blocks
# than its one-layer token refiner: the blocks are what FSDP2 and activation checkpointing wrap) over the noisy
# latents, condition latents and mask (9 channels), a two-layer Qwen2.5-VL text model (the pipeline reads its
# third-last hidden states) with the tiny Qwen tokenizer and a chat template in Qwen's form, a one-layer T5 glyph
# encoder with ByT5's byte tokenizer (it needs no vocabulary file), and a classifier-free-guidance guider.
HUNYUAN_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_HUNYUAN_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "max_position_embeddings": 2048,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
TINY_BYT5 = {"d_model": 16, "d_ff": 32, "d_kv": 8, "num_layers": 1, "num_heads": 2, "relative_attention_num_buckets": 8,
             "relative_attention_max_distance": 16}
TINY_HUNYUAN_VAE = {"latent_channels": 4, "block_out_channels": [8, 8, 8, 8], "layers_per_block": 1,
                    "spatial_compression_ratio": 8, "temporal_compression_ratio": 4, "scaling_factor": 0.7}
TINY_HUNYUAN_TRANSFORMER = {"in_channels": 9, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
                            "num_layers": 2, "num_refiner_layers": 1, "text_embed_dim": 32, "text_embed_2_dim": 16,
                            "image_embed_dim": 16, "rope_axes_dim": [2, 2, 4], "target_size": 32}


def tiny_hunyuan(directory: Path, seed: int = 0) -> Path:
    """A tiny HunyuanVideo15Pipeline saved with weights in ``directory`` (the configs above), freshly initialised
    with ``seed``."""
    import diffusers
    import torch
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = HUNYUAN_CHAT_TEMPLATE
    text = Qwen2_5_VLTextConfig(**TINY_HUNYUAN_TEXT, vocab_size=len(tokenizer), bos_token_id=None,
                                eos_token_id=tokenizer.eos_token_id)
    glyph_tokenizer = ByT5Tokenizer()
    pipeline = diffusers.HunyuanVideo15Pipeline(
        text_encoder=Qwen2_5_VLTextModel(text), tokenizer=tokenizer,
        transformer=diffusers.HunyuanVideo15Transformer3DModel(**TINY_HUNYUAN_TRANSFORMER),
        vae=diffusers.AutoencoderKLHunyuanVideo15(**TINY_HUNYUAN_VAE),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=T5EncoderModel(T5Config(vocab_size=len(glyph_tokenizer), **TINY_BYT5)),
        tokenizer_2=glyph_tokenizer, guider=diffusers.ClassifierFreeGuidance(guidance_scale=6.0))
    pipeline.save_pretrained(str(directory))
    return directory


CLIP_CAPTIONS = ("a red square moving right", "a blue square moving down", "a green square moving left",
                 "a white square moving up")


def tiny_clips(directory: Path, frames: int = 5, size: int = 32) -> Path:
    """Four clips of a square crossing a dark background, with ``.txt`` captions beside them: two animated GIFs,
    an animated WebP and a folder of PNG frames."""
    from PIL import Image, ImageDraw

    directory.mkdir(parents=True, exist_ok=True)
    colours = ("red", "blue", "green", "white")
    steps = ((1, 0), (0, 1), (-1, 0), (0, -1))
    for number, (caption, colour, (dx, dy)) in enumerate(zip(CLIP_CAPTIONS, colours, steps, strict=True)):
        images = []
        for f in range(frames):
            image = Image.new("RGB", (size, size), (20, 20, 30))
            x, y = size // 2 + dx * (f * 3 - 6), size // 2 + dy * (f * 3 - 6)
            ImageDraw.Draw(image).rectangle((x - 5, y - 5, x + 5, y + 5), fill=colour)
            images.append(image)
        name = f"clip_{number}"
        if number == 3:
            (directory / name).mkdir()
            for f, image in enumerate(images):
                image.save(directory / name / f"{f:03d}.png")
        else:
            suffix = "webp" if number == 2 else "gif"
            images[0].save(directory / f"{name}.{suffix}", save_all=True, append_images=images[1:], duration=100,
                           loop=0, **({"lossless": True} if suffix == "webp" else {}))
        (directory / f"{name}.txt").write_text(caption, encoding="utf-8")
    return directory


def clip_batch(clips: Path, n: int = 2) -> Any:
    """The first ``n`` clips of a ``tiny_clips`` folder at 32x32, as one batch (batch, channels, frames, h, w)."""
    import torch

    from automodel_diffusion.datasets import VideoCaptionDataset

    data = VideoCaptionDataset(str(clips), resolution=32)
    return torch.stack([data[i]["pixel_values"] for i in range(n)])


def form_overrides(base: Path, clips: Path, ckpt: Path) -> tuple:
    """A video upstream form's overrides: the tiny pipeline, the clip folder and the checkpoint folder."""
    return ("--model.pretrained_model_name_or_path", base, "--data.dataloader.cache_dir", clips,
            "--checkpoint.checkpoint_dir", ckpt)


# ---- shared by the model-family tests (test_flux.py, test_qwen_image.py) ------------------------------------------


def family_model(base: Path, **kwargs: Any) -> Any:
    """The pipeline in ``base`` as the recipe trains it, with a logit-normal flow-matching objective."""
    from automodel_diffusion import AutoDiffusionPipeline
    from automodel_diffusion.objectives import ObjectiveConfig, build_objective

    model = AutoDiffusionPipeline.from_pretrained(str(base), **kwargs)
    model.objective = build_objective(ObjectiveConfig(timestep_sampling="logit_normal"), model.pipeline.scheduler)
    return model


def assert_a_cache_gives_the_full_pipelines_loss(base: Path, transformer_cls: str, captions: list[str],
                                                  images: Any = None, **kwargs: Any) -> None:
    """One batch's losses on the transformer loaded alone, from latent-cache entries made as ``precompute diffusion``
    makes them (one image, one caption at a time), equal the full pipeline's on the same images, noise and caption
    dropout (up to float rounding). ``images``: one per caption (None: ``pixels``)."""
    import torch

    from automodel_diffusion import AutoDiffusionPipeline
    from automodel_diffusion.objectives import ObjectiveConfig, build_objective

    images = pixels(len(captions)) if images is None else images
    cpu, settings = torch.device("cpu"), ObjectiveConfig(caption_dropout=0.5)
    full = AutoDiffusionPipeline.from_pretrained(str(base), **kwargs)
    alone = AutoDiffusionPipeline.load_transformer_only(str(base), transformer_cls, **kwargs)
    assert alone.transformer_only and alone.pipeline.vae is None and alone.pipeline.text_encoder is None
    full.objective = build_objective(settings, full.pipeline.scheduler)
    alone.objective = build_objective(settings, alone.pipeline.scheduler)
    conditioning = full.conditioning
    dropped = (torch.rand(len(captions), generator=torch.Generator().manual_seed(4)) < 0.5).tolist()
    assert dropped[:3] == [False, False, True], "seed 4 keeps two captions and drops the third"
    with torch.no_grad():
        cached = {"latent_parameters": torch.cat([full.encode_pixels(images[i:i + 1]).latent_dist.parameters
                                                  for i in range(len(captions))]),
                  "conditions": [conditioning.split(conditioning.encode([c], cpu))[0] for c in captions],
                  "empty_conditions": conditioning.split(conditioning.encode([""], cpu))[0]}
        expected = full(images, captions, generator=torch.Generator().manual_seed(4))
        got = alone(None, captions, generator=torch.Generator().manual_seed(4), cached=cached)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def pixels(n: int = 2) -> Any:
    """``n`` fixed 32x32 RGB images in [-1, 1]."""
    import torch

    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1


def refusals(config: Path, *overrides: Any) -> dict[str, str]:
    """Key -> message of what validation refuses in ``config`` with ``overrides``."""
    import pytest

    from automodel.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(config, *overrides)
    return {issue.key: issue.message for issue in info.value.issues}


def build_refusals_on_the_sd3_pipeline(config: Path) -> dict[str, str]:
    """Key -> message of what the build refuses when ``config`` (a family form naming a hub pipeline, which
    validation cannot read) is built on the tiny SD3 pipeline."""
    import pytest

    from automodel.errors import ConfigError
    from automodel_diffusion import AutoDiffusionPipeline
    from automodel_diffusion.upstream import apply_adapter

    _, cfg = load_config(config)
    with pytest.raises(ConfigError) as info:
        apply_adapter(cfg, AutoDiffusionPipeline.from_config(str(ASSETS / "tiny_flow")))
    return {issue.key: issue.message for issue in info.value.issues}


def fixed_batch_loss(model: Any, images: Any, captions: list[str]) -> Any:
    """The mean loss of one batch with the same noise and timesteps every call."""
    import torch

    return model(images, captions, generator=torch.Generator().manual_seed(0)).mean()


def train_on_fixed_batch(model: Any, images: Any, captions: list[str], steps: int = 15) -> tuple[float, float]:
    """(loss before, loss after) ``steps`` AdamW steps on one batch."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.no_grad():
        first = float(fixed_batch_loss(model, images, captions))
    for _ in range(steps):
        optimizer.zero_grad()
        fixed_batch_loss(model, images, captions).backward()
        optimizer.step()
    with torch.no_grad():
        return first, float(fixed_batch_loss(model, images, captions))


def assert_cli_run_saved_the_trained_pipeline(ckpt: Path, base: Path, pipeline_class: str) -> None:
    """A 3-step run with a checkpoint each step: finite losses; a ``pipeline_class`` that diffusers loads, whose
    transformer is trained (changed from ``base`` and after step 1) and whose VAE is ``base``'s."""
    import numpy
    import torch
    from diffusers import DiffusionPipeline

    losses = testing.losses_by_step(ckpt / "training.jsonl")
    assert sorted(losses) == [1, 2, 3] and all(numpy.isfinite(v) for v in losses.values())
    pipeline = DiffusionPipeline.from_pretrained(str(ckpt / "epoch_0_step_3" / "model"))
    assert type(pipeline).__name__ == pipeline_class
    before = DiffusionPipeline.from_pretrained(str(base)).transformer.state_dict()
    trained = pipeline.transformer.state_dict()
    assert trained.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], trained[k])]
    assert len(changed) > len(before) // 2, f"training changed only {changed} of the transformer"
    first = testing.load_safetensors_state(ckpt / "epoch_0_step_1" / "model" / "transformer")
    assert any(not torch.equal(first[k], trained[k]) for k in first), "steps 2-3 changed nothing"
    testing.assert_states_equal(testing.load_safetensors_state(ckpt / "epoch_0_step_3" / "model" / "vae"),
                                testing.load_safetensors_state(base / "vae"))


def assert_generate_samples(config: Path, model_dir: Path, out: Path, pipeline_class: str, *overrides: Any) -> None:
    """``generate diffusion`` (``config``, run in ``out``, the working directory) on the pipeline in ``model_dir``
    loads a ``pipeline_class`` and writes two 32x32 images."""
    import numpy
    from PIL import Image

    recipe_cls, cfg = load_config(config, "--model.pretrained_model_name_or_path", model_dir,
                                  "--inference.guidance_scale", "null", *overrides, route=("generate", "diffusion"))
    generate = recipe_cls(cfg)
    generate.setup()
    assert type(generate.pipeline).__name__ == pipeline_class
    generate.run_train_validation_loop()
    written = sorted((out / "inference_outputs").iterdir())
    assert len(written) == 2 and numpy.asarray(Image.open(written[0])).shape == (32, 32, 3)
