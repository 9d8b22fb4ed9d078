"""The ``automodel`` click group: core commands, plugin commands and ``<command> <domain>`` routes."""

from __future__ import annotations

import sys

import click

from automodel.cli.execute import OVERRIDE_SETTINGS, exit_rank
from automodel.cli.launch import launch_params
from automodel.cli.trust_options import trust_params
from automodel.config.trust import set_command_line_trust
from automodel.errors import AutomodelError, UsageError
from automodel.noise import debug_enabled, filter_third_party_noise
from automodel.plugins.manager import PluginManager, get_plugin_manager
from automodel.suggest import did_you_mean

# Domains shipped by this project's own distributions, so an unknown route can say what to install.
KNOWN_DOMAINS = {
    "llm": "automodel-llm", "vlm": "automodel-vlm", "diffusion": "automodel-diffusion",
    "retrieval": "automodel-retrieval", "bi-encoder": "automodel-retrieval", "cross-encoder": "automodel-retrieval",
}


def _install_hint(domain: str) -> str:
    dist = KNOWN_DOMAINS.get(domain)
    return f"; domain '{domain}' is provided by the '{dist}' distribution: pip install {dist}" if dist else ""


def _failed_plugin_hint(manager: PluginManager, *names: str) -> str:
    for info in manager.failed():
        if any(n and (n == info.name or n in info.distribution) for n in names):
            why = info.error or "; ".join(f"{h}: {e}" for h, e in info.hook_errors.items())
            return f"; plugin '{info.name}' ({info.distribution}) that may provide it failed: {why}"
    return ""


class RouteCommand(click.Command):
    """``automodel <command> <domain> -c cfg.yaml [--a.b value ...]`` for one routed command word."""

    def __init__(self, name: str, manager: PluginManager):
        self.manager = manager
        domains = manager.routes.domains(name)
        super().__init__(
            name,
            callback=self._run,
            params=[
                click.Argument(["domain"], required=False),
                click.Option(["-c", "--config"], help="config YAML (a path, or a shipped example name)"),
                click.Option(["--dry-run"], is_flag=True, help="validate and print the plan; build nothing heavy"),
                click.Option(["--print-config"], is_flag=True, help="print the resolved config (secrets masked)"),
                *launch_params(),
                click.Option(["--slurm"], is_flag=True, help="write an sbatch script (slurm: section) and exit"),
                *trust_params(),
            ],
            help=f"Run a '{name}' recipe. Domains: {', '.join(domains)}. Extra --section.key value pairs "
                 "override the config.",
            short_help=f"{name} recipes: {', '.join(domains)}",
            context_settings=OVERRIDE_SETTINGS,
        )

    def _run(self, domain: str | None, config: str | None, dry_run: bool, print_config: bool, slurm: bool,
             **launch):
        from automodel.cli.execute import import_recipe, resolve_config_path, run_recipe

        ctx = click.get_current_context()
        manager, command = self.manager, self.name
        available = manager.routes.domains(command)
        if domain is None:
            raise UsageError(f"'automodel {command}' needs a domain: {', '.join(available)}")
        domain = manager.aliases.domains.get(domain, domain)
        route = manager.routes.get(command, domain)
        if route is None:
            hint = did_you_mean(domain, available)
            raise UsageError(
                f"no recipe for '{command} {domain}'; available for '{command}': {', '.join(available) or 'none'}"
                + (f" (did you mean '{hint}'?)" if hint else "")
                + _install_hint(domain) + _failed_plugin_hint(manager, domain, command))
        if (command, domain) in manager.routes.conflicts:
            raise UsageError(manager.routes.conflicts[(command, domain)])
        if not config:
            raise UsageError(f"'automodel {command} {domain}' needs a config: -c cfg.yaml"
                             + (f" (try -c {route.examples[0]})" if route.examples else ""))
        path = resolve_config_path(config, manager)
        recipe_cls = import_recipe(route.recipe)
        if slurm:
            from automodel.cli.execute import load_and_validate
            from automodel.cli.slurm import write_sbatch

            cfg = load_and_validate(recipe_cls, path, list(ctx.args), manager)
            script = write_sbatch(cfg.get("slurm"))
            click.echo(f"wrote {script}: submit it with `sbatch {script}`")
            ctx.exit(0)
        ctx.exit(run_recipe(recipe_cls, path, list(ctx.args), manager, dry_run, print_config, launch))


class AutomodelGroup(click.Group):
    """Core commands first; plugin commands may not shadow them; routed command words resolve lazily."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loaded = False
        self.core_commands: set[str] = set()

    @property
    def manager(self) -> PluginManager:
        manager = get_plugin_manager()
        if not self._loaded:
            self._loaded = True
            manager.register_commands(self)
        return manager

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        name = name or cmd.name
        if name in self.commands:
            raise AutomodelError(f"command '{name}' already exists and cannot be replaced by a plugin")
        super().add_command(cmd, name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        manager = self.manager
        return sorted(set(self.commands) | set(manager.routes.commands()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        manager = self.manager
        if name in self.commands:  # before aliases: a plugin's command alias cannot shadow a command
            return self.commands[name]
        name = manager.aliases.commands.get(name, name)
        if name in self.commands:
            return self.commands[name]
        if name in manager.routes.commands():
            return RouteCommand(name, manager)
        return None

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        cmd = self.get_command(ctx, name)
        if cmd is None and not name.startswith("-"):
            available = self.list_commands(ctx)
            hint = did_you_mean(name, available)
            domain = args[1] if len(args) > 1 else ""
            installed = {d for _, d in self.manager.routes.routes} | set(self.manager.aliases.domains)
            raise UsageError(
                f"unknown command '{name}'" + (f" (did you mean '{hint}'?)" if hint else "")
                + f"; available: {', '.join(available)}" + (_install_hint(domain) if domain not in installed else "")
                + _failed_plugin_hint(self.manager, name, args[1] if len(args) > 1 else ""))
        return super().resolve_command(ctx, args)


@click.group(cls=AutomodelGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="automodel-core", prog_name="automodel")
def cli() -> None:
    """Train PyTorch / Hugging Face models from YAML recipes.

    \b
    automodel finetune llm -c my.yaml --optimizer.lr 1e-4
    automodel cp llm/tiny_squad my.yaml       # start from a shipped example
    automodel recipes                         # what is installed
    """


def _warn_failed_plugins(argv: list[str]) -> None:
    if argv[:1] == ["plugins"]:
        return
    for info in get_plugin_manager().failed():
        why = info.error or "; ".join(f"{h}: {e}" for h, e in info.hook_errors.items())
        click.echo(f"warning: plugin '{info.name}' ({info.distribution}) is not working: {why}", err=True)


def main(argv: list[str] | None = None) -> int:
    return exit_rank(_main(argv))


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled()
    filter_third_party_noise()
    set_command_line_trust(names=(), remote_code=False)  # each invocation's options decide afresh
    try:
        _warn_failed_plugins(argv)
        result = cli.main(args=argv, prog_name="automodel", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("aborted", err=True)
        return 130
    except AutomodelError as exc:
        if debug:
            raise
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
