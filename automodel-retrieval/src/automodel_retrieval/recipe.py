"""Bi-encoder and cross-encoder training recipes, on the core's shared loop.

Both read ``{query, positive | positives, negatives}`` rows (``automodel_retrieval.RetrievalDataset``, the default
dataset target) and differ in how a micro-batch becomes a loss and what validation reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel.config import Config, ConfigNode, FieldErrors, Free, Target, require_positive
from automodel.errors import AutomodelError, ConfigIssue
from automodel.hf import check_vocab, model_source
from automodel.training.context import BuildContext
from automodel.training.dist import all_reduce_sum
from automodel.training.modules import unwrap
from automodel.training.recipe import TrainRecipe
from automodel_retrieval import upstream, upstream_distill
from automodel_retrieval.bidirectional import is_bidirectional
from automodel_retrieval.data import BiEncoderCollator, CrossEncoderCollator, instructed
from automodel_retrieval.legacy_data import legacy_datasets, legacy_issues, without_dataset
from automodel_retrieval.metrics import group_metrics, ranking_metrics
from automodel_retrieval.models import DEFAULT_INPUTS, POOLINGS, BiEncoder, encoder_dir
from automodel_retrieval.negatives import exclusions, gather_documents
from automodel_retrieval.pooled_cross_encoder import PooledCrossEncoder

DATASET = "automodel_retrieval.data.RetrievalDataset"
TRAINING_DATA_KEYS = ("dataset", "dataloader.dataset")  # the keys of the training data set's section (legacy_data.py)


UPSTREAM = "automodel_retrieval.upstream"
UPSTREAM_COLLATORS = (f"{UPSTREAM}.UpstreamBiEncoderCollator", f"{UPSTREAM}.UpstreamCrossEncoderCollator",
                      "automodel_retrieval.upstream_distill.UpstreamBiEncoderDistillCollator")
NEGATIVES = {  # what each in-batch negatives mode (BiEncoderRecipe.inbatch_negatives) does on several ranks
    upstream.GATHERED: "every rank's documents, gathered with their gradients (N ranks train as one process with "
                       "N times the batch)",
    upstream.DETACHED: "every rank's documents, the other ranks' without gradients "
                       "(model.detach_distributed_inbatch_negatives)",
    upstream.LOCAL: "each rank's own micro-batch (model.do_distributed_inbatch_negative: false)",
}


def _expanded(cfg: Config, node: Any) -> str | None:
    """The dotted path a target node's ``_target_`` stands for (through aliases), or None."""
    if not isinstance(node, ConfigNode) or not isinstance(node.target, str):
        return None
    return cfg.resolver.expand(node.target)


def _dataset_section(help: str) -> Target:
    return Target(help, runtime_args=(), plain=True, default_target=DATASET)


def _loss_section(help: str, target: str) -> Target:
    """``loss_fn`` may leave out ``_target_`` ({temperature: 0.02}) or be absent: the recipe's loss either way."""
    return Target(help, plain=True, default_target=target, default={})


_FROM_MODEL = ("; unset: the model's own (a sentence-transformers model's {}, a trained bi-encoder's setting), "
               "else {!r}")


@dataclass
class BiEncoderSettings:
    query_max_length: int | None = field(default=None, metadata={
        "help": "tokens per query (longer ones are truncated)" + _FROM_MODEL.format("max_seq_length", 64)})
    document_max_length: int | None = field(default=None, metadata={
        "help": "tokens per document" + _FROM_MODEL.format("max_seq_length", 128)})
    query_prefix: str | None = field(default=None, metadata={
        "help": "text put before every query (e.g. 'query: ')" + _FROM_MODEL.format("'query' prompt", "")})
    document_prefix: str | None = field(default=None, metadata={
        "help": "text put before every document (e.g. 'passage: ')" + _FROM_MODEL.format("'document' prompt", "")})
    recall_at: list[int] = field(default_factory=lambda: [1, 5, 10],
                                 metadata={"help": "validation reports recall@k for each k"})
    eval_batch_size: int = field(default=64, metadata={"help": "texts per forward pass when validation embeds "
                                                               "its queries and corpus"})

    def __post_init__(self) -> None:
        if not self.recall_at or any(k < 1 for k in self.recall_at):
            raise FieldErrors({"recall_at": f"must be a list of k >= 1, found {self.recall_at}"})
        require_positive(self, "query_max_length", "document_max_length", "eval_batch_size")


@dataclass
class CrossEncoderSettings:
    max_length: int = field(default=192, metadata={"help": "tokens per (query, document) pair"})
    query_prefix: str = field(default="", metadata={"help": "text put before every query"})
    document_prefix: str = field(default="", metadata={"help": "text put before every document"})

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"retrieval.max_length must be >= 2, found {self.max_length}")


class _RetrievalRecipe(TrainRecipe):
    """What both retrieval recipes share: the tokenizer and the data sets."""

    reads_loader_datasets = True  # upstream's legacy dataloader.dataset (data_sections)

    sections = {
        "tokenizer": Target("tokenizer (default: the model's): {pretrained_model_name_or_path: ...}", plain=True,
                            default_target="transformers.AutoTokenizer.from_pretrained"),
        "dataset": _dataset_section("training rows {query, positive | positives, negatives} "
                                    "(default _target_: automodel_retrieval.RetrievalDataset); required, here or "
                                    "as upstream's legacy dataloader.dataset (the same keys, with _target_)"),
        "validation_dataset": _dataset_section("validation rows (same format); or upstream's legacy "
                                               "validation_dataloader.dataset"),
        "validation_dataset_*": _dataset_section("more validation data sets, reported by name"),
    }

    upstream_model = ""  # the upstream model factory this recipe's model may name (its alias target)
    model_type = ""  # upstream's RetrievalDatasetConfig.model_type for this recipe

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        loss = cfg.loss_fn
        if isinstance(loss, ConfigNode):
            temperature = loss.get("temperature")
            if isinstance(temperature, (int, float)) and temperature <= 0:
                issues.append(ConfigIssue("loss_fn.temperature", f"must be > 0, found {temperature}"))
        return issues + cls.upstream_issues(cfg) + legacy_issues(cfg)

    @classmethod
    def upstream_issues(cls, cfg: Config) -> list[ConfigIssue]:
        """Upstream keys (through the upstream names' aliases) that cannot act here, each with its reason."""
        issues = []
        nodes = [cfg.get(name) for name in ("model", "dataset", "validation_dataset")]  # the tokenizer's: its own
        for node in nodes + list(legacy_datasets(cfg).values()):  # (upstream's legacy dataloader.dataset too)
            if not isinstance(node, ConfigNode):
                continue
            name, target, settings = node.key, _expanded(cfg, node), node.to_dict()
            if target in cls.upstream_models():
                check = upstream.bi_encoder_issues if cls.model_type == "bi_encoder" else upstream.cross_encoder_issues
                issues += check(settings, name)
            elif target == f"{UPSTREAM}.retrieval_dataset":
                issues += upstream.dataset_issues(settings, name, cls.model_type)
        loader = cfg.get("dataloader")
        collate = loader.get("collate_fn") if isinstance(loader, ConfigNode) else None
        if _expanded(cfg, collate) in UPSTREAM_COLLATORS:
            issues += upstream.collator_issues(collate.to_dict()) + upstream_distill.collator_issues(collate.to_dict())
            if "retrieval" in cfg:
                issues.append(ConfigIssue("retrieval", "give the lengths and prefixes in dataloader.collate_fn "
                                                       "(upstream's collator) or here, not both"))
        return issues

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        return super().describe_plan(cfg) + [f"{name}: {node.target} (upstream's legacy {node.key})"
                                             for name, node in legacy_datasets(cfg).items()]

    def data_sections(self) -> dict[str, ConfigNode]:
        """Also a data set given inside its loader, upstream's legacy form (legacy_data.py), as the section it
        stands for (validation refused one given both ways)."""
        return {**super().data_sections(), **legacy_datasets(self.cfg)}

    def build_dataloader(self, ctx: BuildContext, dataset: Any, node: ConfigNode | None, train: bool) -> Any:
        """The loader over ``dataset``, from its section less a legacy nested data set (built as a section)."""
        return super().build_dataloader(ctx, dataset, without_dataset(node), train)

    @classmethod
    def upstream_models(cls) -> tuple[str, ...]:
        """The upstream model factories (alias targets) this recipe's model may name, checked as upstream's."""
        return (cls.upstream_model,)

    def collate_runtime_args(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer}  # upstream builds its collator classes with the tokenizer

    def configured_collator(self) -> Any:
        """The collator upstream's collate_fn node describes (None when the config names none): it also collates
        validation, as training does."""
        from automodel.training.builders import configured_collate

        loader = self.cfg.get("dataloader")
        node = loader.get("collate_fn") if isinstance(loader, ConfigNode) else None
        if _expanded(self.cfg, node) not in UPSTREAM_COLLATORS:
            return None
        return configured_collate(node.to_dict(), self.cfg.resolver, node.key, self.collate_runtime_args())

    def build_loss_fn(self, ctx: Any) -> torch.nn.Module:
        """``loss_fn``, with the temperature upstream puts elsewhere (see ``upstream_temperature``)."""
        temperature = self.upstream_temperature()
        if temperature is None:
            return super().build_loss_fn(ctx)
        return ctx.instantiate("loss_fn", temperature=temperature)

    def upstream_temperature(self) -> float | None:
        return None

    def _tokenizer_source(self) -> str | None:
        found = model_source(self.cfg.model, ("pretrained_model_name_or_path", "name_or_path", "query_encoder",
                                              "config"))
        if found is None:
            return None
        path = Path(found[0])
        path = encoder_dir(path.parent if path.is_file() else path)
        return str(path) if path.exists() else found[0]

    def setup_domain(self) -> None:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        node = self.cfg.tokenizer
        if node is not None:
            self.tokenizer = node.instantiate(default_target="transformers.AutoTokenizer.from_pretrained")
        else:
            source = self._tokenizer_source()
            try:
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(source) if source else None
            except (OSError, ValueError) as err:
                raise AutomodelError(f"tokenizer: none found beside the model ({source}): {err}; add "
                                     "`tokenizer: {pretrained_model_name_or_path: ...}`") from None
            if self.tokenizer is None:
                raise AutomodelError("tokenizer: none found; add `tokenizer: {pretrained_model_name_or_path: ...}`")

    def _check_vocab(self, encoders: list[torch.nn.Module]) -> None:
        for encoder in encoders:
            check_vocab(self.tokenizer, getattr(encoder, "config", None),
                        "tokenizer: {tokens} tokens but the model's vocab_size is {vocab}; use the model's own "
                        "tokenizer")

    def count_input_tokens(self, batch: dict[str, Any]) -> int:
        return sum(int(v["attention_mask"].sum()) for v in batch.values()
                   if isinstance(v, dict) and "attention_mask" in v)

    def count_label_tokens(self, batch: dict[str, Any]) -> int:
        return len(batch["labels"])  # the loss is summed over queries (groups)


class BiEncoderRecipe(_RetrievalRecipe):
    """Contrastive bi-encoder training: InfoNCE over in-batch and hard negatives; validation ranks the corpus."""

    domain = "retrieval"
    upstream_model = f"{UPSTREAM}.bi_encoder_from_pretrained"
    model_type = "bi_encoder"
    unsupported_stages = {"peft": "LoRA on a bi-encoder is not built here: model/ is a sentence-transformers model "
                                  "with its encoders whole, which holds no adapter; remove peft: to fine-tune the "
                                  "encoders (LoRA acts in finetune cross-encoder and the LLM / VLM recipes)"}
    sections = {
        "model": Target("the bi-encoder: {_target_: automodel_retrieval.BiEncoder.from_config | .from_pretrained, "
                        "shared, pooling, normalize, ...}", required=True),
        "loss_fn": _loss_section("the contrastive loss (default automodel_retrieval.InfoNCELoss: {temperature: "
                                 "0.05})", "automodel_retrieval.losses.InfoNCELoss"),
        "retrieval": BiEncoderSettings,
        "temperature": Free("upstream's name for the contrastive temperature (loss_fn.temperature): a number > 0"),
    }

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = super().check_config(cfg)
        model = cfg.model
        if isinstance(model, ConfigNode) and _expanded(cfg, model) not in cls.upstream_models() and \
                model.get("pooling") is not None and model["pooling"] not in POOLINGS:
            issues.append(ConfigIssue("model.pooling", f"'{model['pooling']}' is not one of {', '.join(POOLINGS)}"))
        temperature = cfg.resolved.get("temperature")
        if temperature is not None:
            given = cfg.loss_fn.get("temperature") if isinstance(cfg.loss_fn, ConfigNode) else None
            if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
                issues.append(ConfigIssue("temperature", f"expected a number > 0, found {temperature!r}"))
            elif given is not None and given != temperature:
                issues.append(ConfigIssue("temperature", f"{temperature}, but loss_fn.temperature is {given}: "
                                                         "they are the same setting; give one"))
        return issues

    def upstream_temperature(self) -> float | None:
        return self.cfg.resolved.get("temperature")

    @property
    def settings(self) -> BiEncoderSettings:
        collator = self.configured_collator()
        if collator is None:
            return self.cfg.retrieval
        return BiEncoderSettings(collator.query_max_length, collator.document_max_length, collator.query_prefix,
                                 collator.document_prefix, self.cfg.retrieval.recall_at,
                                 self.cfg.retrieval.eval_batch_size)

    def input_settings(self) -> dict[str, Any]:
        """Max lengths and prefixes: upstream's configured collator's or the retrieval section's, else the model's
        own (what its sentence-transformers directory or saved bi-encoder said), else the defaults."""
        model = unwrap(self.model)
        if not isinstance(model, BiEncoder):
            raise AutomodelError(f"model: the bi-encoder recipe needs an automodel_retrieval.BiEncoder, built "
                                 f"{type(model).__name__}; use automodel_retrieval.BiEncoder.from_config or "
                                 ".from_pretrained")
        return {name: getattr(self.settings, name) if getattr(self.settings, name) is not None
                else model.input_setting(name) for name in DEFAULT_INPUTS}

    def default_collate_fn(self, train: bool = True) -> Any:
        configured = self.configured_collator()
        if configured is not None:
            return configured
        s = self.input_settings()
        return BiEncoderCollator(self.tokenizer, s["query_max_length"], s["document_max_length"], s["query_prefix"],
                                 s["document_prefix"])

    @classmethod
    def inbatch_negatives(cls, cfg: Config) -> str:
        """Where training takes each query's in-batch negatives from on several ranks: every rank's documents,
        gathered with their gradients (``gathered``), unless upstream's bi-encoder asks otherwise (its
        ``do_distributed_inbatch_negative`` / ``detach_distributed_inbatch_negatives``: ``local``, ``detached``)."""
        model = cfg.model
        if _expanded(cfg, model) != cls.upstream_model:
            return upstream.GATHERED
        return upstream.inbatch_negatives(model.to_dict())

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        from automodel.training.dist import expected_world_size

        several = expected_world_size() > 1
        found = NEGATIVES[cls.inbatch_negatives(cfg)] if several else "the micro-batch's documents (one process)"
        return super().describe_plan(cfg) + [f"in-batch negatives: {found}"]

    def setup(self) -> None:
        super().setup()
        model = unwrap(self.model)
        s = self.input_settings()
        attention = "bidirectional" if is_bidirectional(model.encoder("query")) else "causal"
        self.log(f"bi-encoder: pooling {model.pooling}, normalize {str(model.normalize).lower()}, attention "
                 f"{attention}, max length {s['query_max_length']} (queries) / {s['document_max_length']} "
                 "(documents)")
        self._check_vocab([model.encoder("query"), model.encoder("document")])
        self.setup_negatives()

    def setup_negatives(self) -> None:
        """Where the contrastive loss takes its in-batch negatives from on several ranks (logged)."""
        self.negatives_mode = self.inbatch_negatives(self.cfg) if self.world_size > 1 else upstream.LOCAL
        if _expanded(self.cfg, self.cfg.model) == self.upstream_model:
            for note in upstream.inbatch_negatives_notes(self.cfg.model.to_dict(), self.world_size):
                self.log(note)
        if self.world_size > 1:
            self.log(f"in-batch negatives: {NEGATIVES[self.negatives_mode]}")

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """InfoNCE of the micro-batch's queries against its documents, or, when training on several ranks,
        against every rank's documents (negatives.py: gathered with their gradients, or with the other ranks' as
        constants) unless ``inbatch_negatives`` keeps them local."""
        query, documents = model(query=batch["query"], document=batch["document"])
        keys, labels = batch["document_keys"], batch["labels"]
        padding = None
        if self.negatives_mode != upstream.LOCAL and torch.is_grad_enabled():
            documents, keys, valid, offset = gather_documents(documents, keys, self.negatives_mode == upstream.DETACHED)
            labels, padding = labels + offset, ~valid
        exclude = exclusions(keys, batch["positive_keys"], labels)
        return self.loss_fn(query, documents, labels, exclude if padding is None else exclude | padding)

    # ---- validation: rank each query against the validation set's whole corpus -----------------------------

    def _embed(self, model: BiEncoder, side: str, texts: list[str], collator: BiEncoderCollator) -> torch.Tensor:
        encode = collator.encode_queries if side == "query" else collator.encode_documents
        size = self.settings.eval_batch_size
        chunks = [model.encode(side, self.move_to_device(encode(texts[i: i + size])))
                  for i in range(0, len(texts), size)]
        return torch.cat(chunks) if chunks else torch.zeros(0)

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        dataset = dataloader.dataset
        if not all(hasattr(dataset, a) for a in ("queries", "corpus", "positive_ids")):
            return {}
        model = unwrap(self.model)
        collator = self.default_collate_fn(False)
        queries, corpus = dataset.queries, dataset.corpus
        if collator.use_instructions:  # each text after its source's instruction, as in training
            queries = instructed(queries, getattr(dataset, "query_instructions", [""] * len(queries)))
            corpus = instructed(corpus, [getattr(dataset, "document_instructions", {}).get(d, "") for d in corpus])
        queries = self._embed(model, "query", queries, collator)
        corpus = self._embed(model, "document", corpus, collator)
        metrics = ranking_metrics(queries @ corpus.T, dataset.positive_ids, self.settings.recall_at)
        metrics["corpus_size"] = len(dataset.corpus)
        return metrics

    # ---- weights --------------------------------------------------------------------------------------------

    def save_model(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        unwrap(self.model).save_pretrained(directory, state_dict=state_dict, tokenizer=self.tokenizer,
                                           extra=self.input_settings())

    def load_model_weights(self, model: torch.nn.Module, directory: Path) -> None:
        unwrap(model).load_weights(directory)

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        if final_checkpoint is None:
            return
        model_dir = final_checkpoint / "model"
        if unwrap(self.model).shared:
            how = f"sentence_transformers.SentenceTransformer('{model_dir}') (encode_query / encode_document)"
        else:
            how = (f"sentence_transformers.SentenceTransformer('{model_dir / 'query_encoder'}') for queries and "
                   f"'{model_dir / 'document_encoder'}' for documents")
        self.log(f"Trained bi-encoder in {model_dir}: load it with {how}, transformers.AutoModel (then pool: "
                 f"{unwrap(self.model).pooling}), or all of it with automodel_retrieval.BiEncoder.from_pretrained("
                 f"'{model_dir}')")


class CrossEncoderRecipe(_RetrievalRecipe):
    """Cross-encoder (reranker) training: one logit per (query, document), listwise cross-entropy over each
    positive and its negatives; validation reports accuracy (the positive ranked first) and MRR."""

    domain = "cross-encoder"
    upstream_model = f"{UPSTREAM}.cross_encoder_from_pretrained"
    model_type = "cross_encoder"
    sections = {
        "model": Target("the cross-encoder: {_target_: automodel_retrieval.CrossEncoder.from_config | "
                        ".from_pretrained, ...} (AutoModelForSequenceClassification, one logit; with pooling: the "
                        "base model, that pooling and a one-output score layer)", required=True),
        "loss_fn": _loss_section("the listwise loss (default automodel_retrieval.ListwiseCrossEntropy)",
                                 "automodel_retrieval.losses.ListwiseCrossEntropy"),
        "retrieval": CrossEncoderSettings,
    }

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = super().check_config(cfg)
        model, checkpoint = cfg.model, cfg.checkpoint
        if isinstance(model, ConfigNode) and model.get("pooling") is not None and checkpoint is not None:
            issues += checkpoint.no_sharded_form_issues("a pooled cross-encoder (model.pooling) writes model/ as a "
                                                        "sentence-transformers CrossEncoder")
        return issues

    def default_collate_fn(self, train: bool = True) -> Any:
        configured = self.configured_collator()
        if configured is not None:
            return configured
        s = self.cfg.retrieval
        return CrossEncoderCollator(self.tokenizer, s.max_length, s.query_prefix, s.document_prefix)

    def upstream_temperature(self) -> float | None:
        """Upstream gives the cross-encoder model a temperature that divides its scores: the loss's here."""
        model = self.cfg.model
        if _expanded(self.cfg, model) == self.upstream_model:
            return model.get("temperature")
        return None

    def build_dataset(self, ctx: BuildContext, node: ConfigNode) -> Any:
        """A data set whose queries all come without negatives is refused: each group would hold only its
        positive, so the listwise loss is 0 (nothing trains) and accuracy and MRR are 1.0 whatever the model."""
        dataset = super().build_dataset(ctx, node)
        examples = getattr(dataset, "examples", None)
        if examples and not any(example["negatives"] for example in examples):
            source = node.get("path") or node.get("dataset_name") or "the data"
            what = "nothing would train (the loss of a group of one document is 0)" if node.key in TRAINING_DATA_KEYS \
                else "accuracy and MRR would be 1.0 whatever the model (each query ranked against itself alone)"
            if node.get("num_negatives") == 0:
                raise AutomodelError(f"{node.key}.num_negatives: 0 leaves every query of '{source}' without "
                                     f"negatives, so {what}; set it to 1 or more")
            raise AutomodelError(f"{node.key}: no row of '{source}' has negatives, so {what}. A cross-encoder "
                                 "ranks each positive against its negatives: add a 'negatives' list to the rows "
                                 "(`automodel mine retrieval` mines them with a trained bi-encoder)")
        return dataset

    def setup(self) -> None:
        super().setup()
        model = unwrap(self.model)
        pooled = isinstance(model, PooledCrossEncoder)
        labels = 1 if pooled else getattr(getattr(model, "config", None), "num_labels", None)
        if labels != 1:
            raise AutomodelError(f"model: a cross-encoder scores each pair with one logit; the model has "
                                 f"num_labels={labels} (set model.num_labels: 1)")
        self._check_vocab([model])
        if pooled:
            # model/ is a sentence-transformers CrossEncoder (pooled_cross_encoder.py), written by this recipe
            self.save_model = self._save_pooled
            attention = "bidirectional" if is_bidirectional(model.backbone) else "causal"
            self.log(f"cross-encoder: {type(model.backbone).__name__}, attention {attention}, pooling "
                     f"{model.pooling}, one-output score layer")

    def _save_pooled(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        unwrap(self.model).save_pretrained(directory, state_dict=state_dict, tokenizer=self.tokenizer,
                                           max_seq_length=self.default_collate_fn(False).max_length)

    def load_model_weights(self, model: torch.nn.Module, directory: Path) -> None:
        if isinstance(unwrap(model), PooledCrossEncoder):
            unwrap(model).load_weights(directory)
            return
        super().load_model_weights(model, directory)

    def scores(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """[B, G] scores of each group's candidates (-inf where a group is padded)."""
        logits = model(**batch["pairs"]).logits.reshape(-1).float()
        valid = batch["valid"]
        scores = torch.full(valid.shape, float("-inf"), device=logits.device)
        return scores.masked_scatter(valid, logits)

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self.loss_fn(self.scores(model, batch), batch["valid"], batch["labels"])

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        correct = reciprocal = chance = 0.0
        groups = 0
        for batch in dataloader:
            batch = self.move_to_device(batch)
            c, r, p = group_metrics(self.scores(self.model, batch), batch["valid"], batch["labels"])
            correct, reciprocal, chance, groups = correct + c, reciprocal + r, chance + p, groups + len(batch["labels"])
        if self.ctx.mesh.dp > 1:  # each data-parallel rank scored its share of the groups: the metrics are of all
            correct, reciprocal, chance, groups = (float(v) for v in all_reduce_sum(
                correct, reciprocal, chance, groups, device=self.device, group=self.data_parallel_group()))
        groups = max(groups, 1)
        return {"accuracy": correct / groups, "mrr": reciprocal / groups, "chance_accuracy": chance / groups}

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        if final_checkpoint is not None:
            model_dir = final_checkpoint / "model"
            if isinstance(unwrap(self.model), PooledCrossEncoder):
                self.log(f"Trained cross-encoder in {model_dir}: load it with sentence_transformers.CrossEncoder("
                         f"'{model_dir}') or automodel_retrieval.CrossEncoder.from_pretrained('{model_dir}')")
                return
            self.log(f"Trained cross-encoder in {model_dir}: load it with transformers."
                     f"AutoModelForSequenceClassification.from_pretrained('{model_dir}') and AutoTokenizer")
