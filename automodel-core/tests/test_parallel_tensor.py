"""Tensor and sequence parallelism: tp=2 on two gloo ranks and dp=2 x tp=2 (FSDP2) on four against one process
(six AdamW steps of the engine's token-weighted loss), the plan from the model's own ``tp_plan`` or the registry,
the sequence-parallel styles, and ``tp_issues`` with the numbers.

The distributed runs come from ``model_parallel_workers.scenario_two`` / ``scenario_four`` (one launch each)."""

from __future__ import annotations

import pytest
import torch
from model_parallel_workers import SEQ, assert_like_one_process, mp_config, qwen3_config
from parallel_workers import meta_model
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from automodel.errors import AutomodelError
from automodel.training.parallel.tensor_parallel import describe_plan, tp_issues
from automodel.training.parallel.tp_plans import (
    STYLES,
    LayerSequenceBoundary,
    OwnOutput,
    ReplicateWithGradSum,
    SequenceLayout,
    TPPlanRegistry,
    config_plan,
    expand_plan,
    model_plan,
    sequence_parallel_entries,
    torch_styles,
)


@pytest.fixture(scope="module")
def runs(model_parallel_ranks):
    return model_parallel_ranks


@pytest.mark.parametrize("name", ["tp", "tp_sp"])
def test_tp2_losses_and_grad_norms_equal_one_process(runs, name):
    assert_like_one_process([rank[name] for rank in runs["two"]], runs["tied"])  # one loss for the tp group


@pytest.mark.parametrize("name", ["dp2_tp2", "dp2_tp2_sp"])
def test_dp2_x_tp2_equals_one_process_with_doubled_accumulation(runs, name):
    ranks = [rank[name] for rank in runs["four"]]
    assert_like_one_process(ranks, runs["tied"])
    assert ranks[0]["q_proj"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]  # FSDP2 over dp on top of TP


def test_per_head_norms_sum_their_gradients_over_the_tp_ranks(runs):
    """Qwen3's q_norm / k_norm ('replicated_with_grad_allreduce') see each rank's heads only."""
    assert_like_one_process([rank["tp_qwen3"] for rank in runs["two"]], runs["qwen3"], steps=3)


def test_sequence_parallel_norms_run_on_half_the_sequence(runs):
    assert runs["two"][0]["tp"]["norm_sequence"] == SEQ
    assert runs["two"][0]["tp_sp"]["norm_sequence"] == SEQ // 2
    assert runs["four"][0]["dp2_tp2_sp"]["norm_sequence"] == SEQ // 2


def test_the_head_is_vocabulary_parallel_and_stays_tied(runs):
    result = runs["two"][0]["tp"]
    assert result["vocab_parallel"] and result["tied"] and result["q_proj"] == ["Shard(dim=0)"]
    assert "  model.layers.*.mlp.down_proj: rowwise (row-wise: input features sharded, output all-reduced) x 4" \
        in result["plan"]
    assert runs["two"][0]["tp_sp"]["plan"][0] == "tensor parallel over tp 2, sequence parallel, " \
                                                "vocabulary-parallel loss"


def test_the_models_own_plan_is_used_and_a_registered_plan_replaces_it():
    model = meta_model(mp_config())
    own = expand_plan(model_plan(model), model)
    assert own["model.layers.3.self_attn.q_proj"] == "colwise" and own["lm_head"] == "colwise_gather_output"
    assert own["model.embed_tokens"] == "embedding_rowwise"
    registry = TPPlanRegistry()
    registry.register("llama", {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"})
    assert "llama" in registry
    replaced = expand_plan(model_plan(model, registry), model)
    assert sorted(replaced) == sorted(f"model.layers.{i}.mlp.{p}" for i in range(4) for p in ("up_proj", "down_proj"))


def test_bad_plans_are_refused():
    registry = TPPlanRegistry()
    with pytest.raises(AutomodelError, match="unknown styles packed_colwise"):
        registry.register("mine", {"layers.*.qkv": "packed_colwise"})
    model = meta_model(mp_config())
    with pytest.raises(AutomodelError, match="'model.layers.*.attn.qkv', which matches no module"):
        expand_plan({"model.layers.*.attn.qkv": "colwise"}, model)
    assert expand_plan({"model.layers.*.attn.qkv": "colwise"}, model, require_all=False) == {}
    model.config.base_model_tp_plan = None
    model._tp_plan = {}
    with pytest.raises(AutomodelError, match="has no tensor-parallel plan"):
        model_plan(model, TPPlanRegistry())


def test_lora_layers_shard_the_adapter_matrix_that_shares_the_base_layers_sharded_dimension():
    import peft

    from automodel.training.parallel.tensor_parallel import _with_lora_layers
    from automodel.training.parallel.tp_plans import expand_plan, model_plan

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], task_type="CAUSAL_LM")
    base = peft.get_peft_model(meta_model(mp_config()), lora).get_base_model()
    concrete = _with_lora_layers(base, expand_plan(model_plan(base), base))
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    adapted = [name for name, module in base.named_modules() if name.endswith(("q_proj", "o_proj"))
               and hasattr(module, "lora_A")]
    assert q in adapted and o in adapted and q not in concrete and o not in concrete
    assert concrete[f"{q}.base_layer"] == concrete[f"{q}.lora_B.default"] == "colwise"  # output features sharded
    assert concrete[f"{o}.base_layer"] == concrete[f"{o}.lora_A.default"] == "rowwise"  # input features sharded
    assert f"{q}.lora_A.default" not in concrete and f"{o}.lora_B.default" not in concrete  # replicated


def test_lora_layers_of_gathering_and_splitting_styles_shard_the_adapter_matrix_of_that_side():
    import peft
    from transformers import Phi3Config, Phi3ForCausalLM

    from automodel.training.parallel.tensor_parallel import _with_lora_layers
    from automodel.training.parallel.tp_plans import expand_plan, model_plan

    config = Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, pad_token_id=0,
                        num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        model = Phi3ForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj"], task_type="CAUSAL_LM")
    base = peft.get_peft_model(model, lora).get_base_model()
    concrete = _with_lora_layers(base, expand_plan(model_plan(base), base))
    qkv, o = "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"
    assert concrete[f"{qkv}.base_layer"] == concrete[f"{qkv}.lora_B.default"] == "colwise_gather_output"
    assert concrete[f"{o}.base_layer"] == concrete[f"{o}.lora_A.default"] == "rowwise_split_input"
    assert f"{qkv}.lora_A.default" not in concrete and f"{o}.lora_B.default" not in concrete  # replicated


def test_style_names_map_to_torch_styles():
    styles = torch_styles({"a": "colwise", "b": "rowwise_split_input", "c": "embedding_rowwise", "d": "replicate",
                           "e": "colwise_gather_output", "f": "replicated_with_grad_allreduce"},
                          vocab_parallel_head="e")
    assert "d" not in styles
    assert isinstance(styles["a"], ColwiseParallel) and styles["a"].output_layouts == (Shard(-1),)
    assert isinstance(styles["b"], RowwiseParallel) and styles["b"].input_layouts == (Replicate(),)
    embedding = styles["c"]  # its output a tensor of its own (a compiled first block takes no view of a DTensor)
    assert isinstance(embedding, OwnOutput) and isinstance(embedding.style, RowwiseParallel)
    assert embedding.style.output_layouts == (Replicate(),)
    assert styles["e"].output_layouts == (Shard(-1),) and not styles["e"].use_local_output  # logits stay DTensors
    assert torch_styles({"e": "colwise_gather_output"})["e"].output_layouts == (Replicate(),)
    # an inner projection of a head style (Phi-3's qkv_proj) gathers its output even when the head's logits do not
    inner = torch_styles({"qkv": "colwise_gather_output", "lm_head": "colwise_gather_output"}, "lm_head")
    assert inner["qkv"].output_layouts == (Replicate(),) and inner["qkv"].use_local_output
    assert inner["lm_head"].output_layouts == (Shard(-1),)
    assert isinstance(styles["f"], ReplicateWithGradSum)
    assert {"colwise_rep", "local_colwise", "gather", "sequence_parallel"} <= set(STYLES)  # transformers 4.x names


def test_sequence_parallel_styles_of_a_stage():
    model = meta_model(mp_config())
    plan = expand_plan(model_plan(model), model)
    layers = [(f"model.layers.{i}", model.model.layers[i]) for i in range(4)]
    entries = sequence_parallel_entries(plan, layers)
    assert isinstance(entries["model.layers.2.input_layernorm"], SequenceParallel)
    assert isinstance(entries["model.layers.2.self_attn"], SequenceLayout)
    assert entries["model.layers.2.self_attn"].target == Replicate()  # gathered into the attention
    assert entries["model.layers.2.mlp.down_proj"].output_layouts == (Shard(1),)  # reduce-scattered back
    boundaries = [(e.split_input, e.gather_output) for e in (entries[f"model.layers.{i}"] for i in range(4))]
    assert boundaries == [(True, False), (False, False), (False, False), (False, True)]
    assert all(isinstance(entries[f"model.layers.{i}"], LayerSequenceBoundary) for i in range(4))


@pytest.mark.parametrize(("tp", "sp", "words"), [
    (3, False, "3 does not divide the model's attention heads (num_attention_heads = 4)"),
    (4, False, "4 does not divide the model's key/value heads (num_key_value_heads = 2)"),
    (5, False, "5 does not divide the model's vocabulary size (vocab_size = 96)"),
    (3, False, "3 does not divide the model's MLP intermediate size (intermediate_size = 64)"),
])
def test_tp_size_is_checked_against_the_model_with_the_numbers(tp, sp, words):
    messages = [issue.message for issue in tp_issues(mp_config(), tp, sp)]
    assert any(words in message for message in messages), messages
    assert all(issue.key == "distributed.tp_size" for issue in tp_issues(mp_config(), tp, sp))


def test_a_towers_own_plan_is_checked_too():
    """Gemma 4's vision tower has a plan of its own, which transformers gathers into the model's: tp_size must divide
    its heads as well (a tiny tower of 2 heads over tp 4 crashed in its first forward: a view of a quarter head)."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    text = Gemma4TextConfig(num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, vocab_size=96,
                            hidden_size=32, head_dim=8).to_dict()
    vision = Gemma4VisionConfig(num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                hidden_size=16).to_dict()
    config = Gemma4Config(text_config=text, vision_config=vision)
    messages = [issue.message for issue in tp_issues(config, 4)]
    assert messages == ["4 does not divide the vision tower's attention heads (vision_config.num_attention_heads = 2), "
                        "which its own plan shards too; use a tp_size that divides 2",
                        "4 does not divide the vision tower's key/value heads (vision_config.num_key_value_heads = "
                        "2), which its own plan shards too; use a tp_size that divides 2"]
    assert tp_issues(config, 2) == []


def test_good_tp_sizes_pass_and_models_without_a_plan_are_refused():
    assert tp_issues(mp_config(), 2, True) == [] and tp_issues(mp_config(), 1) == []
    assert tp_issues(qwen3_config(), 2) == []
    from transformers import GPT2Config

    (issue,) = tp_issues(GPT2Config(), 2)
    assert "(gpt2) has no tensor-parallel plan" in issue.message
    registry = TPPlanRegistry()
    registry.register("gpt2", {"transformer.h.*.mlp.c_fc": "colwise"})
    assert tp_issues(GPT2Config(), 2, registry=registry) == []


def test_unsupported_styles_are_refused_with_their_modules():
    config = mp_config()
    config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.self_attn.q_proj": "colwise"}
    (issue,) = tp_issues(config, 2)  # a packed projection outside experts kept whole (Phi-3's fused gate_up_proj)
    assert "styles not supported here: layers.*.mlp.gate_up_proj (packed_colwise)" in issue.message


def test_a_mixture_of_experts_plan_keeps_the_experts_whole():
    """transformers' experts entries (``moe_tp_experts`` with ``packed_colwise`` / ``rowwise`` weights) leave the
    experts whole on every rank: the weights' entries go, the module's style shards nothing."""
    config = mp_config()
    config.base_model_tp_plan = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                                 "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts",
                                 "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    assert tp_issues(config, 2) == []
    assert config_plan(config) == {"layers.*.mlp.experts": "moe_tp_experts", "layers.*.self_attn.q_proj": "colwise",
                                   "layers.*.self_attn.o_proj": "rowwise"}
    assert torch_styles({"model.layers.0.mlp.experts": "moe_tp_experts"}) == {}
    (issue,) = tp_issues(config, 2, sequence_parallel=True)
    assert "their experts stay whole on every tensor-parallel rank" in issue.message


def test_a_dense_model_of_a_family_whose_plan_also_shards_experts_is_split_without_those_entries():
    """Gemma 4's one plan covers its dense and its mixture-of-experts variants; a dense model has no experts module,
    so the entries for them shard nothing."""
    from transformers import Gemma4TextConfig

    sizes = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32,
             "intermediate_size": 64, "vocab_size": 256, "num_hidden_layers": 2}
    dense = Gemma4TextConfig(**sizes)
    assert any("experts" in pattern for pattern in dense.base_model_tp_plan) and tp_issues(dense, 2) == []
    moe = Gemma4TextConfig(**sizes, enable_moe_block=True, num_experts=4, moe_intermediate_size=16, top_k_experts=2)
    assert config_plan(moe)["layers.*.experts"] == "moe_tp_experts" and "layers.*.experts" not in config_plan(dense)
    model = meta_model(dense)
    concrete = expand_plan(model_plan(model), model)  # every remaining entry names a module of the dense model
    assert concrete["model.layers.1.mlp.down_proj"] == "rowwise" and not any("experts" in n for n in concrete)


def test_the_plan_description_folds_layers():
    lines = describe_plan({"model.layers.0.mlp.up_proj": "colwise", "model.layers.1.mlp.up_proj": "colwise",
                           "lm_head": "colwise_gather_output"}, 2, False, True)
    assert lines == ["tensor parallel over tp 2, vocabulary-parallel loss",
                     "  model.layers.*.mlp.up_proj: colwise (column-wise: output features sharded) x 2",
                     "  lm_head: colwise_gather_output "
                     "(column-wise, output gathered (the head: vocabulary-parallel logits))"]
