"""Giving a built transformers model its MTP heads (:mod:`automodel.mtp.heads`): the family's sublayers as the
model's ``mtp`` submodule (so its state dict, checkpoints and HF export hold them under the HF names
``mtp.layers.{i}...``), their weights from the checkpoint's safetensors ``mtp.*`` tensors when it has them, and a
forward that, while training, runs the heads on the main model's final hidden states.

A family (a transformers ``model_type``) plugs in with a module giving ``build_heads(model, text_model,
settings)``, ``depth_kwargs(text_model, hidden, attention_mask, position_ids)`` (what a depth's sublayers are called
with, from the attention mask and positions the text model got) and ``checkpoint_tensors(tensors)`` (a checkpoint's
``mtp.*`` tensors under the model's names); :data:`automodel.model_kwargs.MTP_FAMILIES` names it, the final norm
the heads start from (its parent is the text model) and the text config's key counting the depths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.model_kwargs import (
    MTP,
    MTP_CONFIG_MAPPINGS,
    MTP_FAMILIES,
    mtp_config_depths,
    mtp_depths_in_config,
    mtp_depths_zero,
)
from automodel.mtp.heads import MTPHeads, MTPSettings, future_embeddings

KEY = "model.num_nextn_predict_layers"


def attach_heads(model: nn.Module, settings: MTPSettings, checkpoint: str | None) -> MTPHeads | None:
    """Add the heads to ``model`` (built by transformers, on the meta device or not); ``checkpoint``: the
    ``from_pretrained`` path whose ``mtp.*`` tensors initialise them (None: a fresh model). Its config's
    ``num_nextn_predict_layers`` becomes the depths with their own weights (what the saved model holds). None: the
    count of a config mapping of a family without heads here, which builds none (the recipe says so)."""
    config = model.config
    if config.model_type not in MTP_FAMILIES:
        if settings.asked_by.startswith(MTP_CONFIG_MAPPINGS):
            return None
        asked = f"{KEY}: {settings.depths}" if settings.depths else settings.asked_by
        raise AutomodelError(f"{asked} asks for {MTP}; this model is {config.model_type}: remove the MTP keys")
    module_name, norm_name, depths_key = MTP_FAMILIES[config.model_type]
    text_config = config.get_text_config()
    if not settings.depths:  # the keys leave the count to the checkpoint's config
        depths = mtp_config_depths(text_config, depths_key)
        if not depths:
            raise AutomodelError(f"{settings.asked_by}: acts on {MTP}, but the {config.model_type} config "
                                 f"has {depths_key} 0 (no heads); set model.num_nextn_predict_layers")
        settings = dataclasses.replace(settings, depths=depths)
    family = importlib.import_module(module_name)
    embeddings = model.get_input_embeddings().weight
    text_model = model.get_submodule(norm_name.rpartition(".")[0])
    from automodel.training.parallel.materialize import parameters_on_meta

    with parameters_on_meta() if embeddings.is_meta else contextlib.nullcontext():
        heads = family.build_heads(model, text_model, settings).to(embeddings.dtype)
    _keep_in_fp32(model, heads)
    model.add_module("mtp", heads)
    setattr(text_config, depths_key, settings.physical_depths)  # what the saved config says: the depths it holds
    if getattr(text_config, "num_nextn_predict_layers", None) is not None:  # upstream's name, where a config has it
        text_config.num_nextn_predict_layers = settings.physical_depths
    heads.origin = _initialise(text_model, heads, family, checkpoint, on_meta=embeddings.is_meta)
    _run_heads_in_forward(model, heads, family, text_model, model.get_submodule(norm_name))
    return heads


def _keep_in_fp32(model: nn.Module, heads: MTPHeads) -> None:
    """The tensors the model keeps in float32 whatever its dtype (transformers' ``_keep_in_fp32_modules_strict``:
    a MoE router's weight and bias) stay so in the heads too."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    for module_name, module in heads.named_modules():
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None and any(part in f"{module_name}.{name}" for part in keep):
                tensor.data = tensor.data.float()


def _initialise(text_model: nn.Module, heads: MTPHeads, family: Any, checkpoint: str | None, on_meta: bool) -> str:
    """Where the heads' weights come from, said for the run's log; reads them when the model is built (fresh ones
    as the text model initialises its layers: its config has the initializer range a composite one may lack)."""
    from automodel.meta_build import local_weights
    from automodel.training.parallel.materialize import weight_files

    directory = local_weights(checkpoint) if checkpoint else None
    files = weight_files(directory) if directory is not None else {}
    names = [name for name in files if name.startswith("mtp.")]
    if not names:
        if not on_meta:  # on the meta device the engine initialises them from the seed
            heads.apply(text_model._init_weights)
        return "freshly initialised (the checkpoint has no mtp.* tensors)" if checkpoint else "freshly initialised"
    if on_meta:  # the engine reads the model's tensors, the heads' among them, by their names
        _check_fit(heads, {name.removeprefix("mtp."): None for name in names})
        return f"read with the model from '{directory}'"
    from safetensors import safe_open

    tensors = {}
    for name in names:
        with safe_open(str(files[name]), framework="pt") as handle:
            tensors[name] = handle.get_tensor(name)
    state = {name.removeprefix("mtp."): tensor for name, tensor in family.checkpoint_tensors(tensors).items()}
    _check_fit(heads, state)
    with torch.no_grad():
        for name, tensor in heads.state_dict(keep_vars=True).items():
            tensor.copy_(state[name])
    return f"read from the checkpoint's {len(names)} mtp.* tensors"


def _check_fit(heads: MTPHeads, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``mtp.*`` tensors (``state``, under the heads' names; None: shape unknown) are not
    exactly the heads'."""
    expected = heads.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{name}: checkpoint {tuple(state[name].shape)} vs heads {tuple(expected[name].shape)}"
             for name in expected if state.get(name) is not None and state[name].shape != expected[name].shape]
    if missing or extra or wrong:
        raise AutomodelError(f"{KEY}: the checkpoint's mtp.* tensors do not fit {heads.settings.physical_depths} MTP "
                             f"depths of this model (missing: {', '.join(missing[:4]) or 'none'}; unexpected: "
                             f"{', '.join(extra[:4]) or 'none'}; shapes: {'; '.join(wrong[:4]) or 'fine'}); use the "
                             "checkpoint's own num_nextn_predict_layers (mtp_use_repeated_layer: one physical depth)")


def _run_heads_in_forward(model: nn.Module, heads: MTPHeads, family: Any, text_model: nn.Module,
                          norm: nn.Module) -> None:
    """The model's forward, while training, also runs the heads on the output of its final norm (kept by a
    forward hook) with the attention mask and positions the text model got (a vision-language model computes the
    positions of image rows inside), inside the model's own call: FSDP2 has its parameters gathered there. The
    hooks keep nothing outside that call (a pipeline stage runs the modules without it: :mod:`.pipeline`)."""
    captured: dict[str, Any] = {}

    def keep(**values: Any) -> None:
        if captured.get("active"):
            captured.update(values)

    norm.register_forward_hook(lambda module, args, output: keep(hidden=output))
    text_model.register_forward_pre_hook(
        lambda module, args, kwargs: keep(attention_mask=kwargs.get("attention_mask"),
                                          position_ids=kwargs.get("position_ids")), with_kwargs=True)
    forward = model.forward

    @functools.wraps(forward)
    def forward_with_heads(*args: Any, **kwargs: Any) -> Any:
        captured.clear()
        captured["active"] = True
        try:
            output = forward(*args, **kwargs)
        finally:
            captured["active"] = False
        hidden = captured.pop("hidden", None)
        if model.training and hidden is not None:
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if input_ids is None:
                raise AutomodelError(f"{KEY}: the MTP heads embed the tokens ahead, but the model got no input_ids")
            embedded = future_embeddings(input_ids, model.get_input_embeddings(), heads.settings.depths)
            heads.run(hidden, embedded, family.depth_kwargs(text_model, hidden, captured.pop("attention_mask", None),
                                                            captured.pop("position_ids", None)))
        captured.clear()
        return output

    model.forward = forward_with_heads


def read_settings(section: Mapping[str, Any], kwargs: dict[str, Any], config_asks: bool = True) -> MTPSettings | None:
    """Take the MTP keys out of a model factory's keyword arguments (``section``: them with the factory's
    ``config`` / ``text_config`` parameters): the settings when heads are asked for
    (``num_nextn_predict_layers`` > 0; or unset with ``mtp_loss_scaling_factor`` / ``mtp_use_repeated_layer``, as
    upstream's Super-V3 configs do: the checkpoint config's count, ``depths`` 0 here; or a count > 0 in
    ``section``'s own config mapping, :func:`mtp_depths_in_config`, where ``config_asks``: the factory's recipe
    trains heads), else None (``num_nextn_predict_layers: 0`` stays: it is set on a config that has the attribute;
    a depths count 0 in ``section``'s ``text_config`` or ``config`` turns them off: :func:`mtp_depths_zero`)."""
    depths = kwargs.get("num_nextn_predict_layers")
    off = mtp_depths_zero(section)
    factor = kwargs.pop("mtp_loss_scaling_factor", None)
    repeated = kwargs.pop("mtp_use_repeated_layer", None)
    in_config = mtp_depths_in_config(section) if config_asks else None
    if off or (depths is None and factor is None and not repeated and in_config is None):
        return None
    kwargs.pop("num_nextn_predict_layers", None)
    asked = {"num_nextn_predict_layers": depths, "mtp_loss_scaling_factor": factor, "mtp_use_repeated_layer": repeated}
    asked_by = next((key for key, value in asked.items() if value not in (None, False)), in_config)
    return MTPSettings(depths=int(depths or 0), scaling_factor=0.1 if factor is None else float(factor),
                       repeated_layer=bool(repeated), asked_by=f"model.{asked_by}")
