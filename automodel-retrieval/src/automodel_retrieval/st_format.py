"""The sentence-transformers model directory, read and written without importing sentence-transformers.

``SentenceTransformer(path)`` reads ``modules.json`` (the module chain: the Hugging Face encoder, pooling,
optionally L2 normalisation), ``sentence_bert_config.json`` (``max_seq_length``), ``1_Pooling/config.json`` and
``config_sentence_transformers.json`` (prompts, similarity function). The files written here use the module names
and keys every sentence-transformers release from 2.x to 6.x reads (6.x maps the legacy names itself); reading
accepts both the legacy keys and 6.x's (``pooling_mode``, ``embedding_dimension``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError

MODULES = "modules.json"
MODULE_CONFIG = "sentence_bert_config.json"
PACKAGE_CONFIG = "config_sentence_transformers.json"
POOLING_DIR, NORMALIZE_DIR = "1_Pooling", "2_Normalize"

# our pooling name -> sentence-transformers' mode name
_TO_ST = {"mean": "mean", "cls": "cls", "last": "lasttoken"}
_FROM_ST = {mode: ours for ours, mode in _TO_ST.items()}
_LEGACY_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                     "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass
class STSettings:
    """What a sentence-transformers directory says about the embedding it computes."""

    pooling: str
    normalize: bool
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    encoder_dir: Path = Path()  # where the Hugging Face encoder (and its tokenizer) lies


def is_st_dir(directory: str | Path) -> bool:
    return (Path(str(directory)) / MODULES).is_file()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise AutomodelError(f"model: cannot read the sentence-transformers file '{path}': {err}") from None


def _module_kind(entry: dict[str, Any]) -> str:
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _pooling_mode(config: dict[str, Any], where: Path) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_MODE_KEYS.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else (tuple(modes) or "mean")
    if isinstance(mode, (list, tuple)) and len(mode) == 1:
        mode = mode[0]
    if mode not in _FROM_ST:
        raise AutomodelError(f"model: '{where}' pools with sentence-transformers mode {mode!r}, which the bi-encoder "
                             f"does not implement (it pools with {', '.join(_TO_ST.values())}); set model.pooling to "
                             "one of mean, cls, last to train with that pooling instead")
    if config.get("include_prompt") is False:
        raise AutomodelError(f"model: '{where}' leaves the prompt out of its pooling (include_prompt: false), which "
                             "the bi-encoder does not implement")
    return _FROM_ST[mode]


def _max_seq_length(encoder_dir: Path) -> int | None:
    """As sentence-transformers decides: ``max_seq_length`` of the module config (releases before 6), else the
    tokenizer's ``model_max_length`` capped at the encoder's ``max_position_embeddings``."""
    if (encoder_dir / MODULE_CONFIG).is_file():
        length = _read_json(encoder_dir / MODULE_CONFIG).get("max_seq_length")
        if length is not None:
            return int(length)
    limits = []
    for name, key in (("tokenizer_config.json", "model_max_length"), ("config.json", "max_position_embeddings")):
        value = _read_json(encoder_dir / name).get(key) if (encoder_dir / name).is_file() else None
        if isinstance(value, int) and value > 0:
            limits.append(value)
    return min(limits) if limits else None


def read_st_dir(directory: str | Path) -> STSettings:
    """The pooling, normalisation, max_seq_length and prompts of a sentence-transformers model directory.

    Only the chain encoder -> Pooling -> (Normalize) is accepted: any other module (Dense, ...) would be dropped
    from the embedding, so it is refused with its name.
    """
    directory = Path(str(directory))
    modules = _read_json(directory / MODULES)
    kinds = [_module_kind(m) for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise AutomodelError(f"model: '{directory / MODULES}' chains {kinds}; the bi-encoder reproduces only "
                             "Transformer -> Pooling -> (Normalize)")
    encoder_dir = directory / modules[0].get("path", "")
    pooling = _pooling_mode(_read_json(directory / modules[1].get("path", "") / "config.json"), directory)
    settings = STSettings(pooling=pooling, normalize="Normalize" in kinds, encoder_dir=encoder_dir)
    settings.max_seq_length = _max_seq_length(encoder_dir)
    if (directory / PACKAGE_CONFIG).is_file():
        prompts = _read_json(directory / PACKAGE_CONFIG).get("prompts") or {}
        settings.prompts = {k: v for k, v in prompts.items() if isinstance(v, str)}
    return settings


def write_st_dir(directory: str | Path, *, pooling: str, normalize: bool, embedding_dimension: int,
                 max_seq_length: int, prompts: dict[str, str], default_prompt_name: str | None = None) -> None:
    """Make ``directory`` (already holding a Hugging Face encoder and its tokenizer) a sentence-transformers model
    that embeds as the bi-encoder does: ``pooling``, L2-normalised when ``normalize``, inputs truncated to
    ``max_seq_length`` tokens, ``prompts`` put before the texts (``encode(..., prompt_name=...)``)."""
    import torch
    import transformers

    directory = Path(str(directory))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": "sentence_transformers.models.Normalize"})
    mode = _TO_ST[pooling]
    pooling_config = {"word_embedding_dimension": embedding_dimension,
                      **{key: name == mode for key, name in _LEGACY_MODE_KEYS.items()}}
    package = {"__version__": {"transformers": transformers.__version__, "pytorch": torch.__version__},
               "model_type": "SentenceTransformer", "prompts": prompts, "default_prompt_name": default_prompt_name,
               "similarity_fn_name": "cosine" if normalize else "dot"}
    files = {MODULES: modules, MODULE_CONFIG: {"max_seq_length": max_seq_length, "do_lower_case": False},
             PACKAGE_CONFIG: package, f"{POOLING_DIR}/config.json": pooling_config}
    if normalize:
        files[f"{NORMALIZE_DIR}/config.json"] = {"module_input_name": "sentence_embedding",
                                                 "module_output_name": "sentence_embedding"}
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# ---- the cross-encoder layout (sentence-transformers 6's modular CrossEncoder) -----------------------------------

DENSE_DIR = "2_Dense"
_CROSS_MODULES = ("Transformer", "Pooling", "Dense")
_ST6 = "sentence_transformers"
_CROSS_TYPES = (f"{_ST6}.base.modules.transformer.Transformer",
                f"{_ST6}.sentence_transformer.modules.pooling.Pooling", f"{_ST6}.base.modules.dense.Dense")


def write_st_cross_encoder_dir(directory: str | Path, *, pooling: str, hidden_size: int,
                               max_seq_length: int | None) -> None:
    """Make ``directory`` (already holding the Hugging Face backbone, its tokenizer, and the score weights in
    ``2_Dense/model.safetensors`` as ``linear.weight``) a sentence-transformers 6 CrossEncoder that scores as the
    pooled cross-encoder does: backbone -> ``pooling`` -> a one-output linear layer without bias, its output the
    ``scores``. ``CrossEncoder(directory).predict`` applies a sigmoid to them, as for any one-label reranker
    (``activation_fn=torch.nn.Identity()`` gives the raw scores)."""
    import torch
    import transformers

    directory = Path(str(directory))
    modules = [{"idx": i, "name": str(i), "path": path, "type": kind}
               for i, (path, kind) in enumerate(zip(("", POOLING_DIR, DENSE_DIR), _CROSS_TYPES, strict=True))]
    transformer = {"transformer_task": "feature-extraction",
                   "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
                   "module_output_name": "token_embeddings"}
    if max_seq_length is not None:
        transformer["max_seq_length"] = max_seq_length
    package = {"__version__": {"transformers": transformers.__version__, "pytorch": torch.__version__},
               "model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.activation.Sigmoid",
               "prompts": {}, "default_prompt_name": None}
    files = {MODULES: modules, MODULE_CONFIG: transformer, PACKAGE_CONFIG: package,
             f"{POOLING_DIR}/config.json": {"embedding_dimension": hidden_size, "pooling_mode": _TO_ST[pooling],
                                            "include_prompt": True},
             f"{DENSE_DIR}/config.json": {"in_features": hidden_size, "out_features": 1, "bias": False,
                                          "activation_function": "torch.nn.modules.linear.Identity",
                                          "module_input_name": "sentence_embedding", "module_output_name": "scores"}}
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def is_st_cross_encoder_dir(directory: str | Path) -> bool:
    """A sentence-transformers directory whose chain ends in a Dense layer writing the ``scores``."""
    directory = Path(str(directory))
    if not is_st_dir(directory):
        return False
    modules = _read_json(directory / MODULES)
    if not modules or _module_kind(modules[-1]) != "Dense":
        return False
    return _read_json(directory / modules[-1].get("path", "") / "config.json").get("module_output_name") == "scores"


def read_st_cross_encoder_dir(directory: str | Path) -> str:
    """The pooling of a cross-encoder written by :func:`write_st_cross_encoder_dir` (others are refused)."""
    directory = Path(str(directory))
    modules = _read_json(directory / MODULES)
    kinds = tuple(_module_kind(m) for m in modules)
    dense = _read_json(directory / modules[-1].get("path", "") / "config.json") if modules else {}
    if kinds != _CROSS_MODULES or [m.get("path") for m in modules] != ["", POOLING_DIR, DENSE_DIR] or \
            dense.get("out_features") != 1 or dense.get("bias") is not False or \
            dense.get("activation_function") != "torch.nn.modules.linear.Identity":
        raise AutomodelError(f"model: '{directory}' is a sentence-transformers CrossEncoder of another form "
                             f"({list(kinds)}); the pooled cross-encoder loads only Transformer -> Pooling -> "
                             "Dense (one output, no bias, no activation) in the layout it saves")
    return _pooling_mode(_read_json(directory / POOLING_DIR / "config.json"), directory)
