"""Config validation: every problem at once, each with its dotted key and a did-you-mean."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from automodel import BaseRecipe
from automodel.config import Free, Target, TargetResolver, build_config
from automodel.errors import ConfigError, ConfigIssue
from automodel.suggest import did_you_mean


@dataclass
class Sched:
    max_steps: int = 10
    num_epochs: int = 1
    val_check_interval: int = field(default=5, metadata={"aliases": ("val_every_steps",)})
    lr: float = 0.1
    name: str | None = None
    mode: str = "train"


@dataclass
class Required:
    path: str


class Recipe(BaseRecipe):
    sections: ClassVar[dict] = {
        "step_scheduler": Sched,
        "model": Target("the model"),
        "optimizer": Target("the optimizer", runtime_args=("params",)),
        "dataset": Target("training data", required=True),
        "validation_dataset_*": Target("extra validation sets"),
        "extra": Free("anything"),
    }


class Child(Recipe):
    sections: ClassVar[dict] = {"restore_from": Required}


class Checked(Recipe):
    @classmethod
    def check_config(cls, cfg):
        s = cfg.step_scheduler
        if s is not None and s.max_steps < s.val_check_interval:
            return [ConfigIssue("step_scheduler.val_check_interval", "larger than max_steps")]
        return []


@pytest.fixture
def check(resolver):
    def run(data: dict, recipe=Recipe):
        data = {"dataset": {"_target_": "amt_targets.anything"}, **data}
        return build_config(data, recipe, resolver)

    return run


def _issues(check, data, recipe=Recipe) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        check(data, recipe)
    return info.value.issues


# (id, config, expected issue key, message fragment, suggestion)
BAD = [
    ("unknown-section", {"step_schedular": {}}, "step_schedular", "unknown section", "step_scheduler"),
    ("unknown-section-far", {"zzz": {}}, "zzz", "unknown section", None),
    ("unknown-key", {"step_scheduler": {"max_step": 5}}, "step_scheduler.max_step", "unknown key", "max_steps"),
    ("unknown-key-lists-accepted", {"step_scheduler": {"bogus": 1}}, "step_scheduler.bogus",
     "accepts: max_steps, num_epochs", None),
    ("wrong-int", {"step_scheduler": {"max_steps": "ten"}}, "step_scheduler.max_steps", "expected int, found str",
     None),
    ("bool-is-not-int", {"step_scheduler": {"max_steps": True}}, "step_scheduler.max_steps", "expected int", None),
    ("float-is-not-int", {"step_scheduler": {"max_steps": 1.5}}, "step_scheduler.max_steps", "expected int", None),
    ("wrong-float", {"step_scheduler": {"lr": "fast"}}, "step_scheduler.lr", "expected float", None),
    ("wrong-optional", {"step_scheduler": {"name": 3}}, "step_scheduler.name", "expected str | null", None),
    ("section-not-mapping", {"step_scheduler": 5}, "step_scheduler", "expected a section", None),
    ("alias-and-canonical", {"step_scheduler": {"val_check_interval": 1, "val_every_steps": 2}},
     "step_scheduler.val_every_steps", "given twice", None),
    ("kwarg-not-in-signature", {"model": {"_target_": "amt_targets.make_thing", "size": 1, "colr": "b"}},
     "model.colr", "does not accept an argument 'colr'", "color"),
    ("missing-required-arg", {"model": {"_target_": "amt_targets.make_thing"}}, "model.size",
     "missing required argument 'size'", None),
    ("keyword-only-checked", {"model": {"_target_": "amt_targets.Widget", "nmae": "x"}}, "model.nmae",
     "does not accept", "name"),
    ("target-does-not-import", {"model": {"_target_": "amt_targets.make_thnig", "size": 1}}, "model._target_",
     "has no attribute 'make_thnig'", "amt_targets.make_thing"),
    ("torch-typo", {"optimizer": {"_target_": "torch.optim.AdamX", "lr": 1e-4}}, "optimizer._target_",
     "'torch.optim.AdamX' is not a registered target", "torch.optim.AdamW"),
    ("torch-kwarg", {"optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-4, "betas2": [0.9, 0.9]}},
     "optimizer.betas2", "does not accept", "betas"),
    ("target-missing", {"model": {"size": 1}}, "model._target_", "missing", None),
    ("target-section-scalar", {"model": "gpt2"}, "model", "expected a section with _target_", None),
    ("nested-kwarg", {"model": {"_target_": "amt_targets.combine",
                                "left": {"_target_": "amt_targets.make_thing", "sise": 1}}},
     "model.left.sise", "does not accept", "size"),
    ("nested-in-list", {"model": {"_target_": "amt_targets.combine", "left": 1,
                                  "items": [{"_target_": "amt_targets.make_thing"}]}},
     "model.items[0].size", "missing required argument", None),
    ("nested-in-free", {"extra": {"a": {"_target_": "amt_targets.Widget", "bogus": 1}}}, "extra.a.bogus",
     "does not accept", None),
    ("family-member-checked", {"validation_dataset_squad": {"_target_": "amt_targets.make_thing"}},
     "validation_dataset_squad.size", "missing required argument", None),
    ("missing-env", {"model": {"_target_": "amt_targets.make_thing", "size": "${AMT_UNSET_VAR}"}}, "model.size",
     "AMT_UNSET_VAR", None),
]


@pytest.mark.parametrize("data,key,fragment,suggestion", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_invalid_configs(check, data, key, fragment, suggestion, monkeypatch):
    monkeypatch.delenv("AMT_UNSET_VAR", raising=False)
    issues = _issues(check, data)
    by_key = {i.key: i for i in issues}
    assert key in by_key, issues
    assert fragment in by_key[key].message
    assert by_key[key].suggestion == suggestion
    if suggestion:
        assert f"(did you mean '{suggestion}'?)" in str(by_key[key])


def test_required_section_missing(resolver):
    with pytest.raises(ConfigError, match="dataset: required section is missing: training data"):
        build_config({}, Recipe, resolver)


def test_required_dataclass_key_missing(check):
    issues = _issues(check, {}, Child)
    assert [(i.key, i.message) for i in issues] == [("restore_from.path", "required key is missing")]


def test_sections_merge_along_the_class_hierarchy():
    assert set(Child.all_sections()) == {"recipe", "ci", "skypilot", "nemo_run", "step_scheduler", "model",
                                         "optimizer", "dataset", "validation_dataset_*", "extra", "restore_from"}


def test_valid_config_types_defaults_and_aliases(check, monkeypatch):
    monkeypatch.setenv("AMT_STEPS", "20")
    cfg = check({"step_scheduler": {"max_steps": "${AMT_STEPS,3}", "lr": 1, "val_every_steps": 4},
                 "model": {"_target_": "amt_targets.make_thing", "size": 2},
                 "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-4}})
    s = cfg.step_scheduler
    assert isinstance(s, Sched)
    assert (s.max_steps, s.lr, s.val_check_interval, s.num_epochs) == (20, 1.0, 4, 1)
    assert isinstance(s.lr, float)
    assert cfg.model.size == 2 and cfg.model.instantiate() == {"size": 2, "color": "red"}
    assert cfg.optimizer.lr == 1e-4
    assert cfg.extra is None and cfg.get("extra", "d") == "d"
    assert cfg.raw["step_scheduler"]["max_steps"] == "${AMT_STEPS,3}"  # placeholders kept for printing


def test_absent_dataclass_section_reads_as_defaults(check):
    assert check({}).step_scheduler == Sched()


def test_overrides_are_validated_like_the_file(resolver):
    base = {"dataset": {"_target_": "amt_targets.anything"}}
    cfg = build_config(base, Recipe, resolver, overrides=[("step_scheduler.max_steps", 7)])
    assert cfg.step_scheduler.max_steps == 7
    with pytest.raises(ConfigError) as info:
        build_config(base, Recipe, resolver, overrides=[("step_scheduler.max_step", 7)])
    assert info.value.issues[0].suggestion == "max_steps"


def test_three_mistakes_are_reported_together(check):
    issues = _issues(check, {
        "step_schedular": {"max_steps": 5},                                     # unknown section
        "model": {"_target_": "amt_targets.make_thing", "size": 1, "colr": 1},  # unknown kwarg
        "optimizer": {"_target_": "torch.optim.AdamX"},                         # target not registered
    })
    assert [i.key for i in issues] == ["step_schedular", "model.colr", "optimizer._target_"]
    assert [i.suggestion for i in issues] == ["step_scheduler", "color", "torch.optim.AdamW"]
    text = str(ConfigError(issues))
    assert text.startswith("invalid configuration (3 problems):")
    assert ConfigError(issues).exit_code == 2


def test_recipe_checks_run_with_section_errors(check):
    issues = _issues(check, {"step_scheduler": {"max_steps": 2, "val_check_interval": 5}, "bogus": 1}, Checked)
    assert {i.key for i in issues} == {"bogus", "step_scheduler.val_check_interval"}


def test_recipe_section_names_the_recipe_being_run(targets, resolver):
    tiny = targets.TinyRecipe
    for form in ({"_target_": "amt_targets.TinyRecipe"}, "amt_targets.TinyRecipe"):
        assert build_config({"recipe": form}, tiny, resolver).recipe.target == "amt_targets.TinyRecipe"
    with pytest.raises(ConfigError) as info:
        build_config({"recipe": {"_target_": "amt_targets.TinyRecipe", "lr": 1}}, tiny, resolver)
    assert [i.key for i in info.value.issues] == ["recipe.lr"]  # the section holds the name only


def test_recipe_section_naming_another_recipe_is_refused(check):
    """A route runs its own recipe: a config written for another one says so instead of running the wrong one."""
    issues = _issues(check, {"recipe": "amt_targets.TinyRecipe"})
    assert [i.key for i in issues] == ["recipe"]
    assert "amt_targets.TinyRecipe" in issues[0].message and "automodel run -c FILE" in issues[0].message


@pytest.mark.parametrize("name,candidates,expected", [
    ("AdamX", ["Adam", "AdamW", "Adamax", "SGD"], "AdamW"),
    ("max_step", ["max_steps", "num_epochs"], "max_steps"),
    ("nam", ["name", "out"], "name"),
    ("lr", ["lr_scheduler", "optimizer"], None),
    ("trian", ["train", "test"], "train"),
    ("zzz", ["a", "b"], None),
    ("x", [], None),
])
def test_did_you_mean(name, candidates, expected):
    assert did_you_mean(name, candidates) == expected


def test_validation_with_core_resolver_only():
    """Without the test prefix, the test's own module is not allowed: reported, not imported."""
    with pytest.raises(ConfigError, match="is not a registered target"):
        build_config({"dataset": {"_target_": "amt_targets.anything"}}, Recipe, TargetResolver())



@pytest.mark.parametrize("value", ["<your_path>", "/path/to/model", "runs/one/epoch_0_step_3/model", "a b"])
def test_a_model_location_neither_a_path_nor_a_hub_id_is_refused(check, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    issues = _issues(check, {"extra": {"tokenizer": {"pretrained_model_name_or_path": value}}})
    assert [i.key for i in issues] == ["extra.tokenizer.pretrained_model_name_or_path"]
    assert f"'{value}' is neither an existing local path" in issues[0].message
    assert str(tmp_path) in issues[0].message  # where a relative path was looked for


@pytest.mark.parametrize("value", ["org/name", "gpt2", "here", "here/inner", "s3://bucket/model"])
def test_a_hub_id_or_an_existing_path_is_a_model_location(check, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here" / "inner").mkdir(parents=True)
    assert check({"extra": {"model_name_or_path": value, "model_path": str(tmp_path / "here")}}) is not None
