"""Retrieval models: a bi-encoder (query and document encoders + pooling) and a cross-encoder factory.

Checkpoint layout of a bi-encoder (``save_pretrained(directory)``), each encoder loadable with
``transformers.AutoModel.from_pretrained``::

    directory/                         separate encoders (the default)
      bi_encoder_config.json           {"shared": false, "pooling": "mean", "normalize": true, ...}
      query_encoder/                   config.json, model.safetensors, tokenizer files
      document_encoder/                config.json, model.safetensors, tokenizer files

    directory/                         shared: true (one encoder for both sides)
      bi_encoder_config.json  config.json  model.safetensors  tokenizer files

Decoder-only encoders (Llama, Qwen3, ...) attend causally unless the checkpoint's config says ``is_causal: false``
or ``bidirectional: true`` asks (bidirectional.py); their saved config.json then carries ``is_causal: false``, so
``AutoModel`` and sentence-transformers load them bidirectional too.

Each encoder directory is also a sentence-transformers model (``modules.json``, pooling, ``Normalize``; see
st_format.py), and ``from_pretrained`` reads a sentence-transformers directory's pooling, normalisation,
``max_seq_length`` and prompts.

transformers is imported inside the functions, so importing this module for config validation stays light.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from automodel.errors import AutomodelError
from automodel.hf import is_sequence_classifier
from automodel.model_files import HUB_ARGUMENTS, has_weights, parse_dtype, pop_hub_arguments
from automodel.model_kwargs import check_config_keys, fresh_model_issues
from automodel_retrieval.bidirectional import set_bidirectional, upstream_checkpoint, upstream_checkpoint_config
from automodel_retrieval.st_format import STSettings, is_st_dir, read_st_dir, write_st_dir

POOLINGS = ("mean", "cls", "last")
CONFIG_NAME = "bi_encoder_config.json"
QUERY_DIR, DOCUMENT_DIR = "query_encoder", "document_encoder"
_ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
# How texts become encoder inputs, when neither the config nor the model's source says otherwise.
DEFAULT_INPUTS = {"query_max_length": 64, "document_max_length": 128, "query_prefix": "", "document_prefix": ""}


# ---- pooling ----------------------------------------------------------------------------------------------

def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """One vector per sequence from ``hidden`` [B, T, H]: mean over real tokens, the first token, or the last one."""
    mask = attention_mask.to(hidden.dtype)
    if pooling == "mean":
        summed = (hidden * mask.unsqueeze(-1)).sum(dim=1)
        return summed / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        # the last real token, whichever side the padding is on
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand_as(attention_mask)
        last = (positions * (attention_mask > 0)).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise AutomodelError(f"model.pooling: '{pooling}' is not one of {', '.join(POOLINGS)}")


def _check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise AutomodelError(f"model.pooling: '{pooling}' is not one of {', '.join(POOLINGS)}")
    return pooling


# ---- loading helpers ----------------------------------------------------------------------------------------

def resolve_model_dir(path: str | Path) -> Path:
    """A model directory from a run's checkpoint_dir (its LATEST), one checkpoint, or the model directory itself."""
    path = Path(str(path))
    latest = path / "LATEST"
    if latest.is_file():
        path = path / latest.read_text(encoding="utf-8").strip()
    if (path / "trainer_state.json").is_file() and (path / "model").is_dir():
        path = path / "model"
    return path


def load_hf_config(config: Any, **overrides: Any) -> Any:
    """A transformers config from a config.json path, a directory, a hub name or a mapping with model_type."""
    from transformers import AutoConfig, PretrainedConfig

    hub = pop_hub_arguments(overrides)  # to AutoConfig.from_pretrained only: never into the saved config
    if isinstance(config, PretrainedConfig):
        check_config_keys(config, overrides)  # a key the config lacks would be kept, read by nothing
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    if isinstance(config, dict):
        data = dict(config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise AutomodelError("model.config: a config mapping needs a 'model_type' (bert, ...)")
        data.pop("architectures", None)
        check_config_keys(AutoConfig.for_model(model_type, **data), overrides)
        return AutoConfig.for_model(model_type, **{**data, **overrides})
    path = Path(str(config))
    if path.is_file():
        return load_hf_config(json.loads(path.read_text(encoding="utf-8")), **overrides)
    try:
        loaded = AutoConfig.from_pretrained(str(config), **hub)
    except OSError as err:
        raise AutomodelError(f"model.config: cannot load '{config}': {err}") from None
    return load_hf_config(loaded, **overrides)


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Initialise under ``seed`` without disturbing the global RNG (no seed: the global RNG, as seeded)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _encoder_from_config(config: Any, seed: int | None, attn_implementation: str | None, **overrides: Any) -> Any:
    from transformers import AutoModel

    hf_config = load_hf_config(config, **overrides)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with _seeded(seed):
        return AutoModel.from_config(hf_config, **kwargs)


def _encoder_from_pretrained(path: str | Path, dtype: Any = None, **kwargs: Any) -> tuple[Any, STSettings | None]:
    """An encoder and, when ``path`` is a sentence-transformers directory, what that directory says."""
    from transformers import AutoModel

    local = Path(str(path))
    st = read_st_dir(local) if is_st_dir(local) else None
    if st is not None:
        local = path = st.encoder_dir
    upstream_config = upstream_checkpoint_config(str(path), **{k: v for k, v in kwargs.items() if k in HUB_ARGUMENTS})
    if upstream_config is not None:  # upstream's llama_bidirec / ministral3_bidirec: the base model, no remote code
        kwargs = {k: v for k, v in kwargs.items() if k != "trust_remote_code"}
    if local.is_dir() and (local / "config.json").is_file() and not has_weights(local):
        return _encoder_from_config(upstream_config or local / "config.json", None,
                                    kwargs.pop("attn_implementation", None)), st
    if upstream_config is not None:
        kwargs["config"] = upstream_config
    try:
        return AutoModel.from_pretrained(str(path), dtype=parse_dtype(dtype), **kwargs), st
    except OSError as err:
        raise AutomodelError(f"model: cannot load an encoder from '{path}': {err}") from None


def encoder_dir(path: str | Path) -> Path:
    """Where the Hugging Face encoder of ``path`` lies (the query encoder's, for two encoders)."""
    directory = resolve_model_dir(path)
    if (directory / QUERY_DIR).is_dir():
        directory = directory / QUERY_DIR
    return read_st_dir(directory).encoder_dir if is_st_dir(directory) else directory


def read_bi_encoder_config(directory: str | Path) -> dict[str, Any]:
    """The saved bi-encoder settings of a model directory ({} for a plain encoder)."""
    file = Path(str(directory)) / CONFIG_NAME
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def _st_inputs(st: STSettings | None, sides: tuple[str, ...]) -> dict[str, Any]:
    """Bi-encoder settings from a sentence-transformers directory, for the side(s) it encodes."""
    if st is None:
        return {}
    found: dict[str, Any] = {"pooling": st.pooling, "normalize": st.normalize}
    for side in sides:
        prompt = st.prompts.get(side, st.prompts.get("passage") if side == "document" else None)
        found.update({f"{side}_max_length": st.max_seq_length, f"{side}_prefix": prompt})
    return {k: v for k, v in found.items() if v is not None}


def _merge_sides(query: dict[str, Any], document: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("pooling", "normalize"):
        if key in query and key in document and query[key] != document[key]:
            raise AutomodelError(f"model: the query and document encoders of '{where}' disagree on {key} "
                                 f"({query[key]!r} vs {document[key]!r}); set model.{key}")
    return {**document, **query}


# ---- the bi-encoder -----------------------------------------------------------------------------------------

class BiEncoder(nn.Module):
    """A query encoder and a document encoder (one module when ``shared``), pooled and optionally L2-normalised.

    ``forward(query=..., document=...)`` takes the tokenizer's outputs for each side and returns their
    embeddings ``(query [Bq, H], document [Bd, H])`` (either may be None). ``input_settings`` holds what the
    model's source said about its inputs (``query_max_length``, ``document_prefix``, ...: a sentence-transformers
    directory's ``max_seq_length`` and prompts, or a saved bi-encoder's settings); the recipe's ``retrieval``
    section overrides them.
    """

    def __init__(self, query_encoder: nn.Module, document_encoder: nn.Module | None = None, pooling: str = "mean",
                 normalize: bool = True, input_settings: dict[str, Any] | None = None):
        super().__init__()
        self.query_encoder = query_encoder
        self.shared = document_encoder is None or document_encoder is query_encoder
        if not self.shared:
            self.document_encoder = document_encoder
        self.pooling = _check_pooling(pooling)
        self.normalize = normalize
        self.input_settings = {k: v for k, v in (input_settings or {}).items() if k in DEFAULT_INPUTS}
        for encoder in {id(m): m for m in (query_encoder, document_encoder) if m is not None}.values():
            # The encoder's own pooler (BERT's tanh head) plays no part in the embedding: frozen, so that the
            # optimizer skips it and DDP does not wait for gradients that never come. It is still saved, so the
            # checkpoint loads into AutoModel without missing weights.
            head = getattr(encoder, "pooler", None)
            if isinstance(head, nn.Module):
                head.requires_grad_(False)

    def input_setting(self, name: str) -> Any:
        """``query_max_length`` / ``document_max_length`` / ``query_prefix`` / ``document_prefix``: the source's
        value, else the default."""
        return self.input_settings.get(name, DEFAULT_INPUTS[name])

    def encoder(self, side: str) -> nn.Module:
        if side not in ("query", "document"):
            raise ValueError(f"side must be 'query' or 'document', found {side!r}")
        return self.query_encoder if side == "query" or self.shared else self.document_encoder

    def encode(self, side: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in inputs.items() if k in _ENCODER_INPUTS}
        hidden = self.encoder(side)(**inputs).last_hidden_state
        embeddings = pool(hidden, inputs["attention_mask"], self.pooling)
        return F.normalize(embeddings.float(), dim=-1) if self.normalize else embeddings.float()

    def forward(self, query: dict[str, torch.Tensor] | None = None,
                document: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.encode("query", query) if query is not None else None,
                self.encode("document", document) if document is not None else None)

    # ---- building ---------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Any, *, shared: bool = False, pooling: str = "mean", normalize: bool = True,
                    bidirectional: bool | None = None, seed: int | None = None,
                    attn_implementation: str | None = None, **overrides: Any) -> BiEncoder:
        """A freshly initialised bi-encoder of the architecture in ``config`` (a config.json, a directory, ...).

        Keys in ``overrides`` replace the config's (``hidden_dropout_prob: 0.0``). With separate encoders the
        document encoder starts as a copy of the query encoder (as when both start from one pre-trained model).
        ``bidirectional: true`` makes a decoder's attention bidirectional (unset: as its config says).
        """
        encoder = set_bidirectional(_encoder_from_config(config, seed, attn_implementation, **overrides),
                                    bidirectional)
        return cls(encoder, None if shared else copy.deepcopy(encoder), pooling, normalize)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        query_encoder: str | None = None, document_encoder: str | None = None,
                        shared: bool | None = None, pooling: str | None = None, normalize: bool | None = None,
                        bidirectional: bool | None = None, dtype: Any = None, **kwargs: Any) -> BiEncoder:
        """Load a bi-encoder saved by this package (a model directory, a checkpoint, or a run's checkpoint_dir),
        or start one from a sentence-transformers model or a plain encoder (a hub name or directory loadable with
        ``AutoModel``).

        ``query_encoder`` / ``document_encoder`` name the two sides' encoders separately instead. ``pooling`` and
        ``normalize`` left unset keep the saved model's (a sentence-transformers directory's), else mean and true.
        ``bidirectional: true`` / ``false`` makes decoder encoders attend both ways / causally; unset, each attends
        as its checkpoint's config says (``is_causal``).
        """
        path = pretrained_model_name_or_path or name_or_path
        if query_encoder is not None or document_encoder is not None:
            if query_encoder is None:
                raise AutomodelError("model.query_encoder: missing (document_encoder is set)")
            query, query_st = _encoder_from_pretrained(query_encoder, dtype, **kwargs)
            document, document_st = _encoder_from_pretrained(document_encoder, dtype, **kwargs) \
                if document_encoder else (None, None)
            found = _merge_sides(_st_inputs(query_st, ("query",) if document_encoder else ("query", "document")),
                                 _st_inputs(document_st, ("document",)), "model")
            if document is None and not shared:
                document = copy.deepcopy(query)
            return cls._assemble(query, document, found, pooling, normalize, bidirectional)
        if not path:
            raise AutomodelError("model.pretrained_model_name_or_path: missing (a bi-encoder checkpoint, or an "
                                 "encoder's hub name or directory)")
        directory = resolve_model_dir(path)
        saved = read_bi_encoder_config(directory)
        if (directory / QUERY_DIR).is_dir():
            if shared:
                raise AutomodelError(f"model.shared: '{directory}' holds two separate encoders; drop shared: true "
                                     "or point at one of them")
            query, query_st = _encoder_from_pretrained(directory / saved.get("query_encoder", QUERY_DIR), dtype,
                                                       **kwargs)
            document, document_st = _encoder_from_pretrained(
                directory / saved.get("document_encoder", DOCUMENT_DIR), dtype, **kwargs)
            found = _merge_sides(_st_inputs(query_st, ("query",)), _st_inputs(document_st, ("document",)),
                                 str(directory))
            return cls._assemble(query, document, {**found, **saved}, pooling, normalize, bidirectional)
        encoder, st = _encoder_from_pretrained(directory if directory.exists() else path, dtype, **kwargs)
        shared = saved.get("shared", False) if shared is None else shared
        found = {**_st_inputs(st, ("query", "document")), **saved}
        return cls._assemble(encoder, None if shared else copy.deepcopy(encoder), found, pooling, normalize,
                             bidirectional)

    @classmethod
    def _assemble(cls, query: nn.Module, document: nn.Module | None, found: dict[str, Any], pooling: str | None,
                  normalize: bool | None, bidirectional: bool | None = None) -> BiEncoder:
        """The bi-encoder from its encoders: the arguments win over what the source said (``found``)."""
        for encoder in (query, document):
            if encoder is not None:
                set_bidirectional(encoder, bidirectional)
        return cls(query, document, pooling or found.get("pooling", "mean"),
                   found.get("normalize", True) if normalize is None else normalize, found)

    # ---- saving and loading -------------------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        layout = {} if self.shared else {"query_encoder": QUERY_DIR, "document_encoder": DOCUMENT_DIR}
        inputs = {name: self.input_setting(name) for name in DEFAULT_INPUTS}
        return {"shared": self.shared, "pooling": self.pooling, "normalize": self.normalize, **inputs, **layout}

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        tokenizer: Any = None, extra: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """HF layout (see the module docstring); ``state_dict`` (the whole model's, e.g. gathered from FSDP2
        ranks) is split between the encoders; ``extra`` settings (the recipe's max lengths and prefixes) are
        recorded in bi_encoder_config.json and the sentence-transformers files."""
        directory = Path(str(directory))
        directory.mkdir(parents=True, exist_ok=True)
        settings = {**self.settings(), **(extra or {})}
        targets = [(self.query_encoder, directory, "query_encoder.", ("query", "document"))] if self.shared else [
            (self.query_encoder, directory / QUERY_DIR, "query_encoder.", ("query",)),
            (self.document_encoder, directory / DOCUMENT_DIR, "document_encoder.", ("document",))]
        for encoder, where, prefix, sides in targets:
            part = None if state_dict is None else {
                k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
            encoder.save_pretrained(str(where), state_dict=part, **kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(where))
            write_st_dir(where, pooling=self.pooling, normalize=self.normalize,
                         embedding_dimension=encoder.config.hidden_size,
                         max_seq_length=max(settings[f"{side}_max_length"] for side in sides),
                         prompts={side: settings[f"{side}_prefix"] for side in sides},
                         default_prompt_name=None if self.shared else sides[0])
        (directory / CONFIG_NAME).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")

    def load_weights(self, directory: str | Path) -> None:
        """Copy the weights saved by ``save_pretrained`` into this model (shapes and keys must match)."""
        from automodel.training.checkpoint import load_safetensors_dir, load_weights_into

        directory = Path(str(directory))
        saved = read_bi_encoder_config(directory)
        if saved and saved.get("shared", False) != self.shared:
            raise AutomodelError(f"'{directory}' holds a {'shared' if saved['shared'] else 'two-encoder'} bi-encoder "
                                 f"but the model is {'shared' if self.shared else 'two-encoder'}; set model.shared "
                                 "to match")
        if self.shared:
            load_weights_into(self.query_encoder, load_safetensors_dir(directory), directory)
            return
        for encoder, name in ((self.query_encoder, QUERY_DIR), (self.document_encoder, DOCUMENT_DIR)):
            load_weights_into(encoder, load_safetensors_dir(directory / name), directory / name)


# ---- the cross-encoder --------------------------------------------------------------------------------------

class CrossEncoder:
    """Builds a one-logit cross-encoder: transformers' ``AutoModelForSequenceClassification`` (pooling as its
    architecture does: BERT's [CLS], a decoder's last token), or, with ``pooling`` (mean, cls, last), a
    :class:`~automodel_retrieval.pooled_cross_encoder.PooledCrossEncoder`: the base model, that pooling and a
    one-output score layer, saved as a sentence-transformers CrossEncoder. ``bidirectional: true`` makes a
    decoder backbone attend both ways (unset: as its checkpoint's config says)."""

    @classmethod
    def from_config(cls, config: Any, *, num_labels: int = 1, pooling: str | None = None,
                    bidirectional: bool | None = None, seed: int | None = None,
                    attn_implementation: str | None = None, **overrides: Any) -> Any:
        from transformers import AutoModelForSequenceClassification

        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        if pooling is not None:
            from automodel_retrieval.pooled_cross_encoder import PooledCrossEncoder

            _check_pooling(pooling)
            _check_num_labels(num_labels)
            with _seeded(seed):
                backbone = _encoder_from_config(config, None, attn_implementation, **overrides)
                return PooledCrossEncoder(set_bidirectional(backbone, bidirectional), pooling)
        hf_config = load_hf_config(config, num_labels=num_labels, **overrides)
        with _seeded(seed):
            return set_bidirectional(AutoModelForSequenceClassification.from_config(hf_config, **kwargs),
                                     bidirectional)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | None = None, *, name_or_path: str | None = None,
                        num_labels: int = 1, pooling: str | None = None, bidirectional: bool | None = None,
                        dtype: Any = None, **kwargs: Any) -> Any:
        """A cross-encoder checkpoint (a pooled one saved here too), or a plain encoder / decoder (the one-logit
        head then starts fresh)."""
        from transformers import AutoModelForSequenceClassification

        from automodel_retrieval.pooled_cross_encoder import PooledCrossEncoder
        from automodel_retrieval.st_format import is_st_cross_encoder_dir

        path = pretrained_model_name_or_path or name_or_path
        if not path:
            raise AutomodelError("model.pretrained_model_name_or_path: missing (a hub name or a local directory)")
        if pooling is not None:
            _check_pooling(pooling)
            _check_num_labels(num_labels)
        directory = resolve_model_dir(path)
        if is_st_cross_encoder_dir(directory):
            return set_bidirectional(PooledCrossEncoder.from_saved(directory, pooling, dtype, **kwargs),
                                     bidirectional)
        if directory.is_dir() and (directory / "config.json").is_file() and not has_weights(directory):
            return cls.from_config(directory / "config.json", num_labels=num_labels, pooling=pooling,
                                   bidirectional=bidirectional, **kwargs)
        source = str(directory if directory.exists() else path)
        upstream_found = upstream_checkpoint(source, **{k: v for k, v in kwargs.items() if k in HUB_ARGUMENTS})
        if upstream_found is not None:
            return _upstream_reranker(source, *upstream_found, pooling, bidirectional, dtype, **kwargs)
        try:
            if pooling is not None:
                backbone = _encoder_from_pretrained(source, dtype, **kwargs)[0]
                return PooledCrossEncoder(set_bidirectional(backbone, bidirectional), pooling)
            return set_bidirectional(AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=num_labels, dtype=parse_dtype(dtype), **kwargs), bidirectional)
        except OSError as err:
            raise AutomodelError(f"model: cannot load '{path}': {err}") from None


def _upstream_reranker(source: str, config: Any, saved: dict[str, Any], pooling: str | None,
                       bidirectional: bool | None, dtype: Any, **kwargs: Any) -> Any:
    """A checkpoint of upstream's llama_bidirec / ministral3_bidirec types as a pooled cross-encoder, as upstream
    builds its reranker on them: its saved pooling (unless ``pooling`` is given), and its score layer when it is
    one of upstream's sequence classifiers (else a fresh one). Upstream's model divides its scores by the saved
    ``temperature``; here the loss's temperature does (the same ranking)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    from automodel_retrieval.pooled_cross_encoder import PooledCrossEncoder

    kwargs = {k: v for k, v in kwargs.items() if k != "trust_remote_code"}  # the base model: no remote code
    saved_pooling = {"avg": "mean", "cls": "cls", "last": "last"}.get(saved.get("pooling", "avg"))
    pooling = pooling or saved_pooling
    if pooling is None:
        raise AutomodelError(f"model: '{source}' pools with {saved.get('pooling')!r}, which the cross-encoder does not "
                             "implement; set model.pooling to one of mean, cls, last")
    try:
        if any(is_sequence_classifier(name) for name in saved.get("architectures") or []):
            config.num_labels = 1
            classifier = AutoModelForSequenceClassification.from_pretrained(
                source, config=config, dtype=parse_dtype(dtype), **kwargs)
            backbone, score = classifier.model, classifier.score
        else:
            backbone = AutoModel.from_pretrained(source, config=config, dtype=parse_dtype(dtype), **kwargs)
            score = None
    except OSError as err:
        raise AutomodelError(f"model: cannot load '{source}': {err}") from None
    return PooledCrossEncoder(set_bidirectional(backbone, bidirectional), pooling, score)


def _check_num_labels(num_labels: int) -> None:
    if num_labels != 1:
        raise AutomodelError(f"model.num_labels: {num_labels}, but a pooled cross-encoder scores each pair with one "
                             "logit; set 1")


BiEncoder.from_config.__func__.automodel_config_issues = fresh_model_issues(BiEncoder.from_config)  # type: ignore
CrossEncoder.from_config.__func__.automodel_config_issues = fresh_model_issues(CrossEncoder.from_config)  # type: ignore
