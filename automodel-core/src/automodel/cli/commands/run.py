"""``automodel run -c cfg.yaml``: the recipe named by the config's ``recipe:`` key."""

from __future__ import annotations

from typing import Any

import click

from automodel.cli.execute import OVERRIDE_SETTINGS
from automodel.cli.launch import launch_params
from automodel.cli.trust_options import trust_options
from automodel.plugins.manager import get_plugin_manager


@click.command(context_settings=OVERRIDE_SETTINGS, params=launch_params())
@click.option("-c", "--config", required=True, help="config YAML with a `recipe:` key")
@click.option("--dry-run", is_flag=True, help="validate and print the plan; build nothing heavy")
@click.option("--print-config", is_flag=True, help="print the resolved config (secrets masked)")
@trust_options
@click.pass_context
def run(ctx: click.Context, config: str, dry_run: bool, print_config: bool, **launch: Any) -> None:
    """Run the recipe named by the config's `recipe:` key."""
    from automodel.cli.execute import recipe_from_config, resolve_config_path, run_recipe
    from automodel.config import load_yaml_file

    manager = get_plugin_manager()
    path = resolve_config_path(config, manager)
    recipe_cls = recipe_from_config(load_yaml_file(path), manager)
    ctx.exit(run_recipe(recipe_cls, path, list(ctx.args), manager, dry_run, print_config, launch))
