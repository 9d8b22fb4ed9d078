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
