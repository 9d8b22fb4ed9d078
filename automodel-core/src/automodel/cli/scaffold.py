"""``automodel new``: scaffold a third-party recipe plugin distribution, ready to ``pip install -e``.

The result is a complete distribution (DESIGN §4): ``pyproject.toml`` with the ``automodel`` entry point, a
``plugin.py`` registering its route and aliases, a recipe subclassing the closest installed recipe of the chosen
domain, an example YAML that runs offline from the domain's shipped assets, and a tiny CPU test. Nothing here
imports torch: the base recipe is found through the installed routes (dotted strings).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import click

from automodel.errors import UsageError
from automodel.plugins.manager import PluginManager, get_plugin_manager

# The base recipe with a tailored template (text only: the core never imports a domain package).
LLM_BASE = "automodel_llm.recipe.FinetuneRecipeForNextTokenPrediction"
_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


@dataclass(frozen=True)
class Names:
    """Every spelling of the plugin's name: ``my-sft`` -> automodel-my-sft / automodel_my_sft / MySftRecipe."""

    name: str  # route domain, example prefix and entry point name: my-sft
    command: str

    @property
    def dist(self) -> str:
        return f"automodel-{self.name.replace('_', '-')}"

    @property
    def package(self) -> str:
        return f"automodel_{self.name.replace('-', '_')}"

    @property
    def domain(self) -> str:
        # The example prefix the core derives from the package name (automodel_my_sft -> my-sft): the same word.
        return self.package.removeprefix("automodel_").replace("_", "-")

    @property
    def section(self) -> str:
        return self.name.replace("-", "_")

    @property
    def camel(self) -> str:
        return "".join(part.capitalize() for part in re.split(r"[-_]", self.name))

    @property
    def recipe_class(self) -> str:
        return f"{self.camel}Recipe"

    @property
    def recipe_path(self) -> str:
        return f"{self.package}.recipe.{self.recipe_class}"


@dataclass(frozen=True)
class Base:
    """The installed recipe the new one starts from, and where it comes from."""

    domain: str
    recipe: str  # dotted path of the base recipe class
    distribution: str
    version: str
    plugin_module: str  # the base distribution's plugin module (its stages and aliases, for the test)
    example: Path | None  # its first shipped example, if any


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "0.1.0"


def find_base(manager: PluginManager, domain: str, command: str) -> Base:
    from automodel.cli.examples import find_example

    domain = manager.aliases.domains.get(domain, domain)
    route = manager.routes.get(command, domain) or manager.routes.get("finetune", domain)
    if route is None:
        domains = sorted({d for _, d in manager.routes.routes})
        raise UsageError(f"--domain {domain}: no installed recipe to start from; installed domains: "
                         f"{', '.join(domains) or 'none (pip install automodel-llm)'}")
    info = next((p for p in manager.plugins.values() if p.distribution == route.source), None)
    module = info.module if info is not None else f"{route.recipe.split('.')[0]}.plugin"
    example = find_example(route.examples[0], manager) if route.examples else None
    return Base(domain, route.recipe, route.source, _version(route.source), module, example)


# ---- templates (@@NAME@@ placeholders; YAML keeps its own ${...}) ---------------------------------------------

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "@@DIST@@"
version = "0.1.0"
description = "An automodel recipe plugin: `automodel @@COMMAND@@ @@DOMAIN@@`"
readme = "README.md"
requires-python = ">=3.10"
dependencies = [
    "automodel-core>=@@CORE_VERSION@@",
    "@@BASE_DIST@@>=@@BASE_VERSION@@",
]

[project.optional-dependencies]
test = ["pytest>=8"]

# How automodel finds the plugin: the entry point group `automodel` names the module holding the hooks.
[project.entry-points.automodel]
@@DOMAIN@@ = "@@PACKAGE@@.plugin"

[tool.setuptools.packages.find]
where = ["src"]

[tool.setuptools.package-data]
@@PACKAGE@@ = ["examples/*.yaml"]
'''

README = '''\
# @@DIST@@

An [automodel](https://github.com/) recipe plugin, scaffolded by `automodel new`. It adds the route
`automodel @@COMMAND@@ @@DOMAIN@@`, whose recipe `@@RECIPE_CLASS@@` subclasses `@@BASE_RECIPE@@`.

```bash
pip install -e .                    # registers the `automodel` entry point (re-run after editing pyproject.toml)
automodel recipes                   # lists `@@COMMAND@@ @@DOMAIN@@`
pytest -q tests                     # tiny CPU tests
automodel @@COMMAND@@ @@DOMAIN@@ -c @@DOMAIN@@/tiny     # the shipped example, offline on a CPU
automodel cp @@DOMAIN@@/tiny my.yaml                    # start your own config from it
```

Files:

- `src/@@PACKAGE@@/plugin.py`: the hooks (route, aliases, allowed `_target_` prefixes). Dotted strings only, so
  `automodel --help` stays fast.
- `src/@@PACKAGE@@/recipe.py`: the recipe. Override only what differs from the base (`compute_loss`, builders,
  `sections`); the training loop stays the core's.
- `src/@@PACKAGE@@/examples/tiny.yaml`: the example config (`automodel cp @@DOMAIN@@/tiny` copies it).
- `tests/test_@@SECTION@@.py`: registration, validation and a few training steps on a CPU.
'''

INIT = '''\
"""@@DIST@@: the `automodel @@COMMAND@@ @@DOMAIN@@` recipe plugin. Importing this package imports no torch."""

__version__ = "0.1.0"
'''

PLUGIN = '''\
"""automodel hooks of @@DIST@@. Import-light: recipes are named by dotted strings, imported on first use."""

from automodel import hookimpl

RECIPE = "@@RECIPE_PATH@@"


@hookimpl
def automodel_register_routes(routes):
    routes.add("@@COMMAND@@", "@@DOMAIN@@", recipe=RECIPE,
               help="@@HELP@@",
               examples=["@@DOMAIN@@/tiny"])


@hookimpl
def automodel_register_aliases(aliases):
    # `recipe: {_target_: @@RECIPE_CLASS@@}` in a config run by `automodel run -c cfg.yaml`
    aliases.target("@@RECIPE_CLASS@@", RECIPE)
    # Another spelling of the domain on the command line (`automodel @@COMMAND@@ <alias> ...`):
    # aliases.domain("my-alias", "@@DOMAIN@@")


@hookimpl
def automodel_allowed_targets():
    # What this plugin's configs may name in `_target_`: its own package (datasets, models, losses) by prefix, and
    # the exact callables of other libraries they use (e.g. "torch.optim.SGD").
    return ["@@PACKAGE@@"]
'''

LLM_RECIPE = '''\
"""@@RECIPE_CLASS@@: causal-LM fine-tuning with label smoothing, on automodel-llm's recipe.

Start from the closest recipe and override only what differs. Here that is the loss (``compute_loss``, summed
over label tokens: the core's loop divides by the step's label-token count) and one new config section,
``@@SECTION@@``. Builders (model, dataset, optimizer, ...) stay the base recipe's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from automodel_llm.recipe import IGNORE_INDEX, FinetuneRecipeForNextTokenPrediction


@dataclass
class @@CAMEL@@Config:
    """The `@@SECTION@@:` section: keys, types, defaults and help are what `automodel validate` checks."""

    label_smoothing: float = field(default=0.0,
                                   metadata={"help": "label smoothing of the answer-token loss, in [0, 1)"})

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"@@SECTION@@.label_smoothing must be in [0, 1), found {self.label_smoothing}")


class @@RECIPE_CLASS@@(FinetuneRecipeForNextTokenPrediction):
    """Next-token prediction with label-smoothed cross entropy on the label tokens."""

    sections = {"@@SECTION@@": @@CAMEL@@Config}  # merged with the base recipe's sections

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        smoothing = self.cfg.@@SECTION@@.label_smoothing
        if not smoothing:
            return super().compute_loss(model, batch)
        logits, targets = self.next_token_logits(model, batch, self.head_positions)  # one row per target token
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum",
                               label_smoothing=smoothing)
'''

LLM_EXAMPLE = '''\
# The @@DOMAIN@@ recipe on a tiny Llama-architecture model, offline on a CPU in well under a minute:
#   automodel @@COMMAND@@ @@DOMAIN@@ -c @@DOMAIN@@/tiny
# Model config, tokenizer and data ship with automodel-llm (${pkg:automodel_llm} is that package's directory).
step_scheduler:
  max_steps: 40
  val_check_interval: 20
  checkpoint_interval: 40
  log_interval: 5
  num_epochs: 100

rng:
  seed: 1234

model:
  _target_: automodel_llm.AutoModelForCausalLM.from_config
  config: ${pkg:automodel_llm}/examples/assets/tiny_llama/config.json
  num_hidden_layers: 1                 # keys besides `config` override config.json

tokenizer:
  pretrained_model_name_or_path: ${pkg:automodel_llm}/examples/assets/tiny_tokenizer

dataset:
  _target_: automodel_llm.datasets.SquadDataset
  dataset_name: ${pkg:automodel_llm}/examples/assets/tiny_squad
  split: train
  max_seq_length: 64
  limit_dataset_samples: 256

validation_dataset:
  _target_: automodel_llm.datasets.SquadDataset
  dataset_name: ${pkg:automodel_llm}/examples/assets/tiny_squad
  split: validation
  max_seq_length: 64
  limit_dataset_samples: 32

dataloader:
  batch_size: 8

optimizer:
  _target_: torch.optim.AdamW
  lr: 3.0e-3

lr_scheduler:
  _target_: automodel.optim.CosineAnnealingWarmup
  warmup_steps: 5
  min_lr: 1.0e-4

checkpoint:
  checkpoint_dir: runs/@@DOMAIN@@
  keep_last: 1

@@SECTION@@:
  label_smoothing: 0.1
'''

LLM_TEST_EXTRA = '''\


def test_label_smoothing_is_validated():
    from automodel.cli.execute import import_recipe, load_and_validate
    from automodel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"@@SECTION@@.*label_smoothing must be in \\[0, 1\\)"):
        load_and_validate(import_recipe(RECIPE), EXAMPLE, ["--@@SECTION@@.label_smoothing", "1.5"], manager())
'''

GENERIC_RECIPE = '''\
"""@@RECIPE_CLASS@@: a variant of @@BASE_RECIPE@@.

Start from the closest recipe and override only what differs: ``compute_loss`` (the micro-batch's loss summed
over its targets), ``default_collate_fn``, ``sections`` (new config sections), builders. The training loop
stays the core's.
"""

from __future__ import annotations

from @@BASE_MODULE@@ import @@BASE_CLASS@@


class @@RECIPE_CLASS@@(@@BASE_CLASS@@):
    """Behaves exactly like its base until you override something."""

    sections = {}  # new top-level config sections: {"name": a dataclass | automodel.config.Target(...)}
'''

TEST = '''\
"""Tiny CPU tests of @@DIST@@: the plugin registers its route, the example validates and trains a few steps.

They load the plugin module directly (PluginManager(load_entry_points=False, extra_plugins=[...])), so they
pass before `pip install -e .` too; `automodel recipes` shows the route once it is installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from automodel.cli.main import main
from automodel.plugins.manager import PluginManager, reset_plugin_manager

@@BASE_PLUGIN_IMPORT@@
from @@PACKAGE@@ import plugin

# Offline: everything the example needs ships with the installed packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
EXAMPLE = Path(plugin.__file__).parent / "examples" / "tiny.yaml"
RECIPE = "@@RECIPE_PATH@@"


def manager() -> PluginManager:
    return PluginManager(load_entry_points=False,
                         extra_plugins=[("@@BASE_NAME@@", base_plugin), ("@@DOMAIN@@", plugin)])


@pytest.fixture
def cli():
    """`automodel ...` in this process, with exactly the base domain's plugin and this one loaded."""
    reset_plugin_manager(manager())
    yield lambda *args: main([str(a) for a in args])
    reset_plugin_manager(None)


def test_plugin_registers_its_route_and_aliases():
    m = manager()
    assert not m.failed(), [p.as_dict() for p in m.failed()]
    route = m.routes.get("@@COMMAND@@", "@@DOMAIN@@")
    assert route is not None and route.recipe == RECIPE
    assert m.aliases.targets["@@RECIPE_CLASS@@"] == RECIPE
    assert "@@PACKAGE@@" in m.targets.prefixes()


def test_example_validates(cli):
    assert cli("validate", "@@COMMAND@@", "@@DOMAIN@@", "-c", EXAMPLE) == 0


def test_route_trains_a_few_steps(cli, tmp_path):
    run = tmp_path / "run"
    code = cli("@@COMMAND@@", "@@DOMAIN@@", "-c", EXAMPLE, "--checkpoint.checkpoint_dir", run,
               "--step_scheduler.max_steps", 3, "--step_scheduler.log_interval", 1,
               "--step_scheduler.val_check_interval", 3)
    assert code == 0
    assert (run / "LATEST").is_file()
    losses = [json.loads(line)["loss"] for line in (run / "training.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(loss is not None and loss > 0 for loss in losses)
'''


def _import_as(module: str, alias: str) -> str:
    package, _, name = module.rpartition(".")
    return f"from {package} import {name} as {alias}" if package else f"import {module} as {alias}"


def render(template: str, names: Names, base: Base) -> str:
    module, _, cls = base.recipe.rpartition(".")
    core_version = _version("automodel-core")
    values = {
        "DIST": names.dist, "PACKAGE": names.package, "DOMAIN": names.domain, "COMMAND": names.command,
        "SECTION": names.section, "CAMEL": names.camel, "RECIPE_CLASS": names.recipe_class,
        "RECIPE_PATH": names.recipe_path, "BASE_RECIPE": base.recipe, "BASE_MODULE": module, "BASE_CLASS": cls,
        "BASE_DIST": base.distribution, "BASE_VERSION": base.version,
        "BASE_PLUGIN_IMPORT": _import_as(base.plugin_module, "base_plugin"),
        "BASE_NAME": base.domain, "CORE_VERSION": core_version,
        "HELP": f"Causal-LM fine-tuning with label smoothing ({names.recipe_class})" if base.recipe == LLM_BASE
        else f"{names.recipe_class}: a variant of {cls}",
    }
    for key, value in values.items():
        template = template.replace(f"@@{key}@@", value)
    leftover = re.search(r"@@[A-Z_]+@@", template)
    assert leftover is None, leftover
    return template


def plan_files(names: Names, base: Base) -> dict[str, str]:
    """Relative path -> text of every file the scaffold writes."""
    pkg = f"src/{names.package}"
    files = {
        "pyproject.toml": render(PYPROJECT, names, base),
        "README.md": render(README, names, base),
        f"{pkg}/__init__.py": render(INIT, names, base),
        f"{pkg}/plugin.py": render(PLUGIN, names, base),
    }
    if base.recipe == LLM_BASE:
        files[f"{pkg}/recipe.py"] = render(LLM_RECIPE, names, base)
        files[f"{pkg}/examples/tiny.yaml"] = render(LLM_EXAMPLE, names, base)
        files[f"tests/test_{names.section}.py"] = render(TEST + LLM_TEST_EXTRA, names, base)
    else:
        if base.example is None:
            raise UsageError(f"--domain {base.domain}: its recipe ships no example config to start from; "
                             "use --domain llm")
        header = (f"# Started from {base.example.name} of {base.distribution} (the base recipe's example).\n"
                  f"#   automodel {names.command} {names.domain} -c {names.domain}/tiny\n")
        files[f"{pkg}/recipe.py"] = render(GENERIC_RECIPE, names, base)
        files[f"{pkg}/examples/tiny.yaml"] = header + base.example.read_text(encoding="utf-8")
        files[f"tests/test_{names.section}.py"] = render(TEST, names, base)
    return files


def scaffold(dest: Path, name: str | None = None, domain: str = "llm", command: str = "finetune",
             force: bool = False, manager: PluginManager | None = None) -> tuple[Names, list[Path]]:
    manager = manager or get_plugin_manager()
    name = name or dest.resolve().name
    name = name.removeprefix("automodel-").removeprefix("automodel_")
    if not _NAME.match(name):
        raise UsageError(f"--name {name!r}: use lowercase letters, digits and single '-' or '_' between words "
                         "(it becomes the route's domain, e.g. my-sft)")
    if not _NAME.match(command):
        raise UsageError(f"--command {command!r}: use a lowercase word such as finetune")
    names = Names(name, command)
    existing = manager.routes.get(command, names.domain)
    if existing is not None:
        raise UsageError(f"route '{command} {names.domain}' is already installed (from {existing.source}); "
                         "choose another --name")
    if importlib.util.find_spec(names.package) is not None:
        raise UsageError(f"a Python package named '{names.package}' is already importable; choose another --name")
    base = find_base(manager, domain, command)
    if dest.exists() and any(dest.iterdir()) and not force:
        raise UsageError(f"'{dest}' exists and is not empty; choose a new directory or pass --force")
    written = []
    for rel, text in plan_files(names, base).items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return names, written


@click.command("new")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default=None, help="plugin name, also the route's domain (default: DEST's name)")
@click.option("--domain", default="llm", show_default=True, help="installed domain whose recipe to start from")
@click.option("--command", "command_word", default="finetune", show_default=True, help="the route's command word")
@click.option("--force", is_flag=True, help="write into a non-empty DEST, replacing files")
def new(dest: Path, name: str | None, domain: str, command_word: str, force: bool) -> None:
    """Scaffold a recipe plugin distribution in DEST (pyproject, plugin, recipe, example, test)."""
    names, written = scaffold(dest, name, domain, command_word, force)
    click.echo(f"created {names.dist} in {dest}: route `automodel {names.command} {names.domain}`, recipe "
               f"{names.recipe_path}")
    for path in written:
        click.echo(f"  {path}")
    click.echo("next:\n"
               f"  pip install -e {dest}\n"
               f"  pytest -q {dest / 'tests'}\n"
               f"  automodel {names.command} {names.domain} -c {names.domain}/tiny")
