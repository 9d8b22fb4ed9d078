"""Upstream NeMo AutoModel's retrieval names, on this package's models, data and collators.

What the aliases in ``plugin.py`` lead to: ``NeMoAutoModelBiEncoder`` / ``NeMoAutoModelCrossEncoder`` /
``NeMoAutoTokenizer`` ``.from_pretrained``, ``RetrievalDatasetConfig`` and the ``BiEncoderCollator`` /
``CrossEncoderCollator`` classes, each with upstream's keyword arguments. Values that need what is not here (GPU
kernels, upstream's custom backbones, image corpora) are refused at validation by
:func:`model_issues` and friends, with the reason; the factories refuse them too when called directly.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError, ConfigIssue
from automodel.model_kwargs import upstream_model_issues
from automodel_retrieval.corpus_id import METADATA, Corpus, corpus_id_records, is_corpus_id_data
from automodel_retrieval.data import INSTRUCTIONS, BiEncoderCollator, CrossEncoderCollator

POOLINGS = {"avg": "mean", "mean": "mean", "cls": "cls", "last": "last"}
HF_PREFIX = "hf://"
GATHER, DETACH = "do_distributed_inbatch_negative", "detach_distributed_inbatch_negatives"
LOCAL, GATHERED, DETACHED = "local", "gathered", "detached"


def _model_issues(settings: dict[str, Any], key: str) -> list[ConfigIssue]:
    """What upstream's model keys (dtype names, Liger, attention, SDPA patching) ask for that cannot act here: the
    same checks as the LLM and VLM model sections (:func:`automodel.model_kwargs.upstream_model_issues`)."""
    return [ConfigIssue(f"{key}.{name}", message) for name, message in upstream_model_issues(settings).items()]


def bi_encoder_issues(settings: dict[str, Any], key: str = "model") -> list[ConfigIssue]:
    issues = _model_issues(settings, key)
    pooling = settings.get("pooling", "avg")
    if pooling not in POOLINGS:
        issues.append(ConfigIssue(f"{key}.pooling", f"'{pooling}' is not implemented here (weighted_avg, colbert and "
                                                    "multi_vector are upstream's); use avg, cls or last"))
    for name in (GATHER, DETACH):
        value = settings.get(name)
        if value is not None and not isinstance(value, bool):
            issues.append(ConfigIssue(f"{key}.{name}", f"expected true or false, found {value!r}"))
    return issues


def inbatch_negatives(settings: dict[str, Any]) -> str:
    """Where upstream's bi-encoder takes each query's in-batch negatives from on several ranks: ``local`` (its own
    rank's micro-batch: upstream's default), ``gathered`` (every rank's documents, with their gradients) or
    ``detached`` (every rank's, the other ranks' as constants: upstream's default once gathering is on)."""
    if not settings.get(GATHER, False):
        return LOCAL
    return DETACHED if settings.get(DETACH, True) else GATHERED


def inbatch_negatives_notes(settings: dict[str, Any], world_size: int, key: str = "model") -> list[str]:
    """Notes naming the in-batch negative keys that govern nothing in this run (upstream ignores them then too)."""
    given = [f"{key}.{name}: {str(settings[name]).lower()}" for name in (GATHER, DETACH) if name in settings]
    if settings.get(GATHER) and world_size == 1:
        verb = "governs" if len(given) == 1 else "govern"
        return [f"note: {' and '.join(given)} {verb} nothing this run: gathering the other ranks' documents as "
                "negatives needs more than one process, and this run is one"]
    if DETACH in settings and not settings.get(GATHER):
        return [f"note: {key}.{DETACH}: {str(settings[DETACH]).lower()} governs nothing this run: it applies with "
                f"{key}.{GATHER}: true (upstream ignores it then too)"]
    return []


def cross_encoder_issues(settings: dict[str, Any], key: str = "model") -> list[ConfigIssue]:
    issues = _model_issues(settings, key)
    pooling = settings.get("pooling")
    if pooling is not None and pooling not in POOLINGS:
        issues.append(ConfigIssue(f"{key}.pooling", f"'{pooling}' is not implemented here; use avg, cls or last"))
    if settings.get("num_labels", 1) != 1:
        issues.append(ConfigIssue(f"{key}.num_labels", "a cross-encoder scores each pair with one logit: set 1"))
    return issues


def _encoder_kwargs(torch_dtype: Any, use_sdpa_patching: bool, attn_implementation: str | None,
                    trust_remote_code: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    attention = attn_implementation or ("sdpa" if use_sdpa_patching else None)
    if attention is not None:
        kwargs["attn_implementation"] = attention
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    return kwargs


def _refuse(issues: list[ConfigIssue]) -> None:
    if issues:
        raise AutomodelError("; ".join(str(issue) for issue in issues))


def bi_encoder_from_pretrained(pretrained_model_name_or_path: str, pooling: str = "avg", l2_normalize: bool = True,
                               torch_dtype: Any = None, use_liger_kernel: bool = False,
                               use_sdpa_patching: bool = False, attn_implementation: str | None = None,
                               do_distributed_inbatch_negative: bool = False,
                               detach_distributed_inbatch_negatives: bool = True,
                               extract_submodel: str | None = None, trust_remote_code: bool = False) -> Any:
    """Upstream's bi-encoder: ONE encoder for queries and documents (``shared``), pooled (``avg`` is our
    ``mean``) and L2-normalised (``l2_normalize``); ``use_sdpa_patching`` runs attention through torch's
    scaled-dot-product attention; ``extract_submodel`` (a dotted attribute such as ``language_model``) takes that
    part of a larger model as the encoder. A decoder-only encoder (Llama, Qwen3, ...) attends bidirectionally, as
    upstream builds it (``config.is_causal = False``, saved in its config.json); encoders are unchanged.
    ``do_distributed_inbatch_negative`` and ``detach_distributed_inbatch_negatives`` choose the loss's negatives,
    as upstream: the bi-encoder recipe reads them from the model section (:func:`inbatch_negatives`)."""
    from automodel_retrieval.bidirectional import set_bidirectional
    from automodel_retrieval.models import BiEncoder, _encoder_from_pretrained

    _refuse(bi_encoder_issues({k: v for k, v in locals().items() if v is not None}))
    kwargs = _encoder_kwargs(torch_dtype, use_sdpa_patching, attn_implementation, trust_remote_code)
    if extract_submodel is None:
        return BiEncoder.from_pretrained(pretrained_model_name_or_path, shared=True, pooling=POOLINGS[pooling],
                                         normalize=l2_normalize, bidirectional=True, **kwargs)
    encoder = _encoder_from_pretrained(pretrained_model_name_or_path, **kwargs)[0]
    for part in extract_submodel.split("."):
        encoder = getattr(encoder, part, None)
        if encoder is None:
            raise AutomodelError(f"model.extract_submodel: '{pretrained_model_name_or_path}' has no part "
                                 f"'{extract_submodel}'")
    if not hasattr(encoder, "save_pretrained"):
        raise AutomodelError(f"model.extract_submodel: '{extract_submodel}' is not a transformers model (it has no "
                             "config); name a sub-model such as language_model")
    return BiEncoder(set_bidirectional(encoder, True), None, POOLINGS[pooling], l2_normalize)


def cross_encoder_from_pretrained(pretrained_model_name_or_path: str, num_labels: int = 1,
                                  temperature: float | None = None, pooling: str | None = None,
                                  torch_dtype: Any = None, use_liger_kernel: bool = False,
                                  use_sdpa_patching: bool = False, attn_implementation: str | None = None,
                                  trust_remote_code: bool = False) -> Any:
    """Upstream's cross-encoder. With ``pooling`` (avg, cls, last), as upstream's bidirectional reranker: the
    backbone attending both ways (a decoder's ``config.is_causal = False``), its token states pooled, one linear
    output as the score (:class:`~automodel_retrieval.pooled_cross_encoder.PooledCrossEncoder`, saved as a
    sentence-transformers CrossEncoder). Without it, transformers' one-logit AutoModelForSequenceClassification.
    ``temperature`` divides the scores in the listwise loss (the cross-encoder recipe gives it to its loss_fn)."""
    from automodel_retrieval.models import CrossEncoder

    _refuse(cross_encoder_issues({k: v for k, v in locals().items() if v is not None}))
    kwargs = _encoder_kwargs(torch_dtype, use_sdpa_patching, attn_implementation, trust_remote_code)
    if pooling is not None:
        return CrossEncoder.from_pretrained(pretrained_model_name_or_path, num_labels=num_labels,
                                            pooling=POOLINGS[pooling], bidirectional=True, **kwargs)
    return CrossEncoder.from_pretrained(pretrained_model_name_or_path, num_labels=num_labels, **kwargs)


def tokenizer_from_pretrained(pretrained_model_name_or_path: str, add_eos_token: bool = False,
                              add_bos_token: bool = False, force_hf: bool = True, **kwargs: Any) -> Any:
    """Upstream's NeMoAutoTokenizer: transformers' AutoTokenizer (``kwargs`` such as ``padding_side`` are its
    own). ``add_bos_token`` / ``add_eos_token: true`` make it add BOS / EOS around every text it tokenizes with
    special tokens, as upstream's enforcement does (transformers' own settings of the same names; chat templates,
    tokenized without special tokens, are unchanged); a tokenizer that cannot is refused."""
    from transformers import AutoTokenizer

    _refuse(tokenizer_issues({"add_eos_token": add_eos_token, "add_bos_token": add_bos_token,
                              "force_hf": force_hf}))
    enforced = {name: True for name, on in (("add_bos_token", add_bos_token), ("add_eos_token", add_eos_token)) if on}
    try:
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **enforced, **kwargs)
    except (OSError, ValueError) as err:
        raise AutomodelError(f"tokenizer: cannot load '{pretrained_model_name_or_path}': {err}") from None
    _refuse(enforcement_issues(tokenizer, enforced))
    return tokenizer


def enforcement_issues(tokenizer: Any, enforced: dict[str, bool]) -> list[ConfigIssue]:
    """Whether the built tokenizer adds what ``add_bos_token`` / ``add_eos_token`` ask (a probe text tokenized
    with special tokens starts with BOS / ends with EOS)."""
    probe = tokenizer("a")["input_ids"]
    issues = []
    for name, token, index in (("add_bos_token", "bos", 0), ("add_eos_token", "eos", -1)):
        if name not in enforced:
            continue
        token_id = getattr(tokenizer, f"{token}_token_id", None)
        if token_id is None:
            issues.append(ConfigIssue(f"tokenizer.{name}", f"true, but the tokenizer has no {token.upper()} token "
                                      "to add; remove the key"))
        elif not probe or probe[index] != token_id:
            issues.append(ConfigIssue(f"tokenizer.{name}", f"true, but this tokenizer ({type(tokenizer).__name__}) "
                                      f"has no setting that makes it add its {token.upper()} token; remove the key"))
    return issues


def _own_tokenizer_issues(kwargs: dict[str, Any]) -> dict[str, str]:
    """Validation's check of a ``{_target_: NeMoAutoTokenizer.from_pretrained, ...}`` node (nothing is built)."""
    return {issue.key.removeprefix("tokenizer."): issue.message for issue in tokenizer_issues(kwargs)}


tokenizer_from_pretrained.automodel_config_issues = _own_tokenizer_issues  # type: ignore[attr-defined]


def tokenizer_issues(settings: dict[str, Any], key: str = "tokenizer") -> list[ConfigIssue]:
    issues = [ConfigIssue(f"{key}.{name}", f"expected true or false, found {settings[name]!r}")
              for name in ("add_eos_token", "add_bos_token") if not isinstance(settings.get(name, False), bool)]
    if settings.get("force_hf") is False:
        issues.append(ConfigIssue(f"{key}.force_hf", "false is not supported: upstream's own tokenizer classes are "
                                                     "not here; the tokenizer is always transformers' AutoTokenizer"))
    return issues


# ---- collators -------------------------------------------------------------------------------------------------


def _prefix(text: str) -> str:
    """Upstream joins a prefix and its text with a space (``"query:"`` + ``" "`` + text)."""
    return f"{text} " if text else ""


class UpstreamBiEncoderCollator(BiEncoderCollator):
    """Upstream's BiEncoderCollator arguments on this package's bi-encoder collator (built once, with the
    recipe's tokenizer)."""

    def __init__(self, tokenizer: Any = None, q_max_len: int = 512, p_max_len: int = 512, query_prefix: str = "",
                 passage_prefix: str = "", padding: bool | str = True, pad_to_multiple_of: int | None = None,
                 use_dataset_instruction: bool = False):
        _refuse(collator_issues({"padding": padding, "use_dataset_instruction": use_dataset_instruction,
                                 "query_prefix": query_prefix, "passage_prefix": passage_prefix}))
        super().__init__(tokenizer, q_max_len, p_max_len, _prefix(query_prefix), _prefix(passage_prefix),
                         pad_to_multiple_of, use_instructions=use_dataset_instruction)


class UpstreamCrossEncoderCollator(CrossEncoderCollator):
    """Upstream's CrossEncoderCollator arguments on this package's cross-encoder collator: each pair is one text
    made from ``prompt_template``."""

    def __init__(self, tokenizer: Any = None, rerank_max_length: int = 512,
                 prompt_template: str = "question:{query} \n \n passage:{passage}",
                 pad_to_multiple_of: int | None = None, padding: bool | str = True):
        _refuse(collator_issues({"padding": padding}))
        super().__init__(tokenizer, rerank_max_length, prompt_template=prompt_template,
                         pad_to_multiple_of=pad_to_multiple_of)


def collator_issues(settings: dict[str, Any], key: str = "dataloader.collate_fn") -> list[ConfigIssue]:
    issues = []
    if settings.get("padding", True) not in (True, "longest"):
        issues.append(ConfigIssue(f"{key}.padding", f"'{settings['padding']}': batches are padded to their longest "
                                                    "text here (true / longest)"))
    if settings.get("use_dataset_instruction"):
        given = [name for name in ("query_prefix", "passage_prefix") if settings.get(name)]
        if given:  # upstream's collator puts the instructions in their place
            issues.append(ConfigIssue(f"{key}.{given[0]}", f"{settings[given[0]]!r} would not act: with "
                                      "use_dataset_instruction: true each text is put after its data set's "
                                      "instruction instead of a prefix; remove it (or set it to \"\")"))
    return issues


# ---- RetrievalDatasetConfig ------------------------------------------------------------------------------------


def retrieval_dataset(data_dir_list: Any = None, model_type: str = "bi_encoder", data_type: str = "train",
                      n_passages: int = 5, eval_negative_size: int | None = None, seed: int = 42,
                      do_shuffle: bool = False, max_train_samples: int | None = None,
                      train_data_select_offset: int = 0, use_dataset_instruction: bool = False,
                      cycle_positive_docs: bool = False, use_text_in_document: bool = False) -> Any:
    """Upstream's RetrievalDatasetConfig over local files: inline JSON / JSONL records ``{query | question,
    pos_doc, neg_doc}`` (a document: its text, or ``{text}``; this package's ``positive(s)`` / ``negatives`` are
    read too), or upstream's corpus-id data (corpus_id.py); ``use_dataset_instruction`` gives each example its
    corpus's query and passage instructions (which a collator with ``use_dataset_instruction`` puts before the
    texts). Each example is the first positive and ``n_passages - 1`` negatives (``eval_negative_size`` for
    ``data_type: eval``), repeated in turn when a row has fewer. ``{path, num_samples}`` entries draw that many
    rows with ``seed``; ``max_train_samples`` keeps that many rows from ``train_data_select_offset`` (shuffled
    with ``seed`` first when ``do_shuffle``)."""
    import datasets

    from automodel_retrieval.data import RetrievalDataset

    settings = {k: v for k, v in locals().items() if k in RETRIEVAL_KEYS}
    _refuse(dataset_issues(settings))
    records: list[dict[str, Any]] = []
    corpora: dict[str, Corpus] = {}
    for path, num_samples in _entries(data_dir_list):
        rows = _records(path, corpora, use_dataset_instruction)
        if num_samples is not None and num_samples < len(rows):
            rows = random.Random(seed).sample(rows, num_samples)
        records += rows
    if max_train_samples is not None:
        if do_shuffle:
            random.Random(seed).shuffle(records)
        records = records[train_data_select_offset:train_data_select_offset + max_train_samples]
    negatives = eval_negative_size if data_type == "eval" and eval_negative_size is not None else n_passages - 1
    examples = [_example(record, negatives, index) for index, record in enumerate(records)]
    source = ", ".join(str(path) for path, _ in _entries(data_dir_list))
    return RetrievalDataset.from_rows(datasets.Dataset.from_list(examples), source, expand_positives=False)


RETRIEVAL_KEYS = ("data_dir_list", "model_type", "data_type", "n_passages", "eval_negative_size",
                  "use_dataset_instruction", "cycle_positive_docs", "use_text_in_document")


def dataset_issues(settings: dict[str, Any], key: str = "dataset", model_type: str | None = None
                   ) -> list[ConfigIssue]:
    issues = []
    if settings.get("data_dir_list") is None:
        issues.append(ConfigIssue(f"{key}.data_dir_list", "required: the JSON / JSONL files of the data"))
    else:
        try:
            entries = _entries(settings["data_dir_list"])
        except AutomodelError as err:
            entries = []
            issues.append(ConfigIssue(f"{key}.data_dir_list", str(err).split(": ", 1)[1]))
        issues += [ConfigIssue(f"{key}.data_dir_list", problem) for problem in map(_unreadable, (p for p, _ in entries))
                   if problem]
    if model_type is not None and settings.get("model_type", "bi_encoder") != model_type:
        issues.append(ConfigIssue(f"{key}.model_type", f"'{settings.get('model_type', 'bi_encoder')}', but this "
                                                       f"recipe trains a {model_type}; set {model_type}"))
    if settings.get("data_type", "train") not in ("train", "eval"):
        issues.append(ConfigIssue(f"{key}.data_type", "expected train or eval"))
    if settings.get("n_passages", 5) < 1:
        issues.append(ConfigIssue(f"{key}.n_passages", "must be >= 1 (one positive, n_passages - 1 negatives)"))
    for name, why in (("cycle_positive_docs", "rotating positives by epoch is not implemented (the first positive "
                                              "is used)"),
                      ("use_text_in_document", "image documents are not supported")):
        if settings.get(name):
            issues.append(ConfigIssue(f"{key}.{name}", f"true is not supported: {why}; remove it or set false"))
    return issues


def _entries(data_dir_list: Any) -> list[tuple[str, int | None]]:
    entries = data_dir_list if isinstance(data_dir_list, list) else [data_dir_list]
    parsed = []
    for entry in entries:
        path, num = (entry.get("path"), entry.get("num_samples")) if isinstance(entry, dict) else (entry, None)
        if not isinstance(path, str):
            raise AutomodelError(f"dataset.data_dir_list: expected a path or {{path, num_samples}}, found {entry!r}")
        parsed.append((path, num))
    return parsed


def _unreadable(path: str) -> str | None:
    """Why the data file ``path`` cannot be read here, None when it can."""
    if path.startswith(HF_PREFIX):
        return (f"'{path}' is on the Hugging Face hub, which this run cannot reach offline; download the data and "
                "give its local JSON / JSONL files")
    if not Path(path).is_file():
        return f"'{path}' is not a file (a relative path is read from the working directory, {os.getcwd()})"
    return None


def _records(path: str, corpora: dict[str, Corpus], use_instructions: bool) -> list[dict[str, Any]]:
    """A data file's records: inline ones as they are, corpus-id ones with their documents' text (and, with
    ``use_instructions``, their corpus's instructions: inline records have none, so they are refused then)."""
    problem = _unreadable(path)
    if problem:
        raise AutomodelError(f"dataset.data_dir_list: {problem}")
    file = Path(path)
    text = file.read_text(encoding="utf-8")
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if is_corpus_id_data(data):
        return corpus_id_records(file, data, corpora, use_instructions)
    if use_instructions:
        raise AutomodelError(f"dataset.use_dataset_instruction: true takes each row's instructions from its "
                             f"corpus's metadata ({METADATA}), but '{path}' holds inline records, which have none; "
                             "give corpus-id data or set it false")
    records = data.get("data", data) if isinstance(data, dict) else data
    return [records] if isinstance(records, dict) else list(records)


def _texts(value: Any) -> list[str]:
    values = value if isinstance(value, list) else [] if value is None else [value]
    return [v["text"] if isinstance(v, dict) else str(v) for v in values]


def _example(record: dict[str, Any], negatives: int, index: int) -> dict[str, Any]:
    query = record.get("query", record.get("question"))
    positives = _texts(record.get("pos_doc", record.get("positives", record.get("positive"))))
    found = _texts(record.get("neg_doc", record.get("negatives")))
    if query is None or not positives:
        raise AutomodelError(f"dataset.data_dir_list: record {index + 1} needs a query (or question) and a pos_doc")
    if negatives > 0 and not found:
        raise AutomodelError(f"dataset.data_dir_list: record {index + 1} has no neg_doc, but n_passages asks for "
                             f"{negatives} negative(s)")
    chosen = [found[i % len(found)] for i in range(negatives)] if negatives > 0 else []
    instructions = {name: record.get(name, "") for name in INSTRUCTIONS}
    return {"query": query, "positive": positives[0], "negatives": chosen, **instructions}
