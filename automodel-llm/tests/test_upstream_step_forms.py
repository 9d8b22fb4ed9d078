"""The project-written upstream forms of the step_scheduler and checkpoint keys (tests/upstream_forms/) validate
and train 3 steps on the tiny Llama, through `automodel run -c` (a real CLI process) and `automodel finetune llm
-c`, with the upstream step semantics: no num_epochs lets max_steps run over two epochs, an epoch's shorter last
step is trained, the epoch end is checkpointed, the backends (an offline W&B run) are fed every step."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from automodel.cli.main import main
from automodel.testing import checkpoint_dirs, read_jsonl, run_cli

FORMS = Path(__file__).parent / "upstream_forms"


@pytest.fixture(autouse=True)
def own_wandb_service(monkeypatch):
    """An earlier in-process W&B run leaves its wandb-core service behind (WANDB_SERVICE in the environment, W&B's
    own singleton in this process): a run here would log through that one, configured for another directory,
    instead of writing its own offline run files."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()
    monkeypatch.delenv("WANDB_SERVICE", raising=False)


def wandb_env(root: Path) -> dict[str, str]:
    return {"WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "wandb_config"),
            "WANDB_CACHE_DIR": str(root / "wandb_cache"), "WANDB_DATA_DIR": str(root / "wandb_data")}


def assert_step_form_ran(root: Path) -> None:
    """12 samples, 4 per micro-batch, 2 micro-batches per step: epochs of one full and one shorter step."""
    ckpt = root / "checkpoints"
    assert [(r["step"], r["epoch"]) for r in read_jsonl(ckpt / "training.jsonl")] == [(1, 0), (2, 0), (3, 1)]
    assert checkpoint_dirs(ckpt) == ["epoch_0_step_2", "epoch_1_step_3"]  # the epoch's end, then the last step
    assert [r["step"] for r in read_jsonl(ckpt / "validation.jsonl")] == [0, 3]  # val_at_start, val_every_steps
    (run_dir,) = (ckpt / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("run-*.wandb"))


def test_step_scheduler_form_runs_with_automodel_run(tmp_path):
    pytest.importorskip("wandb", reason="the form's wandb: section needs W&B: pip install automodel-core[wandb]")
    shutil.copy(FORMS / "step_scheduler_upstream_keys.yaml", tmp_path / "form.yaml")
    done = run_cli("run", "-c", "form.yaml", "--step_scheduler.val_at_start", "true",
                   "--step_scheduler.log_interval", "1", cwd=tmp_path, **wandb_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training ended after step 3: step_scheduler.max_steps: 3 reached" in done.stderr
    assert_step_form_ran(tmp_path)


def test_step_scheduler_form_runs_with_finetune_llm(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the form's wandb: section needs W&B: pip install automodel-core[wandb]")
    monkeypatch.chdir(tmp_path)
    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    form = FORMS / "step_scheduler_upstream_keys.yaml"
    assert main(["finetune", "llm", "-c", str(form), "--step_scheduler.val_at_start", "true",
                 "--step_scheduler.log_interval", "1"]) == 0
    assert_step_form_ran(tmp_path)


@pytest.mark.parametrize("command", [["run"], ["finetune", "llm"]])
def test_checkpoint_form_writes_model_in_every_checkpoint(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "-c", str(FORMS / "checkpoint_upstream_keys.yaml")]) == 0
    ckpt = tmp_path / "checkpoints"
    assert checkpoint_dirs(ckpt) == ["epoch_0_step_2", "epoch_0_step_3"]
    for name in checkpoint_dirs(ckpt):
        assert (ckpt / name / "model" / "config.json").is_file() and list((ckpt / name / "model").glob("*.safetensors"))
    assert "note: checkpoint.dequantize_base_checkpoint: true governs nothing this run: the base model is not " \
           "quantized" in capsys.readouterr().err


def test_checkpoint_form_with_final_writes_model_only_in_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """Upstream's default save_consolidated: the earlier checkpoints hold the shards, the last one model/ (and the
    run's last line points at it)."""
    monkeypatch.chdir(tmp_path)
    assert main(["finetune", "llm", "-c", str(FORMS / "checkpoint_upstream_keys.yaml"),
                 "--checkpoint.save_consolidated", "final"]) == 0
    ckpt = tmp_path / "checkpoints"
    assert checkpoint_dirs(ckpt) == ["epoch_0_step_2", "epoch_0_step_3"]
    assert not (ckpt / "epoch_0_step_2" / "model").exists()
    assert list((ckpt / "epoch_0_step_2" / "model_shards").glob("*.safetensors"))
    assert (ckpt / "epoch_0_step_3" / "model" / "config.json").is_file()
    assert not (ckpt / "epoch_0_step_3" / "model_shards").exists()
    model = Path("checkpoints/epoch_0_step_3/model")
    assert f"Trained model in {model}: load it with transformers.AutoModelForCausalLM.from_pretrained('{model}')" \
        in capsys.readouterr().err


def test_checkpoint_form_with_torch_save_keeps_the_shards_which_export_to_the_trained_model(tmp_path, monkeypatch,
                                                                                           capsys):
    """Upstream's `model_save_format: torch_save` beside `save_consolidated: false` (its examples' pairing): every
    checkpoint holds the sharded form alone, in safetensors; `automodel export` makes the Hugging Face model of it,
    which transformers loads with the weights the run trained."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    assert main(["finetune", "llm", "-c", str(FORMS / "checkpoint_upstream_keys.yaml"),
                 "--checkpoint.model_save_format", "torch_save", "--checkpoint.save_consolidated", "false"]) == 0
    ckpt = tmp_path / "checkpoints"
    for name in checkpoint_dirs(ckpt):
        assert not (ckpt / name / "model").exists()
        assert list((ckpt / name / "model_shards").glob("*.safetensors"))
    last = ckpt / "epoch_0_step_3"
    assert f"Trained model in {Path('checkpoints/epoch_0_step_3/model_shards')} (the sharded form only" \
        in capsys.readouterr().err
    assert main(["export", str(last), str(tmp_path / "exported")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    shards = {}  # the shards name the parameters under the recipe's wrapper (model.<Hugging Face name>)
    for file in (last / "model_shards").glob("*.safetensors"):
        shards.update({name.removeprefix("model."): tensor for name, tensor in load_file(file).items()})
    assert shards and set(shards) <= set(model.state_dict())
    for name, tensor in shards.items():
        assert torch.equal(model.state_dict()[name].float(), tensor.float()), name
