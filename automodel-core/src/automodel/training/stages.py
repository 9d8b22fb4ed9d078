"""The core's implementations of pipeline slots: checkpoint restore, parameter freezing, device placement."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from automodel.training.recipe import TrainRecipe


def restore_checkpoint(recipe: TrainRecipe, model: torch.nn.Module) -> str:
    """Load the model weights of ``restore_from.path`` (optimizer, data and RNG follow once they are built)."""
    path = recipe.checkpointer.resolve(recipe.cfg.restore_from.path)
    recipe.restore_path = path
    recipe.load_model_weights(model, path / "model")
    return f"model weights from {path}"


def freeze_parameters(recipe: TrainRecipe, model: torch.nn.Module) -> str:
    """Freeze parameters matching ``freeze.patterns`` (and embeddings), except ``freeze.unfreeze_modules``."""
    cfg = recipe.cfg.freeze
    patterns = list(cfg.patterns)
    if cfg.embeddings and hasattr(model, "get_input_embeddings"):
        embeddings = model.get_input_embeddings()
        names = {f"{name}.weight" for name, module in model.named_modules() if module is embeddings}
        patterns += sorted(names)
    frozen = 0
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatch(name, p) for p in patterns) and not any(
                fnmatch.fnmatch(name, u) or name.startswith(u + ".") for u in cfg.unfreeze_modules):
            param.requires_grad_(False)
            frozen += 1
    total = sum(1 for _ in model.parameters())
    return f"froze {frozen} of {total} parameter tensors"


def place_on_device(recipe: TrainRecipe, model: torch.nn.Module) -> str:
    model.to(recipe.device)
    return f"model on {recipe.device}"


def compile_model(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``torch.compile`` with the configured backend and mode (the eager model stays reachable for saving)."""
    cfg = recipe.cfg.compile
    compiled = torch.compile(model, backend=cfg.backend or "inductor", mode=cfg.mode, fullgraph=cfg.fullgraph,
                             dynamic=cfg.dynamic)
    return compiled, f"torch.compile backend={cfg.backend or 'inductor'} mode={cfg.mode or 'default'}"


def float8_training(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """torchao float8 linear layers (validated beforehand: CUDA with compute capability >= 8.9 and torchao)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    name = recipe.cfg.fp8.recipe_name
    config = Float8LinearConfig.from_recipe_name(name) if name else Float8LinearConfig()
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: "lm_head" not in fqn)
    return model, f"float8 training ({name or 'tensorwise'})"


QAT_QUANTIZERS = {
    "int8_dynamic_act_int4_weight": "Int8DynActInt4WeightQATQuantizer",
    "int4_weight_only": "Int4WeightOnlyQATQuantizer",
}


def fake_quantize(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Quantisation-aware training: torchao swaps linear layers for fake-quantised ones (runs on CPU)."""
    import torchao.quantization.qat as qat

    cfg = recipe.cfg.qat
    quantizer = getattr(qat, QAT_QUANTIZERS[cfg.quantizer])(groupsize=cfg.group_size)
    model = quantizer.prepare(model)
    return model, f"QAT fake quantisation {cfg.quantizer} (group size {cfg.group_size})"
