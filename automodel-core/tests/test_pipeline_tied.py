"""A tied output head under pipeline parallelism (``automodel.training.parallel.pipeline_tied``): which keys keep the
tied weight frozen, the head's own weight before the cut (trainable or frozen), and the copy of the first stage's
embedding into the last stage's head on four gloo ranks (pp 2 x tp 2): shard to shard where both stages shard the
weight alike, the needed part of the whole embedding where they do not; a trained pair's gradients summed, and the
same refusal on both ends where only one trains or a trained pair is sharded apart. The training runs through the CLI
are in automodel-llm's ``test_pipeline_parallel*.py``.
"""

from __future__ import annotations

import pytest
import torch
from parallel_testing import WORKERS, launch_together
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.training.parallel.pipeline_tied import frozen_embedding_key, ties_head, untie_head


def _llama(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)


@pytest.mark.parametrize(("sections", "key"), [
    ({}, None),
    ({"peft": {"dim": 4}}, "peft"),
    ({"freeze": {"embeddings": True}}, "freeze.embeddings"),
    ({"freeze": {"embeddings": False, "patterns": ["*.q_proj.*"]}}, None),
    ({"freeze_config": {"freeze_embeddings": True}}, "freeze_config.freeze_embeddings"),
    ({"freeze_config": {"freeze_language_model": True}}, "freeze_config.freeze_language_model"),
    ({"freeze_config": {"freeze_vision_tower": True}}, None),
])
def test_the_keys_that_keep_the_tied_weight_frozen(sections, key):
    assert frozen_embedding_key(sections) == key  # a mapping: its get is what Config.get gives


@pytest.mark.parametrize("trainable", [True, False])
def test_untie_head_gives_the_head_a_copy_of_its_own_and_says_so_in_the_config(trainable):
    model = AutoModelForCausalLM.from_config(_llama(True))
    assert model.lm_head.weight is model.model.embed_tokens.weight and ties_head(model)
    assert untie_head(model, trainable)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.requires_grad is trainable
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.config.tie_word_embeddings is False and not ties_head(model)
    assert not untie_head(model)  # nothing tied any more


def test_the_last_stage_head_becomes_the_first_stage_embedding_on_four_ranks(tmp_path):
    cases = {"alike": ("shard0", "shard0", "none"), "apart": ("replicate", "shard0", "none"),
             "across": ("shard1", "shard0", "none"), "trained": ("shard0", "shard0", "both"),
             "trained_apart": ("replicate", "shard0", "both"), "one_trains": ("shard0", "shard0", "first")}
    (ranks,) = launch_together([("copy", 4, tmp_path, {"cases": cases})], timeout=300,
                               workers=WORKERS.with_name("pipeline_tied_workers.py"))
    for rank in ranks:
        for name in ("alike", "apart", "across", "trained"):
            assert rank[name]["weight"] == rank[name]["whole"], (name, rank[name])
        assert not rank["alike"]["trains"] and rank["trained"]["trains"]
        assert rank["trained"]["grad"] == [3.0]  # 1 + 2 on both stages: the one tied weight's gradient
        assert "shard it differently (the tensor-parallel plan)" in rank["trained_apart"]["error"]
        assert "first stage that weight trains and on the last is frozen" in rank["one_trains"]["error"]
