"""The pipeline's slot order, and the stages that run (QAT, compile) or are refused (FP8, Megatron-FSDP) on CPU,
on the toy recipe."""

from __future__ import annotations

import pytest

from automodel import hookimpl
from automodel.cli.main import main
from automodel.plugins.manager import PluginManager, reset_plugin_manager
from automodel.testing import ToyRecipe, read_jsonl, train_inprocess
from automodel.training.pipeline import PIPELINE_SLOTS

CALLS: list[str] = []


def _recording(slot: str):
    def stage(ctx, model):
        CALLS.append(slot)
        return model, None

    return stage


class RecordingStages:
    """Registers a recording implementation into every slot, in reverse slot order."""

    @staticmethod
    @hookimpl
    def automodel_register_stages(stages):
        for slot in reversed(PIPELINE_SLOTS):
            stages.add(slot, "recording", _recording(slot))


class EverySlotToy(ToyRecipe):
    @classmethod
    def pipeline_selection(cls, cfg):
        return {slot: ("recording", slot) for slot in PIPELINE_SLOTS}


def test_every_slot_runs_in_the_core_order_whatever_the_registration_order(make_toy):
    """The second run resumes the first's checkpoint, so slot ``checkpoint`` acts too (it acts only on a resume)."""
    reset_plugin_manager(PluginManager(extra_plugins=[("recording", RecordingStages)]))
    config = make_toy()
    try:
        CALLS.clear()
        train_inprocess(config, "--step_scheduler.max_steps", "1", recipe=EverySlotToy)
        assert "checkpoint" not in CALLS
        CALLS.clear()
        train_inprocess(config, "--step_scheduler.max_steps", "2", recipe=EverySlotToy)
    finally:
        reset_plugin_manager(None)
    assert CALLS == ["peft", "fp8", "qat", "checkpoint", "freeze", "sharding", "device", "compile",
                     "context_parallel"]


def test_qat_trains_on_cpu(make_toy, tmp_path):
    recipe = train_inprocess(make_toy(), "--step_scheduler.max_steps", "3", "--qat.enabled", "true",
                             "--qat.group_size", "16", "--model.dim", "16", "--dataset.dim", "16", recipe=ToyRecipe)
    assert any("QAT" in type(m).__name__ for m in recipe.model.modules())
    losses = [row["loss"] for row in read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    assert len(losses) == 3 and all(loss == loss for loss in losses)


def test_torch_compile_trains_on_cpu(make_toy, tmp_path):
    recipe = train_inprocess(make_toy(), "--step_scheduler.max_steps", "2", "--compile.enabled", "true",
                             "--compile.backend", "aot_eager", recipe=ToyRecipe)
    assert hasattr(recipe.model, "_orig_mod")
    assert len(read_jsonl(tmp_path / "ckpt" / "training.jsonl")) == 2
    assert (tmp_path / "ckpt" / "epoch_0_step_2" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("overrides, fragment", [
    (["--fp8.enabled", "true"], "fp8.enabled: FP8 training needs a CUDA GPU"),
    (["--distributed.strategy", "megatron_fsdp"], "distributed.strategy: megatron_fsdp needs CUDA"),
    (["--distributed.cp_size", "2"], "distributed.cp_size"),
    (["--qat.enabled", "true", "--peft.dim", "4"], "QAT together with peft"),
])
def test_stages_that_cannot_run_here_are_refused_at_validation(make_toy, tmp_path, capsys, overrides, fragment):
    code = main(["validate", "-c", str(make_toy()), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()


def test_activation_checkpointing_needs_transformer_blocks(make_toy):
    from automodel.errors import AutomodelError

    with pytest.raises(AutomodelError, match="distributed.activation_checkpointing: ToyModel has no repeated "
                                             "transformer blocks"):
        train_inprocess(make_toy(model={"layers": 0}, distributed={"activation_checkpointing": True}),
                        recipe=ToyRecipe, setup_only=True)


def test_per_block_compile_needs_transformer_blocks(make_toy):
    from automodel.errors import AutomodelError

    with pytest.raises(AutomodelError, match="distributed.enable_compile: ToyModel has no repeated transformer "
                                             "blocks .* compile the whole model with compile.enabled: true"):
        train_inprocess(make_toy(model={"layers": 0}, distributed={"enable_compile": True}),
                        recipe=ToyRecipe, setup_only=True)


def test_activation_checkpointing_wraps_the_toy_blocks_and_keeps_the_losses(make_toy, tmp_path):
    plain = train_inprocess(make_toy(checkpoint={"checkpoint_dir": str(tmp_path / "plain")}), recipe=ToyRecipe)
    wrapped = train_inprocess(make_toy(checkpoint={"checkpoint_dir": str(tmp_path / "ac")},
                                       distributed={"activation_checkpointing": True}), recipe=ToyRecipe)
    assert sum("CheckpointWrapper" in type(m).__name__ for m in wrapped.model.modules()) == 2
    assert not any("CheckpointWrapper" in type(m).__name__ for m in plain.model.modules())
    assert [r["loss"] for r in read_jsonl(tmp_path / "ac" / "training.jsonl")] == \
        [r["loss"] for r in read_jsonl(tmp_path / "plain" / "training.jsonl")]
