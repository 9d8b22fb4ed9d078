"""The core's own commands, registered through ``automodel_register_commands`` like any plugin's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from automodel.cli.examples import list_examples
from automodel.cli.list_targets import targets
from automodel.cli.plot import plot
from automodel.cli.scaffold import new
from automodel.cli.trust_options import trust_options
from automodel.errors import ConfigError, UsageError
from automodel.plugins.manager import get_plugin_manager

_OVERRIDES = {"ignore_unknown_options": True, "allow_extra_args": True}


@click.command(context_settings=_OVERRIDES)
@click.option("-c", "--config", required=True, help="config YAML with a `recipe:` key")
@click.option("--dry-run", is_flag=True, help="validate and print the plan; build nothing heavy")
@click.option("--print-config", is_flag=True, help="print the resolved config (secrets masked)")
@click.option("--nproc-per-node", type=int, default=None, help="processes per node (torchrun)")
@trust_options
@click.pass_context
def run(ctx: click.Context, config: str, dry_run: bool, print_config: bool, nproc_per_node: int | None) -> None:
    """Run the recipe named by the config's `recipe:` key."""
    from automodel.cli.execute import recipe_from_config, resolve_config_path, run_recipe
    from automodel.config import load_yaml_file

    manager = get_plugin_manager()
    path = resolve_config_path(config, manager)
    recipe_cls = recipe_from_config(load_yaml_file(path), manager)
    ctx.exit(run_recipe(recipe_cls, path, list(ctx.args), manager, dry_run, print_config,
                        {"nproc_per_node": nproc_per_node}))


def _best_route_for(path: Path, extra: list[str]):
    """The installed recipe that a config without `recipe:` fits best: the fewest top-level sections it does not
    know (an unknown section is one issue however much it holds), then the fewest problems; `finetune llm` on ties.
    """
    from automodel.cli.execute import import_recipe, load_and_validate
    from automodel.config import load_yaml_file
    from automodel.config.schema import find_spec

    manager = get_plugin_manager()
    names = [str(name) for name in load_yaml_file(path)]
    best = None
    best_rank = None
    routes = sorted(manager.routes.routes.values(), key=lambda r: (r.command, r.domain) != ("finetune", "llm"))
    for route in routes:
        try:
            recipe_cls = import_recipe(route.recipe)
        except UsageError:
            continue
        try:
            load_and_validate(recipe_cls, path, extra, manager)
            return route, None
        except ConfigError as err:
            sections = recipe_cls.all_sections()
            rank = (sum(find_spec(name, sections) is None for name in names), len(err.issues))
            if best_rank is None or rank < best_rank:
                best, best_rank = (route, err), rank
    if best is None:
        raise UsageError("no recipes are installed to validate against; install a domain such as automodel-llm")
    return best


@click.command(context_settings=_OVERRIDES)
@click.argument("route", nargs=-1)
@click.option("-c", "--config", required=True, help="config YAML")
@trust_options
@click.pass_context
def validate(ctx: click.Context, route: tuple[str, ...], config: str) -> None:
    """Report every problem in a config at once (exit 2 when there are any).

    The recipe is the one named by ROUTE (`automodel validate finetune llm -c x.yaml`), else the config's
    `recipe:` key, else the installed recipe the config fits best.
    """
    from automodel.cli.execute import import_recipe, load_and_validate, recipe_from_config, resolve_config_path
    from automodel.config import load_yaml_file

    manager = get_plugin_manager()
    path = resolve_config_path(config, manager)
    # click hands unknown options to the ROUTE words too: words up to the first --option name the route.
    words = list(route)
    first_option = next((i for i, w in enumerate(words) if w.startswith("--")), len(words))
    route, extra = tuple(words[:first_option]), words[first_option:] + list(ctx.args)
    if route:
        if len(route) != 2 or manager.routes.get(route[0], manager.aliases.domains.get(route[1], route[1])) is None:
            raise UsageError(f"unknown route '{' '.join(route)}'; `automodel recipes` lists them")
        found = manager.routes.get(route[0], manager.aliases.domains.get(route[1], route[1]))
        load_and_validate(import_recipe(found.recipe), path, extra, manager)
        label = f"{found.command} {found.domain}"
    elif "recipe" in load_yaml_file(path):
        recipe_cls = recipe_from_config(load_yaml_file(path), manager)
        load_and_validate(recipe_cls, path, extra, manager)
        label = f"{recipe_cls.__module__}.{recipe_cls.__qualname__}"
    else:
        found, error = _best_route_for(path, extra)
        if error is not None:
            raise error
        label = f"{found.command} {found.domain}"
    click.echo(f"{path}: valid for {label}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def recipes(as_json: bool) -> None:
    """List installed routes with their recipe, distribution and examples."""
    manager = get_plugin_manager()
    examples = list_examples(manager)
    rows = []
    for route in sorted(manager.routes.routes.values(), key=lambda r: (r.command, r.domain)):
        info = manager.plugins.get(route.source) or next(
            (p for p in manager.plugins.values() if p.distribution == route.source), None)
        rows.append({"command": route.command, "domain": route.domain, "recipe": route.recipe, "help": route.help,
                     "distribution": route.source, "version": info.version if info else None,
                     "examples": route.examples})
    if as_json:
        click.echo(json.dumps({"routes": rows, "examples": {k: str(v) for k, v in examples.items()}}, indent=2))
        return
    if not rows:
        click.echo("no recipes installed; install a domain, e.g. pip install automodel-llm")
    for row in rows:
        click.echo(f"{row['command']} {row['domain']:<14} {row['recipe']}  [{row['distribution']} {row['version']}]")
        if row["help"]:
            click.echo(f"    {row['help']}")
        for example in row["examples"]:
            click.echo(f"    example: {example}")
    aliases = manager.aliases
    if aliases.commands or aliases.domains:
        click.echo("aliases: " + ", ".join(f"{a} -> {t}" for a, t in {**aliases.commands, **aliases.domains}.items()))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def plugins(as_json: bool) -> None:
    """List plugins with their distribution, version, hooks and failures."""
    manager = get_plugin_manager()
    infos = list(manager.plugins.values())
    if as_json:
        click.echo(json.dumps([info.as_dict() for info in infos], indent=2))
        return
    for info in infos:
        status = "ok" if info.ok else "FAILED"
        click.echo(f"{info.name:<12} {info.distribution} {info.version}  [{status}]")
        if info.hooks:
            click.echo(f"    hooks: {', '.join(info.hooks)}")
        if info.error:
            click.echo(f"    error: {info.error}")
        for hook, error in info.hook_errors.items():
            click.echo(f"    error in {hook}: {error}")


@click.command()
@click.argument("example", required=False)
@click.argument("dest", required=False, type=click.Path(dir_okay=True))
@click.option("--force", is_flag=True, help="overwrite an existing file")
def cp(example: str | None, dest: str | None, force: bool) -> None:
    """Copy a shipped example config to DEST (no arguments: list the examples)."""
    examples = list_examples(get_plugin_manager())
    if example is None:
        for name, path in examples.items():
            click.echo(f"{name:<28} {path}")
        return
    source = examples.get(example.removesuffix(".yaml"))
    if source is None:
        raise UsageError(f"no shipped example '{example}'; available: {', '.join(examples) or 'none'}")
    target = Path(dest or f"{source.stem}.yaml")
    if target.is_dir():
        target = target / source.name
    if target.exists() and not force:
        raise UsageError(f"'{target}' already exists; pass --force to overwrite it")
    shutil.copyfile(source, target)
    click.echo(f"copied {example} to {target}")


CORE_COMMANDS = (run, validate, recipes, plugins, targets, cp, new, plot)
