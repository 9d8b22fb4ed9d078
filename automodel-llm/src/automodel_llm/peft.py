"""LoRA through peft: the PEFT slot of the pipeline, adapter saving/loading and merged export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


class PeftConfig:
    """LoRA settings with upstream-compatible names (``dim``/``alpha``/``match_all_linear``) or peft's own.

    ``target_modules`` are module-name patterns (``q_proj``, ``*.v_proj``); with none given, or
    ``match_all_linear: true``, every linear layer except the output head gets an adapter.
    """

    def __init__(self, target_modules: list[str] | str | None = None, match_all_linear: bool = False,
                 exclude_modules: list[str] | None = None, dim: int | None = None, r: int | None = None,
                 rank: int | None = None, alpha: float | None = None, lora_alpha: float | None = None,
                 dropout: float | None = None, lora_dropout: float | None = None, use_triton: bool = False,
                 use_dora: bool = False, dropout_position: str = "pre", lora_A_init: str | None = None):
        given = [v for v in (dim, r, rank) if v is not None]
        if len(set(given)) > 1:
            raise ValueError(f"peft: dim/r/rank disagree ({given}); give one")
        self.rank = given[0] if given else 8
        self.alpha = alpha if alpha is not None else (lora_alpha if lora_alpha is not None else 2 * self.rank)
        self.dropout = dropout if dropout is not None else (lora_dropout or 0.0)
        self.target_modules = target_modules
        self.match_all_linear = match_all_linear or not target_modules
        self.exclude_modules = exclude_modules
        self.use_dora = use_dora
        if self.rank < 1:
            raise ValueError(f"peft.dim must be >= 1, found {self.rank}")

    def to_lora_config(self) -> Any:
        import peft

        if self.match_all_linear:
            targets: Any = "all-linear"
        elif isinstance(self.target_modules, str):
            targets = self.target_modules
        else:
            # peft matches plain names as suffixes; glob patterns become one regular expression.
            names = [t.replace("*.", "").replace("*", "") for t in self.target_modules]
            targets = names
        return peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                               target_modules=targets, exclude_modules=self.exclude_modules,
                               use_dora=self.use_dora, task_type="CAUSAL_LM")


def lora_config_from(recipe: Any) -> Any:
    import peft

    node = recipe.cfg.peft
    built = node.instantiate(default_target="automodel_llm.peft.PeftConfig")
    if isinstance(built, PeftConfig):
        return built.to_lora_config()
    if isinstance(built, peft.PeftConfig):
        return built
    raise AutomodelError(f"peft._target_: built {type(built).__name__}; expected automodel_llm.peft.PeftConfig or "
                         "peft.LoraConfig")


def apply_lora(recipe: Any, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The PEFT pipeline stage: wrap the model with LoRA adapters; only adapter weights train."""
    import peft

    config = lora_config_from(recipe)
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as err:
        raise AutomodelError(f"peft.target_modules: {err}") from None
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    return wrapped, f"LoRA r={config.r} alpha={config.lora_alpha}: {trainable} of {total} parameters train"


def is_adapter_dir(directory: Path) -> bool:
    return (directory / ADAPTER_WEIGHTS).is_file()


def load_adapter_weights(model: torch.nn.Module, directory: Path) -> None:
    import peft
    from safetensors.torch import load_file

    if not hasattr(model, "peft_config"):
        raise AutomodelError(f"restore_from.path: '{directory}' holds a LoRA adapter but this config has no peft: "
                             "section; add the same peft: settings as the run that wrote it")
    result = peft.set_peft_model_state_dict(model, load_file(str(directory / ADAPTER_WEIGHTS)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise AutomodelError(f"restore_from.path: adapter in '{directory}' does not match the model: unexpected "
                             f"keys {unexpected[:5]}")
