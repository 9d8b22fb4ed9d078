"""docs/config-reference.md is generated from the installed recipes' declared sections and must match the code."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_config_reference.py"
REFERENCE = ROOT / "docs" / "config-reference.md"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rendered(generator) -> str:
    return generator.render()


def test_committed_reference_matches_the_code(rendered):
    committed = REFERENCE.read_text(encoding="utf-8")
    if committed != rendered:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), rendered.splitlines(True),
                                                 "docs/config-reference.md (committed)", "generated", n=1))[:60])
        pytest.fail("docs/config-reference.md is stale: run `.venv/bin/python scripts/gen_config_reference.py`\n"
                    + diff)


def test_reference_covers_every_section_and_key_of_every_route(rendered):
    from automodel.cli.execute import import_recipe
    from automodel.plugins.manager import get_plugin_manager

    routes = list(get_plugin_manager().routes.routes.values())
    assert any((r.command, r.domain) == ("finetune", "llm") for r in routes)
    for route in routes:
        assert f"`automodel {route.command} {route.domain}`" in rendered
        recipe = import_recipe(route.recipe)
        assert f"## Recipe `{route.recipe}`" in rendered
        for name, spec in recipe.all_sections().items():
            shown = name[:-1] + "<name>" if name.endswith("*") else name
            assert f"### `{shown}`" in rendered, f"{route.recipe}: section {name}"
            if isinstance(spec, type) and dataclasses.is_dataclass(spec):
                for f in dataclasses.fields(spec):
                    if f.init:
                        assert f"| `{f.name}` |" in rendered, f"{route.recipe}: {name}.{f.name}"


def test_reference_rows_carry_type_default_and_help(rendered):
    row = next(line for line in rendered.splitlines() if line.startswith("| `val_check_interval` |"))
    assert row == ("| `val_check_interval` | int \\| null | `null` | validate every N steps (and never if unset) "
                   "(also accepted as `val_every_steps`) |")
    assert "| `model_save_format` | `safetensors` \\| `torch_save` | `safetensors` |" in rendered
    assert "Target section (required): the model to train" in rendered


def test_check_mode_reports_a_stale_file(generator, tmp_path, capsys):
    stale = tmp_path / "ref.md"
    stale.write_text("# out of date\n")
    assert generator.main(["--check", "-o", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert generator.main(["-o", str(stale)]) == 0
    assert generator.main(["--check", "-o", str(stale)]) == 0
