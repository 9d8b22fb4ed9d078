"""``automodel cp``: copy a shipped example config to start from."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from automodel.cli.examples import list_examples
from automodel.errors import UsageError
from automodel.plugins.manager import get_plugin_manager


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
