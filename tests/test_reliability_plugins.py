"""Plugin faults: a plugin that raises inside a hook, or whose registered builder or pipeline stage raises when the
core calls it, is named in the error; other routes keep working (DESIGN §4; docs/reliability.md).

tests/test_third_party_plugin.py covers a plugin that fails to *import*, and automodel-core/tests/test_plugins.py a
hook raising in-process. This adds, through the installed console script, a distribution whose registration hook
raises and whose builder for the ``llm`` domain raises at run time.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import reliability_helpers as h

from automodel.testing import write_dist, write_yaml

FAULTY_PLUGIN = '''\
from automodel import hookimpl

@hookimpl
def automodel_register_aliases(aliases):
    raise RuntimeError("aliases exploded in automodel_faulty")

@hookimpl
def automodel_register_builders(builders):
    builders.add("loss_fn", "automodel_faulty.plugin.build_loss_fn", domain="llm")

def build_loss_fn(ctx):
    raise RuntimeError("the loss builder exploded")
'''

HELLO_PLUGIN = '''\
from automodel import hookimpl

@hookimpl
def automodel_register_routes(routes):
    routes.add("hello", "world", recipe="automodel_hi.recipe.HelloRecipe", help="Say hello")
'''

HELLO_RECIPE = '''\
from dataclasses import dataclass
from pathlib import Path
from automodel import BaseRecipe

@dataclass
class GreetingConfig:
    name: str = "world"

class HelloRecipe(BaseRecipe):
    sections = {"greeting": GreetingConfig}
    def setup(self):
        self.greeting = self.cfg.greeting
    def run_train_validation_loop(self):
        Path("hello.txt").write_text(f"hello {self.greeting.name}")
'''


@pytest.fixture(scope="module")
def plugin_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin_faults")
    faulty = write_dist(root / "faulty", "automodel-faulty", "0.1.0",
                          "[automodel]\nfaulty = automodel_faulty.plugin\n",
                          {"automodel_faulty/__init__.py": "", "automodel_faulty/plugin.py": FAULTY_PLUGIN})
    hello = write_dist(root / "hi", "automodel-hi", "1.0", "[automodel]\nhi = automodel_hi.plugin\n",
                         {"automodel_hi/__init__.py": "", "automodel_hi/plugin.py": HELLO_PLUGIN,
                          "automodel_hi/recipe.py": HELLO_RECIPE})
    (root / "greet.yaml").write_text("greeting:\n  name: Ada\n")
    valid = str(h.BAD_CONFIGS / "assets" / "valid.yaml")
    path = f"{faulty}:{hello}"
    runs = {
        "train": ["finetune", "llm", "-c", valid],
        "dry_run": ["finetune", "llm", "-c", valid, "--dry-run"],
        "validate": ["validate", "finetune", "llm", "-c", valid],
        "hello": ["hello", "world", "-c", str(root / "greet.yaml")],
        "plugins": ["plugins", "--json"],
    }
    procs = {}
    for name, argv in runs.items():
        cwd = root / name
        cwd.mkdir()
        env = h.cli_env(PYTHONPATH=path, AMT_BAD_CONFIGS=str(h.BAD_CONFIGS), OMP_NUM_THREADS="1")
        env.pop("AUTOMODEL_ALLOW_TARGETS")
        procs[name] = (cwd, subprocess.Popen(h.cli_command(*argv), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True))
    results = {}
    for name, (cwd, proc) in procs.items():
        out, err = proc.communicate(timeout=240)
        results[name] = {"cwd": cwd, "rc": proc.returncode, "out": out, "err": err}
    return results


WARNING = ("warning: plugin 'faulty' (automodel-faulty) is not working: automodel_register_aliases: RuntimeError: "
           "aliases exploded in automodel_faulty")


def test_a_hook_that_raises_names_the_plugin_and_other_routes_keep_working(plugin_runs):
    for name in ("dry_run", "validate", "hello"):
        run = plugin_runs[name]
        assert run["rc"] == 0, (name, run["err"])
        assert WARNING in run["err"], (name, run["err"])
        assert "Traceback" not in run["err"]
    assert "dry run: nothing was built" in plugin_runs["dry_run"]["out"]
    assert (plugin_runs["hello"]["cwd"] / "hello.txt").read_text() == "hello Ada"
    plugins = {p["name"]: p for p in json.loads(plugin_runs["plugins"]["out"])}
    assert plugins["faulty"]["ok"] is False and plugins["faulty"]["distribution"] == "automodel-faulty"
    assert plugins["faulty"]["hook_errors"] == {
        "automodel_register_aliases": "RuntimeError: aliases exploded in automodel_faulty"}
    assert plugins["hi"]["ok"] and plugins["llm"]["ok"]


def test_a_builder_that_raises_at_run_time_names_the_plugin(plugin_runs):
    run = plugin_runs["train"]
    assert run["rc"] == 1, run["err"]
    assert "Traceback" not in run["err"]
    assert ("error: builder 'loss_fn' registered by plugin 'automodel-faulty' failed: RuntimeError: the loss builder "
            "exploded") in run["err"]
    assert not list(run["cwd"].glob("ckpt/epoch_*")) and not (run["cwd"] / "ckpt" / "LATEST").exists()


def test_a_pipeline_stage_that_raises_names_the_plugin(tmp_path):
    """In the fixed pipeline a plugin's stage implementation raising is reported against that plugin."""
    from dataclasses import replace

    import torch

    from automodel.errors import PluginError
    from automodel.plugins.manager import PluginManager
    from automodel.plugins.registries import StageRegistry
    from automodel.testing import ToyRecipe, load_config, toy_config
    from automodel.training.pipeline import apply_pipeline

    def explode(ctx, model):
        raise ValueError("the stage exploded")

    stages = StageRegistry()
    stages.source = "automodel-faulty"
    stages.add("freeze", "faulty", explode)
    stages.source = "automodel-core"
    stages.add("device", "single", lambda ctx, model: (model, "placed"))
    manager = PluginManager(load_entry_points=False)
    manager.stages = stages
    _, cfg = load_config(write_yaml(tmp_path / "toy.yaml", toy_config(tmp_path / "ckpt")), recipe=ToyRecipe)
    logged: list[str] = []
    ctx = replace(ToyRecipe(cfg).build_context(), plugins=manager, log=logged.append)
    with pytest.raises(PluginError, match=r"pipeline stage 'freeze' \[faulty\] registered by plugin "
                                          r"'automodel-faulty' failed: ValueError: the stage exploded"):
        apply_pipeline(ctx, object(), {"freeze": ("faulty", "freeze"), "device": ("single", "dist_env")})
    assert logged == []
    model = torch.nn.Linear(1, 1)
    assert apply_pipeline(ctx, model, {"device": ("single", "dist_env")}) is model
    assert logged == ["pipeline: device [single]: placed"]
