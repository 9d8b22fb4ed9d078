"""Keys of a ``model.config`` mapping that nothing would read, refused at validation.

transformers' configuration classes keep any keyword they are given as an attribute, declared or not, so a misspelt
key written into a model's config mapping (``num_hiden_layers: 2``) used to build the model unchanged, silently. A
key is taken when the configuration class declares it (an attribute of its default instance, a class attribute or
an ``attribute_map`` name) or when transformers' code for that model reads it: its name appears in the model's own
package or in transformers' shared modules (the configuration and modeling base classes, RoPE, generation,
integrations), as a checkpoint's ``decoder_start_token_id`` or ``rope_theta`` does. An upstream key naming a choice
that transformers' code for the model makes one way without reading it (``topk_method: noaux_tc`` where the router
always corrects its scores by bias) passes with that value and is refused with another. Only mappings written in
the config are checked: a checkpoint's own ``config.json`` may carry keys nothing reads, which are not the user's.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from automodel.suggest import did_you_mean

# AutoConfig.from_pretrained's / a configuration class's from_pretrained's own arguments: not config keys
_LOADER_ARGUMENTS = {"_target_", "pretrained_model_name_or_path", "trust_remote_code", "revision", "cache_dir",
                     "local_files_only", "token", "subfolder", "force_download", "proxies", "code_revision",
                     "return_unused_kwargs"}
# upstream's keys for a choice its own model code makes, which transformers' code for some models makes one way only
# without reading the key: key -> (the value that is what runs, a name in that code showing it runs, what it is)
_WHAT_RUNS = {"topk_method": ("noaux_tc", "e_score_correction_bias", "picks its experts with the score-correction "
                              "bias, by groups (DeepSeek-V3's noaux_tc)")}
_TRANSFORMERS_CONFIG = re.compile(r"transformers\.(?:models\.[a-z0-9_]+\.configuration_[a-z0-9_]+\.)?"
                                  r"(?P<name>[A-Z][A-Za-z0-9]*Config)(?P<load>\.from_pretrained)?")


def config_mapping_issues(node: Any) -> dict[str, str]:
    """``{"config.<key>": message}`` for each key of a model section's ``config`` mapping that its configuration
    class does not declare and no transformers code for that model reads; {} when the class cannot be known here
    (a hub name, remote code, a file: the checkpoint's own keys)."""
    if not isinstance(node, Mapping):
        return {}
    config_class = _config_class(node)
    if config_class is None:
        return {}
    fields = {k: v for k, v in node.items() if k not in _LOADER_ARGUMENTS and k != "model_type"}
    return {f"config.{key}": message for key, message in unread_keys(config_class, fields).items()}


def _config_class(node: Mapping) -> type | None:
    """The configuration class a ``config`` mapping builds: by ``model_type`` (alone or with
    ``AutoConfig.for_model``), by a transformers configuration class path, or a local checkpoint's through
    ``AutoConfig.from_pretrained``; None where that is not known here."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    target = node.get("_target_")
    try:
        if target is None or target == "transformers.AutoConfig.for_model":
            kind = node.get("model_type")
            return CONFIG_MAPPING[kind] if isinstance(kind, str) and kind in CONFIG_MAPPING else None
        found = _TRANSFORMERS_CONFIG.fullmatch(str(target))
        if found is None:
            return None
        if found["name"] == "AutoConfig" or found["load"]:
            source = node.get("pretrained_model_name_or_path")
            if source is None or not Path(str(source)).exists():
                return None  # a hub name: read when the model is built
            loaded = AutoConfig.from_pretrained(str(source), local_files_only=True)
            return type(loaded) if type(loaded).__module__.startswith("transformers.") else None
        import transformers

        found_class = getattr(transformers, found["name"], None)
        return found_class if isinstance(found_class, type) and issubclass(found_class, PretrainedConfig) else None
    except (ValueError, KeyError, OSError, TypeError):
        return None  # refused with its own reason when built


def unread_keys(config_class: type, fields: Mapping[str, Any]) -> dict[str, str]:
    """``{key: message}`` for each of ``fields`` that ``config_class`` does not declare and no transformers code for
    its model reads; a mapping given for a sub-config (``text_config``) is checked against that sub-config's class."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        default = config_class()
    except Exception:  # noqa: BLE001 - a class that needs arguments: not checked here
        return {}
    names = [*vars(default), *getattr(config_class, "attribute_map", {})]
    declared = {*names, *dir(config_class)}
    issues = {}
    for key, value in fields.items():
        if key in declared:
            sub = getattr(default, key, None)
            if isinstance(value, Mapping) and isinstance(sub, PretrainedConfig):
                kind = value.get("model_type")
                sub_class = CONFIG_MAPPING[kind] if kind in CONFIG_MAPPING else type(sub)
                inner = {k: v for k, v in value.items() if k != "model_type"}
                issues |= {f"{key}.{k}": m for k, m in unread_keys(sub_class, inner).items()}
            continue
        package = Path(sys.modules[config_class.__module__].__file__).parent
        word = re.compile(rf"\b{re.escape(key)}\b")
        if word.search(_code_text(package)) or word.search(_shared_code_text()):
            continue
        if key in _WHAT_RUNS and _WHAT_RUNS[key][1] in _code_text(package):
            runs, _, what = _WHAT_RUNS[key]
            if value != runs:
                issues[key] = (f"{value!r}: transformers' code for {getattr(default, 'model_type', '')} reads no "
                               f"{key}; its router always {what}: use {runs!r} or remove the key")
            continue
        close = did_you_mean(key, [name for name in names if not name.startswith("_")])
        issues[key] = (f"{config_class.__name__} has no such setting and no transformers code for "
                       f"{getattr(default, 'model_type', '') or config_class.__name__} reads it (it would be kept as "
                       "an attribute nothing uses): remove it"
                       + (f" (did you mean '{close}'?)" if close else " or correct its name"))
    return issues


@functools.lru_cache(maxsize=8)
def _code_text(folder: Path) -> str:
    """The code of the Python files in ``folder`` (a model's package: where its code reads its config)."""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in sorted(folder.glob("*.py")))


@functools.lru_cache(maxsize=1)
def _shared_code_text() -> str:
    """The code of transformers' modules every model uses: the base classes, RoPE, generation, integrations."""
    import transformers

    root = Path(transformers.__file__).parent
    return "\n".join(_code_text(folder) for folder in (root, root / "generation", root / "integrations"))
