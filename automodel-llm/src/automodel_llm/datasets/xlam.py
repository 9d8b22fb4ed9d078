"""xLAM function-calling rows (Salesforce/xlam-function-calling-60k): a ``query``, the ``tools`` it may call and
the ``answers`` (the calls to make), each a JSON string. A row becomes a user turn and an assistant turn whose
OpenAI ``tool_calls`` are the answers, with the tools in OpenAI's schema; rendered and labelled as
:class:`~automodel_llm.datasets.agent_chat.AgentChatDataset` renders a conversation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from automodel.data import OnBadRow
from automodel_llm.datasets.agent_chat import AgentChatDataset, tool_call
from automodel_llm.datasets.arguments import Given, Padding, SampleLength, Truncation, raise_problems, read_rows
from automodel_llm.datasets.chat import RowProblem, parse_json, with_chat_template

# xLAM's parameter types (Python's names, some with arguments: "List[int]", "str, optional") in JSON Schema's
_TYPES = {"str": "string", "string": "string", "int": "integer", "integer": "integer", "float": "number",
          "double": "number", "number": "number", "bool": "boolean", "boolean": "boolean", "list": "array",
          "array": "array", "tuple": "array", "set": "array", "dict": "object", "object": "object"}


def openai_tool(tool: Any) -> dict:
    """An xLAM tool definition ``{name, description, parameters: {name: {type, description, default}}}`` in
    OpenAI's schema; a parameter without a default (and not typed optional) is required."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise RowProblem(f"a tool needs a name: {tool!r}")
    properties, required = {}, []
    for name, spec in (tool.get("parameters") or {}).items():
        spec = spec if isinstance(spec, dict) else {}
        written = str(spec.get("type", "str")).lower()
        schema = {"type": _TYPES.get(written.split(",")[0].split("[")[0].strip(), "string"),
                  "description": spec.get("description", "")}
        for key in ("enum", "default"):
            if key in spec:
                schema[key] = spec[key]
        if "default" not in spec and "optional" not in written:
            required.append(name)
        properties[name] = schema
    parameters = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                             "parameters": parameters}}


def xlam_conversation(row: dict, index: int) -> tuple[list[dict], list[dict] | None]:
    """The row's user turn and assistant tool-call turn, and its tools."""
    for field in ("query", "tools", "answers"):
        if row.get(field) is None:
            raise RowProblem(f"the field '{field}' is missing or null")
    tools, answers = parse_json(row["tools"], "'tools'"), parse_json(row["answers"], "'answers'")
    if not isinstance(tools, list) or not isinstance(answers, list) or not answers:
        raise RowProblem("'tools' and 'answers' must be lists (or JSON strings of them), 'answers' not empty")
    prefix = f"call_{row['id'] if row.get('id') is not None else index}"
    calls = [tool_call(call, f"{prefix}_{n}") for n, call in enumerate(answers)]
    return ([{"role": "user", "content": str(row["query"])}, {"role": "assistant", "content": "", "tool_calls": calls}],
            [openai_tool(tool) for tool in tools] or None)


class XlamDataset(AgentChatDataset):
    """xLAM function-calling rows as a user request and the assistant's tool calls (the loss on the calls).

    Also upstream's ``make_xlam_dataset``, with its arguments; ``chat_template`` and ``on_bad_row`` are ours.
    """

    argument_help = {**{k: v for k, v in AgentChatDataset.argument_help.items()
                        if k in ("seq_length", "truncation", "padding", "on_bad_row", "split", "chat_template",
                                 "limit_dataset_samples")},
                     "dataset_name": "a hub data set id (default Salesforce/xlam-function-calling-60k), or a local "
                                     "JSON/JSONL/CSV/parquet file or directory of xLAM rows",
                     "fp8": "upstream reserves it and does nothing with it: only false (the default) is accepted"}

    @staticmethod
    def argument_problems(arguments: Mapping[str, Any]) -> list[tuple[str, str]]:
        """``(argument, problem)`` of arguments that cannot act (validation reports them too)."""
        if not arguments.get("fp8"):
            return []
        return [("fp8", "upstream's make_xlam_dataset accepts it and does nothing with it; remove it (FP8 training "
                        "is not a property of the data)")]

    def __init__(self, tokenizer: Any = None, seq_length: int | None = None, limit_dataset_samples: int | None = None,
                 fp8: bool = False, split: str = "train", dataset_name: str = "Salesforce/xlam-function-calling-60k",
                 padding: Padding = False, truncation: Truncation = False, chat_template: str | None = None,
                 on_bad_row: OnBadRow = "error"):
        raise_problems(self.argument_problems(locals()))
        self.options = dict.fromkeys(("filter_no_assistant", "filter_overlong", "trim_incomplete_last_turn",
                                      "truncate_history", "mask_reasoning_content", "train_on_last_turn_only",
                                      "drop_history_reasoning_content"), False)
        self.tokenizer = with_chat_template(tokenizer, chat_template)
        self.length = SampleLength(Given(seq_length, "dataset.seq_length"), truncation, padding)
        source = Given(dataset_name, "dataset.dataset_name")
        rows = read_rows(source, split, limit=limit_dataset_samples)
        self.samples = self._samples(rows, str(dataset_name), on_bad_row, xlam_conversation)
