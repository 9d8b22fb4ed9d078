"""Context parallelism (``distributed.cp_size > 1``) in the VLM recipe: the sequence is split after the multimodal
merge (``automodel_vlm.context_parallel``).

On CPU gloo ranks (``vlm_context_parallel_workers.py``, with the all-gather attention: torch's ring attention has no
CPU kernel) the recipe's context-parallel step over 2 ranks gives one process's losses, gradient norms, vision-tower
gradients and weights for a tiny Llava (CLIP + Llama) and a tiny Qwen2-VL (multi-axis rope positions, pictures of
three sizes), on right-padded and on packed rows; so does the Qwen2-VL with its vision tower's frames split over the
ranks (``distributed.multimodal.vision.frame_sharding``; and a Qwen3-VL tower's, a video's frames cut between them);
and a tiny Gemma 3 (each image's tokens attend to each other both ways; a sliding-window layer) and a tiny Gemma 4
(the same on its sliding-window layers only) on right- and left-padded rows. ``automodel validate`` accepts cp_size 2
where the device is CUDA and refuses, with the reason, what the path cannot run; on two GPUs the CLI trains like one
process and its model/ loads with transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vlm_testing import assert_steps_like_one_process, training_column, write_config

from automodel.cli.main import main
from automodel.testing import free_port, run_cli

CP2 = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2", "--distributed.cp_size", "2"]
FAMILIES = ["llava", "qwen2_vl", "gemma3", "gemma4"]


@pytest.fixture(scope="module")
def cp_steps(tmp_path_factory):
    """One process and cp 2 on two gloo ranks, launched together (every family in each)."""
    from parallel_testing import launch_together

    tmp = tmp_path_factory.mktemp("vlm_cp")
    one, cp2, pp_cp = launch_together([("vlm_cp", 0, tmp / "one", {}), ("vlm_cp", 2, tmp / "cp2", {}),
                                       ("vlm_pp_cp", 4, tmp / "pp_cp", {})],
                                      workers=Path(__file__).with_name("vlm_context_parallel_workers.py"), timeout=600)
    return {"one": one[0], "cp2": cp2, "pp2_cp2": pp_cp}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_context_parallel_step_equals_one_process(cp_steps, family):
    """Two steps of two micro-batches (right-padded rows, then packed rows; Gemma 3 and 4: then left-padded
    rows): losses, gradient norms, the vision tower's gradients of the first step (its images run on both ranks,
    each rank's loss only on its part of the sequence) and the weights after."""
    one = cp_steps["one"][family]
    for rank in cp_steps["cp2"]:
        ran = rank[family]
        # the language model's layers (Gemma 4's: four); the vision tower keeps its attention
        assert ran["hooked"] == (4 if family == "gemma4" else 2)
        assert ran["length"] % 4 == 0  # the collate padded the rows to a multiple of 2 x cp_size
        assert_steps_like_one_process(ran, one)
        for key, value in one["state"].items():
            if key.endswith("k_proj.bias"):  # shifts all of a query's scores alike, which softmax cancels: its
                continue  # gradient is rounding noise, which AdamW's normalisation turns into steps of up to lr
            assert torch.allclose(torch.tensor(ran["state"][key]), torch.tensor(value), atol=1e-5), key


@pytest.mark.slow
def test_paligemma_under_cp_trains_like_one_process_with_its_layers_marked_causal(tmp_path):
    """PaliGemma on cp 2 (two gloo ranks): transformers marks its text config ``use_bidirectional_attention``
    (its forward's mask is causal with the prefix both ways), so its layers are marked causal under the region
    (``causal_prefix_attention``), whose all-gather mask takes the prefix span: the losses and gradient norms of one
    process; left bidirectional (their SDPA calls not the region's), they differ."""
    from parallel_testing import launch_together

    one, cp2 = launch_together([("vlm_cp_paligemma", 0, tmp_path / "one", {}),
                                ("vlm_cp_paligemma", 2, tmp_path / "cp2", {})],
                               workers=Path(__file__).with_name("vlm_context_parallel_workers.py"), timeout=300)
    reference = one[0]["paligemma"]
    for rank in cp2:
        assert rank["paligemma"]["hooked"] == 4
        assert rank["paligemma"]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert rank["paligemma"]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert rank["paligemma_bidirectional"]["losses"] != pytest.approx(reference["losses"], rel=1e-4)


def test_pp2_x_cp2_merges_qwen2_vl_images_and_3d_positions_on_whole_rows_then_splits_them(cp_steps):
    """pp 2 x cp 2 on four ranks: the first stage computes the Qwen2-VL's image features and merges them into the
    whole rows, its 3-D rope positions (from the image grids) reach both stages rows first, and each cp rank's
    layers run on its part: the first step's loss, gradient norm and vision-tower gradients (summed over the cp
    ranks by FSDP2) are one process's (without the positions in the second stage, or with the token ids split
    before the merge, they are not)."""
    one = cp_steps["one"]["qwen2_vl"]
    ranks = [rank["qwen2_vl"] for rank in cp_steps["pp2_cp2"]]
    for ran in ranks:
        assert ran["loss"] == pytest.approx(one["losses"][0], rel=1e-5)
        assert ran["norm"] == pytest.approx(one["norms"][0], rel=1e-5)
    first_stage = [ran["vision_grads"] for ran in ranks if ran["vision_grads"]]
    assert len(first_stage) == 2  # pp rank 0's two cp ranks
    for grads in first_stage:
        assert sorted(grads) == sorted(one["vision_grads"])
        for key, value in one["vision_grads"].items():
            assert torch.allclose(torch.tensor(grads[key]), torch.tensor(value), rtol=1e-4, atol=1e-6), key


def test_frame_sharding_splits_the_vision_tower_and_equals_the_unsharded_run(cp_steps):
    """The Qwen2-VL's vision tower on each rank's share of the images (different sizes, padded with zero frames
    below 40 patch rows), its features gathered: the unsharded cp run's and one process's losses, gradient norms,
    vision-tower gradients (summed over the ranks by FSDP2, each rank's through its own images) and weights."""
    one = cp_steps["one"]["qwen2_vl"]
    ranks = [rank["qwen2_vl_frames"] for rank in cp_steps["cp2"]]
    for ran, unsharded in zip(ranks, cp_steps["cp2"], strict=True):
        assert ran["losses"] == pytest.approx(unsharded["qwen2_vl"]["losses"], rel=1e-5)
        assert ran["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert ran["norms"] == pytest.approx(one["norms"], rel=1e-5)
        for key, value in one["vision_grads"].items():
            assert torch.allclose(torch.tensor(ran["vision_grads"][key]), torch.tensor(value), rtol=1e-4,
                                  atol=1e-6), key
        for key, value in one["state"].items():
            if not key.endswith("k_proj.bias"):  # as above: rounding noise turned into steps by AdamW
                assert torch.allclose(torch.tensor(ran["state"][key]), torch.tensor(value), atol=1e-5), key
    # each call of the tower: every rank ran it, none on all of the batch's images (one process's grids); the
    # second micro-batch's two pictures, one a rank, the smaller padded by two zero frames like it to 48 patch rows
    assert all(len(rank["grids"]) == len(one["grids"]) for rank in ranks)
    for call, whole in enumerate(one["grids"]):
        assert all(rank["grids"][call] != whole for rank in ranks)
    assert one["grids"][1] == [[1, 4, 4], [1, 4, 6]]
    assert [rank["grids"][1] for rank in ranks] == [[[1, 4, 4], [2, 4, 4]], [[1, 4, 6], [1, 4, 6]]]
    assert max(len(whole) for whole in one["grids"]) >= 3 and len({tuple(r) for g in one["grids"] for r in g}) >= 3


def test_frame_sharding_cuts_a_video_and_gathers_qwen3_vl_deepstack_features(cp_steps):
    """A Qwen3-VL tower on a three-frame video (3 x 48 patch rows) and two images (16, 24): the ranks split the
    video's frames (balanced by cost; the second rank padded by a zero frame to 96 patch rows), and the gathered
    features (merged and deepstack) and summed gradients are the whole tower's."""
    ranks = [rank["qwen3_vl_tower"] for rank in cp_steps["cp2"]]
    for ran in ranks:
        assert ran["features"] < 1e-5 and ran["grads"] < 1e-5
    assert [ran["grids"] for ran in ranks] == [[[[2, 6, 8]]], [[[1, 6, 8], [1, 4, 4], [1, 4, 6], [1, 4, 6]]]]


def test_frame_sharding_balances_contiguous_runs_of_frames():
    from automodel_vlm.frame_sharding import balanced_cuts

    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_cuts([1, 1, 10], 2) == [0, 2, 3]
    assert balanced_cuts([10, 1, 1, 1, 1], 3) == [0, 1, 2, 5]  # one item at least for every rank
    assert balanced_cuts([3, 3], 4) == [0, 1, 2, 2, 2]  # fewer items than ranks: the last ones get none


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemmas_image_spans_in_the_mask_are_what_makes_it_equal_one_process(cp_steps, family):
    """Without the image tokens' two-way spans the cp ranks run causal attention only, which is another model: its
    gradient norms are off one process's (the equality above holds them to 1e-5), its second loss too."""
    one = cp_steps["one"][family]
    for rank in cp_steps["cp2"]:
        causal = rank[f"{family}_causal"]
        assert causal["norms"][0] != pytest.approx(one["norms"][0], rel=1e-3)
        assert causal["losses"][1] != pytest.approx(one["losses"][1], rel=1e-5)


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", eval_generation={"enabled": False})


@pytest.fixture
def on_cuda(monkeypatch):
    """Validation sees a CUDA device (the checks a GPU machine runs)."""
    monkeypatch.setattr("automodel.training.stages.context_parallel.validation_device",
                        lambda: torch.device("cuda"))


def test_cp2_passes_validation_where_the_device_is_cuda(config, on_cuda, capsys):
    assert main(["validate", "-c", str(config), *CP2]) == 0, capsys.readouterr().err
    # with pipeline parallelism too (test_pipeline_parallel.py trains pp 2 x cp 2 like one process)
    assert main(["validate", "-c", str(config), *CP2, "--nproc-per-node", "4", "--distributed.pp_size", "2"]) == 0, \
        capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_ring_attention_is_refused_on_this_machine_saying_what_would_run_it(config, tmp_path):
    result = run_cli("validate", "-c", config, *CP2, "--distributed.cp_attention", "ring", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in out
    assert "distributed.cp_size: 2: context parallelism runs torch's ring attention" in out


@pytest.mark.parametrize(("args", "refusal"), [
    (["--packed_sequence.pack_size", "64", "--distributed.cp_attention", "ring"],
     "packed_sequence: packed rows keep attention within each sample, but torch's ring attention"),
    (["--packed_sequence.pack_size", "66"],
     "packed_sequence.pack_size: packed rows of 66 tokens: context parallelism (cp_size 2) splits each row into 4"),
    (["--nproc-per-node", "4", "--distributed.pp_size", "2", "--distributed.cp_attention", "ring"],
     "distributed.cp_attention: ring with pp_size 2: the pipeline schedule runs each micro-batch's backward"),
    (["--distributed.multimodal.vision.frame_sharding.enabled", "true"],
     "distributed.multimodal.vision.frame_sharding.enabled: true: a llava model: frame sharding splits the frames "
     "of a Qwen-VL vision tower"),
    (["--nproc-per-node", "4", "--distributed.pp_size", "2", "--distributed.multimodal.vision.frame_sharding.enabled",
      "true"], "distributed.multimodal.vision.frame_sharding.enabled: true with pp_size 2: frame sharding splits"),
    (["--distributed.multimodal.vision.frame_sharding", "{enabled: true, mesh_dims: [cp, tp], min_frames: -1}"],
     "distributed.multimodal.vision.frame_sharding.mesh_dims: ['cp', 'tp']: frames are split over the "
     "context-parallel ranks only"),
], ids=["packing_with_ring", "packing_length", "pp_ring", "frame_sharding_llava", "frame_sharding_pp",
                                 "frame_sharding_keys"])
def test_what_the_path_cannot_run_is_refused_with_the_reason(config, on_cuda, capsys, args, refusal):
    assert main(["validate", "-c", str(config), *CP2, *args]) == 2
    err = capsys.readouterr().err
    assert refusal in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism runs on two CUDA GPUs")
def test_cp2_on_two_gpus_trains_like_one_process_and_saves_a_model_transformers_loads(tmp_path):
    from transformers import AutoModelForImageTextToText

    sections = {"step_scheduler": {"max_steps": 4, "val_check_interval": 100, "checkpoint_interval": 4},
                "validation_dataset": None, "eval_generation": None, "dataset": {"limit_dataset_samples": 32},
                "distributed": {"mp_policy": {"param_dtype": "float32"}}, "dataloader": {"shuffle": False}}
    runs = {}
    for name, args in (("one", []), ("cp2", [*CP2, "--master-port", str(free_port())])):
        config = write_config(tmp_path / f"{name}.yaml", tmp_path / name, **sections)
        result = run_cli("finetune", "vlm", "-c", config, *args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = tmp_path / name
    assert "ring attention over cp 2" in result.stderr
    assert training_column(runs["cp2"], "loss") == pytest.approx(training_column(runs["one"], "loss"), rel=1e-3)
    loaded = AutoModelForImageTextToText.from_pretrained(runs["cp2"] / "epoch_0_step_4" / "model")
    reference = AutoModelForImageTextToText.from_pretrained(runs["one"] / "epoch_0_step_4" / "model")
    for key, value in reference.state_dict().items():
        assert torch.allclose(loaded.state_dict()[key], value, atol=1e-3), key


def test_models_whose_attention_is_not_one_causal_attention_are_refused_with_ring_attention():
    """Ring attention is causal over the whole split sequence: a Gemma 3 (its image tokens attend to each other
    both ways) or a model with sliding-window layers would silently train another attention under it; the
    all-gather attention's mask takes the spans. A language model that attends both ways everywhere, and the
    unchecked Gemma 3n, are refused with either."""
    from transformers import Gemma3Config, Gemma3nConfig, LlavaConfig, MistralConfig, Qwen2VLConfig

    from automodel.training.parallel.context_parallel import sliding_window_issue
    from automodel_vlm.context_parallel import attention_issue
    from automodel_vlm.frame_sharding import frame_sharding_issue

    assert "attend to each other both ways" in attention_issue(Gemma3Config(), "ring")
    assert "set distributed.cp_attention: all_gather" in attention_issue(Gemma3Config(), "ring")
    assert attention_issue(Gemma3Config(), "all_gather") is None
    embedding = Gemma3Config(text_config={"use_bidirectional_attention": True})
    assert "attends both ways over the whole sequence" in attention_issue(embedding, "all_gather")
    assert "gemma3n model" in attention_issue(Gemma3nConfig(), "all_gather")
    sliding = LlavaConfig(text_config=MistralConfig(sliding_window=64, layer_types=["sliding_attention"] * 2,
                                                    num_hidden_layers=2))
    assert "sliding-window layers see only the last 64 tokens" in sliding_window_issue(sliding)
    for plain in (Qwen2VLConfig(), LlavaConfig()):
        assert attention_issue(plain, "ring") is None and sliding_window_issue(plain) is None
    assert frame_sharding_issue(Qwen2VLConfig()) is None and "a llava model" in frame_sharding_issue(LlavaConfig())


def test_two_way_spans_follow_each_familys_rule():
    """Gemma 3: each image's run of token type 1, every layer; Gemma 4 (``use_bidirectional_attention: vision``):
    images and videos (types 1, 2), sliding layers only; PaliGemma: the prefix (type 0); the others: none."""
    from transformers import Gemma3Config, Gemma4Config, LlavaConfig, PaliGemmaConfig

    from automodel_vlm.context_parallel import two_way_spans

    types = torch.tensor([[0, 1, 1, 0, 1, 0, 2, 2]])
    gemma3 = two_way_spans(Gemma3Config(), {"token_type_ids": types.clamp(max=1)})
    assert gemma3.ids.tolist() == [[-1, 0, 0, -1, 1, -1, 2, 2]] and gemma3.full_layers
    vision = Gemma4Config(text_config={"use_bidirectional_attention": "vision"})
    gemma4 = two_way_spans(vision, {"mm_token_type_ids": types})
    assert gemma4.ids.tolist() == [[-1, 0, 0, -1, 1, -1, 2, 2]] and not gemma4.full_layers
    assert two_way_spans(Gemma4Config(), {"mm_token_type_ids": types}) is None  # causal Gemma 4 models
    assert two_way_spans(PaliGemmaConfig(), {"token_type_ids": types.clamp(max=1)}).ids.tolist() == [
        [0, -1, -1, 0, -1, 0, -1, -1]]
    assert two_way_spans(LlavaConfig(), {"token_type_ids": types}) is None


def test_a_gemma3_model_config_is_refused_with_ring_attention_at_validation(tmp_path, on_cuda, capsys):
    from transformers import Gemma3Config

    model_dir = tmp_path / "gemma3"
    Gemma3Config().save_pretrained(model_dir)
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", eval_generation={"enabled": False},
                          model={"config": str(model_dir)})
    assert main(["validate", "-c", str(config), *CP2, "--distributed.cp_attention", "ring"]) == 2
    err = capsys.readouterr().err
    assert "distributed.cp_size: 2: a gemma3 model lets spans of its tokens (its images) attend" in err
    assert main(["validate", "-c", str(config), *CP2]) == 0, capsys.readouterr().err  # auto: all_gather
