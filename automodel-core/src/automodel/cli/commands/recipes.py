"""``automodel recipes``: the installed routes with their recipe, distribution and examples."""

from __future__ import annotations

import json

import click

from automodel.cli.examples import list_examples
from automodel.plugins.manager import get_plugin_manager


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
        names = sorted(n for n, r in manager.aliases.recipes.items() if r == f"{route.command} {route.domain}")
        rows.append({"command": route.command, "domain": route.domain, "recipe": route.recipe, "help": route.help,
                     "distribution": route.source, "version": info.version if info else None,
                     "examples": route.examples, "recipe_names": names})
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
        short = [n for n in row["recipe_names"] if "." not in n]
        if short:
            click.echo(f"    recipe: {', '.join(short)}  (names a config's `recipe:` may give for this route)")
    aliases = manager.aliases
    if aliases.commands or aliases.domains:
        click.echo("aliases: " + ", ".join(f"{a} -> {t}" for a, t in {**aliases.commands, **aliases.domains}.items()))
