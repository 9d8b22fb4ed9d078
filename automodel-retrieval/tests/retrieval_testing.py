"""Helpers for the retrieval domain's tests: tiny configs in tmp_path pointing at the shipped assets.

Every run here is a few seconds on a CPU: a 2-layer, 64-wide BERT, a few hundred short texts, tens of steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from automodel import testing
from automodel.testing import OFFLINE, deep_update, write_yaml

for _name, _value in OFFLINE.items():
    os.environ.setdefault(_name, _value)

PKG_DIR = Path(importlib.util.find_spec("automodel_retrieval").submodule_search_locations[0])
DIST_DIR = PKG_DIR.parent.parent
ASSETS = PKG_DIR / "examples" / "assets"
DATA = ASSETS / "tiny_retrieval"
TOKENIZER_DIR = ASSETS / "tiny_tokenizer"
BERT_CONFIG = ASSETS / "tiny_bert" / "config.json"

_COMMON = {
    "step_scheduler": {"max_steps": 6, "grad_accumulation_steps": 1, "log_interval": 1, "num_epochs": 100},
    "rng": {"seed": 1234},
    "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER_DIR)},
    "dataloader": {"batch_size": 16},
    "clip_grad_norm": {"max_norm": 1.0},
    "optimizer": {"_target_": "torch.optim.AdamW", "lr": 2.0e-3, "weight_decay": 0.01},
    "lr_scheduler": {"_target_": "automodel.optim.CosineAnnealingWarmup", "warmup_steps": 5, "min_lr": 1.0e-5},
}

BI_ENCODER = {
    **_COMMON,
    "model": {"_target_": "automodel_retrieval.BiEncoder.from_config", "config": str(BERT_CONFIG),
              "pooling": "mean"},
    "dataset": {"path": str(DATA / "train.jsonl"), "num_negatives": 3},
    "validation_dataset": {"path": str(DATA / "validation.jsonl"), "corpus": str(DATA / "corpus.jsonl")},
    "retrieval": {"query_max_length": 32, "document_max_length": 48},
    "loss_fn": {"temperature": 0.05},
}

CROSS_ENCODER = {
    **_COMMON,
    "model": {"_target_": "automodel_retrieval.CrossEncoder.from_config", "config": str(BERT_CONFIG),
              "num_labels": 1},
    "dataset": {"path": str(DATA / "train.jsonl"), "num_negatives": 3},
    "validation_dataset": {"path": str(DATA / "validation.jsonl"), "num_negatives": 3},
    "retrieval": {"max_length": 64},
    "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3.0e-3, "weight_decay": 0.01},
}

ROUTES = {"bi": ("finetune", "retrieval"), "cross": ("finetune", "cross-encoder"), "mine": ("mine", "retrieval")}


def write_config(path: Path, base: dict, checkpoint_dir: Path | None = None, **sections: Any) -> Path:
    data = deep_update(base, sections)
    if checkpoint_dir is not None:
        data = deep_update(data, {"checkpoint": {"checkpoint_dir": str(checkpoint_dir)}})
    return write_yaml(path, data)


def load_config(kind: str, config: Path, *overrides: Any):
    return testing.load_config(config, *overrides, route=ROUTES[kind])[1]


def run_inprocess(kind: str, config: Path, *overrides: Any, before_run=None):
    """Validate and run a route's recipe in this process, as the CLI does; returns the recipe afterwards."""
    return testing.train_inprocess(config, *overrides, route=ROUTES[kind], before_run=before_run)


def latest(root: Path) -> Path:
    return Path(root) / (Path(root) / "LATEST").read_text().strip()


def encode_with_transformers(encoder_dir: Path, texts: list[str], pooling: str = "mean", max_length: int = 48):
    """Embeddings computed only with transformers (AutoModel + AutoTokenizer) and the pooling written out here,
    independently of the package's own code."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir))
    model = AutoModel.from_pretrained(str(encoder_dir)).eval()
    with torch.no_grad():
        batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        if pooling == "mean":
            pooled = (hidden * mask).sum(1) / mask.sum(1)
        else:
            pooled = hidden[:, 0]
        return F.normalize(pooled, dim=-1)


# ---- sentence-transformers comparisons ----------------------------------------------------------------

QUERIES = ["capital of Sikia", "currency of Borvania", "who rules Tessaly and since when"]
DOCUMENTS = ["Sikia's capital city is Zoranton, home to its royal court.",
             "Borvania pays with the florin, minted in its northern hills.", "Tessaly"]


def recipe_embeddings(recipe, side: str, texts: list[str]):
    """What the recipe computes (its collator: prefix, truncation; its model: pooling, normalisation)."""
    import torch

    collator = recipe.default_collate_fn(False)
    encode = collator.encode_queries if side == "query" else collator.encode_documents
    model = recipe.model.eval()
    with torch.no_grad():
        return model.encode(side, encode(texts))


def assert_same_embeddings(theirs, ours) -> None:
    import torch

    theirs = theirs.float().cpu()
    assert theirs.shape == ours.shape
    cosine = torch.nn.functional.cosine_similarity(theirs, ours, dim=-1)
    assert cosine.min() >= 1 - 1e-6, cosine
    assert torch.allclose(theirs.norm(dim=-1), ours.norm(dim=-1), rtol=1e-4)


def st_modules(directory) -> list[str]:
    return [m["type"].rsplit(".", 1)[-1] for m in json.loads((directory / "modules.json").read_text())]
