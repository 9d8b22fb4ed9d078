"""A chat template a config gives (a data set's ``chat_template``): inline Jinja, or the path of a file holding it
(a ``.jinja`` template, or JSON with a ``chat_template`` key, as upstream takes it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError


def chat_template_problem(value: Any) -> str | None:
    """Why ``value`` is no chat template (None when it is one: inline Jinja or an existing file)."""
    if value is None or is_template_text(value) or (isinstance(value, str) and Path(value).is_file()):
        return None
    return (f"{value!r} is neither a Jinja template (no '{{{{' or '{{%') nor an existing file; give the template "
            "inline or the path of a .jinja file")


def is_template_text(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def resolve_chat_template(value: str | None, key: str = "dataset.chat_template") -> str | None:
    """The template ``value`` gives: itself when inline, else the file's (its ``chat_template`` key for JSON)."""
    if value is None:
        return None
    problem = chat_template_problem(value)
    if problem is not None:
        raise AutomodelError(f"{key}: {problem}")
    if is_template_text(value):
        return value
    text = Path(value).read_text(encoding="utf-8")
    if Path(value).suffix == ".json":
        try:
            return json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise AutomodelError(f"{key}: '{value}' is JSON without a 'chat_template' string") from None
    return text
