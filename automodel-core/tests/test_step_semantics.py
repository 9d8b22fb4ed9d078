"""Step semantics as upstream's, on the toy recipe: max_steps without num_epochs runs as many epochs as it needs,
the first of two limits ends the run (and says which), an epoch's shorter last accumulation group is trained with
its loss normalised over its own targets, the step_scheduler keys gc_every_steps / save_checkpoint_every_epoch /
log_remote_every_steps / loss_average_window_steps act, and val_at_start validates the untouched model."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from automodel import hookimpl
from automodel.errors import ConfigError
from automodel.plugins.manager import PluginManager, reset_plugin_manager
from automodel.testing import (
    ToyDataset,
    ToyModel,
    ToyRecipe,
    assert_states_equal,
    checkpoint_dirs,
    deep_update,
    load_config,
    load_safetensors_state,
    read_jsonl,
    train_inprocess,
)
from automodel.training.logging import MetricLogger

# 40 rows at batch 4 = 10 micro-batches; 3 per step: steps of 3, 3, 3 and 1 micro-batches, 4 steps per epoch.
SHORT_LAST_GROUP = {"dataset": {"_target_": "automodel.testing.toy.ToyDataset", "size": 40},
                    "dataloader": {"batch_size": 4, "shuffle": False},
                    "step_scheduler": {"grad_accumulation_steps": 3}}


def short_last_group(**sections: Any) -> dict[str, Any]:
    return deep_update(SHORT_LAST_GROUP, sections)


def steps_and_epochs(root) -> list[tuple[int, int]]:
    return [(r["step"], r["epoch"]) for r in read_jsonl(root / "training.jsonl")]


def masked_mean_loss(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The toy's loss as a mean over the targets of ``rows`` (the reference the engine's step loss must equal)."""
    return ((model(rows["x"]) - rows["y"]) ** 2 * rows["mask"]).sum() / rows["mask"].sum()


# ---- how many steps ------------------------------------------------------------------------------------------

def test_max_steps_without_num_epochs_trains_every_step_over_several_epochs(make_toy, tmp_path, capsys):
    config = make_toy(step_scheduler={"max_steps": 10, "num_epochs": None, "grad_accumulation_steps": 4})
    train_inprocess(config, recipe=ToyRecipe)  # 16 micro-batches of 4 per step: 4 steps per epoch
    assert steps_and_epochs(tmp_path / "ckpt") == [(s, (s - 1) // 4) for s in range(1, 11)]
    assert "training ended after step 10: step_scheduler.max_steps: 10 reached" in capsys.readouterr().err


def test_with_both_limits_the_first_reached_ends_the_run_and_the_schedule(make_toy, tmp_path, capsys):
    lr = 0.01
    config = make_toy(step_scheduler={"max_steps": 100, "num_epochs": 2, "grad_accumulation_steps": 4},
                      optimizer={"_target_": "torch.optim.SGD", "lr": lr},
                      lr_scheduler={"lr_decay_style": "linear", "lr_warmup_steps": 0, "min_lr": 0.0})
    train_inprocess(config, recipe=ToyRecipe)
    records = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert "training ended after step 8: step_scheduler.num_epochs: 2 done before max_steps: 100" in \
        capsys.readouterr().err
    # the learning rate decays over the 8 steps the run has, not over max_steps: update n uses lr * (1 - n / 8)
    assert [r["lr"] for r in records] == pytest.approx([lr * (1 - n / 8) for n in range(8)])


# ---- the shorter last group ----------------------------------------------------------------------------------

def test_the_shorter_last_group_of_an_epoch_is_a_step_with_its_own_token_mean(make_toy, tmp_path):
    lr = 0.1
    config = make_toy(**short_last_group(optimizer={"_target_": "torch.optim.SGD", "lr": lr}))
    train_inprocess(config, "--step_scheduler.max_steps", 4, "--step_scheduler.checkpoint_interval", 1,
                    recipe=ToyRecipe)
    root = tmp_path / "ckpt"
    assert checkpoint_dirs(root)[-2:] == ["epoch_0_step_3", "epoch_0_step_4"]
    logged = {r["step"]: r["loss"] for r in read_jsonl(root / "training.jsonl")}

    model = ToyModel()
    model.load_state_dict(load_safetensors_state(root / "epoch_0_step_3" / "model"))
    data = ToyDataset(size=40)
    last = {"x": data.x[36:40], "y": data.y[36:40], "mask": data.mask[36:40]}  # the 10th micro-batch, alone
    loss = masked_mean_loss(model, last)
    assert logged[4] == pytest.approx(loss.item(), rel=1e-6)
    loss.backward()
    with torch.no_grad():
        expected = {name: p - lr * p.grad for name, p in model.named_parameters()}
    assert_states_equal(load_safetensors_state(root / "epoch_0_step_4" / "model"), expected, atol=1e-6)


def test_a_resume_from_the_checkpoint_after_the_shorter_step_continues_exactly(make_toy, tmp_path):
    config = make_toy(**short_last_group(step_scheduler={"max_steps": 8, "checkpoint_interval": 4},
                                         dataloader={"shuffle": True}))
    reference = train_inprocess(config, recipe=ToyRecipe)
    root = tmp_path / "ckpt"
    assert checkpoint_dirs(root) == ["epoch_0_step_4", "epoch_1_step_8"]
    resumed = train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "again", "--restore_from.path",
                              root / "epoch_0_step_4", recipe=ToyRecipe)
    again = read_jsonl(tmp_path / "again" / "training.jsonl")
    first = {r["step"]: r for r in read_jsonl(root / "training.jsonl")}
    assert [(r["step"], r["epoch"]) for r in again] == [(s, 1) for s in range(5, 9)]
    assert all(r["loss"] == first[r["step"]]["loss"] for r in again)  # bitwise
    assert_states_equal(resumed.model.state_dict(), reference.model.state_dict())


def test_save_checkpoint_every_epoch_checkpoints_each_epochs_last_step(make_toy, tmp_path):
    config = make_toy(**short_last_group(step_scheduler={"max_steps": 10, "save_checkpoint_every_epoch": True}))
    train_inprocess(config, recipe=ToyRecipe)
    assert checkpoint_dirs(tmp_path / "ckpt") == ["epoch_0_step_4", "epoch_1_step_8", "epoch_2_step_10"]


# ---- garbage collection ----------------------------------------------------------------------------------------

class RecordsCollector(ToyRecipe):
    """Notes, after each step, whether automatic garbage collection is on."""

    def after_step(self, step: int, tokens: int, seconds: float) -> None:
        self.gc_enabled_at = {**getattr(self, "gc_enabled_at", {}), step: gc.isenabled()}


def test_gc_every_steps_turns_automatic_collection_off_and_collects_every_n_steps(make_toy):
    config = make_toy(step_scheduler={"max_steps": 5, "gc_every_steps": 2})
    collections: list[tuple[int, int]] = []
    recipe: dict[str, Any] = {}

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and "run" in recipe:
            collections.append((recipe["run"].step_scheduler.step, info["generation"]))

    gc.callbacks.append(record)
    try:
        run = train_inprocess(config, recipe=RecordsCollector, before_run=lambda r: recipe.update(run=r))
    finally:
        gc.callbacks.remove(record)
    assert gc.isenabled()  # the collector's setting is back after the run
    assert run.gc_enabled_at == dict.fromkeys(range(1, 6), False)
    assert collections[0] == (0, 2)  # one full collection before the first step
    assert [c for c in collections[1:] if c[1] == 1] == [(2, 1), (4, 1)]


# ---- validation before the first step ------------------------------------------------------------------------

VALIDATION = {"validation_dataset": {"_target_": "automodel.testing.toy.ToyDataset", "size": 16, "seed": 7},
              "validation_dataloader": {"batch_size": 8}}


def test_val_at_start_validates_the_untouched_model_as_step_0(make_toy, tmp_path):
    config = make_toy(**VALIDATION, step_scheduler={"max_steps": 2, "val_check_interval": 2, "val_at_start": True})
    untouched = train_inprocess(config, recipe=ToyRecipe, setup_only=True).model
    train_inprocess(config, recipe=ToyRecipe)
    records = read_jsonl(tmp_path / "ckpt" / "validation.jsonl")
    assert [r["step"] for r in records] == [0, 2]
    data = ToyDataset(size=16, seed=7)
    with torch.no_grad():
        expected = masked_mean_loss(untouched, {"x": data.x, "y": data.y, "mask": data.mask}).item()
    assert records[0]["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_val_at_start_is_not_repeated_by_a_resume(make_toy, tmp_path):
    """As documented: a resumed run starts past step 0, so it does not validate the untouched model again."""
    config = make_toy(**VALIDATION, step_scheduler={"max_steps": 4, "val_check_interval": 2, "val_at_start": True,
                                                    "checkpoint_interval": 2})
    train_inprocess(config, recipe=ToyRecipe)
    assert [r["step"] for r in read_jsonl(tmp_path / "ckpt" / "validation.jsonl")] == [0, 2, 4]
    train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "again", "--restore_from.path",
                    tmp_path / "ckpt" / "epoch_0_step_2", recipe=ToyRecipe)
    assert [r["step"] for r in read_jsonl(tmp_path / "again" / "validation.jsonl")] == [4]


def test_val_at_start_without_validation_data_is_refused(make_toy):
    config = make_toy(step_scheduler={"val_at_start": True})
    with pytest.raises(ConfigError, match="step_scheduler.val_at_start: true, but there is no validation_dataset"):
        load_config(config, recipe=ToyRecipe)


# ---- what the metric backends and training.jsonl receive ---------------------------------------------------------

RECEIVED: list[int] = []


class StepRecorder(MetricLogger):
    def log_train(self, sample: dict[str, Any], step: int) -> None:
        RECEIVED.append(step)


class RecorderPlugin:
    @staticmethod
    @hookimpl
    def automodel_register_loggers(loggers: Any) -> None:
        loggers.add("steps", StepRecorder)


@pytest.fixture
def step_recorder():
    RECEIVED.clear()
    reset_plugin_manager(PluginManager(extra_plugins=[("step-recorder", RecorderPlugin)]))
    yield RECEIVED
    reset_plugin_manager(None)


def test_log_remote_every_steps_sets_what_the_backends_receive(make_toy, tmp_path, step_recorder):
    config = make_toy(step_scheduler={"max_steps": 7, "log_interval": 3, "log_remote_every_steps": 2},
                      logging={"backends": ["steps"]})
    train_inprocess(config, recipe=ToyRecipe)
    assert step_recorder == [2, 4, 6, 7]
    assert [r["step"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [3, 6, 7]


def test_without_log_remote_every_steps_the_backends_get_what_training_jsonl_gets(make_toy, step_recorder):
    train_inprocess(make_toy(step_scheduler={"max_steps": 7, "log_interval": 3}, logging={"backends": ["steps"]}),
                    recipe=ToyRecipe)
    assert step_recorder == [3, 6, 7]


def test_log_remote_every_steps_without_a_backend_is_refused(make_toy):
    with pytest.raises(ConfigError, match="step_scheduler.log_remote_every_steps: sets how often the metric "
                                          "backends receive the training metrics, but none is configured"):
        load_config(make_toy(step_scheduler={"log_remote_every_steps": 2}), recipe=ToyRecipe)


def test_log_remote_every_steps_with_a_backend_turned_off_is_kept_with_a_note(make_toy, tmp_path, capsys):
    """Like the section's own settings, it acts once the backend is turned on (upstream configs ship it so)."""
    config = make_toy(step_scheduler={"max_steps": 2, "log_remote_every_steps": 1}, wandb={"enable": False})
    train_inprocess(config, recipe=ToyRecipe)
    assert "note: step_scheduler.log_remote_every_steps governs nothing this run: every metric backend is turned " \
           "off" in capsys.readouterr().err


def test_loss_average_window_steps_adds_the_mean_of_the_last_n_losses(make_toy, tmp_path):
    train_inprocess(make_toy(step_scheduler={"max_steps": 6, "loss_average_window_steps": 3}), recipe=ToyRecipe)
    records = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    losses = [r["loss"] for r in records]
    for i, record in enumerate(records):
        window = losses[max(0, i - 2): i + 1]
        assert record["loss_avg_window"] == pytest.approx(sum(window) / len(window), rel=1e-6)


@pytest.mark.parametrize("key, value, needle", [("start_step", 5, "a run starts at step 0"),
                                                ("start_epoch", 1, "a run starts at epoch 0"),
                                                ("dp_size", 2, "the data-parallel size is distributed's"),
                                                ("preemption_signal", "SIGUSR1", "on SIGTERM and on SIGINT, always")])
def test_upstreams_step_scheduler_arguments_that_choose_nothing_are_refused(make_toy, key, value, needle):
    """Never "unknown key" for an argument of upstream's StepScheduler; what happens here is accepted."""
    with pytest.raises(ConfigError) as refused:
        load_config(make_toy(step_scheduler={key: value}), recipe=ToyRecipe)
    assert f"step_scheduler.{key}: {value!r}: " in str(refused.value) and needle in str(refused.value)
    accepted = {"start_step": 0, "start_epoch": 0, "dp_size": None, "preemption_signal": "SIGTERM"}[key]
    load_config(make_toy(step_scheduler={key: accepted}), recipe=ToyRecipe)


# ---- the order of the samples ----------------------------------------------------------------------------------

def test_one_process_reads_every_epoch_in_the_order_the_ranks_of_a_data_parallel_run_read_it(make_toy):
    """One process with twice the accumulation trains each step on the rows two ranks train it on, in every epoch
    (before, epochs after the first were shuffled otherwise: a checkpoint resumed on another number of ranks, or the
    one-process reference of a two-rank run, then read other rows)."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    config = make_toy(dataset={"_target_": "automodel.testing.toy.ToyDataset", "size": 24},
                      dataloader={"batch_size": 4, "shuffle": True})
    run = train_inprocess(config, recipe=ToyRecipe, setup_only=True)
    try:
        one = run.dataloader.sampler
        ranks = [StatefulDistributedSampler(range(24), num_replicas=2, rank=r, shuffle=True, seed=run.cfg.rng.seed,
                                            drop_last=True) for r in (0, 1)]
        for epoch in (0, 1, 2):
            for sampler in (one, *ranks):
                sampler.set_epoch(epoch)
            order, (first, second) = list(one), (list(rank) for rank in ranks)
            # a step: two micro-batches of 4 in one process, one of 4 on each rank
            assert [sorted(order[i:i + 8]) for i in range(0, 24, 8)] == \
                [sorted(first[i:i + 4] + second[i:i + 4]) for i in range(0, 12, 4)], epoch
    finally:
        run.checkpointer.release()
