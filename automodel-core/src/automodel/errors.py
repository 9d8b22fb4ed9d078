"""User-facing errors. The CLI prints these without a traceback."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: the dotted key, what is wrong and, when known, what was probably meant."""

    key: str
    message: str
    suggestion: str | None = None

    def __str__(self) -> str:
        text = f"{self.key}: {self.message}" if self.key else self.message
        if self.suggestion:
            text += f" (did you mean '{self.suggestion}'?)"
        return text


class AutomodelError(Exception):
    """An error caused by the user's input or environment; exit code 1."""

    exit_code = 1


class ConfigError(AutomodelError):
    """Every problem found in a config at once; exit code 2."""

    exit_code = 2

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue):
        self.issues = [issues] if isinstance(issues, ConfigIssue) else list(issues)
        super().__init__(self.render())

    def render(self) -> str:
        if len(self.issues) == 1:
            return f"invalid configuration: {self.issues[0]}"
        lines = [f"invalid configuration ({len(self.issues)} problems):"]
        lines += [f"  - {issue}" for issue in self.issues]
        return "\n".join(lines)


class UsageError(AutomodelError):
    """A command-line mistake (unknown route, missing file); exit code 2."""

    exit_code = 2


class PluginError(AutomodelError):
    """A plugin registered something invalid or conflicting."""
