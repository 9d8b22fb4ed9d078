"""``automodel plugins``: the loaded plugins with their distribution, version, hooks and failures."""

from __future__ import annotations

import json

import click

from automodel.plugins.manager import get_plugin_manager


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
