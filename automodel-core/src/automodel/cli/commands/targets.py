"""``automodel targets``: what a config may name in ``_target_``, who registered it, and the aliases.

Registration is by dotted string, so listing imports nothing but the plugin modules (no torch).
"""

from __future__ import annotations

import json
from typing import Any

import click

from automodel.cli.trust_options import trust_options
from automodel.config.registry import Registration
from automodel.config.trust import UserTrust
from automodel.plugins.manager import PluginManager, get_plugin_manager


def registered(manager: PluginManager) -> list[dict[str, Any]]:
    """One row per registered name: name, kind (exact / prefix / rule) and the distributions that registered it."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for reg in manager.targets.entries():
        rows.setdefault((reg.name, reg.kind), {"name": reg.name, "kind": reg.kind, "sources": []})["sources"] \
            .append(reg.source)
    return list(rows.values())


def trusted() -> list[Registration]:
    """The names the person running trusts (command line, environment, their own file), as prefixes."""
    return [Registration(t.name, "prefix", t.source) for t in UserTrust.current().names]


def aliases(manager: PluginManager) -> list[dict[str, str]]:
    table = manager.aliases.targets
    return [{"alias": a, "target": table[a], "source": manager.aliases.target_source(a)} for a in sorted(table)]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@trust_options
def targets(as_json: bool) -> None:
    """List what configs may name in `_target_`: exact callables, own packages (prefix) and transformers'
    configuration classes (rule), with who registered them, the names you trust, and the aliases."""
    manager = get_plugin_manager()
    rows, mine, table = registered(manager), trusted(), aliases(manager)
    if as_json:
        click.echo(json.dumps({"targets": rows, "trusted": [vars(r) for r in mine], "aliases": table}, indent=2))
        return
    width = max(len(r["name"]) for r in [*rows, *({"name": t.name} for t in mine)])
    click.echo(f"{'name':<{width}}  kind    registered by")
    for row in rows:
        click.echo(f"{row['name']:<{width}}  {row['kind']:<6}  {', '.join(row['sources'])}")
    click.echo("exact: that callable (a class also admits its from_* constructors); prefix: everything under it; "
               "rule: transformers' own configuration classes (PretrainedConfig subclasses in "
               "transformers.models.<model>.configuration_<model>, also as transformers.<Name>Config), their "
               "constructors and from_pretrained only")
    if mine:
        click.echo("trusted by you:")
        for reg in mine:
            click.echo(f"{reg.name:<{width}}  prefix  {reg.source}")
    if table:
        click.echo("aliases:")
        for alias in table:
            click.echo(f"  {alias['alias']} -> {alias['target']}  [{alias['source']}]")
