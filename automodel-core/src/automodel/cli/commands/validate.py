"""``automodel validate``: every problem of a config at once, against the recipe it is for."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import click

from automodel.cli.execute import OVERRIDE_SETTINGS
from automodel.cli.trust_options import trust_options
from automodel.errors import ConfigError, UsageError
from automodel.plugins.manager import get_plugin_manager


def _best_route_for(path: Path, extra: list[str], own_layout: bool):
    """The installed recipe that a config without `recipe:` fits best: the fewest top-level sections it does not
    know (an unknown section is one issue however much it holds), then the fewest problems; `finetune llm` on ties.
    """
    from automodel.cli.execute import import_recipe
    from automodel.config import load_yaml_file
    from automodel.config.specs import find_spec

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
            _check(recipe_cls, path, extra, manager, own_layout, quiet=True)
            return route, None
        except ConfigError as err:
            sections = recipe_cls.all_sections()
            rank = (sum(find_spec(name, sections) is None for name in names), len(err.issues))
            if best_rank is None or rank < best_rank:
                best, best_rank = (route, err), rank
    if best is None:
        raise UsageError("no recipes are installed to validate against; install a domain such as automodel-llm")
    return best


@click.command(context_settings=OVERRIDE_SETTINGS)
@click.argument("route", nargs=-1)
@click.option("-c", "--config", required=True, help="config YAML")
@click.option("--nproc-per-node", type=int, default=None, help="check for this many processes per node")
@click.option("--nnodes", type=int, default=None, help="check for this many nodes")
@trust_options
@click.pass_context
def validate(ctx: click.Context, route: tuple[str, ...], config: str, nproc_per_node: int | None,
             nnodes: int | None) -> None:
    """Report every problem in a config at once (exit 2 when there are any).

    The recipe is the one named by ROUTE (`automodel validate finetune llm -c x.yaml`), else the config's
    `recipe:` key, else the installed recipe the config fits best. The device mesh (`distributed.*`) is checked
    against --nproc-per-node x --nnodes processes, else against WORLD_SIZE, else (neither given) against the
    smallest world the config's own layout needs (tp_size x cp_size x pp_size x dp_size, say), which the result
    line names with the launch options to use.
    """
    from automodel.cli.launch import planned_world
    from automodel.training.dist import planned_world_size

    launch = {"nproc_per_node": nproc_per_node, "nnodes": nnodes}
    planned = (planned_world_size(*planned_world(launch), nodes=nnodes or 1) if nproc_per_node or nnodes
               else contextlib.nullcontext())
    with planned:
        label, path, checked = _validate(ctx, route, config, own_layout=not (nproc_per_node or nnodes
                                                                             or "WORLD_SIZE" in os.environ))
    click.echo(f"{path}: valid for {label} ({checked})")


@contextlib.contextmanager
def _world_for(recipe_cls: type, path: Path, extra: list[str], own_layout: bool) -> Iterator[None]:
    """Validation in the block checks the world given (the launch options, WORLD_SIZE), else, ``own_layout``, the
    smallest one the config's own layout needs (``own_world``): a config written for 8 ranks is checked as 8."""
    if not own_layout:
        yield
        return
    from automodel.config import apply_overrides, interpolate, load_yaml_file, parse_overrides
    from automodel.training.dist import planned_world_size

    raw = apply_overrides(load_yaml_file(path), parse_overrides(extra))
    size, nodes = recipe_cls.own_world(interpolate(raw, []))  # a broken reference is reported by validation
    launch = f"--nproc-per-node {size // nodes}" + (f" --nnodes {nodes}" if nodes > 1 else "")
    source = "the layout's own size, as neither --nproc-per-node / --nnodes nor WORLD_SIZE was given"
    with planned_world_size(size, f"{source}: launch with {launch}" if size > 1 else source, nodes):
        yield


def _check(recipe_cls: type, path: Path, extra: list[str], manager, own_layout: bool, quiet: bool = False) -> str:
    """Validate (a ``ConfigError`` on problems); the words saying which world it was checked for."""
    from automodel.cli.execute import load_and_validate
    from automodel.training.dist import expected_world_size, world_size_source

    with _world_for(recipe_cls, path, extra, own_layout):
        load_and_validate(recipe_cls, path, extra, manager, quiet=quiet)
        world = expected_world_size()
        return f"checked for {world} process{'es' if world > 1 else ''}: {world_size_source()}"


def _validate(ctx: click.Context, route: tuple[str, ...], config: str, own_layout: bool) -> tuple[str, Path, str]:
    from automodel.cli.execute import import_recipe, recipe_from_config, resolve_config_path
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
        checked = _check(import_recipe(found.recipe), path, extra, manager, own_layout)
        label = f"{found.command} {found.domain}"
    elif "recipe" in load_yaml_file(path):
        recipe_cls = recipe_from_config(load_yaml_file(path), manager)
        checked = _check(recipe_cls, path, extra, manager, own_layout)
        label = f"{recipe_cls.__module__}.{recipe_cls.__qualname__}"
    else:
        found, error = _best_route_for(path, extra, own_layout)
        if error is not None:
            raise error
        checked = _check(import_recipe(found.recipe), path, extra, manager, own_layout)  # once more, for its notes
        label = f"{found.command} {found.domain}"
    return label, path, checked
