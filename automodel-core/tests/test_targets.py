"""``_target_`` resolution and instantiation: classmethods, nested nodes, lists, runtime kwargs, aliases."""

from __future__ import annotations

import inspect

import pytest

from automodel.config import (
    BuildError,
    Config,
    ConfigNode,
    TargetError,
    TargetResolver,
    instantiate,
)
from automodel.errors import ConfigError


def test_classmethod_target_resolves_to_a_callable_without_calling_it():
    import transformers

    fn = TargetResolver().resolve("transformers.AutoTokenizer.from_pretrained")
    assert callable(fn) and inspect.ismethod(fn) and fn.__self__ is transformers.AutoTokenizer
    # resolving returned the bound classmethod itself: nothing was loaded (offline, no such model anyway)


def test_real_classmethod_resolves():
    fn = TargetResolver().resolve("transformers.AutoTokenizer.from_pretrained")
    assert fn.__func__.__name__ == "from_pretrained"


@pytest.mark.parametrize("name,expected", [
    ("torch.optim.AdamW", "AdamW"),
    ("torch.nn.CrossEntropyLoss", "CrossEntropyLoss"),
    ("torch.optim.lr_scheduler.LambdaLR", "LambdaLR"),  # a submodule imported on the way
    ("torchdata.stateful_dataloader.StatefulDataLoader", "StatefulDataLoader"),
])
def test_library_targets_resolve(name, expected):
    assert TargetResolver().resolve(name).__name__ == expected


def test_own_classmethod_target(resolver, targets):
    fn = resolver.resolve("amt_targets.Widget.create")
    assert targets.CALLS == []
    widget = fn(size=5)
    assert (widget.size, widget.name) == (5, "created")


def test_resolution_is_cached_per_name(resolver):
    assert resolver.resolve("amt_targets.make_thing") is resolver.resolve("amt_targets.make_thing")


@pytest.mark.parametrize("name,needle,suggestion", [
    ("torch.optim.AdamX", "is not a registered target", "torch.optim.AdamW"),
    ("torch.optim.SDG", "is not a registered target", "torch.optim.SGD"),
    ("torch.nn.MSELos", "is not a registered target", "torch.nn.MSELoss"),
    ("amt_targets.make_thnig", "has no attribute 'make_thnig'", "amt_targets.make_thing"),
    ("amt_targets.zzzzzz", "has no attribute 'zzzzzz'", None),
    ("amt_no_such_pkg.f", "is not a registered target", None),
    ("torch.optim", "is not a registered target", "torch.optim.SGD"),
    ("amt_targets", "is a module, not a callable", None),
    ("amt_targets.NOT_CALLABLE", "is not callable", None),
    ("Thnig", "is not a registered target", "Thing"),  # an alias typo suggests the alias
    ("", "must be a dotted path string", None),
    (None, "must be a dotted path string", None),
    (["torch.optim.AdamW"], "must be a dotted path string", None),
    ("torch nn", "not a dotted Python path", None),
])
def test_unresolvable_targets(resolver, name, needle, suggestion):
    with pytest.raises(TargetError) as info:
        resolver.resolve(name)
    assert needle in str(info.value)
    assert info.value.suggestion == suggestion


def test_missing_top_level_module(monkeypatch):
    monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", "amt_absent_pkg")
    with pytest.raises(TargetError, match="cannot import 'amt_absent_pkg'"):
        TargetResolver().resolve("amt_absent_pkg.thing")


def test_user_allow_list_from_environment(monkeypatch, targets):
    with pytest.raises(TargetError, match="AUTOMODEL_ALLOW_TARGETS"):
        TargetResolver().resolve("amt_targets.make_thing")
    monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", " amt_other , amt_targets ")
    assert TargetResolver().resolve("amt_targets.make_thing") is targets.make_thing


def test_prefix_must_match_a_whole_module_name(monkeypatch, targets):
    monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", "amt_tar")
    with pytest.raises(TargetError, match="is not a registered target"):
        TargetResolver().resolve("amt_targets.make_thing")


# ---- aliases ------------------------------------------------------------------------------------------------

def test_aliases_expand_including_chains(resolver, targets):
    assert resolver.expand("Thing") == "amt_targets.make_thing"
    assert resolver.expand("Chain") == "amt_targets.make_thing"
    assert resolver.resolve("Chain") is targets.make_thing


def test_upstream_file_form_stands_for_the_alias_of_its_dotted_name(make_resolver, targets, tmp_path, monkeypatch):
    """Upstream's loader imports ``nemo_automodel/x/y.py:Name`` from the file; here it is the alias of
    ``nemo_automodel.x.y.Name``, and no file is read (one planted at that path runs nothing)."""
    planted = tmp_path / "nemo_automodel" / "datasets"
    planted.mkdir(parents=True)
    (planted / "mock.py").write_text(f"open({str(tmp_path / 'sentinel')!r}, 'w').close()\nMock = None\n")
    monkeypatch.chdir(tmp_path)
    resolver = make_resolver("amt_targets", aliases={"nemo_automodel.datasets.mock.Mock": "amt_targets.make_thing"})
    assert resolver.resolve("nemo_automodel/datasets/mock.py:Mock") is targets.make_thing
    for unaliased in ("nemo_automodel/datasets/mock.py:Other", "nemo_automodel/../evil.py:f",
                      "./nemo_automodel/datasets/mock.py:Mock", "/x/nemo_automodel/datasets/mock.py:Mock"):
        with pytest.raises(TargetError, match="looks like a file path"):
            resolver.resolve(unaliased)
    assert not (tmp_path / "sentinel").exists()


def test_alias_cycle_does_not_hang():
    resolver = TargetResolver(aliases={"A": "B", "B": "A"})
    with pytest.raises(TargetError):
        resolver.resolve("A")


# ---- instantiation ------------------------------------------------------------------------------------------

def test_instantiate_passes_siblings_as_kwargs(resolver):
    assert instantiate({"_target_": "Thing", "size": 3, "color": "blue"}, resolver, "thing") == \
        {"size": 3, "color": "blue"}


def test_nested_target_nodes_are_built_first(resolver, targets):
    node = {"_target_": "amt_targets.combine",
            "left": {"_target_": "amt_targets.make_thing", "size": 1},
            "right": {"plain": {"_target_": "amt_targets.make_thing", "size": 2}}}
    out = instantiate(node, resolver, "root")
    assert out == {"left": {"size": 1, "color": "red"}, "right": {"plain": {"size": 2, "color": "red"}},
                   "items": []}
    assert [c[0] for c in targets.CALLS] == ["make_thing", "make_thing", "combine"]


def test_lists_of_target_nodes(resolver):
    node = {"_target_": "amt_targets.combine", "left": 0,
            "items": [{"_target_": "Thing", "size": 1}, 5, {"_target_": "amt_targets.Widget", "size": 9}]}
    out = instantiate(node, resolver, "root")
    assert out["items"][0] == {"size": 1, "color": "red"}
    assert out["items"][1] == 5
    assert out["items"][2].size == 9


def test_runtime_kwargs_win_over_config(resolver):
    node = {"_target_": "Thing", "size": 1, "color": "blue"}
    assert instantiate(node, resolver, "thing", size=99) == {"size": 99, "color": "blue"}


def test_default_target_when_node_has_none(resolver):
    assert instantiate({"size": 4}, resolver, "thing", default_target="Thing") == {"size": 4, "color": "red"}


def test_instantiate_refused_target_is_a_config_error_naming_the_key(resolver):
    with pytest.raises(ConfigError) as info:
        instantiate({"_target_": "amt_targets.make_thnig"}, resolver, "model")
    assert info.value.issues[0].key == "model._target_"
    assert info.value.issues[0].suggestion == "amt_targets.make_thing"


def test_nested_refused_target_names_the_nested_key(resolver):
    with pytest.raises(ConfigError) as info:
        instantiate({"_target_": "amt_targets.combine", "left": {"_target_": "os.getcwd"}}, resolver, "model")
    assert info.value.issues[0].key == "model.left._target_"


def test_build_error_names_the_node(resolver):
    with pytest.raises(BuildError) as info:
        instantiate({"_target_": "Thing", "size": 1, "bogus": 2}, resolver, "dataset")
    assert info.value.key == "dataset"
    assert "dataset: building Thing failed: TypeError" in str(info.value)


def test_config_node_attribute_access_and_instantiate(resolver):
    node = ConfigNode({"_target_": "Thing", "size": 2, "sub": {"k": "v"}}, "thing", resolver)
    assert node.size == 2 and node["size"] == 2
    assert node.sub.k == "v" and node.sub.key == "thing.sub"
    assert node.target == "Thing"
    assert dict(node.to_dict()) == {"_target_": "Thing", "size": 2, "sub": {"k": "v"}}
    assert ConfigNode({"_target_": "Thing", "size": 2}, "t", resolver).instantiate(color="green") == \
        {"size": 2, "color": "green"}
    with pytest.raises(AttributeError, match="no key 'nope'"):
        _ = node.nope


def test_config_to_yaml_prints_raw_masked(resolver):
    raw = {"model": {"name": "${AMT_MODEL,m}", "hf_token": "hf_secret"}}
    resolved = {"model": {"name": "m", "hf_token": "hf_secret"}}
    cfg = Config(raw, resolved, {"model": ConfigNode(resolved["model"], "model", resolver)}, resolver)
    text = cfg.to_yaml()
    assert "${AMT_MODEL,m}" in text and "hf_secret" not in text and "***" in text
    assert cfg.model.name == "m" and "model" in cfg and "other" not in cfg
    with pytest.raises(AttributeError, match="no section 'other'"):
        _ = cfg.other


def test_unsupported_name_is_refused_with_its_reason_even_if_an_alias_exists():
    resolver = TargetResolver(aliases={"upstream.Thing": "torch.optim.AdamW"},
                              unsupported={"upstream.Other": "no such data set here; use pkg.Mine"})
    with pytest.raises(TargetError, match=r"'upstream.Other' is not supported here: no such data set here; "
                                          r"use pkg.Mine"):
        resolver.resolve("upstream.Other")
    assert resolver.resolve("upstream.Thing").__name__ == "AdamW"


def test_alias_registry_records_unsupported_names_and_refuses_a_conflicting_reason():
    from automodel.errors import PluginError
    from automodel.plugins.registries import AliasRegistry

    aliases = AliasRegistry()
    aliases.source = "dist-a"
    aliases.unsupported("up.Name", "use ours")
    aliases.unsupported("up.Name", "use ours")  # the same twice is fine
    assert aliases.unsupported_targets == {"up.Name": "use ours"}
    aliases.source = "dist-b"
    with pytest.raises(PluginError, match="dist-a"):
        aliases.unsupported("up.Name", "something else")


# ---- the rule: transformers' own configuration classes, their constructors and from_pretrained ----------------

QWEN3_MOE_CONFIG = "transformers.models.qwen3_moe.configuration_qwen3_moe.Qwen3MoeConfig"


@pytest.mark.parametrize("name", [QWEN3_MOE_CONFIG, "transformers.Qwen3MoeConfig"])
def test_a_transformers_configuration_class_builds_by_the_rule(name):
    from transformers import Qwen3MoeConfig

    node = {"_target_": name, "num_experts": 4, "hidden_size": 32, "rope_theta": 1000.0}
    config = instantiate(node, TargetResolver(), "model.config")
    assert type(config) is Qwen3MoeConfig and config.num_experts == 4 and config.hidden_size == 32
    assert config.rope_parameters["rope_theta"] == 1000.0  # a legacy key transformers converts (not in the signature)


@pytest.mark.parametrize("name", [f"{QWEN3_MOE_CONFIG}.from_pretrained", "transformers.Qwen3MoeConfig.from_pretrained"])
def test_a_transformers_configuration_class_reads_a_config_json_by_the_rule(name, tmp_path):
    """``from_pretrained`` (upstream's ``model.config`` form with a model id): the keys given override the file's."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(num_experts=8, hidden_size=64).save_pretrained(tmp_path)
    node = {"_target_": name, "pretrained_model_name_or_path": str(tmp_path), "num_experts": 4}
    config = instantiate(node, TargetResolver(), "model.config")
    assert type(config) is Qwen3MoeConfig and config.num_experts == 4 and config.hidden_size == 64


@pytest.mark.parametrize("name, fragment", [
    ("transformers.Qwen3MoeConfig.from_dict", "is not a registered target"),
    ("transformers.Qwen3MoeConfig.from_json_file", "is not a registered target"),
    ("transformers.AutoConfig.from_pretrained", "is not one of transformers. configuration classes"),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeForCausalLM", "is not a registered target"),
    ("transformers.models.auto.configuration_auto.AutoConfig", "is not one of transformers' configuration classes"),
    ("transformers.GenerationConfig", "is not one of transformers' configuration classes"),
    ("transformers.PretrainedConfig", "is not one of transformers' configuration classes"),
    ("transformers.BitsAndBytesConfig", "is not one of transformers' configuration classes"),
])
def test_the_rule_admits_nothing_but_the_configuration_classes(name, fragment):
    with pytest.raises(TargetError, match=fragment):
        TargetResolver().resolve(name)


def test_a_plugin_may_register_the_rule_and_nothing_like_it():
    from automodel.config.registry import HF_CONFIG_RULE, RULE, classify

    registrations, problems = classify([HF_CONFIG_RULE, "transformers.models.<model>.anything"], set(), "p")
    assert [(r.name, r.kind) for r in registrations] == [(HF_CONFIG_RULE, RULE)]
    assert len(problems) == 1 and "is not a dotted path" in problems[0]
