"""Cross-distribution fixtures: third-party plugin distributions built outside the repository, and the CLI.

Each distribution is a directory holding its package and a real ``.dist-info`` (``METADATA`` and
``entry_points.txt``), exactly what ``pip install`` leaves behind; putting the directory on ``PYTHONPATH`` makes
``importlib.metadata`` discover its ``automodel`` entry point in a subprocess of the real ``automodel`` CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from automodel.testing import write_dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# The worked example of DESIGN §4, verbatim: the API third-party plugin authors rely on.
HELLO_PLUGIN = '''\
from automodel import hookimpl

@hookimpl
def automodel_register_routes(routes):
    routes.add("hello", "world", recipe="automodel_hello.recipe.HelloRecipe", help="Say hello")

@hookimpl
def automodel_register_aliases(aliases):
    aliases.domain("earth", "world")          # `automodel hello earth` == `automodel hello world`
'''

HELLO_RECIPE = '''\
from dataclasses import dataclass
from pathlib import Path
from automodel import BaseRecipe

@dataclass
class GreetingConfig:
    name: str = "world"
    out: str = "hello.txt"

class HelloRecipe(BaseRecipe):
    sections = {"greeting": GreetingConfig}   # top-level YAML sections this recipe reads (beyond its parents')
    def setup(self):
        self.greeting = self.cfg.greeting     # attribute access into the validated config
    def run_train_validation_loop(self):
        Path(self.greeting.out).write_text(f"hello {self.greeting.name}")
'''

HELLO_EXAMPLE = "greeting:\n  name: from-example\n"

# A richer plugin: a `finetune world` route, its own allowed targets, a command, and a recipe with a target
# section (built in setup) and a free section (for secrets).
PROBE_PLUGIN = '''\
import click
from automodel import hookimpl

@hookimpl
def automodel_register_routes(routes):
    routes.add("finetune", "world", recipe="automodel_probe.recipe.ProbeRecipe", help="Probe the world",
               examples=["probe/base"])

@hookimpl
def automodel_allowed_targets():
    return ["automodel_probe"]

@hookimpl
def automodel_register_commands(cli):
    @click.command("probe-ping")
    def ping():
        """Answer pong."""
        click.echo("pong")
    cli.add_command(ping)
'''

PROBE_RECIPE = '''\
import json
from dataclasses import dataclass
from pathlib import Path
from automodel import BaseRecipe
from automodel.config import Free, Target

@dataclass
class StepScheduler:
    max_steps: int = 3
    lr: float = 0.1

class ProbeRecipe(BaseRecipe):
    sections = {"step_scheduler": StepScheduler, "thing": Target("a thing built in setup"),
                "hub": Free("hub settings")}
    def setup(self):
        self.thing = self.cfg.thing.instantiate() if self.cfg.thing is not None else None
    def run_train_validation_loop(self):
        s = self.cfg.step_scheduler
        Path("probe_done.json").write_text(json.dumps({"thing": self.thing, "max_steps": s.max_steps,
                                                       "lr": s.lr}))
'''

PROBE_TARGETS = '''\
from pathlib import Path

def make_thing(size: int, color: str = "red", marker: str = ""):
    if marker:
        Path(marker).write_text("built")
    return {"size": size, "color": color}
'''

BROKEN_PLUGIN = 'raise RuntimeError("automodel_broken cannot start: missing amt_fancy_lib")\n'

DUPE_PLUGIN = '''\
from automodel import hookimpl

@hookimpl
def automodel_register_routes(routes):
    routes.add("hello", "world", recipe="automodel_dupe.recipe.Other")
'''

SHADOW_PLUGIN = '''\
import click
from automodel import hookimpl

@hookimpl
def automodel_register_aliases(aliases):
    aliases.command("plugins", "hello")

@hookimpl
def automodel_register_commands(cli):
    @click.command("recipes")
    def fake():
        click.echo("SHADOWED")
    cli.add_command(fake)
'''


@dataclass(frozen=True)
class Dists:
    hello: Path
    probe: Path
    broken: Path
    dupe: Path
    shadow: Path


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> Dists:
    base = tmp_path_factory.mktemp("site")
    hello = write_dist(base / "hello", "automodel-hello", "0.3.0", "[automodel]\nhello = automodel_hello.plugin", {
        "automodel_hello/__init__.py": "",
        "automodel_hello/plugin.py": HELLO_PLUGIN,
        "automodel_hello/recipe.py": HELLO_RECIPE,
        "automodel_hello/examples/hi.yaml": HELLO_EXAMPLE,
    })
    probe = write_dist(base / "probe", "automodel-probe", "1.0.0", "[automodel]\nprobe = automodel_probe.plugin\n", {
        "automodel_probe/__init__.py": "",
        "automodel_probe/plugin.py": PROBE_PLUGIN,
        "automodel_probe/recipe.py": PROBE_RECIPE,
        "automodel_probe/targets.py": PROBE_TARGETS,
        "automodel_probe/examples/base.yaml": "thing:\n  _target_: automodel_probe.targets.make_thing\n  size: 1\n",
    })
    broken = write_dist(base / "broken", "automodel-broken", "0.0.1", "[automodel]\nbroken = automodel_broken\n",
                        {"automodel_broken/__init__.py": BROKEN_PLUGIN})
    dupe = write_dist(base / "dupe", "automodel-dupe", "2.0", "[automodel]\ndupe = automodel_dupe\n",
                      {"automodel_dupe/__init__.py": DUPE_PLUGIN})
    shadow = write_dist(base / "shadow", "automodel-shadow", "0.1", "[automodel]\nshadow = automodel_shadow\n",
                        {"automodel_shadow/__init__.py": SHADOW_PLUGIN})
    return Dists(hello, probe, broken, dupe, shadow)


_CONSOLE_SCRIPT = Path(sys.executable).with_name("automodel")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


class Cli:
    """Runs the installed ``automodel`` CLI in a subprocess, with chosen plugin distributions on PYTHONPATH."""

    def __init__(self, cwd: Path):
        self.cwd = cwd

    def env(self, dists=(), **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOMODEL_") and k != "PYTHONPATH"}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        if dists:
            env["PYTHONPATH"] = os.pathsep.join(str(d) for d in dists)
        env.update(extra)
        return env

    def command(self) -> list[str]:
        if _CONSOLE_SCRIPT.exists():
            return [str(_CONSOLE_SCRIPT)]
        return [sys.executable, "-m", "automodel.cli.main"]

    def __call__(self, *args: str, dists=(), timeout: float = 120, **env: str) -> Result:
        proc = subprocess.run([*self.command(), *args], cwd=self.cwd, env=self.env(dists, **env),
                              capture_output=True, text=True, timeout=timeout, check=False)
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def python(self, code: str, *args: str, dists=(), timeout: float = 120, **env: str) -> Result:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=self.cwd,
                              env=self.env(dists, **env), capture_output=True, text=True, timeout=timeout, check=False)
        return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(autouse=True)
def _own_user_config(tmp_path, monkeypatch):
    """Never the developer's ~/.config/automodel/trusted-targets.txt: each test has its own (empty) config home."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    """The test's own working directory (``tmp_path``), without the user's automodel environment variables."""
    monkeypatch.chdir(tmp_path)
    for name in ("AUTOMODEL_ALLOW_TARGETS", "AUTOMODEL_DEBUG", "AUTOMODEL_DISABLE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture
def cli(tmp_path) -> Cli:
    return Cli(tmp_path)


@pytest.fixture
def write(tmp_path):
    """Write a file (dedented) under the test's working directory; returns its name."""
    def _write(name: str, text: str) -> str:
        (tmp_path / name).write_text(textwrap.dedent(text))
        return name

    return _write


@pytest.fixture(scope="session")
def hello_sources() -> dict[str, str]:
    """The hello plugin's files as the fixture writes them (checked against DESIGN §4 where it is available)."""
    return {"automodel_hello/plugin.py": HELLO_PLUGIN, "automodel_hello/recipe.py": HELLO_RECIPE}
