"""Pipeline parallelism: pp=2 on two gloo ranks with GPipe (two batches accumulated per step), 1F1B, interleaved
1F1B and looped BFS (two stages per rank), pp=2 x dp=2 (FSDP2), pp=2 x tp=2 and pp=2 x cp=2 on four, against one
process (six AdamW steps of the engine's token-weighted loss); how the model is cut; a rank's stages as one module;
``pp_issues`` with the numbers."""

from __future__ import annotations

import pytest
import torch
from model_parallel_workers import assert_like_one_process, mp_config
from parallel_workers import local_model, meta_model

from automodel.errors import AutomodelError
from automodel.training.linear_ce import LinearCrossEntropy, LinearLossHead
from automodel.training.loss import MaskedCrossEntropy
from automodel.training.next_token import next_targets
from automodel.training.parallel.blocks import LayerPlaceholder, transformer_blocks
from automodel.training.parallel.pipeline_parallel import PipelineSettings, pp_issues
from automodel.training.parallel.pipeline_stages import (
    LocalStages,
    split_model,
    stage_indices,
    stage_layer_ranges,
    stages_of,
)


@pytest.fixture(scope="module")
def runs(model_parallel_ranks):
    return model_parallel_ranks


@pytest.mark.parametrize(("schedule", "layers"), [
    ("gpipe", [[[0, 1]], [[2, 3]]]),
    ("1f1b", [[[0, 1]], [[2, 3]]]),
    ("interleaved1f1b", [[[0], [2]], [[1], [3]]]),
    ("loopedbfs", [[[0], [2]], [[1], [3]]]),
])
def test_pp2_losses_and_grad_norms_equal_one_process(runs, schedule, layers):
    ranks = [rank[f"pp_{schedule}"] for rank in runs["two"]]
    assert [rank["layers"] for rank in ranks] == layers
    assert_like_one_process(ranks, runs["untied"])  # the last stage's loss reaches every rank; norms of both stages


def test_static_stage_shapes_skip_the_shape_finding_pass_and_train_like_one_process(runs):
    """pp=2 GPipe (two batches a step) with the stages given static shapes of each batch's own length (upstream's
    ``distributed.pipeline.dtype`` without ``pp_seq_len``): torch ran them in its STATIC mode (no forward and
    backward on the first batch to find the shapes), the run equals one process."""
    ranks = [rank["pp_static"] for rank in runs["two"]]
    assert [rank["modes"] for rank in ranks] == [["STATIC"], ["STATIC"]]
    assert [rank["modes"] for rank in (run["pp_gpipe"] for run in runs["two"])] == [["DYNAMIC"], ["DYNAMIC"]]
    assert_like_one_process(ranks, runs["untied"])


def test_fused_linear_cross_entropy_through_the_pipeline_trains_like_the_masked_loss(runs):
    """pp=2 GPipe with static shapes and FusedLinearCrossEntropy (chunk_len 5): the last stage returns its final
    hidden states (its static output shape) and the schedule's loss projects them through the output head chunk by
    chunk; losses, gradient norms and final weights (the head's among them) are those of MaskedCrossEntropy through
    the pipeline and of one process."""
    fused, masked = ([rank[name] for rank in runs["two"]] for name in ("pp_fused", "pp_static"))
    assert [rank["modes"] for rank in fused] == [["STATIC"], ["STATIC"]]
    assert_like_one_process(fused, runs["untied"])
    assert fused[0]["losses"] == pytest.approx(masked[0]["losses"], rel=1e-5)
    weights = {name: value for rank in fused for name, value in rank["weights"].items()}
    assert "lm_head.weight" in weights and set(weights) == set(runs["untied_state"])
    for name, value in weights.items():
        torch.testing.assert_close(torch.tensor(value), runs["untied_state"][name], rtol=0, atol=1e-5)
        other = next(rank["weights"][name] for rank in masked if name in rank["weights"])
        torch.testing.assert_close(torch.tensor(value), torch.tensor(other), rtol=0, atol=1e-5)


def test_the_last_stage_gives_the_fused_loss_hidden_states_it_caps_and_chunks_like_one_process():
    """With ``head_in_loss`` the last stage returns its final hidden states; the loss projects them through its head
    (logit_softcapping 3, chunk_len 5 of 64 rows) with the loss and the gradients (the head's, the first stage's
    embedding's) of the whole model's soft-capped logits under MaskedCrossEntropy."""
    from model_parallel_workers import lm_batch

    model = local_model(mp_config(tied=False))
    (first,), (last,) = split_model(model, 0, 2), split_model(model, 1, 2)
    last.head_in_loss = True
    head = LinearLossHead.attach(last, LinearCrossEntropy(logit_softcapping=3.0, chunk_len=5), last.output_head)
    ids, labels = lm_batch(0)
    hidden = last(first(ids))
    assert hidden.shape == (*ids.shape, mp_config().hidden_size)
    head.summed(hidden, next_targets(labels)).backward()
    logits = 3.0 * torch.tanh(model(input_ids=ids).logits / 3.0)
    expected = MaskedCrossEntropy()(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    expected.backward()
    found = head.summed(hidden.detach(), next_targets(labels))
    torch.testing.assert_close(found, expected.detach())
    torch.testing.assert_close(last.lm_head.weight.grad, model.lm_head.weight.grad)
    torch.testing.assert_close(first.model.embed_tokens.weight.grad, model.model.embed_tokens.weight.grad)


@pytest.mark.parametrize("name", ["pp2_dp2", "pp2_tp2", "pp2_tp2_fused"])
def test_pp2_x_dp2_and_pp2_x_tp2_equal_one_process(runs, name):
    """dp=2 against one process with doubled accumulation; tp=2 (sequence parallel) inside interleaved stages, also
    with FusedLinearCrossEntropy (the last stage's head, vocabulary-sharded, applied by the schedule's loss)."""
    assert_like_one_process([rank[name] for rank in runs["four"]], runs["untied"])


@pytest.mark.parametrize(("name", "modes"), [("pp2_cp2", ["DYNAMIC"]), ("pp2_cp2_static", ["STATIC", "STATIC"])])
def test_pp2_x_cp2_trains_like_one_process(runs, name, modes):
    """Each batch split over the cp ranks before the schedule, each stage's attention gathered over its cp group
    (the checkpointed blocks' recomputation in backward back in its micro-batch's region), FSDP2 over the cp ranks;
    1F1B finding its shapes, interleaved with static shapes of each rank's part: the losses, gradient norms and
    final weights of one process; validation through the pipeline (whole sequences) the first step's loss."""
    ranks = [rank[name] for rank in runs["four"]]
    assert [rank["modes"] for rank in ranks] == [modes] * 4
    assert_like_one_process(ranks, runs["untied"])
    assert [rank["evaluated"] for rank in ranks] == pytest.approx([runs["untied"]["losses"][0]] * 4, rel=1e-5)
    weights = {key: value for rank in ranks for key, value in rank["weights"].items()}
    assert set(weights) == set(runs["untied_state"])
    for key, value in weights.items():
        torch.testing.assert_close(torch.tensor(value), runs["untied_state"][key], rtol=0, atol=1e-5)


def test_the_gradients_of_a_steps_micro_batches_are_reduced_once_with_the_parameters_kept_gathered(runs):
    """pp=2 x dp=2, two pipeline runs per step: FSDP2 reduce-scatters after the second only (the sharded parameters
    have no gradient after the first) and keeps the parameters gathered in between; the step equals one process."""
    ranks = [rank["pp2_dp2_deferred"] for rank in runs["four"]]
    assert_like_one_process(ranks, runs["untied"])
    seen = [entry for rank in ranks for entry in rank["deferred"]]
    assert len(seen) == 4 * 6 and all(not entry["reduced"] and entry["gathered"] for entry in seen)


def test_stages_keep_the_whole_models_names():
    model = meta_model(mp_config(tied=False))
    full = set(model.state_dict())
    first, = split_model(meta_model(mp_config(tied=False)), 0, 2)
    last, = split_model(meta_model(mp_config(tied=False)), 1, 2)
    assert set(first.state_dict()) | set(last.state_dict()) == full
    assert not set(first.state_dict()) & set(last.state_dict())
    assert "model.embed_tokens.weight" in first.state_dict() and "lm_head.weight" in last.state_dict()
    assert "model.norm.weight" in last.state_dict() and "model.norm.weight" not in first.state_dict()
    assert isinstance(first.model.layers[3], LayerPlaceholder) and isinstance(first.model.norm, LayerPlaceholder)
    assert isinstance(last.model.layers[0], LayerPlaceholder) and last.model.embed_tokens is None
    assert len(transformer_blocks(last)) == 2  # FSDP2 units and checkpointing regions: the stage's own layers
    assert "model.rotary_emb.inv_freq" in dict(last.named_buffers())  # every stage computes rotary embeddings
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)


def test_a_ranks_stages_are_one_module_under_the_models_names():
    """Rank 0 of pp=2 with two stages each holds stages 0 and 2: their tensors (the same objects) under the model's
    names, the layers of other ranks' stages as placeholders."""
    stages = split_model(meta_model(mp_config(tied=False)), 0, 2, stages_per_rank=2)
    local = LocalStages(stages)
    assert stages_of(local) == stages and stages_of(stages[0]) == [stages[0]]
    assert local.state_dict(keep_vars=True) == {**stages[0].state_dict(keep_vars=True),
                                                **stages[1].state_dict(keep_vars=True)}
    assert "model.embed_tokens.weight" in local.state_dict() and "lm_head.weight" not in local.state_dict()
    assert isinstance(local.model.layers[1], LayerPlaceholder) and local.model.layers[2] is stages[1].model.layers[2]
    assert local.config is stages[0].config
    local.eval()
    assert not any(module.training for stage in stages for module in stage.modules())


def test_stage_layer_split():
    assert stage_layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layer_ranges(8, 4)[3] == range(6, 8)
    assert stage_indices(1, 2, 3) == [1, 3, 5]
    with pytest.raises(AutomodelError, match="4 pipeline stages for 3 layers"):
        stage_layer_ranges(3, 4)
    with pytest.raises(AutomodelError, match="ties its output head"):
        split_model(meta_model(mp_config(tied=True)), 0, 2)
    with pytest.raises(AutomodelError, match="the model factory returned a LoRA .peft. model"):
        split_model(meta_model(mp_config(tied=False), lora=True), 0, 2)


def test_lora_on_a_stage_adapts_what_one_process_would_under_its_names():
    """``all-linear`` resolved on the whole model: the last stage's head gets no adapter, each stage's adapters
    carry the one model's peft names, and the plain PeftModel passes the stage's positional input through."""
    import peft

    from automodel.hf import apply_lora
    from automodel.lora_targets import all_linear_targets
    from automodel.training.parallel.pipeline_stages import is_stage

    whole = meta_model(mp_config(tied=False))
    one = peft.get_peft_model(meta_model(mp_config(tied=False)), peft.LoraConfig(r=4, target_modules="all-linear",
                                                                                 task_type="CAUSAL_LM"))
    names = set()
    for stage in split_model(whole, 1, 2) + split_model(whole, 0, 2):
        config = all_linear_targets(peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"), whole)
        assert "lm_head" not in config.target_modules and "model.layers.0.mlp.up_proj" in config.target_modules
        wrapped, line = apply_lora(stage, config, plain=True)
        assert type(wrapped) is peft.PeftModel and is_stage(wrapped) and not is_stage(whole)
        names |= {name for name, _ in wrapped.named_parameters() if "lora_" in name}
        assert wrapped.index == stage.index and "parameters train" in line
    assert names == {name for name, _ in one.named_parameters() if "lora_" in name}


def test_the_peft_stage_resolves_a_glob_on_the_whole_model_and_names_a_stage_without_targets():
    from types import SimpleNamespace

    from automodel.hf import PeftConfig
    from automodel.training.stages.peft import add_lora

    whole = meta_model(mp_config(tied=False))
    ctx = SimpleNamespace(instantiate=lambda key: PeftConfig(target_modules=["*.layers.3.*_proj"], dim=4))
    (last,) = split_model(whole, 1, 2)
    wrapped, line = add_lora(ctx, last)
    assert "(pipeline stage 1)" in line
    adapted = {name.split(".lora_")[0] for name, _ in wrapped.named_parameters() if "lora_A" in name}
    assert adapted and all(".layers.3." in name for name in adapted)
    (first,) = split_model(whole, 0, 2)
    with pytest.raises(AutomodelError, match="pipeline stage 0 holds layers 0-1: under pipeline parallelism every "
                                             "stage needs a module LoRA adapts"):
        add_lora(ctx, first)


def test_upstream_settings():
    settings = PipelineSettings(pp_schedule="Interleaved_1F1B", layers_per_stage=2)
    assert settings.schedule == "interleaved1f1b" and settings.num_stages(8, 2) == 4
    assert PipelineSettings().schedule == "1f1b" and PipelineSettings().pp_microbatch_size == 1
    assert PipelineSettings(layers_per_stage=3, round_virtual_stages_to_pp_multiple="up").num_stages(8, 2) == 4
    assert PipelineSettings(layers_per_stage=3, round_virtual_stages_to_pp_multiple="down").num_stages(8, 2) == 2


def _messages(pp_size, batch=8, config=None, **settings):
    return [(issue.key, issue.message) for issue in pp_issues(config or mp_config(tied=False), pp_size,
                                                               PipelineSettings(**settings), batch)]


@pytest.mark.parametrize(("pp", "settings", "batch", "key", "words"), [
    (8, {}, 8, "distributed.pp_size", "8 ranks x 1 stages each = 8 stages, but the model has 4 layers"),
    (2, {"pp_microbatch_size": 3}, 8, "distributed.pipeline.pp_microbatch_size",
     "3 does not divide the 8 rows each data-parallel rank feeds"),
    (2, {"pp_microbatch_size": 8}, 8, "distributed.pipeline.pp_microbatch_size",
     "8 makes 1 micro-batches of the 8 rows, but 1f1b needs at least one per stage (2)"),
    (2, {"pp_schedule": "interleaved1f1b", "layers_per_stage": 1}, 8, "distributed.pipeline.layers_per_stage",
     None),
    (2, {"pp_schedule": "zero_bubble"}, 8, "distributed.pipeline.pp_schedule", "'zero_bubble' is not supported"),
    (2, {"layers_per_stage": 1}, 8, "distributed.pipeline.layers_per_stage",
     "1 layers per stage make 4 stages, but 1f1b runs one stage per rank (2)"),
    (2, {"layers_per_stage": 0}, 8, "distributed.pipeline.layers_per_stage", "must be a positive integer, found 0"),
])
def test_pp_layouts_are_checked_with_the_numbers(pp, settings, batch, key, words):
    found = _messages(pp, batch, **settings)
    if words is None:
        assert found == []
        return
    assert [k for k, _ in found] == [key], found
    assert words in found[0][1]


def test_interleaved_stages_split_the_layers_as_upstream():
    """``layers_per_stage`` decides how many stages (upstream's rule: the layers then split as evenly as they go,
    so 6 layers make stages of 2, 2, 1, 1); interleaved schedules need two stages per rank at least."""
    config = mp_config(tied=False)
    config.num_hidden_layers = 6
    assert _messages(2, 8, config, pp_schedule="interleaved1f1b") == []
    assert stage_layer_ranges(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert _messages(2, 8, config, pp_schedule="interleaved1f1b", layers_per_stage=2,
                     round_virtual_stages_to_pp_multiple="up") == []  # 3 stages rounded up to 4
    found = _messages(2, 8, config, pp_schedule="interleaved1f1b", layers_per_stage=3)
    assert found == [("distributed.pipeline.layers_per_stage", "3 layers per stage make 2 stages, 1 per rank over "
                      "pp_size 2, but interleaved1f1b runs at least 2 stages per rank (upstream's rule); use "
                      "layers_per_stage 1 or lower")]


def test_models_without_a_pipeline_plan_are_refused_and_tied_embeddings_are_not():
    assert _messages(2, 8, mp_config(tied=True)) == []  # the last stage gets a copy (pipeline_tied)
    from transformers import GPT2Config

    (key, message), = _messages(2, 8, GPT2Config(tie_word_embeddings=False))
    assert "has no pipeline plan" in message
    assert _messages(1, 8, mp_config(tied=True)) == []  # pp_size 1: nothing to cut


def test_static_shapes_follow_the_runs_precision():
    """The hidden states in FSDP2's output_dtype, else the compute dtype of the parameters (autocast leaves the
    residual stream alone); the logits in the head's matmul dtype; meta examples of a micro-batch per stage."""
    import torch

    from automodel.training.parallel.pipeline_static import StaticShapes, activations_dtype, logits_dtype
    from automodel.training.parallel.precision import Precision

    bf16, fp32 = torch.bfloat16, torch.float32
    assert activations_dtype(Precision(), fp32) == fp32 and activations_dtype(Precision(), None) is None
    assert activations_dtype(Precision(bf16), fp32) == bf16
    assert activations_dtype(Precision(bf16, fp32, fp32), fp32) == fp32  # output_dtype fp32 casts the outputs
    assert activations_dtype(Precision(autocast_dtype=bf16), fp32) == fp32
    assert logits_dtype(Precision(autocast_dtype=bf16), fp32, head_fp32=False) == bf16
    assert logits_dtype(Precision(bf16), fp32, head_fp32=True) == fp32
    assert logits_dtype(Precision(bf16), fp32, head_fp32=False) == bf16
    shapes = StaticShapes(128, 32, 96, bf16, fp32)
    first, middle, last = (type("Stage", (), {"is_first": i == 0, "is_last": i == 2}) for i in range(3))
    examples = [shapes.examples(stage, 2) for stage in (first, middle, last)]
    assert [(tuple(e["input_args"].shape), e["input_args"].dtype) for e in examples] == [
        ((2, 128), torch.long), ((2, 128, 32), bf16), ((2, 128, 32), bf16)]
    assert [(tuple(e["output_args"].shape), e["output_args"].dtype) for e in examples] == [
        ((2, 128, 32), bf16), ((2, 128, 32), bf16), ((2, 128, 96), fp32)]
    assert all(e["output_args"].device.type == "meta" and e["output_args"].requires_grad for e in examples)
    split = StaticShapes(128, 32, 96, bf16, fp32, cp=2)  # context parallelism: each rank's part of the sequences
    assert [tuple(split.examples(stage, 2)["output_args"].shape) for stage in (first, last)] == [(2, 64, 32),
                                                                                                (2, 64, 96)]
    assert "token ids [2, 64]" in split.describe(2) and "cp 2" in split.describe(2)


def test_every_stage_gets_packed_rows_position_ids_and_other_rows_their_padded_mask():
    """Packed rows (position ids, no mask) keep their position ids, the padding a segment of its own; other rows get
    their mask with the padding masked out; multi-axis positions (rows first) restart on every axis."""
    from automodel.training.pipeline_steps import stage_kwargs

    ids = torch.zeros(2, 4, dtype=torch.long)
    packed = stage_kwargs({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 0]])}, 2)
    assert set(packed) == {"position_ids"}
    assert packed["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 2, 0, 0, 1]]
    masked = stage_kwargs({"input_ids": ids, "attention_mask": torch.ones(2, 4, dtype=torch.long)}, 1)
    assert set(masked) == {"attention_mask"} and masked["attention_mask"].tolist() == [[1, 1, 1, 1, 0]] * 2
    axes = stage_kwargs({"input_ids": ids, "position_ids": torch.zeros(2, 4, 4, dtype=torch.long)}, 2)
    assert axes["position_ids"].shape == (2, 4, 6) and axes["position_ids"][:, :, 4:].tolist() == [[[0, 1]] * 4] * 2
