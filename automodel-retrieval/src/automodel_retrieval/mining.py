"""Hard-negative mining (``automodel mine retrieval -c cfg.yaml``): a recipe that runs no training loop.

A trained bi-encoder embeds every query of ``mining.data`` and every document of the corpus; each query's
``num_negatives`` most similar documents become its hard negatives, except its positives and, by the margin
filter, documents scoring too close to the positive to be trusted as negatives (likely unlabelled positives):

* ``margin_type: perc``: keep a document only if its score <= ``margin`` x the query's lowest positive score
  (``margin: 0.95``: at most 95% of the positive's);
* ``margin_type: abs``: keep it only if its score <= the lowest positive score - ``margin``;
* ``margin_type: none``: no filter.

Scores are computed for blocks of ``query_batch_size`` queries against chunks of ``chunk_size`` documents, keeping a
running top-k, so memory stays bounded by one block x chunk score matrix; the result does not depend on the chunk
size (ties break towards the earlier document; scores are written rounded to 6 decimals). The output JSONL
(``{query, positives, negatives, positive_scores, negative_scores}``) is ready for bi-encoder training
(``dataset.path``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from automodel.config import Config, FieldErrors, Free, require_positive
from automodel.errors import AutomodelError
from automodel.recipe import BaseRecipe


def _help(text: str, *aliases: str) -> dict:
    return {"help": text, "aliases": aliases}


@dataclass
class MiningConfig:
    model: str = field(metadata=_help("the bi-encoder: a run's checkpoint_dir (its LATEST), a checkpoint, or a "
                                      "model directory (or any encoder AutoModel loads, with `pooling`)",
                                      "model_name_or_path"))
    data: str = field(metadata=_help("rows {query, positive | positives[, negatives]} (JSONL, ... or a hub name)",
                                     "train_qa_file_path"))
    output: str = field(metadata=_help("where the mined JSONL is written", "train_file_output_path"))
    split: str = field(default="train", metadata=_help("split of `data` when it is a directory or hub name"))
    corpus: str | None = field(default=None, metadata=_help(
        "documents to mine from: .txt (one per line) or JSON/JSONL with `text` (default: every document of data)"))
    num_negatives: int = field(default=5, metadata=_help("hard negatives kept per query (top-k)",
                                                         "hard_negatives_to_mine"))
    margin_type: Literal["perc", "abs", "none"] = field(default="perc", metadata=_help(
        "perc: score <= margin * positive score; abs: score <= positive score - margin; none: no filter",
        "hard_neg_margin_type"))
    margin: float = field(default=0.95, metadata=_help("the margin filter's value", "hard_neg_margin"))
    chunk_size: int = field(default=8192, metadata=_help("documents scored at once (bounds memory)",
                                                         "corpus_chunk_size"))
    query_batch_size: int = field(default=256, metadata=_help("queries scored at once", "mining_batch_size"))
    batch_size: int = field(default=64, metadata=_help("texts per forward pass while embedding"))
    query_embedding_batch_size: int | None = field(default=None, metadata=_help(
        "queries per forward pass while embedding (default: batch_size)"))
    document_embedding_batch_size: int | None = field(default=None, metadata=_help(
        "documents per forward pass while embedding (default: batch_size)"))
    tokenizer: str | None = field(default=None, metadata=_help("tokenizer (default: the model's)",
                                                               "tokenizer_name_or_path"))
    pooling: Literal["mean", "cls", "last"] | None = field(default=None, metadata=_help(
        "pooling (default: the checkpoint's)"))
    query_prefix: str | None = field(default=None, metadata=_help("default: the checkpoint's"))
    document_prefix: str | None = field(default=None, metadata=_help("default: the checkpoint's", "passage_prefix"))
    query_max_length: int | None = field(default=None, metadata=_help("default: the checkpoint's, else 64"))
    document_max_length: int | None = field(default=None, metadata=_help("default: the checkpoint's, else 128",
                                                                         "passage_max_length"))
    limit: int | None = field(default=None, metadata=_help("mine only the first N rows"))
    write_scores: bool = field(default=True, metadata=_help("write positive_scores and negative_scores"))
    device: str = field(default="auto", metadata=_help("auto (cuda when available), cpu, cuda, cuda:1, ..."))

    load_embeddings_from_cache: bool = field(default=False, metadata=_help(
        "upstream's embedding cache: not implemented (only false)"))
    cache_embeddings_dir: str | None = field(default=None, metadata=_help(
        "upstream's embedding cache folder: not implemented (only null)"))
    use_negatives_from_file: bool = field(default=False, metadata=_help(
        "keep the data's own negatives besides the mined ones: not implemented (only false; the mined replace them)"))

    def __post_init__(self) -> None:
        unsupported = {
            "load_embeddings_from_cache": "true is not supported: embeddings are computed each run",
            "cache_embeddings_dir": "is not supported: embeddings are computed each run (no cache)",
            "use_negatives_from_file": "true is not supported: the mined negatives replace the data's",
        }
        bad = {name: why for name, why in unsupported.items() if getattr(self, name) not in (None, False)}
        if bad:
            raise FieldErrors(bad)
        require_positive(self, "num_negatives", "chunk_size", "query_batch_size", "batch_size", "limit",
                         "query_max_length", "document_max_length", "query_embedding_batch_size",
                         "document_embedding_batch_size")
        if self.margin_type == "perc" and not 0 < self.margin <= 1:
            raise ValueError(f"mining.margin must be in (0, 1] with margin_type perc, found {self.margin}")
        if self.margin_type == "abs" and self.margin < 0:
            raise ValueError(f"mining.margin must be >= 0 with margin_type abs, found {self.margin}")


# ---- the search ---------------------------------------------------------------------------------------------

def margin_thresholds(positive_scores: Any, margin_type: str, margin: float) -> Any:
    """The highest score a negative may have, per query, from its lowest positive score."""
    import torch

    if margin_type == "perc":
        return positive_scores * margin
    if margin_type == "abs":
        return positive_scores - margin
    return torch.full_like(positive_scores, float("inf"))


def top_k_negatives(queries: Any, corpus: Any, excluded: list[set[int]], thresholds: Any, k: int,
                    chunk_size: int, query_batch_size: int = 256, progress: Any = None
                    ) -> tuple[list[list[int]], list[list[float]]]:
    """Per query, the ``k`` best-scoring corpus documents (index, score) that are not excluded and score at most
    its threshold; best first, ties towards the lower index. Exact whatever ``chunk_size`` is."""
    import torch

    indices: list[list[int]] = []
    scores: list[list[float]] = []
    corpus = corpus.double()
    for start in range(0, queries.shape[0], query_batch_size):
        block = queries[start: start + query_batch_size].double()
        limit = thresholds[start: start + query_batch_size].double()[:, None]
        best_scores = torch.empty(block.shape[0], 0, dtype=torch.float64, device=block.device)
        best_ids = torch.empty(block.shape[0], 0, dtype=torch.long, device=block.device)
        for offset in range(0, corpus.shape[0], chunk_size):
            chunk = block @ corpus[offset: offset + chunk_size].T
            for row, ids in enumerate(excluded[start: start + block.shape[0]]):
                local = [i - offset for i in ids if offset <= i < offset + chunk.shape[1]]
                if local:
                    chunk[row, local] = float("-inf")
            chunk = chunk.masked_fill(chunk > limit, float("-inf"))
            # a stable sort keeps equal scores in index order; the running best (earlier chunks, lower indices)
            # goes first, so the merged order is (score desc, index asc), as one big chunk would give
            top = torch.sort(chunk, dim=1, descending=True, stable=True)
            top_scores, top_ids = top.values[:, :k], top.indices[:, :k] + offset
            merged = torch.sort(torch.cat([best_scores, top_scores], 1), dim=1, descending=True, stable=True)
            best_scores = merged.values[:, :k]
            best_ids = torch.cat([best_ids, top_ids], 1).gather(1, merged.indices[:, :k])
            if progress is not None:
                progress.update(block.shape[0] * chunk.shape[1])
        for row_scores, row_ids in zip(best_scores.tolist(), best_ids.tolist(), strict=True):
            keep = [(i, s) for i, s in zip(row_ids, row_scores, strict=True) if s != float("-inf")]
            indices.append([i for i, _ in keep])
            scores.append([s for _, s in keep])
    return indices, scores


# ---- the recipe ---------------------------------------------------------------------------------------------

class MineHardNegativesRecipe(BaseRecipe):
    """Embeds queries and a corpus with a trained bi-encoder and writes the hardest negatives of every query."""

    sections = {"mining": MiningConfig,
                "dist_env": Free("upstream's process-group settings: mining runs in one process here, so they "
                                 "configure nothing (a note says so)")}

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        m = cfg.mining
        filter_ = "none" if m.margin_type == "none" else f"{m.margin_type} {m.margin}"
        return [f"recipe: {cls.__module__}.{cls.__qualname__}", f"model: {m.model}", f"data: {m.data}",
                f"corpus: {m.corpus or 'every document of data'}",
                f"negatives: top {m.num_negatives} per query, margin filter {filter_}",
                f"chunks: {m.query_batch_size} queries x {m.chunk_size} documents", f"output: {m.output}"]

    def log(self, message: str) -> None:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)

    def setup(self) -> None:
        import torch
        import transformers

        from automodel_retrieval.data import BiEncoderCollator, load_corpus, load_rows, row_negatives, row_positives
        from automodel_retrieval.models import BiEncoder, encoder_dir, resolve_model_dir

        m = self.mining = self.cfg.mining
        if "dist_env" in self.cfg:
            self.log("note: section 'dist_env' configures nothing: mine retrieval runs in one process")
        transformers.utils.logging.disable_progress_bar()
        if m.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(m.device)
        model_dir = resolve_model_dir(m.model)
        try:
            model = BiEncoder.from_pretrained(str(model_dir), pooling=m.pooling)
        except AutomodelError as err:
            if model_dir.exists():
                raise
            raise AutomodelError(f"mining.model: '{m.model}' is no local directory, and loading it as a hub model "
                                 f"failed ({err}); train a bi-encoder first (automodel finetune retrieval -c ...) and "
                                 "point mining.model at its checkpoint_dir") from None
        self.model = model.to(self.device).eval()
        source = m.tokenizer or str(encoder_dir(model_dir))
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise AutomodelError(f"mining.tokenizer: cannot load a tokenizer from '{source}': {err}") from None

        def pick(name: str) -> Any:  # the mining section's, else the model's own (or the default)
            value = getattr(m, name)
            return value if value is not None else model.input_setting(name)

        self.collator = BiEncoderCollator(self.tokenizer, pick("query_max_length"), pick("document_max_length"),
                                          pick("query_prefix"), pick("document_prefix"))
        rows = load_rows(m.data, m.split, "mining.data")
        if "query" not in rows.column_names:
            raise AutomodelError(f"mining.data: '{m.data}' has no 'query' column (found: "
                                 f"{', '.join(rows.column_names)})")
        if m.limit is not None:
            rows = rows.select(range(min(m.limit, len(rows))))
        self.rows = []
        for index, row in enumerate(rows):
            positives = row_positives(row, f"mining.data row {index}")
            if not positives:
                raise AutomodelError(f"mining.data: row {index} has no 'positive' or 'positives'")
            self.rows.append({"query": row["query"], "positives": positives,
                              "negatives": row_negatives(row, f"mining.data row {index}")})
        if not self.rows:
            raise AutomodelError(f"mining.data: '{m.data}' has no rows")
        if m.corpus is not None:
            documents = load_corpus(m.corpus, "mining.corpus")
        else:
            documents = [d for row in self.rows for d in row["positives"] + row["negatives"]]
        self.corpus = list(dict.fromkeys(documents))
        if not self.corpus:
            raise AutomodelError("mining.corpus: no documents to mine from")

    def embed(self, side: str, texts: list[str], desc: str) -> Any:
        import torch

        from automodel.training.progress import TaskProgress

        encode = self.collator.encode_queries if side == "query" else self.collator.encode_documents
        size = getattr(self.mining, f"{side}_embedding_batch_size") or self.mining.batch_size
        out = []
        with torch.no_grad(), TaskProgress(len(texts), desc, unit="text") as bar:
            for i in range(0, len(texts), size):
                inputs = {k: v.to(self.device) for k, v in encode(texts[i: i + size]).items()}
                out.append(self.model.encode(side, inputs).float())
                bar.update(len(texts[i: i + size]))
        return torch.cat(out)

    def run_train_validation_loop(self) -> None:
        import torch

        from automodel.training.progress import TaskProgress

        m = self.mining
        index = {text: i for i, text in enumerate(self.corpus)}
        extra = list(dict.fromkeys(p for row in self.rows for p in row["positives"] if p not in index))
        queries = self.embed("query", [row["query"] for row in self.rows], "embed queries")
        corpus = self.embed("document", self.corpus, "embed corpus")
        outside = self.embed("document", extra, "embed positives") if extra else corpus[:0]
        outside_index = {text: i for i, text in enumerate(extra)}

        def doc_vector(text: str) -> torch.Tensor:
            return corpus[index[text]] if text in index else outside[outside_index[text]]

        positive_scores = [[float(queries[q].double() @ doc_vector(p).double()) for p in row["positives"]]
                           for q, row in enumerate(self.rows)]
        lowest = torch.tensor([min(s) for s in positive_scores], dtype=torch.float64, device=self.device)
        thresholds = margin_thresholds(lowest, m.margin_type, m.margin)
        excluded = [{index[p] for p in row["positives"] if p in index} for row in self.rows]
        with TaskProgress(len(self.rows) * len(self.corpus), "search", unit="pair", unit_scale=True) as bar:
            ids, scores = top_k_negatives(queries, corpus, excluded, thresholds, m.num_negatives, m.chunk_size,
                                          m.query_batch_size, bar)
        output = Path(m.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")
        short = 0
        with staging.open("w", encoding="utf-8") as f:
            for row, pos_scores, row_ids, row_scores in zip(self.rows, positive_scores, ids, scores, strict=True):
                record = {"query": row["query"], "positives": row["positives"],
                          "negatives": [self.corpus[i] for i in row_ids]}
                if m.write_scores:
                    # rounded: the last bits of a float64 dot product depend on the BLAS kernel, hence on the
                    # chunk shape; the choice and order of negatives does not
                    record["positive_scores"] = [round(s, 6) for s in pos_scores]
                    record["negative_scores"] = [round(s, 6) for s in row_scores]
                short += len(row_ids) < m.num_negatives
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(staging, output)
        mined = sum(len(i) for i in ids)
        self.log(f"mined {mined} hard negatives for {len(self.rows)} queries from {len(self.corpus)} documents "
                 f"({mined / len(self.rows):.2f} per query; {short} queries got fewer than {m.num_negatives} after "
                 f"the margin filter) -> {output}")
