"""The LLM recipe's tokenizer: where it comes from, building it, and what validation checks with it.

The tokenizer is the ``tokenizer:`` section, else (upstream's form) the training data set's ``tokenizer``, else the
model's (the directory it loads from). Validation loads the tokenizer when it is on this machine and checks,
before any model is built, what would otherwise fail later: a chat data set without a chat template, and a
tokenizer with more tokens than the model's embedding table (read from the model's local config.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from automodel.config import Config, ConfigNode
from automodel.config.model_paths import missing_location
from automodel.config.targets import TargetError
from automodel.errors import AutomodelError, ConfigIssue
from automodel.hf import load_tokenizer, model_source
from automodel_llm.datasets.arguments import argument_issues
from automodel_llm.datasets.chat import missing_template_problem

AUTO_TOKENIZER = "transformers.AutoTokenizer.from_pretrained"
VOCAB_PROBLEM = ("{tokens} tokens but the model's vocab_size is {vocab}: token ids past {vocab} have no embedding; "
                 "use the model's own tokenizer, or a model whose vocabulary holds the tokenizer's")


def tokenizer_section(cfg: Config) -> ConfigNode | None:
    """The section the tokenizer is built from: ``tokenizer``, else the training data set's ``tokenizer``."""
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    dataset = cfg.dataset
    nested = dataset.get("tokenizer") if dataset is not None else None
    return nested if isinstance(nested, ConfigNode) else None


def tokenizer_source(cfg: Config) -> tuple[str | None, str]:
    """``(name or path, config key)`` the tokenizer loads from: its section's, else the model's (the directory of
    a config file), else the data set's ``tokenizer_name_or_path``."""
    node = tokenizer_section(cfg)
    if node is not None:
        return node.get("pretrained_model_name_or_path"), f"{node.key}.pretrained_model_name_or_path"
    found = model_source(cfg.model)
    if found is not None:
        value, key = found
        return (str(Path(value).parent) if Path(value).is_file() else value), key
    dataset = cfg.dataset
    if dataset is not None and isinstance(dataset.get("tokenizer_name_or_path"), str):
        return dataset["tokenizer_name_or_path"], "dataset.tokenizer_name_or_path"
    return None, "tokenizer"


def needs_tokenizer(cfg: Config) -> bool:
    """False when no tokenizer is named and every data set section reads token ids (its target says
    ``pretokenized``, as NanogptDataset does): such a run pads nothing and trains without a tokenizer."""
    if tokenizer_section(cfg) is not None or tokenizer_source(cfg)[0] is not None:
        return True
    sections = dataset_sections(cfg)
    return not sections or not all(getattr(fn, "pretokenized", False) for _, _, fn in sections)


def build_tokenizer(cfg: Config) -> Any:
    """The tokenizer the recipe trains with (None for token-id data without one: :func:`needs_tokenizer`); the pad
    token falls back to EOS."""
    node = tokenizer_section(cfg)
    source, key = tokenizer_source(cfg)
    if not needs_tokenizer(cfg):
        return None
    if node is not None:
        if node.target is None and missing_location(source):
            raise AutomodelError(f"{key}: '{source}' does not exist")
        tokenizer = node.instantiate(default_target=AUTO_TOKENIZER)
    elif source is None:
        raise AutomodelError("tokenizer: none found; add `tokenizer: {pretrained_model_name_or_path: ...}`")
    else:
        tokenizer = load_tokenizer(source, key, **_model_file_arguments(cfg, key))
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _model_file_arguments(cfg: Config, key: str) -> dict[str, Any]:
    """A tokenizer taken from the model's directory reads the model's ``gguf_file`` too: a GGUF checkpoint holds
    its tokenizer, and the directory often has no other tokenizer files."""
    gguf_file = cfg.model.get("gguf_file") if key.startswith("model.") and cfg.model is not None else None
    return {"gguf_file": gguf_file} if isinstance(gguf_file, str) else {}


def model_vocab_size(cfg: Config) -> int | None:
    """The model's vocab_size when its config.json is on this machine (or the model section sets it)."""
    model = cfg.model
    if model is None:
        return None
    if isinstance(model.get("vocab_size"), int):
        return model["vocab_size"]
    found = model_source(model)
    if found is None:
        return None
    path = Path(found[0])
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # building the model reports an unreadable config with its key
    vocab = data.get("vocab_size", (data.get("text_config") or {}).get("vocab_size"))
    return vocab if isinstance(vocab, int) else None


def dataset_sections(cfg: Config) -> list[tuple[str, Any, Any]]:
    """``(key, node, callable)`` of each data set section whose ``_target_`` resolves."""
    found = []
    for name in cfg.section_names():
        node = cfg.get(name)
        if not (name == "dataset" or name.startswith("validation_dataset")) or not isinstance(node, ConfigNode) \
                or node.target is None:  # not a section (validation reports what it is)
            continue
        try:
            found.append((name, node, cfg.resolver.resolve(node.target)))
        except TargetError:
            continue  # section validation reported it
    return found


def local_tokenizer(cfg: Config) -> Any:
    """The tokenizer when it loads from this machine without error, else None (setup reports the error)."""
    source, _ = tokenizer_source(cfg)
    if not isinstance(source, str) or not Path(source).expanduser().exists():
        return None
    try:
        return build_tokenizer(cfg)
    except Exception:  # noqa: BLE001 - any failure is reported by setup, with its key
        return None


def _same_node(given: Any, node: ConfigNode | None) -> bool:
    """Whether a data set's ``tokenizer`` is written exactly as the run's tokenizer section."""
    if node is None:
        return False
    return (given.to_dict() if isinstance(given, ConfigNode) else given) == node.to_dict()


def tokenizer_issues(cfg: Config) -> list[ConfigIssue]:
    """The data set sections' argument problems, a data set ``tokenizer`` that cannot be the run's, then, with a
    local tokenizer, a chat data set without a chat template and a vocabulary larger than the model's."""
    sections = dataset_sections(cfg)
    issues = [issue for key, node, fn in sections for issue in argument_issues(node, key, fn)]
    if needs_tokenizer(cfg) and tokenizer_section(cfg) is None and tokenizer_source(cfg)[0] is None:
        issues.append(ConfigIssue("tokenizer", "none found: the model section names no directory to take it from "
                                  "(a model built from keys, such as build_gpt2_model), and a data set here "
                                  "tokenizes text; add `tokenizer: {pretrained_model_name_or_path: ...}`"))
    run_tokenizer = tokenizer_section(cfg)
    for key, node, _ in sections:
        given = node.get("tokenizer")
        if given is None or (key == "dataset" and cfg.tokenizer is None) or _same_node(given, run_tokenizer):
            continue  # the run's tokenizer itself (upstream repeats it in each data set): the run uses it
        where = "the tokenizer: section is given too" if key == "dataset" else "only the training data set's counts"
        issues.append(ConfigIssue(f"{key}.tokenizer", f"the run has one tokenizer, and {where}; give it once, in "
                                                      "tokenizer: (or dataset.tokenizer, upstream's form)"))
    chat = [key for key, node, fn in sections
            if getattr(fn, "requires_chat_template", False) and node.get("chat_template") is None]
    vocab = model_vocab_size(cfg)
    if not chat and vocab is None:
        return issues
    tokenizer = local_tokenizer(cfg)
    if tokenizer is None:
        return issues
    if not getattr(tokenizer, "chat_template", None):
        issues += [ConfigIssue(f"{key}.chat_template", missing_template_problem(tokenizer_source(cfg)[0]))
                   for key in chat]
    if vocab is not None and len(tokenizer) > vocab:
        issues.append(ConfigIssue(tokenizer_source(cfg)[1], VOCAB_PROBLEM.format(tokens=len(tokenizer),
                                                                                  vocab=vocab)))
    return issues
