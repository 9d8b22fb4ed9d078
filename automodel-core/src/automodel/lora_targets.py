"""Which modules upstream's ``peft.target_modules`` (or ``all-linear``) reach, and which of them peft cannot wrap.

Upstream writes module names (``q_proj``) and globs over the whole module name (``*_proj``); this build hands them to
peft, whose matcher differs, so globs are resolved here against the model. peft refuses LoRA on some modules of some
model types (the Mamba mixer's ``out_proj`` of falcon_h1, mamba2, nemotron_h ...: its fused CUDA scan reads
``out_proj.weight`` directly, so an adapter there would be bypassed in training). A glob or ``all-linear`` leaves
those out (the caller says so in a note); a module named outright is refused with the reason.
torch and peft are imported on first use.
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Any

from automodel.errors import AutomodelError
from automodel.fused_experts import EXPERT_WEIGHTS

if TYPE_CHECKING:
    import torch



def peft_patterns(patterns: list[str] | str) -> list[str] | str:
    """Upstream's module patterns as peft takes them: one name or a list of them, each a module's own name
    (``q_proj``: any module so named) or a glob over the module's whole name (``*_proj``, ``*.layers.0.*.v_proj``:
    ``*`` spans any characters, dots included). Plain names stay a list (peft matches them as name suffixes); with a
    glob among them they become one regular expression, which peft matches against the whole name."""
    names = [patterns] if isinstance(patterns, str) else list(patterns)
    if not any("*" in name for name in names):
        return names
    parts = [".*".join(re.escape(piece) for piece in name.split("*")) if "*" in name
             else rf"(?:.*\.)?{re.escape(name)}" for name in names]
    return "|".join(f"(?:{part})" for part in parts)


def glob_targets(model: torch.nn.Module, pattern: str, written: Any) -> tuple[list[str], list[str], list[str]]:
    """What upstream's glob patterns adapt, as upstream's matcher does: every linear layer whose whole name the
    pattern matches (``*`` includes the output head), and every MoE experts module it matches, through its fused
    weights (peft's ``target_parameters``). Returns (module names, parameter names, matched modules left out because
    peft refuses them for this model type: :func:`peft_refused`)."""
    import torch

    regex = re.compile(pattern)
    matched = [name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and regex.fullmatch(name)]
    refused = peft_refused(model, matched)
    modules = [name for name in matched if name not in refused]
    parameters = [name for name in fused_expert_weights(model) if regex.fullmatch(name.rsplit(".", 1)[0])]
    if not modules and not parameters:
        why = f" (peft refuses LoRA on {refused_summary(refused)} for this model type)" if refused else ""
        raise AutomodelError(f"peft.target_modules: {written} matches no linear layer or MoE experts module of "
                             f"{type(model).__name__}{why}")
    return modules, parameters, refused


def peft_refused(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Those of ``names`` (modules of ``model``) that peft refuses to wrap with LoRA for ``model``'s type, by
    asking peft's own check, so the rule follows the installed peft (none where that peft has no such check)."""
    import peft
    from peft.tuners import tuners_utils

    check = getattr(tuners_utils, "_check_lora_target_modules_mamba", None)
    if check is None:
        return []
    probe = peft.LoraConfig()
    refused = []
    for name in names:
        try:
            check(probe, model, name.rsplit(".", 1)[-1])
        except ValueError:
            refused.append(name)
    return refused


def refused_summary(names: list[str]) -> str:
    """``out_proj (x 2)``: the refused modules by their own name, with how many of each."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name.rsplit(".", 1)[-1]] = counts.get(name.rsplit(".", 1)[-1], 0) + 1
    return ", ".join(f"{short} (x {n})" for short, n in counts.items())


def named_refused(model: torch.nn.Module, names: list[str]) -> None:
    """Refuse module names given outright (``target_modules: [q_proj, out_proj]``) that peft cannot wrap here."""
    wanted = set(names)
    reached = [full for full, _ in model.named_modules() if full.rsplit(".", 1)[-1] in wanted or full in wanted]
    refused = peft_refused(model, reached)
    if refused:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        shorts = sorted({name.rsplit(".", 1)[-1] for name in refused})
        keep = [name for name in names if name not in shorts]
        raise AutomodelError(f"peft.target_modules: {shorts} cannot take LoRA on a {kind} model (peft refuses them: "
                             "the Mamba mixer's fused scan reads out_proj's weight directly, bypassing an adapter); "
                             f"use target_modules: {keep or ['in_proj']}")


def fused_expert_weights(model: torch.nn.Module | None) -> list[str]:
    """The names of a mixture-of-experts model's fused expert weights (3-D ``gate_up_proj`` / ``down_proj``)."""
    return [name for name, param in model.named_parameters()
            if param.dim() == 3 and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS] if model is not None else []


def all_linear_targets(config: Any, model: torch.nn.Module) -> Any:
    """``config`` with peft's ``all-linear`` spelt out for ``model``: every linear layer but the output head, by
    name, as peft resolves it on a causal LM. A part of ``model`` (a pipeline stage) adapted with it gets the
    adapters one process would, and its ``adapter_config.json`` names every part's."""
    targets = config.target_modules
    if not (isinstance(targets, str) and targets.lower() == "all-linear"):
        return config
    spelt = copy.copy(config)
    spelt.target_modules = set(all_linear_names(model))
    return spelt


def all_linear_names(model: torch.nn.Module) -> list[str]:
    """Every linear layer of ``model`` but its output head, by full name (peft's ``all-linear`` on a causal LM)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head]
