"""Context parallelism (``distributed.cp_size > 1``) in the VLM recipe: the sequence is split after the multimodal
merge (``automodel_vlm.context_parallel``).

On CPU gloo ranks (``vlm_context_parallel_workers.py``, with the all-gather attention: torch's ring attention has
no CPU kernel) the recipe's context-parallel step over 2 ranks gives one process's losses, gradient norms,
vision-tower gradients and weights for a tiny Llava (CLIP + Llama) and a tiny Qwen2-VL (multi-axis rope
positions), on right-padded and on packed rows. ``automodel validate`` accepts cp_size 2 where the device is CUDA
and refuses, with the reason, what the path cannot run; on two GPUs the CLI trains like one process and its model/
loads with transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vlm_testing import training_column, write_config

from automodel.cli.main import main
from automodel.testing import free_port, run_cli

CP2 = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2", "--distributed.cp_size", "2"]
FAMILIES = ["llava", "qwen2_vl"]


@pytest.fixture(scope="module")
def cp_steps(tmp_path_factory):
    """One process and cp 2 on two gloo ranks, launched together (both families in each)."""
    from parallel_testing import launch_together

    tmp = tmp_path_factory.mktemp("vlm_cp")
    one, cp2 = launch_together([("vlm_cp", 0, tmp / "one", {}), ("vlm_cp", 2, tmp / "cp2", {})],
                               workers=Path(__file__).with_name("vlm_context_parallel_workers.py"), timeout=600)
    return {"one": one[0], "cp2": cp2}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_context_parallel_step_equals_one_process(cp_steps, family):
    """Two steps of two micro-batches (right-padded rows, then packed rows): losses, gradient norms, the vision
    tower's gradients of the first step (its images run on both ranks, each rank's loss only on its part of the
    sequence) and the weights after."""
    one = cp_steps["one"][family]
    for rank in cp_steps["cp2"]:
        ran = rank[family]
        assert ran["hooked"] == 2  # the language model's two layers; the vision tower keeps its attention
        assert ran["length"] % 4 == 0  # the collate padded the rows to a multiple of 2 x cp_size
        assert ran["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert ran["norms"] == pytest.approx(one["norms"], rel=1e-5)
        assert sorted(ran["vision_grads"]) == sorted(one["vision_grads"]) and one["vision_grads"]
        for key, value in one["vision_grads"].items():
            assert torch.allclose(torch.tensor(ran["vision_grads"][key]), torch.tensor(value), rtol=1e-4,
                                  atol=1e-6), key
        for key, value in one["state"].items():
            if key.endswith("k_proj.bias"):  # shifts all of a query's scores alike, which softmax cancels: its
                continue  # gradient is rounding noise, which AdamW's normalisation turns into steps of up to lr
            assert torch.allclose(torch.tensor(ran["state"][key]), torch.tensor(value), atol=1e-5), key


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
    (["--nproc-per-node", "4", "--distributed.pp_size", "2"],
     "distributed.pp_size: 2 with cp_size 2: a vision-language model merges its media into the whole sequence"),
    (["--nproc-per-node", "4", "--distributed.tp_size", "2"],
     "distributed.tp_size: 2 with cp_size 2: tensor parallelism's vocabulary-parallel loss"),
    (["--distributed.multimodal.vision.frame_sharding.enabled", "true"], "multimodal.vision.frame_sharding"),
], ids=["packing_with_ring", "packing_length", "pp", "tp", "frame_sharding"])
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


def test_models_whose_attention_is_not_one_causal_attention_are_refused_with_cp():
    """Ring attention is causal over the whole split sequence: a Gemma 3 (its image tokens attend to each other
    both ways) or a model with sliding-window layers would silently train another attention under it."""
    from transformers import Gemma3Config, LlavaConfig, MistralConfig, Qwen2VLConfig

    from automodel.training.parallel.context_parallel import sliding_window_issue
    from automodel_vlm.context_parallel import attention_issue

    assert "attend to each other both ways" in attention_issue(Gemma3Config())
    sliding = LlavaConfig(text_config=MistralConfig(sliding_window=64, layer_types=["sliding_attention"] * 2,
                                                    num_hidden_layers=2))
    assert "sliding-window layers see only the last 64 tokens" in sliding_window_issue(sliding)
    for plain in (Qwen2VLConfig(), LlavaConfig()):
        assert attention_issue(plain) is None and sliding_window_issue(plain) is None


def test_a_gemma3_model_config_is_refused_with_cp_at_validation(tmp_path, on_cuda, capsys):
    from transformers import Gemma3Config

    model_dir = tmp_path / "gemma3"
    Gemma3Config().save_pretrained(model_dir)
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", eval_generation={"enabled": False},
                          model={"config": str(model_dir)})
    assert main(["validate", "-c", str(config), *CP2]) == 2
    assert "distributed.cp_size: 2: a gemma3 model lets each image's tokens attend" in capsys.readouterr().err
