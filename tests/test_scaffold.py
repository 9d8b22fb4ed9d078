"""`automodel new`: the scaffolded plugin distribution installs, its own tests pass and its route trains."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from automodel.cli.main import main

AUTOMODEL = [sys.executable, "-m", "automodel.cli.main"]


def run_main(*args) -> tuple[int, str]:
    from automodel.plugins.manager import reset_plugin_manager

    reset_plugin_manager(None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in args])
    reset_plugin_manager(None)
    return code, out.getvalue()


def install_for_test(dest: Path, site: Path) -> dict[str, str]:
    """What `pip install -e DEST` leaves behind: a .dist-info with its entry points; returns a subprocess env."""
    project = tomllib.loads((dest / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    entry_points = project["entry-points"]["automodel"]
    (info / "entry_points.txt").write_text("[automodel]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOMODEL_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(dest / "src")]), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


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


def test_installed_plugin_passes_its_own_tests_and_its_route_trains(scaffolded, monkeypatch):
    root, dest, _ = scaffolded
    env = install_for_test(dest, root / "site")
    listed = subprocess.run([*AUTOMODEL, "recipes"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "finetune label-sft" in listed.stdout and "[automodel-label-sft 0.1.0]" in listed.stdout
    assert "example: label-sft/tiny" in listed.stdout

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=dest,
                           env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert "4 passed" in tests.stdout, tests.stdout[-2000:]

    # The route through the installed entry point, in this process (torch is already imported here): the same
    # sys.path the subprocesses had, and a fresh plugin manager that discovers the .dist-info.
    monkeypatch.chdir(root)
    for path in reversed(env["PYTHONPATH"].split(os.pathsep)):
        monkeypatch.syspath_prepend(path)
    importlib.invalidate_caches()
    try:
        code, output = run_main("finetune", "label-sft", "-c", "label-sft/tiny", "--step_scheduler.max_steps", 2,
                                "--checkpoint.checkpoint_dir", "run")
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "automodel_label_sft"]:
            del sys.modules[name]
    assert code == 0, output[-3000:]
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
