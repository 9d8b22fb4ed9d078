"""Two CPU ranks (gloo) through the CLI: DDP and FSDP2 match one process with doubled accumulation, and sharded
checkpoints (every rank writes its own shards) resume on any number of ranks with the uninterrupted run's losses.

The data is unshuffled, so one process with doubled accumulation sees each step's samples exactly as two ranks do,
and a resume on another number of ranks, which starts the epoch again and skips the steps already trained, is
exact too. 32 samples at 4 a step: the step-2 checkpoints lie mid-epoch.
"""

from __future__ import annotations

import json

import pytest
import torch
from llm_testing import DISTRIBUTED_OVERRIDES as COMMON
from llm_testing import losses as _losses
from llm_testing import val_losses

from automodel.testing import free_port, read_jsonl, run_cli

TWO = ["--nproc-per-node", "2"]
ACCUMULATE = ["--step_scheduler.grad_accumulation_steps", "2"]  # one process: the samples of two ranks per step


def _run(config, cwd, directory, *args):
    """``automodel finetune llm`` into checkpoint_dir ``directory``; two ranks when ``args`` has --nproc-per-node."""
    port = ["--master-port", str(free_port())] if "--nproc-per-node" in args else []
    result = run_cli("finetune", "llm", "-c", config, *COMMON, *args, *port, "--checkpoint.checkpoint_dir",
                     directory, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def fsdp2_run(single_process, tmp_path_factory):
    config, _ = single_process
    tmp = tmp_path_factory.mktemp("fsdp2")
    result = _run(config, tmp, tmp / "ckpt", *TWO, "--distributed.strategy", "fsdp2")
    return tmp, result


@pytest.mark.parametrize(("strategy", "checkpointing"), [("ddp", "true"), ("fsdp2", "false")])
def test_two_ranks_match_one_process_with_doubled_accumulation(strategy, checkpointing, single_process, fsdp2_run,
                                                               tmp_path):
    """DDP also with activation checkpointing (it recomputes, the losses stay the same). Validation runs on both
    ranks, each its half of the samples (under FSDP2 a forward needs every rank), and rank 0 reports the loss over
    all of them: the one process's."""
    from transformers import AutoModelForCausalLM

    config, single = single_process
    if strategy == "fsdp2":
        out, result = fsdp2_run[0] / "ckpt", fsdp2_run[1]
    else:
        out = tmp_path / strategy
        result = _run(config, tmp_path, out, *TWO, "--distributed.strategy", strategy,
                      "--distributed.activation_checkpointing", checkpointing)
    assert f"sharding [{strategy}]" in result.stderr
    assert ("activation checkpointing on 1 transformer blocks" in result.stderr) == (checkpointing == "true")
    assert _losses(out) == pytest.approx(_losses(single / "ckpt"), abs=1e-5)
    validation, reference = val_losses(out), val_losses(single / "ckpt")
    assert [step for step, _ in validation] == [step for step, _ in reference] == [2, 4]
    assert [loss for _, loss in validation] == pytest.approx([loss for _, loss in reference], abs=1e-5)
    model = AutoModelForCausalLM.from_pretrained(out / "epoch_0_step_4" / "model")
    reference = AutoModelForCausalLM.from_pretrained(single / "ckpt" / "epoch_0_step_4" / "model")
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert (a - b).abs().max() < 1e-4, name


def test_every_fsdp2_rank_writes_only_its_own_shards(fsdp2_run):
    from automodel.training.parallel.shard_files import read_slices

    optim = fsdp2_run[0] / "ckpt" / "epoch_0_step_2" / "optim"
    shapes, slices = read_slices(optim)
    assert {part.file.name.split("-")[1] for parts in slices.values() for part in parts} == {"00001", "00002"}
    for key, shape in shapes.items():
        if shape[0] >= 2:  # FSDP2 shards dim 0: each rank wrote its own half, nobody the whole tensor
            assert len(slices[key]) == 2 and all(part.shape[0] < shape[0] for part in slices[key]), key


def test_two_rank_checkpoints_resume_on_two_ranks_and_in_one_process_exactly(single_process, fsdp2_run, tmp_path):
    """2 -> 2 (bitwise, saved sharded and asynchronously, with FSDP2's CPU offload: ``distributed.offload_policy``)
    and 2 -> 1; the sharded form, exported, is the model/ the uninterrupted run wrote, and both equal the weights
    gathered from every rank's shards."""
    from transformers import AutoModelForCausalLM

    from automodel.testing import load_safetensors_state
    from automodel.training.parallel.sharded_checkpoint import load_sharded_state

    config, single = single_process
    first = fsdp2_run[0] / "ckpt"
    restore = ["--restore_from.path", first / "epoch_0_step_2"]
    again, one = tmp_path / "again", tmp_path / "one"
    offloaded = _run(config, tmp_path, again, *TWO, "--distributed.strategy", "fsdp2", *restore,
                     "--checkpoint.save_consolidated", "false", "--checkpoint.async_save", "true",
                     "--distributed.offload_policy._target_", "torch.distributed.fsdp.CPUOffloadPolicy")
    assert "shards offloaded to host memory" in offloaded.stderr
    assert "distributed.offload_policy.pin_memory: true governs nothing this run" in offloaded.stderr
    assert _losses(again) == _losses(first)[2:]  # bitwise: steps 3-4
    on_one = _run(config, tmp_path, one, *restore, *ACCUMULATE)
    assert "written by 2 ranks, resuming on 1" in on_one.stderr
    assert [row["step"] for row in read_jsonl(one / "training.jsonl")] == [3, 4]
    assert _losses(one) == pytest.approx(_losses(single / "ckpt")[2:], abs=1e-5)

    saved = again / "epoch_0_step_4"
    assert not (saved / "model").exists() and json.loads((saved / "trainer_state.json").read_text())["weights"] \
        == "model_shards"
    exported = tmp_path / "exported"
    assert run_cli("export", saved, exported, cwd=tmp_path).returncode == 0
    model_dir = first / "epoch_0_step_4" / "model"
    assert (exported / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    gathered = AutoModelForCausalLM.from_pretrained(model_dir)
    load_sharded_state(saved / "model_shards", gathered)  # every rank's shards into one process
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    for key, value in gathered.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert set(load_safetensors_state(model_dir)) == {k for k in loaded.state_dict() if k != "lm_head.weight"}


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_a_one_process_checkpoint_resumes_on_two_ranks(single_process, tmp_path):
    config, single = single_process
    out = tmp_path / "two"
    result = _run(config, tmp_path, out, *TWO, "--distributed.strategy", "fsdp2", "--restore_from.path",
                  single / "ckpt" / "epoch_0_step_2")
    assert "written by 1 ranks, resuming on 2" in result.stderr
    assert _losses(out) == pytest.approx(_losses(single / "ckpt")[2:], abs=1e-5)


@pytest.mark.slow
def test_a_two_rank_lora_checkpoint_loads_in_peft(single_process, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, single = single_process
    lora = ["--peft.dim", "4", "--peft.alpha", "8", "--step_scheduler.max_steps", "2"]
    two, one = tmp_path / "two", tmp_path / "one"
    _run(config, tmp_path, two, *TWO, "--distributed.strategy", "fsdp2", *lora)
    _run(config, tmp_path, one, *lora, *ACCUMULATE)
    adapters = {}
    for name, root in (("two", two), ("one", one)):
        base = AutoModelForCausalLM.from_pretrained(single / "ckpt" / "epoch_0_step_2" / "model")  # any base
        model = PeftModel.from_pretrained(base, root / "epoch_0_step_2" / "model")
        adapters[name] = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert adapters["two"] and any(v.abs().sum() > 0 for k, v in adapters["two"].items() if "lora_B" in k)
    for key, value in adapters["one"].items():
        assert torch.allclose(adapters["two"][key], value, atol=1e-5), key


def test_a_rank_that_stops_with_an_error_is_reported_in_one_line_without_the_launchers_traceback(single_process,
                                                                                                  tmp_path):
    """torchrun's ChildFailedError traceback says nothing the failing rank did not already print."""
    config, _ = single_process
    result = run_cli("finetune", "llm", "-c", config, *COMMON, *TWO, "--master-port", str(free_port()),
                     "--model.config", tmp_path / "missing.json", "--checkpoint.checkpoint_dir", tmp_path / "ckpt",
                     cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"error: model.config: '{tmp_path / 'missing.json'}' does not exist" in result.stderr
    assert "error: rank " in result.stderr and "stopped with exit status 1 (its message is above)" in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
