"""Hook specifications: what a plugin may implement. Every hook is optional.

Hooks receive a registry and call its ``add``-style methods, so that validation (duplicates, bad names) stays
in the host and plugins stay small. Registration takes dotted strings where possible so that listing routes
imports nothing heavy. Hooks are called once per process, when the plugin manager first loads, in plugin
registration order (the core first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automodel.plugins.markers import hookspec

if TYPE_CHECKING:
    import click

    from automodel.plugins.registries import (
        AliasRegistry,
        BuilderRegistry,
        LoggerRegistry,
        RouteRegistry,
        StageRegistry,
    )


@hookspec
def automodel_register_routes(routes: RouteRegistry) -> None:
    """Add (command, domain) routes:
    ``routes.add("finetune", "llm", recipe="pkg.mod.Class", help=..., examples=[...])``."""


@hookspec
def automodel_register_aliases(aliases: AliasRegistry) -> None:
    """Add command, domain, target and recipe aliases: ``aliases.command("sft", "finetune")``,
    ``aliases.domain(...)``, ``aliases.target("SquadDataset", "pkg.mod.SquadDataset")``,
    ``aliases.recipe("UpstreamRecipeName", "finetune", "llm")`` (a name a config's ``recipe:`` may give), and
    names refused with a reason: ``aliases.unsupported("upstream.Name", "what to use instead")``."""


@hookspec
def automodel_register_builders(builders: BuilderRegistry) -> None:
    """Add or override builders: ``builders.add("model", fn, domain="vlm")``; ``fn(ctx, *args)`` receives the
    ``BuildContext`` and the core builder's arguments and returns what it builds."""


@hookspec
def automodel_register_stages(stages: StageRegistry) -> None:
    """Add an implementation to a fixed pipeline slot: ``stages.add("sharding", "fsdp2", fn)``; ``fn(ctx, model)``
    returns ``(model, message)``."""


@hookspec
def automodel_allowed_targets() -> list[str]:
    """Return what this plugin's configs may name in ``_target_``, as dotted strings: the exact callables of other
    libraries they use (a class also admits its public ``from_*`` classmethods), and the plugin's own package as a
    prefix (``"automodel_hello"``: everything under it). A package the plugin's distribution does not ship is not
    accepted as a prefix: it is ignored and recorded as this hook's error."""


@hookspec
def automodel_register_commands(cli: click.Group) -> None:
    """Add whole click commands to the ``automodel`` group (core commands cannot be shadowed)."""


@hookspec
def automodel_register_loggers(loggers: LoggerRegistry) -> None:
    """Add metric logging backends: ``loggers.add("wandb", factory)``."""
