"""The command-line options by which the person running trusts code a config cannot vouch for.

``--allow-target NAME`` (repeatable) trusts NAME (a package, module or callable) as a ``_target_`` prefix;
``--trust-remote-code`` lets a config's ``trust_remote_code: true`` (and the other keys that run a model's own
code or unpickle) act. Both are recorded in :mod:`automodel.config.trust` as the options are parsed, so commands
need no extra parameters; torchrun ranks and sbatch jobs re-run the same command line and record the same.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from automodel.config.trust import ALLOW_FLAG, TRUST_REMOTE_CODE_FLAG, set_command_line_trust


def _record_targets(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    set_command_line_trust(names=value)


def _record_remote_code(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    set_command_line_trust(remote_code=value)


_OPTIONS: tuple[tuple[tuple[str, ...], dict], ...] = (
    ((ALLOW_FLAG,), {"multiple": True, "metavar": "NAME", "expose_value": False, "callback": _record_targets,
                     "help": "trust your own package, module or callable NAME as a _target_ (repeatable)"}),
    ((TRUST_REMOTE_CODE_FLAG,), {"is_flag": True, "expose_value": False, "callback": _record_remote_code,
                                 "help": "let the config's trust_remote_code: true (and other keys that run a "
                                         "model's code or unpickle) act"}),
)


def trust_params() -> list[click.Option]:
    """Fresh option objects for one command built as a ``click.Command``."""
    return [click.Option(list(decls), **attrs) for decls, attrs in _OPTIONS]


def trust_options(command: Callable) -> Callable:
    """Decorator adding the trust options to a ``@click.command`` function."""
    for decls, attrs in reversed(_OPTIONS):
        command = click.option(*decls, **attrs)(command)
    return command
