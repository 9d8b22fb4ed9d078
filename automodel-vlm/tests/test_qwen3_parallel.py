"""Qwen3-VL (dense, MoE) and Qwen3.5 (dense, MoE) under pipeline parallelism: their media layout is Qwen2-VL's (each
row's images of any size regrouped per row, the 3-D rope positions computed on the whole rows from the token types),
and Qwen3-VL's DeepStack feature maps (its vision tower's, added by the language model at the image positions after
each of its first layers) travel beside the hidden states to the stages holding those layers
(``automodel_vlm.deepstack``). In process: the stages chained on one-row micro-batches give the whole model's logits
and vision-tower gradients. On two gloo ranks (pp 2), and four (pp 2 x cp 2, Qwen3-VL): the recipe's pipelined step
(1F1B) has the losses and gradient norms of one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vlm_testing import assert_steps_like_one_process

FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def _chained(stages: list[Any], ids: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stages run one after the other as the schedule runs them: the first with the micro-batch's media, each
    later one on what the one before returned (the hidden states, then what travels beside them)."""
    later = {key: value for key, value in kwargs.items() if not key.startswith("media_")}
    output = stages[0](ids, **kwargs)
    for stage in stages[1:]:
        output = stage(*(output if isinstance(output, tuple) else (output,)), **later)
    return output


def _stages(model: torch.nn.Module, count: int, travel: bool = True) -> list[Any]:
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel_vlm.deepstack import travel_deepstack

    stages = [split_model(model, rank, count)[0] for rank in range(count)]
    for stage in stages if travel else ():
        travel_deepstack(stage)
    return stages


@pytest.mark.parametrize(("family", "count"), [("qwen3_vl", 2), ("qwen3_vl", 4), ("qwen3_vl_moe", 2),
                                               ("qwen3_5", 2), ("qwen3_5_moe", 2)])
def test_stages_run_one_row_micro_batches_like_the_whole_model(family, count):
    """Two stages (Qwen3-VL: layers 0-1 adding maps 0 and 1 on the first, map 2 sent to the second) or four (one
    layer each: map 1 and 2 sent on from the first, map 2 on from the second) on each one-row micro-batch of
    right-padded and of packed rows give the whole model's logits, and the loss's gradients of the vision tower's
    DeepStack mergers are the whole model's; without the maps travelling (the first stage's model adding them all
    after its placeholders) they are not."""
    from vlm_context_parallel_workers import micro_batches, tiny_model

    from automodel.training.parallel.pipeline_media import media_kwargs
    from automodel.training.pipeline_steps import padded_tokens, stage_kwargs
    from automodel_vlm.datasets.packing import rope_index
    from automodel_vlm.deepstack import deepstack_layers
    from automodel_vlm.pipeline import media_per_row, rope_positions

    model, processor = tiny_model(family)
    deepstack = deepstack_layers(model.config)
    assert deepstack == (3 if family.startswith("qwen3_vl") else 0)
    stages = _stages(model, count)
    if deepstack:
        assert [stage.beside.counts(stage) for stage in stages] == \
            ([(0, 1), (1, 0)] if count == 2 else [(0, 2), (2, 1), (1, 0), (0, 0)])
    padded, packed = micro_batches(processor, 1, 4)[0], micro_batches(processor, 1, 4, rope_index(model))[0]
    for batch in (padded, packed):
        pipelined = rope_positions(batch, model.config, rope_index(model))
        assert "mm_token_type_ids" not in pipelined and pipelined["position_ids"].dim() == 3
        kwargs = {**stage_kwargs(pipelined, 8), **media_kwargs(media_per_row(pipelined, model.config))}
        ids, _ = padded_tokens(pipelined, 8, 0)
        length = batch["input_ids"].shape[1]
        inputs = {key: value for key, value in batch.items() if key not in ("labels", "token_count")}
        whole = model(**inputs, use_cache=False).logits
        whole.sin().sum().backward()
        for row in range(2):
            row_kwargs = {key: value[row:row + 1] for key, value in kwargs.items()}
            logits = _chained(stages, ids[row:row + 1], row_kwargs)
            assert torch.allclose(logits[:, :length], whole[row:row + 1].detach(), atol=1e-5), row
            logits[:, :length].sin().sum().backward()
            if deepstack:
                with torch.no_grad():
                    without = _chained(_stages(model, count, travel=False), ids[row:row + 1], row_kwargs)
                assert not torch.allclose(without[:, :length], whole[row:row + 1].detach(), atol=1e-3)
        mergers = "model.visual.deepstack_merger_list" if deepstack else "model.visual.merger"
        for name, param in model.get_submodule(mergers).named_parameters():
            staged = stages[0].get_submodule(mergers).get_parameter(name)
            assert torch.allclose(staged.grad, param.grad, rtol=1e-4, atol=1e-5), name
        model.zero_grad(), stages[0].zero_grad()


@pytest.fixture(scope="module")
def pp_steps(tmp_path_factory) -> dict[str, Any]:
    """One process and pp 2 on two gloo ranks, launched together."""
    from parallel_testing import launch_together

    tmp = tmp_path_factory.mktemp("vlm_pp_qwen3")
    cp = {"cp": True}
    one, pp2, pp2_cp2, one_cp, cp2 = launch_together(
        [("vlm_pp_qwen3", 0, tmp / "one", {}), ("vlm_pp_qwen3", 2, tmp / "pp2", {}),
         ("vlm_pp_qwen3", 4, tmp / "pp2_cp2", {}), ("vlm_pp_qwen3", 0, tmp / "one_cp", cp),
         ("vlm_pp_qwen3", 2, tmp / "cp2", cp)],
        workers=Path(__file__).with_name("vlm_context_parallel_workers.py"), timeout=300)
    return {"one": {**one[0], **one_cp[0]}, "pp2": pp2, "pp2_cp2": pp2_cp2, "cp2": cp2}


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen3_vl_frozen"])
def test_pp2_steps_equal_one_process(pp_steps, family):
    """Three steps (rows without and with an image: the pipeline's first micro-batch has no maps, which still
    travel, as zeros needing a gradient like the others, or torch's stages would not send the later maps'
    gradients back; then right-padded rows, then packed rows), each of two micro-batches of two rows, through the
    recipe's pipelined step on two ranks (1F1B over one-row micro-batches; Qwen3-VL's map of layer 2 sent to the
    second stage; frozen: with the vision tower frozen, its maps sent as needing a gradient all the same, and static
    stage shapes): every rank's losses and gradient norms are one process's."""
    one = pp_steps["one"][family]
    for rank in pp_steps["pp2"]:
        assert rank[family]["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert rank[family]["norms"] == pytest.approx(one["norms"], rel=1e-5)


def test_validate_takes_a_qwen3_vl_under_pp(tmp_path):
    """``automodel validate`` reads the model's config and finds its media layout (before: refused, none known)."""
    from vlm_testing import write_config

    from automodel.testing import run_cli_inprocess

    text = {"num_hidden_layers": 4, "tie_word_embeddings": False}
    model = {"config": {"model_type": "qwen3_vl", "text_config": text, "tie_word_embeddings": False,
                        "vision_config": {"deepstack_visual_indexes": [0, 1, 2]}}}
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", model=model, eval_generation=None,
                          distributed={"strategy": "fsdp2", "pp_size": 2})
    result = run_cli_inprocess("validate", "-c", config, "--nproc-per-node", "4", "--distributed.cp_size", "2",
                               cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "valid for finetune vlm" in out, out


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_frozen"])
def test_pp2_x_cp2_splits_the_deepstack_maps_with_the_merged_embeddings(pp_steps, family):
    """pp 2 x cp 2 on four ranks: the first stage merges the images into the whole rows, scatters the DeepStack maps
    over them and splits both over its cp group, the second stage adds map 2 to its part; the three steps' losses
    and gradient norms are one process's (frozen: with static shapes of each rank's part)."""
    one = pp_steps["one"][family]
    for rank in pp_steps["pp2_cp2"]:
        assert rank[family]["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert rank[family]["norms"] == pytest.approx(one["norms"], rel=1e-5)


def test_cp2_alone_splits_the_deepstack_maps_with_the_merged_embeddings(pp_steps):
    """Context parallelism without a pipeline (the language model's pre-hook, ``SequenceSplit``): the DeepStack maps
    of the whole rows are scattered and split like the merged embeddings (before, the model indexed the rank's part
    with the whole rows' image mask and failed); two steps (right-padded, then packed rows) have one process's
    losses, gradient norms and vision-tower gradients."""
    one = pp_steps["one"]["qwen3_vl_cp"]
    for rank in pp_steps["cp2"]:
        ran = rank["qwen3_vl_cp"]
        assert_steps_like_one_process(ran, one)
