"""A third-party plugin distribution, built outside the repository, works with the installed CLI (DESIGN §4)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

DESIGN = Path(os.environ.get("AUTOMODEL_DESIGN_MD", "/work/shared/DESIGN.md"))


@pytest.mark.skipif(not DESIGN.exists(), reason="DESIGN.md is not available here")
def test_fixture_is_the_design_worked_example_verbatim(hello_sources):
    text = DESIGN.read_text()
    block = re.search(r"```python\n(# automodel_hello/plugin\.py\n.*?)```", text, re.DOTALL).group(1)
    plugin, recipe = block.split("# automodel_hello/recipe.py\n")
    plugin = plugin.removeprefix("# automodel_hello/plugin.py\n").rstrip("\n") + "\n"
    assert hello_sources["automodel_hello/plugin.py"] == plugin
    assert hello_sources["automodel_hello/recipe.py"] == recipe


def test_hello_route_with_domain_alias_and_override(cli, dists, write):
    write("x.yaml", "greeting:\n  name: Alice\n")
    result = cli("hello", "earth", "-c", "x.yaml", "--greeting.name", "Bob", dists=[dists.hello])
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "hello.txt").read_text() == "hello Bob"


def test_hello_route_canonical_domain_and_equals_override(cli, dists, write):
    write("x.yaml", "greeting:\n  name: Alice\n  out: greet.txt\n")
    result = cli("hello", "world", "-c", "x.yaml", "--greeting.out=other.txt", dists=[dists.hello])
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "other.txt").read_text() == "hello Alice"
    assert not (cli.cwd / "greet.txt").exists()


def test_hello_defaults_from_the_dataclass(cli, dists, write):
    write("x.yaml", "greeting: {}\n")
    assert cli("hello", "world", "-c", "x.yaml", dists=[dists.hello]).returncode == 0
    assert (cli.cwd / "hello.txt").read_text() == "hello world"


def test_recipes_lists_the_plugin_route(cli, dists):
    result = cli("recipes", dists=[dists.hello])
    assert result.returncode == 0, result.stderr
    assert re.search(r"hello world\s+automodel_hello\.recipe\.HelloRecipe\s+\[automodel-hello 0\.3\.0\]",
                     result.stdout), result.stdout
    assert "Say hello" in result.stdout
    assert "earth -> world" in result.stdout

    rows = cli("recipes", "--json", dists=[dists.hello]).json()["routes"]
    row = next(r for r in rows if (r["command"], r["domain"]) == ("hello", "world"))
    assert row == {"command": "hello", "domain": "world", "recipe": "automodel_hello.recipe.HelloRecipe",
                   "help": "Say hello", "distribution": "automodel-hello", "version": "0.3.0", "examples": [],
                   "recipe_names": []}


def test_plugins_json_lists_the_plugin(cli, dists):
    result = cli("plugins", "--json", dists=[dists.hello])
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in result.json()}
    hello = plugins["hello"]
    assert (hello["distribution"], hello["version"], hello["module"], hello["ok"]) == \
        ("automodel-hello", "0.3.0", "automodel_hello.plugin", True)
    assert hello["hooks"] == ["automodel_register_aliases", "automodel_register_routes"]
    assert plugins["core"]["distribution"] == "automodel-core" and plugins["core"]["ok"]


def test_without_the_plugin_there_is_no_hello(cli, dists, write):
    write("x.yaml", "greeting: {}\n")
    result = cli("hello", "earth", "-c", "x.yaml")
    assert result.returncode == 2
    assert "unknown command 'hello'" in result.stderr
    assert not (cli.cwd / "hello.txt").exists()


def test_disabled_plugin_is_skipped(cli, dists):
    for value in ("hello", "automodel-hello"):
        result = cli("recipes", "--json", dists=[dists.hello], AUTOMODEL_DISABLE_PLUGINS=value)
        assert all(r["command"] != "hello" for r in result.json()["routes"]), value
    assert any(r["command"] == "hello" for r in cli("recipes", "--json", dists=[dists.hello]).json()["routes"])


# ---- a broken plugin never breaks the CLI -----------------------------------------------------------------

def test_broken_plugin_help_still_works(cli, dists):
    result = cli("--help", dists=[dists.hello, dists.broken])
    assert result.returncode == 0
    assert "hello" in result.stdout and "recipes" in result.stdout
    assert "Traceback" not in result.stderr
    assert "plugin 'broken' (automodel-broken) is not working" in result.stderr


def test_broken_plugin_other_routes_still_work(cli, dists, write):
    write("x.yaml", "greeting:\n  name: Ann\n")
    result = cli("hello", "earth", "-c", "x.yaml", dists=[dists.broken, dists.hello])
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "hello.txt").read_text() == "hello Ann"


def test_plugins_shows_the_failure_and_why(cli, dists):
    result = cli("plugins", dists=[dists.hello, dists.broken])
    assert result.returncode == 0
    assert re.search(r"broken\s+automodel-broken 0\.0\.1\s+\[FAILED\]", result.stdout), result.stdout
    assert "RuntimeError: automodel_broken cannot start: missing amt_fancy_lib" in result.stdout
    assert re.search(r"hello\s+automodel-hello 0\.3\.0\s+\[ok\]", result.stdout)

    broken = {p["name"]: p for p in cli("plugins", "--json", dists=[dists.hello, dists.broken]).json()}["broken"]
    assert broken["ok"] is False and broken["distribution"] == "automodel-broken"
    assert "Error importing plugin 'broken'" in broken["error"] and "amt_fancy_lib" in broken["error"]


def test_broken_plugin_own_command_errors_and_says_why(cli, dists):
    result = cli("broken", "thing", dists=[dists.broken])
    assert result.returncode == 2
    assert "unknown command 'broken'" in result.stderr
    assert "plugin 'broken' (automodel-broken) that may provide it failed" in result.stderr
    assert "Traceback" not in result.stderr


# ---- conflicts and shadowing across distributions ---------------------------------------------------------

def test_duplicate_route_names_both_distributions(cli, dists, write):
    write("x.yaml", "greeting: {}\n")
    result = cli("hello", "world", "-c", "x.yaml", dists=[dists.hello, dists.dupe])
    assert result.returncode == 2
    assert "route 'hello world'" in result.stderr
    assert "'automodel-dupe'" in result.stderr and "'automodel-hello'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (cli.cwd / "hello.txt").exists()
    failed = [p for p in cli("plugins", "--json", dists=[dists.hello, dists.dupe]).json() if not p["ok"]]
    assert any("'automodel-dupe'" in str(p["hook_errors"]) and "'automodel-hello'" in str(p["hook_errors"])
               for p in failed), failed


def test_plugin_cannot_shadow_core_commands(cli, dists):
    result = cli("plugins", dists=[dists.hello, dists.shadow])
    assert result.returncode == 0, result.stderr
    assert "automodel-shadow" in result.stdout and "FAILED" in result.stdout
    assert "command 'recipes' already exists and cannot be replaced" in result.stdout
    recipes = cli("recipes", dists=[dists.hello, dists.shadow])
    assert recipes.returncode == 0 and "SHADOWED" not in recipes.stdout
    assert "automodel_hello.recipe.HelloRecipe" in recipes.stdout


def test_plugin_command_is_added(cli, dists):
    result = cli("probe-ping", dists=[dists.probe])
    assert (result.returncode, result.stdout.strip()) == (0, "pong")
    assert "probe-ping" in cli("--help", dists=[dists.probe]).stdout
