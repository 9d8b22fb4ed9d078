"""The engine's contracts on the toy recipe: builders and stages see a BuildContext and return what they build, a
plugin's builder for a domain wins over the core's, section defaults live in their Target specs, stateful
attributes are declared and a checkpoint restores them all (an exact resume)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from automodel import hookimpl
from automodel.cli.main import main
from automodel.errors import PluginError
from automodel.plugins.manager import PluginManager, reset_plugin_manager
from automodel.testing import (
    ToyRecipe,
    assert_states_equal,
    checkpoint_dirs,
    load_config,
    losses_by_step,
    train_inprocess,
)
from automodel.training.context import BuildContext
from automodel.training.pipeline import apply_pipeline

SEEN: list[BuildContext] = []


def sgd_for_toys(ctx, model):
    SEEN.append(ctx)
    return torch.optim.SGD(model.parameters(), lr=0.5)


class ToyBuilders:
    @staticmethod
    @hookimpl
    def automodel_register_builders(builders):
        builders.add("optimizer", sgd_for_toys, domain="toy")


@pytest.fixture
def with_plugin():
    def install(name, plugin):
        reset_plugin_manager(PluginManager(extra_plugins=[(name, plugin)]))

    yield install
    reset_plugin_manager(None)


def test_a_plugin_builder_for_the_domain_receives_the_context_and_wins(make_toy, with_plugin):
    with_plugin("toy-builders", ToyBuilders)
    SEEN.clear()
    recipe = train_inprocess(make_toy(), "--step_scheduler.max_steps", "1", recipe=ToyRecipe, setup_only=True)
    assert isinstance(recipe.optimizer, torch.optim.SGD) and recipe.optimizer.param_groups[0]["lr"] == 0.5
    (ctx,) = SEEN
    assert ctx is recipe.ctx and ctx.domain == "toy" and ctx.device == torch.device("cpu")
    assert (ctx.rank, ctx.world_size, ctx.seed) == (0, 1, 1234)
    assert ctx.batch.micro_batch_size == 4 and ctx.batch.grad_accumulation_steps == 1


def test_other_domains_keep_the_core_builder(make_toy, with_plugin):
    class OtherToy(ToyRecipe):
        domain = "other-toy"

    with_plugin("toy-builders", ToyBuilders)
    recipe = train_inprocess(make_toy(), recipe=OtherToy, setup_only=True)
    assert isinstance(recipe.optimizer, torch.optim.AdamW)


def test_a_plugin_builder_that_fails_names_the_plugin(make_toy, with_plugin):
    class Failing:
        @staticmethod
        @hookimpl
        def automodel_register_builders(builders):
            builders.add("loss_fn", lambda ctx: 1 / 0, domain="toy")

    with_plugin("failing", Failing)
    with pytest.raises(PluginError, match=r"builder 'loss_fn' registered by plugin 'failing' failed: "
                                          r"ZeroDivisionError"):
        train_inprocess(make_toy(), recipe=ToyRecipe, setup_only=True)


def test_a_stage_returns_model_and_message(make_toy):
    """Whatever else a stage returns is refused with the plugin's name; every stage that acts logs one line."""
    from automodel.plugins.registries import StageRegistry

    stages = StageRegistry()
    stages.source = "automodel-sloppy"
    stages.add("freeze", "sloppy", lambda ctx, model: model)
    stages.source = "automodel-core"
    stages.add("device", "single", lambda ctx, model: (model, "placed"))
    manager = PluginManager(load_entry_points=False)
    manager.stages = stages
    _, cfg = load_config(make_toy(), recipe=ToyRecipe)
    logged: list[str] = []
    ctx = replace(ToyRecipe(cfg).build_context(), plugins=manager, log=logged.append)
    with pytest.raises(PluginError, match=r"pipeline stage 'freeze' \[sloppy\] registered by 'automodel-sloppy' "
                                          r"returned Linear; a stage returns \(model, message\)"):
        apply_pipeline(ctx, torch.nn.Linear(2, 2), {"freeze": ("sloppy", "freeze")})
    model = torch.nn.Linear(2, 2)
    assert apply_pipeline(ctx, model, {"device": ("single", "dist_env")}) is model
    assert logged == ["pipeline: device [single]: placed"]


def test_section_defaults_are_their_target_specs(make_toy, capsys):
    config = make_toy(optimizer=None)
    recipe = train_inprocess(config, recipe=ToyRecipe, setup_only=True)
    spec = ToyRecipe.all_sections()["optimizer"]
    assert dict(spec.default) == {"_target_": "torch.optim.AdamW", "lr": 1e-5}
    assert isinstance(recipe.optimizer, torch.optim.AdamW) and recipe.optimizer.param_groups[0]["lr"] == 1e-5
    assert type(recipe.loss_fn).__name__ == "MaskedCrossEntropy"  # loss_fn's spec default
    assert type(recipe.dataloader).__name__ == "StatefulDataLoader"  # dataloader's spec default target
    assert recipe.lr_scheduler is None  # lr_scheduler has no default: absent means none
    assert main(["run", "-c", str(config), "--dry-run"]) == 0
    assert "optimizer: torch.optim.AdamW (default)" in capsys.readouterr().out


def test_stateful_attributes_are_declared_and_merged():
    class WithTeacher(ToyRecipe):
        stateful = ("ema",)

    assert ToyRecipe.all_stateful() == ("model", "optimizer", "lr_scheduler", "step_scheduler", "dataloader", "rng",
                                         "grad_scaler")
    assert WithTeacher.all_stateful() == (*ToyRecipe.all_stateful(), "ema")


def test_checkpoint_holds_every_stateful_attribute_and_resumes_exactly(make_toy, tmp_path):
    run = {"step_scheduler": {"max_steps": 6, "checkpoint_interval": 3}, "dataloader": {"shuffle": True},
           "lr_scheduler": {"_target_": "automodel.optim.CosineAnnealingWarmup", "warmup_steps": 2}}
    config = make_toy(**run)
    reference = train_inprocess(config, recipe=ToyRecipe)
    root = tmp_path / "ckpt"
    assert checkpoint_dirs(root) == ["epoch_0_step_3", "epoch_0_step_6"]
    middle = root / "epoch_0_step_3"
    files = sorted(str(p.relative_to(middle)) for p in middle.rglob("*") if p.is_file())
    assert [f for f in files if not f.startswith(("model/", "optim/shard-"))] == [
        "config.yaml", "dataloader/rank_0.json", "optim/lr_scheduler.json",
        "optim/optimizer.json", "optim/tensors.json", "rng/rank_0.json", "rng/rank_0.safetensors",
        "trainer_state.json"]  # JSON and safetensors only: nothing is pickled
    state = json.loads((middle / "trainer_state.json").read_text())
    assert state["step_scheduler"] == {"step": 3, "epoch": 0, "epoch_step": 3} and state["weights"] == "model"

    resumed = train_inprocess(config, "--checkpoint.checkpoint_dir", tmp_path / "again", "--restore_from.path",
                              middle, recipe=ToyRecipe)
    assert resumed.step_scheduler.step == 6
    first, again = losses_by_step(root / "training.jsonl"), losses_by_step(tmp_path / "again" / "training.jsonl")
    assert sorted(again) == [4, 5, 6] and all(again[s] == first[s] for s in again)  # bitwise
    assert_states_equal(resumed.model.state_dict(), reference.model.state_dict())


def test_declared_stage_choices_and_refusals_are_validated(make_toy, capsys):
    class Refusing(ToyRecipe):
        unsupported_stages = {"freeze": "the toy never freezes; remove freeze:"}

    class Elsewhere(ToyRecipe):
        stage_implementations = {"device": "elsewhere"}

    with pytest.raises(Exception, match="freeze: the toy never freezes; remove freeze:"):
        load_config(make_toy(freeze={"patterns": ["head.*"]}), recipe=Refusing)
    assert "freeze" not in Refusing.pipeline_selection(load_config(make_toy(), recipe=ToyRecipe)[1])
    with pytest.raises(Exception, match="dist_env: pipeline stage 'device' needs implementation 'elsewhere', which "
                                        "is not installed"):
        load_config(make_toy(), recipe=Elsewhere)


def test_the_toy_plugin_routes_train_toy(make_toy, tmp_path, with_plugin):
    from automodel.testing import ToyPlugin, read_jsonl

    with_plugin("toy", ToyPlugin)
    assert main(["train", "toy", "-c", str(make_toy()), "--step_scheduler.max_steps", "2"]) == 0
    assert [row["step"] for row in read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1, 2]
    assert checkpoint_dirs(tmp_path / "ckpt") == ["epoch_0_step_2"]
