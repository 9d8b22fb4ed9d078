"""Tool calls in generated text, and how well they match the expected ones (upstream NeMo AutoModel's tool-call
parser and per-sample metrics, same forms and same numbers).

Chat templates write a tool call in one of a few forms; the first form found in the text is the one read:

* Harmony / GPT-OSS: ``<|channel|>commentary to=functions.NAME<|message|>{arguments}``;
* Qwen / Hermes / Gemma / GLM: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (a JSON list inside
  is several calls);
* Llama 3.1+: ``<|python_tag|>{"name": ..., "parameters": ...}``;
* Mistral: ``[TOOL_CALLS][{...}, {...}]``;
* else any JSON object in the text with a ``name``.

Reading never raises: a wrapped call whose JSON is malformed counts as a call without a name or valid arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

METRIC_KEYS = ("has_call", "name_correct", "args_json_valid", "args_field_recall", "args_field_precision",
               "args_exact_match")
_HARMONY = re.compile(r"<\|channel\|>\s*commentary\s+to=functions\.([\w\-]+)[^<]*<\|message\|>\s*")
_QWEN = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.DOTALL)
_LLAMA = re.compile(r"<\|python_tag\|>\s*")
_MISTRAL = re.compile(r"\[TOOL_CALLS\]\s*")
_CLOSING = {"{": "}", "[": "]"}


@dataclass
class ToolCall:
    """A call read from generated text: ``name`` None when it could not be read, ``arguments`` empty unless
    ``valid_arguments`` (they were a JSON object)."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    valid_arguments: bool = False


def balanced_end(text: str, start: int) -> int | None:
    """The index just past the bracket that closes the one at ``text[start]`` (brackets inside JSON strings do
    not count); None when it is not closed."""
    opener = text[start] if start < len(text) else ""
    if opener not in _CLOSING:
        return None
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char == opener:
            depth += 1
        elif char == _CLOSING[opener]:
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _arguments(value: Any) -> tuple[dict[str, Any], bool]:
    """The arguments as a dict, and whether they were a JSON object (a dict, or a string holding one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}, False
    return (value, True) if isinstance(value, dict) else ({}, False)


def _call(obj: Any) -> ToolCall | None:
    """The call a ``{"name", "arguments" | "parameters"}`` object makes; None without a name."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments, valid = _arguments(obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], arguments, valid)


def _calls(objects: list[Any]) -> list[ToolCall]:
    return [call for call in map(_call, objects) if call is not None]


def _harmony(text: str) -> list[ToolCall]:
    calls = []
    for match in _HARMONY.finditer(text):
        end = balanced_end(text, match.end())
        if end is not None:
            calls.append(ToolCall(match.group(1), *_arguments(text[match.end():end])))
    return calls


def _qwen(text: str) -> list[ToolCall]:
    calls = []
    for match in _QWEN.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            calls.append(ToolCall(None))
            continue
        calls += _calls(body if isinstance(body, list) else [body])
    return calls


def _llama(text: str) -> list[ToolCall]:
    calls = []
    for match in _LLAMA.finditer(text):
        end = balanced_end(text, match.end())
        if end is None:
            continue
        try:
            body = json.loads(text[match.end():end])
        except ValueError:
            calls.append(ToolCall(None))
            continue
        calls += _calls([body])
    return calls


def _mistral(text: str) -> list[ToolCall]:
    calls = []
    for match in _MISTRAL.finditer(text):
        end = balanced_end(text, match.end())
        try:
            body = json.loads(text[match.end():end]) if end is not None else None
        except ValueError:
            continue
        calls += _calls(body if isinstance(body, list) else [])
    return calls


def _any_json_object(text: str) -> list[ToolCall]:
    objects, start = [], text.find("{")
    while start >= 0:
        end = balanced_end(text, start)
        if end is None:
            break
        try:
            objects.append(json.loads(text[start:end]))
        except ValueError:
            pass
        start = text.find("{", end)
    return _calls(objects)


_FORMS: tuple[Callable[[str], list[ToolCall]], ...] = (_harmony, _qwen, _llama, _mistral, _any_json_object)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in ``text`` in order, in the first of the forms above that has any (possibly none)."""
    for form in _FORMS:
        calls = form(text) if text else []
        if calls:
            return calls
    return []


def _pair_scores(got: ToolCall | None, expected: dict[str, Any]) -> dict[str, float]:
    if got is None:
        return dict.fromkeys(METRIC_KEYS, 0.0)
    wanted = _arguments(expected.get("arguments", {}))[0]
    given = set(got.arguments) if got.valid_arguments else set()
    common = len(given & set(wanted))
    return {"has_call": 1.0, "name_correct": float(got.name == expected.get("name")),
            "args_json_valid": float(got.valid_arguments),
            "args_field_recall": common / len(wanted) if wanted else float(not given),
            "args_field_precision": common / len(given) if given else float(not wanted),
            "args_exact_match": float(got.valid_arguments and got.arguments == wanted)}


def sample_scores(calls: list[ToolCall], expected: list[dict[str, Any]]) -> dict[str, float]:
    """Each of :data:`METRIC_KEYS` in [0, 1] for one sample: the i-th call read is scored against the i-th expected
    call (``{name, arguments}``), a missing one scores 0 everywhere, extra ones are ignored; the mean over the
    expected calls (all 0 when none are expected)."""
    sums = dict.fromkeys(METRIC_KEYS, 0.0)
    for index, want in enumerate(expected):
        for key, value in _pair_scores(calls[index] if index < len(calls) else None, want).items():
            sums[key] += value
    return {key: total / len(expected) if expected else 0.0 for key, total in sums.items()}
