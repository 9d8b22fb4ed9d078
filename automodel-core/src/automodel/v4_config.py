"""``checkpoint.v4_compatible`` (upstream's): model/'s config files as the pretrained model shipped them.

transformers 5 writes ``config.json`` in its own form, which transformers 4 and the servers built on it (vLLM) may
not read. With ``v4_compatible`` each of ``config.json`` and ``generation_config.json`` that the pretrained model
ships is copied into model/ (its ``quantization_config`` dropped, as the weights saved are not quantized; its
special-token ids those of the saved config, which carry the tokenizer's), and the file transformers 5 wrote is
kept beside it as ``config.v5.json`` / ``generation_config.v5.json``, as upstream keeps them. The weights need
nothing: they are saved under the checkpoint's original names (transformers' load-time conversions reverted).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError
from automodel.hf import model_source

CONFIG_FILES = ("config.json", "generation_config.json")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def original_config_files(name_or_path: str) -> dict[str, Path]:
    """The config files the pretrained model ships: in its directory, or in the hub cache (nothing is downloaded
    here: the model itself was loaded from there)."""
    local = Path(name_or_path)
    if local.is_dir():
        return {name: local / name for name in CONFIG_FILES if (local / name).is_file()}
    from huggingface_hub import try_to_load_from_cache

    found = {}
    for name in CONFIG_FILES:
        try:
            cached = try_to_load_from_cache(name_or_path, name)
        except ValueError:  # not a hub repository id
            return {}
        if isinstance(cached, str):
            found[name] = Path(cached)
    return found


def v4_config_issue(model: Mapping[str, Any] | None, adapter: bool) -> str | None:
    """Why ``checkpoint.v4_compatible: true`` cannot act for this model (None when it can)."""
    if adapter:
        return ("a LoRA run's model/ is the adapter (adapter_config.json), which has no config.json to write in "
                "either form; remove it")
    source = model_source(model, ("pretrained_model_name_or_path",))
    if source is None:
        return ("copies the pretrained model's config.json, and this model has none to copy (it is not loaded with "
                "model.pretrained_model_name_or_path); remove it")
    name, key = source
    if "config.json" not in original_config_files(name):
        return f"copies the pretrained model's config.json, and {key} '{name}' has none here; remove it"
    return None


def write_v4_configs(directory: Path, model: Mapping[str, Any] | None) -> list[str]:
    """In ``directory`` (a saved model's config files): each config file the pretrained model ships replaces the
    one transformers 5 wrote, which is kept as ``<name>.v5.json``; returns the files replaced."""
    source = model_source(model, ("pretrained_model_name_or_path",))
    if source is None:
        raise AutomodelError(f"checkpoint.v4_compatible: {v4_config_issue(model, adapter=False)}")
    replaced = []
    for name, original_file in original_config_files(source[0]).items():
        saved = directory / name
        if not saved.is_file():
            continue
        ours = json.loads(saved.read_text(encoding="utf-8"))
        original = json.loads(original_file.read_text(encoding="utf-8"))
        original.pop("quantization_config", None)
        original.update({key: ours[key] for key in TOKEN_IDS if ours.get(key) is not None})
        saved.rename(directory / name.replace(".json", ".v5.json"))
        saved.write_text(json.dumps(original, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        replaced.append(name)
    return replaced
