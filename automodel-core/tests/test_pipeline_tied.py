"""A tied output head under pipeline parallelism (``automodel.training.parallel.pipeline_tied``): which keys keep the
tied weight frozen, the refusal without one, the head's own frozen weight before the cut, and the copy of the first
stage's embedding into the last stage's head on four gloo ranks (pp 2 x tp 2): shard to shard where both stages
shard the weight alike, the needed part of the whole embedding where they do not, and the same refusal on both ends
where the weight trains. The training runs through the CLI are in automodel-llm's ``test_pipeline_parallel*.py``."""

from __future__ import annotations

import pytest
import torch
from parallel_testing import WORKERS, launch_together
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.training.parallel.pipeline_parallel import PipelineSettings, pp_issues
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
    ({"freeze_config": {"freeze_vision_tower": True}}, None),
])
def test_the_keys_that_keep_the_tied_weight_frozen(sections, key):
    assert frozen_embedding_key(sections) == key  # a mapping: its get is what Config.get gives


def test_a_tied_model_is_refused_on_a_pipeline_unless_its_embedding_is_frozen():
    settings = PipelineSettings.from_section({"pp_schedule": "gpipe"})
    (issue,) = pp_issues(_llama(True), 2, settings, 2)
    assert issue.key == "distributed.pp_size"
    assert "they stay one weight only while it does not train; freeze it (freeze.embeddings: true" in issue.message
    assert pp_issues(_llama(True), 2, settings, 2, frozen_embedding="freeze.embeddings") == []
    assert pp_issues(_llama(False), 2, settings, 2) == []


def test_untie_head_gives_the_head_a_frozen_copy_and_says_so_in_the_config():
    model = AutoModelForCausalLM.from_config(_llama(True))
    assert model.lm_head.weight is model.model.embed_tokens.weight and ties_head(model)
    assert untie_head(model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and not model.lm_head.weight.requires_grad
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.config.tie_word_embeddings is False and not ties_head(model)
    assert not untie_head(model)  # nothing tied any more


def test_the_last_stage_head_becomes_the_first_stage_embedding_on_four_ranks(tmp_path):
    cases = {"alike": ("shard0", "shard0", False), "apart": ("replicate", "shard0", False),
             "across": ("shard1", "shard0", False), "trains": ("shard0", "shard0", True)}
    (ranks,) = launch_together([("copy", 4, tmp_path, {"cases": cases})], timeout=300,
                               workers=WORKERS.with_name("pipeline_tied_workers.py"))
    for rank in ranks:
        for name in ("alike", "apart", "across"):
            assert rank[name]["weight"] == rank[name]["whole"], (name, rank[name])
        assert "but that weight trains here, so the two would drift apart" in rank["trains"]["error"]
