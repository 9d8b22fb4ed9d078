"""`automodel new`: the scaffolded plugin distribution installs with the steps `new` prints, its own tests pass and
its route trains."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import shlex
import subprocess

import pytest
import tomllib
from venv_testing import AUTOMODEL_FILES, PYTEST, ROOT, fresh_venv, repack_wheel, run, third_party_links

from automodel.cli.main import main


def run_main(*args) -> tuple[int, str]:
    from automodel.plugins.manager import reset_plugin_manager

    reset_plugin_manager(None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in args])
    reset_plugin_manager(None)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def scaffolded(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaffold")
    code, output = run_main("new", root / "label-sft")
    assert code == 0, output
    return root, root / "label-sft", output


def test_new_writes_a_complete_distribution(scaffolded):
    _, dest, output = scaffolded
    assert "route `automodel finetune label-sft`, recipe automodel_label_sft.recipe.LabelSftRecipe" in output
    pkg = dest / "src" / "automodel_label_sft"
    for rel in ("pyproject.toml", "README.md", "tests/test_label_sft.py"):
        assert (dest / rel).is_file(), rel
    for rel in ("__init__.py", "plugin.py", "recipe.py", "examples/tiny.yaml"):
        assert (pkg / rel).is_file(), rel
    project = tomllib.loads((dest / "pyproject.toml").read_text())
    assert project["project"]["name"] == "automodel-label-sft"
    assert project["project"]["entry-points"]["automodel"] == {"label-sft": "automodel_label_sft.plugin"}
    assert "automodel-llm~=" in " ".join(project["project"]["dependencies"])
    assert project["tool"]["setuptools"]["package-data"]["automodel_label_sft"] == ["examples/*.yaml"]
    recipe = ast.parse((pkg / "recipe.py").read_text())
    cls = next(n for n in recipe.body if isinstance(n, ast.ClassDef) and n.name == "LabelSftRecipe")
    assert [ast.unparse(b) for b in cls.bases] == ["FinetuneRecipeForNextTokenPrediction"]
    assert "from automodel_llm.recipe import" in (pkg / "recipe.py").read_text()
    plugin = (pkg / "plugin.py").read_text()
    assert 'routes.add("finetune", "label-sft"' in plugin and 'aliases.target("LabelSftRecipe"' in plugin
    assert "import torch" not in plugin  # plugin modules stay import-light
    example = (pkg / "examples" / "tiny.yaml").read_text()
    assert "${pkg:automodel_llm}/examples/assets/tiny_llama/config.json" in example
    for path in dest.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")


def printed_steps(output: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next steps"))
    return [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


@pytest.mark.slow  # make test-slow: a fresh virtualenv and its installs (the default run installs a domain from its
# wheels into a fresh virtualenv and trains there: test_wheels.py)
def test_the_printed_next_steps_work_in_a_clean_virtualenv(scaffolded, tmp_path):
    """A virtualenv holding automodel-core and automodel-llm and their dependencies but no pytest (the issue: a
    plain `pip install -e` left the scaffold's tests without one, or with another interpreter's): the steps `new`
    printed, run as printed with the virtualenv first on PATH, install the [test] extra, pass the tests and train.
    Offline: pip finds pytest in a local wheelhouse, and builds with the setuptools already installed."""
    root, dest, output = scaffolded
    steps = printed_steps(output)
    assert steps == [f"python -m pip install -e '{dest}[test]'", f"python -m pytest -q {dest / 'tests'}",
                     "automodel finetune label-sft -c label-sft/tiny"]
    python = fresh_venv(tmp_path / "venv", third_party_links(tmp_path / "site", AUTOMODEL_FILES + PYTEST))
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(repack_wheel("pytest", tmp_path / "wheels")),
               # pip keeps this variable's value in build_isolation: a false value turns isolation off
               "PIP_NO_BUILD_ISOLATION": "0", "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}
    run([python, "-m", "pip", "install", "-e", ROOT / "automodel-core", "-e", ROOT / "automodel-llm"], cwd=tmp_path,
        timeout=600, **offline)
    missing = subprocess.run([python, "-c", "import pytest"], capture_output=True, text=True, check=False)
    assert missing.returncode != 0, "pytest leaked into the clean virtualenv"

    install, tests, train = (shlex.split(step) for step in steps)
    installed = run(install, cwd=root, timeout=600, **offline)
    assert "pytest" in installed.stdout and "automodel-label-sft" in installed.stdout  # the [test] extra came along
    result = run(tests, cwd=root, timeout=600, **offline)
    assert "4 passed" in result.stdout, result.stdout[-2000:]
    listed = run(["automodel", "recipes"], cwd=root, **offline)
    assert "finetune label-sft" in listed.stdout and "[automodel-label-sft 0.1.0]" in listed.stdout
    assert "example: label-sft/tiny" in listed.stdout
    run([*train, "--step_scheduler.max_steps", 2, "--checkpoint.checkpoint_dir", "run"], cwd=root, timeout=600,
        **offline)
    assert (root / "run" / "LATEST").read_text().strip() == "epoch_0_step_2"
    assert (root / "run" / "epoch_0_step_2" / "model" / "model.safetensors").is_file()
    config = (root / "run" / "epoch_0_step_2" / "config.yaml").read_text()
    assert "label_sft:" in config and "label_smoothing: 0.1" in config


def test_new_refuses_bad_names_existing_routes_and_non_empty_directories(tmp_path):
    code, output = run_main("new", tmp_path / "x", "--name", "Bad Name")
    assert code == 2 and "--name 'Bad Name': use lowercase letters" in output
    code, output = run_main("new", tmp_path / "llm")
    assert code == 2 and "route 'finetune llm' is already installed (from automodel-llm)" in output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    code, output = run_main("new", tmp_path / "busy")
    assert code == 2 and "exists and is not empty" in output
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["keep.txt"]
    code, output = run_main("new", tmp_path / "y", "--domain", "nonesuch")
    assert code == 2 and "--domain nonesuch: no installed recipe to start from" in output


def test_name_option_and_command_option(tmp_path):
    code, output = run_main("new", tmp_path / "dir", "--name", "automodel-qa_tune", "--command", "tune")
    assert code == 0, output
    plugin = (tmp_path / "dir" / "src" / "automodel_qa_tune" / "plugin.py").read_text()
    assert 'routes.add("tune", "qa-tune"' in plugin
    assert (tmp_path / "dir" / "tests" / "test_qa_tune.py").is_file()
