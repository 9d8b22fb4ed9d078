"""What the person running automodel trusts, as opposed to what a config asks for.

A config is untrusted data. Only the person running decides to trust their own code or a model's code, in three
places a config cannot reach: the command line (``--allow-target NAME``, ``--trust-remote-code``), the environment
(``AUTOMODEL_ALLOW_TARGETS=pkg,pkg2.fn``) and their own file (``$XDG_CONFIG_HOME/automodel/trusted-targets.txt``,
one dotted name per line, ``#`` comments). A trusted name is a prefix: ``mypkg`` trusts everything under it.

The command line's choices are set once per invocation by the CLI (:func:`set_command_line_trust`); a torchrun
rank or an sbatch job re-runs the same command line, so it makes the same choices.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ALLOW_ENV = "AUTOMODEL_ALLOW_TARGETS"
ALLOW_FLAG = "--allow-target"
TRUST_REMOTE_CODE_FLAG = "--trust-remote-code"


def trusted_targets_file() -> Path:
    """``$XDG_CONFIG_HOME/automodel/trusted-targets.txt``; ``~/.config/automodel/...`` without XDG_CONFIG_HOME."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "automodel" / "trusted-targets.txt"


@dataclass(frozen=True)
class TrustedName:
    name: str
    source: str  # where the person running said so: the flag, the variable or the file


@dataclass(frozen=True)
class UserTrust:
    """The names the person running trusts as ``_target_`` prefixes, and whether model code may run."""

    names: tuple[TrustedName, ...] = ()
    remote_code: bool = False

    @classmethod
    def current(cls) -> UserTrust:
        """This process's trust: the command line's choices, the environment variable and the user's file."""
        names = [TrustedName(n, ALLOW_FLAG) for n in _command_line.names]
        names += [TrustedName(n, ALLOW_ENV) for n in _split(os.environ.get(ALLOW_ENV, "").split(","))]
        path = trusted_targets_file()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            lines = []
        names += [TrustedName(n, str(path)) for n in _split(line.split("#", 1)[0] for line in lines)]
        return cls(tuple(names), _command_line.remote_code)


@dataclass(frozen=True)
class _CommandLine:
    names: tuple[str, ...] = ()
    remote_code: bool = False


_command_line = _CommandLine()


def _split(items: Iterable[str]) -> list[str]:
    return [item.strip() for item in items if item.strip()]


def set_command_line_trust(*, names: Iterable[str] | None = None, remote_code: bool | None = None) -> None:
    """Record what this invocation's command line trusts; a field left None keeps its value.

    The CLI resets both when it starts and sets each from its options for every command that reads a config.
    """
    global _command_line
    _command_line = _CommandLine(_command_line.names if names is None else tuple(_split(names)),
                                 _command_line.remote_code if remote_code is None else bool(remote_code))
