"""The pipeline's slot order, and the stages that run (QAT, compile) or are refused (FP8, Megatron-FSDP) on CPU."""

from __future__ import annotations

import pytest
from llm_testing import read_jsonl, train_inprocess

from automodel.cli.main import main
from automodel.plugins.manager import PluginManager, reset_plugin_manager
from automodel.plugins.registries import PIPELINE_SLOTS

CALLS: list[str] = []


class RecordingStages:
    """Registers a recording implementation into every slot, in reverse slot order."""

    @staticmethod
    def automodel_register_stages(stages):
        for slot in reversed(PIPELINE_SLOTS):
            stages.add(slot, "recording", lambda recipe, model, slot=slot: CALLS.append(slot))


def test_every_slot_runs_in_the_core_order_whatever_the_registration_order(make_config, monkeypatch):
    from automodel import hookimpl
    from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction

    RecordingStages.automodel_register_stages = hookimpl(RecordingStages.automodel_register_stages)
    reset_plugin_manager(PluginManager(extra_plugins=[("recording", RecordingStages)]))
    monkeypatch.setattr(FinetuneRecipeForNextTokenPrediction, "pipeline_selection",
                        classmethod(lambda cls, cfg: {slot: ("recording", slot) for slot in PIPELINE_SLOTS}))
    CALLS.clear()
    try:
        train_inprocess(make_config(), "--step_scheduler.max_steps", "1")
    finally:
        reset_plugin_manager(None)
    assert CALLS == ["peft", "fp8", "qat", "checkpoint", "freeze", "sharding", "device", "compile",
                     "context_parallel"]


def test_qat_trains_on_cpu(make_config, tmp_path):
    recipe = train_inprocess(make_config(), "--step_scheduler.max_steps", "3", "--qat.enabled", "true",
                             "--qat.group_size", "16")
    assert any("QAT" in type(m).__name__ for m in recipe.model.modules())
    losses = [row["loss"] for row in read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    assert len(losses) == 3 and all(loss == loss for loss in losses)


def test_torch_compile_trains_on_cpu(make_config, tmp_path):
    recipe = train_inprocess(make_config(), "--step_scheduler.max_steps", "2", "--compile.enabled", "true",
                             "--compile.backend", "aot_eager")
    assert hasattr(recipe.model, "_orig_mod")
    assert len(read_jsonl(tmp_path / "ckpt" / "training.jsonl")) == 2
    assert (tmp_path / "ckpt" / "epoch_0_step_2" / "model" / "config.json").is_file()


@pytest.mark.parametrize("overrides, fragment", [
    (["--fp8.enabled", "true"], "fp8.enabled: FP8 training needs a CUDA GPU"),
    (["--distributed.strategy", "megatron_fsdp"], "distributed.strategy: megatron_fsdp needs CUDA"),
    (["--distributed.cp_size", "2"], "distributed.cp_size"),
    (["--qat.enabled", "true", "--peft.dim", "4"], "QAT together with peft"),
])
def test_stages_that_cannot_run_here_are_refused_at_validation(make_config, tmp_path, capsys, overrides,
                                                               fragment):
    code = main(["validate", "-c", str(make_config()), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()
