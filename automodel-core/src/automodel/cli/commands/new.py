"""``automodel new``: scaffold a third-party recipe plugin distribution, ready to ``pip install -e``.

The result is a complete distribution (DESIGN §4): ``pyproject.toml`` with the ``automodel`` entry point, a
``plugin.py`` registering its route and aliases, a recipe subclassing the closest installed recipe of the chosen
domain, an example YAML that runs offline from the domain's shipped assets, and a tiny CPU test. The files are
rendered from ``automodel/cli/templates/*.tmpl`` with ``string.Template`` (``${name}`` placeholders; ``$$`` is a
literal ``$``). Nothing here imports torch: the base recipe is found through the installed routes (dotted strings).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from string import Template

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


def _import_as(module: str, alias: str) -> str:
    package, _, name = module.rpartition(".")
    return f"from {package} import {name} as {alias}" if package else f"import {module} as {alias}"


def template(name: str) -> Template:
    return Template((resources.files("automodel.cli") / "templates" / f"{name}.tmpl").read_text(encoding="utf-8"))


def render(name: str, names: Names, base: Base) -> str:
    """The template ``name`` with every placeholder filled (a placeholder without a value raises KeyError)."""
    module, _, cls = base.recipe.rpartition(".")
    return template(name).substitute(
        dist=names.dist, package=names.package, domain=names.domain, command=names.command, section=names.section,
        camel=names.camel, recipe_class=names.recipe_class, recipe_path=names.recipe_path, base_recipe=base.recipe,
        base_module=module, base_class=cls, base_dist=base.distribution, base_version=base.version,
        base_plugin_import=_import_as(base.plugin_module, "base_plugin"), base_name=base.domain,
        core_version=_version("automodel-core"),
        help=f"Causal-LM fine-tuning with label smoothing ({names.recipe_class})" if base.recipe == LLM_BASE
        else f"{names.recipe_class}: a variant of {cls}")


def plan_files(names: Names, base: Base) -> dict[str, str]:
    """Relative path -> text of every file the scaffold writes."""
    pkg = f"src/{names.package}"
    files = {
        "pyproject.toml": render("pyproject.toml", names, base),
        "README.md": render("README.md", names, base),
        f"{pkg}/__init__.py": render("__init__.py", names, base),
        f"{pkg}/plugin.py": render("plugin.py", names, base),
    }
    if base.recipe == LLM_BASE:
        files[f"{pkg}/recipe.py"] = render("llm_recipe.py", names, base)
        files[f"{pkg}/examples/tiny.yaml"] = render("llm_example.yaml", names, base)
        files[f"tests/test_{names.section}.py"] = render("test.py", names, base) + render("llm_test_extra.py", names,
                                                                                           base)
    else:
        if base.example is None:
            raise UsageError(f"--domain {base.domain}: its recipe ships no example config to start from; "
                             "use --domain llm")
        header = (f"# Started from {base.example.name} of {base.distribution} (the base recipe's example).\n"
                  f"#   automodel {names.command} {names.domain} -c {names.domain}/tiny\n")
        files[f"{pkg}/recipe.py"] = render("generic_recipe.py", names, base)
        files[f"{pkg}/examples/tiny.yaml"] = header + base.example.read_text(encoding="utf-8")
        files[f"tests/test_{names.section}.py"] = render("test.py", names, base)
    return files


def scaffold(dest: Path, name: str | None = None, domain: str = "llm", command: str = "finetune",
             force: bool = False, manager: PluginManager | None = None) -> tuple[Names, Base, list[Path]]:
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
    return names, base, written


@click.command("new")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default=None, help="plugin name, also the route's domain (default: DEST's name)")
@click.option("--domain", default="llm", show_default=True, help="installed domain whose recipe to start from")
@click.option("--command", "command_word", default="finetune", show_default=True, help="the route's command word")
@click.option("--force", is_flag=True, help="write into a non-empty DEST, replacing files")
def new(dest: Path, name: str | None, domain: str, command_word: str, force: bool) -> None:
    """Scaffold a recipe plugin distribution in DEST (pyproject, plugin, recipe, example, test)."""
    names, base, written = scaffold(dest, name, domain, command_word, force)
    click.echo(f"created {names.dist} in {dest}: route `automodel {names.command} {names.domain}`, recipe "
               f"{names.recipe_path}")
    for path in written:
        click.echo(f"  {path}")
    click.echo(f"next steps (in the virtualenv where {base.distribution} is installed):")
    for step in next_steps(dest, names):
        click.echo(f"  {step}")


def next_steps(dest: Path, names: Names) -> list[str]:
    """The commands that install the scaffold with its test extra, run its tests with that interpreter's pytest,
    and run its route (tests/test_scaffold.py runs exactly these in a clean virtualenv)."""
    return [f"python -m pip install -e {shlex.quote(f'{dest}[test]')}",
            f"python -m pytest -q {shlex.quote(str(dest / 'tests'))}",
            f"automodel {names.command} {names.domain} -c {names.domain}/tiny"]
