"""The plugin manager: every hook, guarded loading, conflicts, disabling, no shadowing, the fixed pipeline."""

from __future__ import annotations

import click
import pytest

from automodel import hookimpl
from automodel.cli.commands import CORE_COMMANDS
from automodel.cli.main import AutomodelGroup
from automodel.errors import PluginError
from automodel.plugins import PIPELINE_SLOTS, hookspecs
from automodel.plugins.manager import (
    HOOK_NAMES,
    PluginManager,
    get_plugin_manager,
    reset_plugin_manager,
)
from automodel.plugins.registries import (
    AliasRegistry,
    BuilderRegistry,
    LoggerRegistry,
    RouteRegistry,
    StageRegistry,
)

pytestmark = pytest.mark.smoke  # the core's share of make test-min

SPEC_NAMES = sorted(n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "automodel_spec"))


def moon_builder(**kwargs):
    return "moon-model"


def moon_stage(model, cfg):
    return model


def moon_logger(**kwargs):
    return "moon-logger"


@click.command("moon-cmd")
def moon_cmd():
    """A plugin's own command."""
    click.echo("moon!")


class AllHooks:
    """A plugin implementing every hook once."""

    @hookimpl
    def automodel_register_routes(self, routes):
        routes.add("greet", "moon", recipe="amt_moon.recipe.MoonRecipe", help="Greet the moon", examples=["moon/hi"])

    @hookimpl
    def automodel_register_aliases(self, aliases):
        aliases.command("gr", "greet")
        aliases.domain("luna", "moon")
        aliases.target("Thing", "amt_targets.make_thing")
        aliases.recipe("UpstreamMoonRecipe", "greet", "moon")

    @hookimpl
    def automodel_register_builders(self, builders):
        builders.add("model", moon_builder, domain="moon")

    @hookimpl
    def automodel_register_stages(self, stages):
        stages.add("sharding", "moonshard", moon_stage)

    @hookimpl
    def automodel_allowed_targets(self):
        return ["amt_moon.make_moon", "torch.optim.SGD"]  # exact callables (this test plugin owns no package)

    @hookimpl
    def automodel_register_commands(self, cli):
        cli.add_command(moon_cmd)

    @hookimpl
    def automodel_register_loggers(self, loggers):
        loggers.add("moonlog", moon_logger)


def _check_routes(mgr, group):
    route = mgr.routes.get("greet", "moon")
    assert (route.recipe, route.help, route.examples, route.source) == \
        ("amt_moon.recipe.MoonRecipe", "Greet the moon", ["moon/hi"], "t")
    assert "greet" in mgr.routes.commands() and mgr.routes.domains("greet") == ["moon"]


def _check_aliases(mgr, group):
    assert mgr.aliases.commands["gr"] == "greet"
    assert mgr.aliases.domains["luna"] == "moon"
    assert mgr.resolver().expand("Thing") == "amt_targets.make_thing"
    recipes = mgr.resolver().recipes
    assert recipes.paths["UpstreamMoonRecipe"] == "amt_moon.recipe.MoonRecipe"  # selects the route's recipe
    assert recipes.routes["amt_moon.recipe.MoonRecipe"] == ("greet moon",)
    assert "greet moon: amt_moon.recipe.MoonRecipe; also named UpstreamMoonRecipe" in recipes.describe()


def _check_builders(mgr, group):
    assert mgr.builders.get("model", "moon") is moon_builder
    assert mgr.builders.builders[("model", "moon")].source == "t"
    assert mgr.builders.builders[("model", None)].source == "automodel-core"  # the default is untouched


def _check_stages(mgr, group):
    assert mgr.stages.get("sharding", "moonshard") is moon_stage
    assert mgr.stages.implementations("sharding")["moonshard"].source == "t"


def _check_allowed_targets(mgr, group):
    mine = {(r.name, r.kind) for r in mgr.targets.entries() if r.source == "t"}
    assert mine == {("amt_moon.make_moon", "exact"), ("torch.optim.SGD", "exact")}
    assert mgr.resolver().registry.grant("amt_moon.make_moon") is not None
    assert mgr.resolver().registry.grant("amt_moon.other") is None


def _check_commands(mgr, group):
    assert group.commands["moon-cmd"] is moon_cmd
    assert {c.name for c in CORE_COMMANDS} <= set(group.commands)


def _check_loggers(mgr, group):
    assert mgr.loggers.get("moonlog") is moon_logger


HOOK_CHECKS = {
    "automodel_register_routes": _check_routes,
    "automodel_register_aliases": _check_aliases,
    "automodel_register_builders": _check_builders,
    "automodel_register_stages": _check_stages,
    "automodel_allowed_targets": _check_allowed_targets,
    "automodel_register_commands": _check_commands,
    "automodel_register_loggers": _check_loggers,
}


@pytest.fixture
def loaded():
    mgr = PluginManager(load_entry_points=False, extra_plugins=[("t", AllHooks())])
    group = AutomodelGroup(name="automodel")
    mgr.register_commands(group)
    return mgr, group


def test_every_hookspec_has_a_test():
    assert SPEC_NAMES, "no hookspecs found"
    assert sorted(HOOK_CHECKS) == SPEC_NAMES
    assert sorted(HOOK_NAMES) == SPEC_NAMES  # the manager knows every hook
    assert sorted(n for n in dir(AllHooks) if n.startswith("automodel_")) == SPEC_NAMES


@pytest.mark.parametrize("hook", SPEC_NAMES)
def test_hook(loaded, hook):
    mgr, group = loaded
    assert mgr.plugins["t"].ok, mgr.plugins["t"]
    assert hook in mgr.plugins["t"].hooks
    HOOK_CHECKS[hook](mgr, group)


@pytest.mark.parametrize("hook", SPEC_NAMES)
def test_every_hookspec_is_documented(hook):
    doc = getattr(hookspecs, hook).__doc__
    assert doc and doc.strip()


def test_core_registers_through_the_same_hooks():
    mgr = PluginManager(load_entry_points=False)
    core = mgr.plugins["core"]
    assert core.ok and core.distribution == "automodel-core" and core.module == "automodel.builtin_plugin"
    assert "automodel_register_commands" in core.hooks
    group = AutomodelGroup(name="automodel")
    mgr.register_commands(group)
    assert {"run", "validate", "recipes", "plugins", "cp"} <= set(group.commands)


# ---- failures are recorded against the plugin --------------------------------------------------------------

class RaisesInRoutes:
    @hookimpl
    def automodel_register_routes(self, routes):
        routes.add("early", "one", recipe="amt_x.Recipe")
        raise RuntimeError("routes exploded")

    @hookimpl
    def automodel_register_aliases(self, aliases):
        aliases.domain("uno", "one")


class Good:
    @hookimpl
    def automodel_register_routes(self, routes):
        routes.add("fine", "two", recipe="amt_y.Recipe")


def test_plugin_raising_in_a_hook_is_recorded_and_others_keep_working():
    mgr = PluginManager(load_entry_points=False, extra_plugins=[("bad", RaisesInRoutes()), ("good", Good())])
    bad = mgr.plugins["bad"]
    assert not bad.ok
    assert bad.hook_errors == {"automodel_register_routes": "RuntimeError: routes exploded"}
    assert [i.name for i in mgr.failed()] == ["bad"]
    assert mgr.routes.get("fine", "two") is not None  # the other plugin's registrations
    assert mgr.aliases.domains["uno"] == "one"  # the failing plugin's other hooks still ran
    assert mgr.plugins["core"].ok and mgr.plugins["good"].ok
    assert bad.as_dict()["ok"] is False and "routes exploded" in bad.as_dict()["hook_errors"][
        "automodel_register_routes"]


class BadAllowedTargets:
    @hookimpl
    def automodel_allowed_targets(self):
        return "amt_str_not_list"


def test_allowed_targets_must_be_a_list():
    mgr = PluginManager(load_entry_points=False, extra_plugins=[("p", BadAllowedTargets())])
    assert "must return a list" in mgr.plugins["p"].hook_errors["automodel_allowed_targets"]
    assert all(r.source != "p" for r in mgr.targets.entries())


def _routes_plugin(command, domain, recipe):
    class P:
        @hookimpl
        def automodel_register_routes(self, routes):
            routes.add(command, domain, recipe=recipe)

    return P()


def test_duplicate_route_names_both_distributions():
    mgr = PluginManager(load_entry_points=False, extra_plugins=[
        ("automodel-first", _routes_plugin("finetune", "moon", "amt_a.Recipe")),
        ("automodel-second", _routes_plugin("finetune", "moon", "amt_b.Recipe")),
    ])
    conflict = mgr.routes.conflicts[("finetune", "moon")]
    assert "'automodel-first'" in conflict and "'automodel-second'" in conflict
    assert "finetune moon" in conflict
    assert mgr.plugins["automodel-first"].ok
    assert "automodel-first" in mgr.plugins["automodel-second"].hook_errors["automodel_register_routes"]
    assert mgr.routes.get("finetune", "moon").recipe == "amt_a.Recipe"


@pytest.mark.parametrize("command,domain,recipe,needle", [
    ("", "x", "a.B", "route command must be a word"),
    ("fine tune", "x", "a.B", "route command must be a word"),
    ("x", "a/b", "a.B", "route domain must be a word"),
    ("x", "y", "NoDots", "recipe must be a dotted path"),
])
def test_route_registry_refuses_bad_routes(command, domain, recipe, needle):
    with pytest.raises(PluginError, match=needle):
        RouteRegistry().add(command, domain, recipe=recipe)


class RecipeNameForNoRoute:
    @hookimpl
    def automodel_register_aliases(self, aliases):
        aliases.recipe("OrphanRecipe", "finetune", "nowhere")


def test_recipe_name_for_a_route_nobody_registers_is_the_plugins_error():
    mgr = PluginManager(load_entry_points=False, extra_plugins=[("p", RecipeNameForNoRoute())])
    assert "'finetune nowhere'" in mgr.plugins["p"].hook_errors["automodel_register_aliases"]
    assert "OrphanRecipe" not in mgr.resolver().recipes.paths


def test_alias_registry_conflicts_name_both_sources():
    aliases = AliasRegistry()
    aliases.source = "automodel-a"
    aliases.domain("text", "llm")
    aliases.domain("text", "llm")  # the same mapping again is fine
    aliases.source = "automodel-b"
    with pytest.raises(PluginError, match="'automodel-a' and 'automodel-b'"):
        aliases.domain("text", "vlm")
    with pytest.raises(PluginError, match="needs a name"):
        aliases.command("", "x")


def test_builder_and_logger_registries():
    builders = BuilderRegistry()
    builders.add("model", "amt_targets.make_thing")
    builders.add("model", moon_builder, domain="moon")
    assert builders.get("model", "moon") is moon_builder
    assert builders.names() == ["model"]
    builders.source = "other"
    with pytest.raises(PluginError, match="builder 'model'"):
        builders.add("model", moon_builder)
    with pytest.raises(KeyError):
        builders.get("optimizer")
    loggers = LoggerRegistry()
    loggers.add("x", moon_logger)
    with pytest.raises(PluginError, match="logger 'x'"):
        loggers.add("x", moon_logger)
    assert loggers.get("nope") is None


def test_dotted_registrations_import_lazily(targets_dir):
    builders = BuilderRegistry()
    builders.add("model", "amt_targets.make_thing")
    import amt_targets

    assert builders.get("model") is amt_targets.make_thing


# ---- the pipeline --------------------------------------------------------------------------------------------

def test_pipeline_slots_are_fixed_and_ordered():
    assert PIPELINE_SLOTS == ("peft", "fp8", "qat", "checkpoint", "freeze", "sharding", "device", "compile",
                              "context_parallel")


@pytest.mark.parametrize("slot", ["quantum", "PEFT", "sharding2", ""])
def test_stage_registry_refuses_unknown_slots(slot):
    with pytest.raises(PluginError, match="unknown pipeline slot") as info:
        StageRegistry().add(slot, "x", moon_stage)
    assert "peft, fp8, qat, checkpoint, freeze, sharding, device, compile, context_parallel" in str(info.value)


def test_stage_duplicates_are_refused_and_plugin_new_slot_is_recorded():
    stages = StageRegistry()
    stages.add("peft", "lora", moon_stage)
    with pytest.raises(PluginError, match="stage 'lora' in slot 'peft'"):
        stages.add("peft", "lora", moon_stage)

    class NewSlot:
        @hookimpl
        def automodel_register_stages(self, stages):
            stages.add("warp_drive", "x", moon_stage)

    mgr = PluginManager(load_entry_points=False, extra_plugins=[("p", NewSlot())])
    assert "unknown pipeline slot 'warp_drive'" in mgr.plugins["p"].hook_errors["automodel_register_stages"]
    assert {s for s, _ in mgr.stages.stages} <= set(PIPELINE_SLOTS)


# ---- core commands cannot be shadowed ------------------------------------------------------------------------

class Shadow:
    @hookimpl
    def automodel_register_commands(self, cli):
        @click.command("run")
        def fake_run():
            click.echo("SHADOWED")

        cli.add_command(fake_run)

    @hookimpl
    def automodel_register_aliases(self, aliases):
        aliases.command("plugins", "greet")  # try to hijack a core command through an alias

    @hookimpl
    def automodel_register_routes(self, routes):
        routes.add("greet", "moon", recipe="amt_moon.Recipe")
        routes.add("validate", "moon", recipe="amt_moon.Recipe")


@pytest.fixture
def shadow_group():
    mgr = PluginManager(load_entry_points=False, extra_plugins=[("shadow", Shadow())])
    reset_plugin_manager(mgr)
    try:
        yield mgr, AutomodelGroup(name="automodel")
    finally:
        reset_plugin_manager(None)


def test_core_commands_cannot_be_shadowed(shadow_group):
    mgr, group = shadow_group
    ctx = click.Context(group)
    core = {c.name: c for c in CORE_COMMANDS}
    for name in ("run", "plugins", "validate", "recipes", "cp"):
        assert group.get_command(ctx, name) is core[name], name
    assert "cannot be replaced" in mgr.plugins["shadow"].hook_errors["automodel_register_commands"]
    assert group.get_command(ctx, "greet").name == "greet"  # the plugin's own route still works


def test_global_manager_is_reset(shadow_group):
    mgr, _ = shadow_group
    assert get_plugin_manager() is mgr


# ---- entry points ------------------------------------------------------------------------------------------

def _plugin_module(command: str) -> str:
    return (f"from automodel import hookimpl\n\n@hookimpl\ndef automodel_register_routes(routes):\n"
            f"    routes.add({command!r}, 'moon', recipe='amt_ep.Recipe')\n")


def test_entry_point_plugins_load_with_their_distribution(make_dist, tmp_path):
    make_dist(tmp_path / "a", "automodel-amtalpha", "1.2.3", {"amtalpha": "amt_alpha_plugin"},
              {"amt_alpha_plugin.py": _plugin_module("alpha")})
    mgr = PluginManager()
    info = mgr.plugins["amtalpha"]
    assert (info.distribution, info.version, info.module, info.ok) == \
        ("automodel-amtalpha", "1.2.3", "amt_alpha_plugin", True)
    assert mgr.routes.get("alpha", "moon").source == "automodel-amtalpha"


def test_broken_entry_point_is_recorded_not_raised(make_dist, tmp_path):
    make_dist(tmp_path / "b", "automodel-amtbroken", "0.1", {"amtbroken": "amt_broken_plugin"},
              {"amt_broken_plugin.py": "raise ImportError('needs amt_missing_lib')\n"})
    make_dist(tmp_path / "g", "automodel-amtgood", "0.2", {"amtgood": "amt_good_plugin"},
              {"amt_good_plugin.py": _plugin_module("good")})
    mgr = PluginManager()
    broken = mgr.plugins["amtbroken"]
    assert not broken.ok
    assert broken.error == "Error importing plugin 'amtbroken': ImportError: needs amt_missing_lib"
    assert mgr.routes.get("good", "moon") is not None


def test_hookimpl_with_a_wrong_signature_is_recorded_not_raised(make_dist, tmp_path):
    code = ("from automodel import hookimpl\n\n@hookimpl\ndef automodel_register_aliases(aliases):\n"
            "    aliases.domain('amtsig', 'moon')\n\n"
            "@hookimpl\ndef automodel_register_routes(registry, extra):\n    pass\n")
    make_dist(tmp_path / "s", "automodel-amtsig", "0.1", {"amtsig": "amt_sig_plugin"}, {"amt_sig_plugin.py": code})
    mgr = PluginManager()
    info = mgr.plugins["amtsig"]
    assert not info.ok and "cannot be registered" in info.error and "automodel_register_routes" in info.error
    assert "amtsig" not in mgr.aliases.domains  # none of its hooks ran half-registered
    assert mgr.plugins["core"].ok


@pytest.mark.parametrize("disable", ["amtdis", "automodel-amtdis", "other, amtdis"])
def test_disable_plugins_env(make_dist, tmp_path, monkeypatch, disable):
    make_dist(tmp_path / "d", "automodel-amtdis", "0.1", {"amtdis": "amt_dis_plugin"},
              {"amt_dis_plugin.py": "raise RuntimeError('must not be imported')\n"})
    assert "amtdis" in PluginManager().plugins
    monkeypatch.setenv("AUTOMODEL_DISABLE_PLUGINS", disable)
    mgr = PluginManager()
    assert "amtdis" not in mgr.plugins
    assert not mgr.failed()


def test_duplicate_plugin_names_across_distributions(make_dist, tmp_path):
    make_dist(tmp_path / "x", "automodel-amtx", "0.1", {"amtdup": "amt_dup_x"},
              {"amt_dup_x.py": _plugin_module("dupx")})
    make_dist(tmp_path / "y", "automodel-amty", "0.1", {"amtdup": "amt_dup_y"},
              {"amt_dup_y.py": _plugin_module("dupy")})
    mgr = PluginManager()
    names = [k for k in mgr.plugins if k.startswith("amtdup")]
    assert len(names) == 2
    failed = [mgr.plugins[k] for k in names if not mgr.plugins[k].ok]
    assert len(failed) == 1 and "already used by distribution" in failed[0].error


def test_command_and_domain_aliases_route_through_the_group():
    mgr = PluginManager(load_entry_points=False, extra_plugins=[("t", AllHooks())])
    reset_plugin_manager(mgr)
    try:
        group = AutomodelGroup(name="automodel")
        ctx = click.Context(group)
        command = group.get_command(ctx, "gr")
        assert command is not None and command.name == "greet"
        assert "greet" in group.list_commands(ctx) and "moon-cmd" in group.list_commands(ctx)
        assert group.get_command(ctx, "nope") is None
    finally:
        reset_plugin_manager(None)
