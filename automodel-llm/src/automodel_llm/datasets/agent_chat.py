"""Function-calling (agent) chat data: conversations with tool calls and tool results, and the tools the model may
call, rendered with the tokenizer's chat template; the loss on the assistant turns (their tool calls included).

Each row becomes OpenAI chat messages plus a ``tools`` list (the form chat templates take), then is rendered as
:class:`~automodel_llm.datasets.chat.ChatDataset` renders a conversation, with ``tools=`` passed to the template.
Three row schemas are read (upstream NeMo AutoModel's ``make_agent_chat_dataset`` reads the same):

* chatml ``messages`` with ``tool_call`` turns (content: JSON ``{name, arguments}``) and ``tool_response`` turns;
* ShareGPT ``conversations`` of ``{from, value}``: human / gpt / function_call / observation (and system);
* OpenAI ``messages``: assistant turns with ``tool_calls``, ``tool`` turns with ``tool_call_id``.

Consecutive tool calls become one assistant message (parallel calls), attached to the assistant text just before
them if there is one; the tool results that follow take the calls' ids in order. ``tools`` is a list or a JSON
string of one. The xLAM rows (``make_xlam_dataset``) are converted to the same messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from automodel.data import BadRows, OnBadRow
from automodel.errors import AutomodelError
from automodel_llm.datasets.arguments import (
    ARGUMENT_HELP,
    Given,
    Padding,
    SampleLength,
    Truncation,
    learns_nothing,
    raise_problems,
    read_rows,
)
from automodel_llm.datasets.chat import (
    SHAREGPT_CHAT_ROLES,
    RowProblem,
    parse_json,
    parse_tools,
    render,
    text_content,
    tokenize_conversation,
    turns_of,
    with_chat_template,
)

_SHAREGPT_ROLES = {**SHAREGPT_CHAT_ROLES, "function_call": "tool_call", "tool_call": "tool_call",
                   "observation": "tool_response", "tool_response": "tool_response", "tool": "tool_response"}


# ---- rows to OpenAI messages ---------------------------------------------------------------------------------

def tool_call(function: Any, call_id: str) -> dict:
    """An OpenAI tool call; its arguments as a JSON string, as chat templates expect them."""
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RowProblem(f"a tool call needs a function name: {function!r}")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def row_turns(row: dict) -> list[dict]:
    """The row's turns as ``{role, content, ...}`` (ShareGPT ``conversations`` mapped to chatml roles)."""
    if row.get("messages") is not None:
        turns = row["messages"]
    elif row.get("conversations") is not None:
        turns = [{**{k: v for k, v in turn.items() if k not in ("from", "value")},
                  "role": _SHAREGPT_ROLES.get(turn.get("from"), turn.get("from")), "content": turn.get("value")}
                 for turn in turns_of(row["conversations"], "conversations")]
    else:
        raise RowProblem("the row has neither 'messages' nor 'conversations'")
    return turns_of(turns, "messages")


def openai_messages(turns: list[dict], call_prefix: str = "call") -> list[dict]:
    """OpenAI chat messages of chatml / ShareGPT / OpenAI turns: tool calls in assistant messages, results as
    ``tool`` messages paired with the calls before them in order."""
    out: list[dict] = []
    pending: list[str] = []  # the ids of the last group of calls, for the results that follow
    answered = 0
    previous = None
    for turn in turns:
        role = turn.get("role")
        if role == "tool_call":
            call = tool_call(parse_json(turn.get("content") or "{}", "a tool_call's content"),
                              f"{call_prefix}_{sum(len(m.get('tool_calls', ())) for m in out)}")
            if previous != "tool_call":
                pending, answered = [], 0
            if previous == "tool_call" or (out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            pending.append(call["id"])
        elif role in ("tool_response", "tool"):
            given = turn.get("tool_call_id")
            call_id = given if isinstance(given, str) and given else \
                pending[answered] if answered < len(pending) else f"{call_prefix}_result_{len(out)}"
            answered += 1
            content = turn.get("content")
            message = {"role": "tool", "tool_call_id": call_id,
                       "content": content if isinstance(content, str) else "" if content is None else
                       json.dumps(content, ensure_ascii=False)}
            if isinstance(turn.get("name"), str) and turn["name"]:
                message["name"] = turn["name"]
            out.append(message)
        elif role in ("system", "user", "assistant"):
            out.append(_text_message(turn, call_prefix, len(out)))
            pending, answered = [call["id"] for call in out[-1].get("tool_calls", ())], 0
        else:
            raise RowProblem(f"unknown role {role!r} (expected system, user, assistant, tool_call, tool_response, "
                             "tool; or ShareGPT's human, gpt, function_call, observation)")
        previous = role
    return out


def _text_message(turn: dict, call_prefix: str, position: int) -> dict:
    message = {"role": turn["role"], "content": text_content(turn.get("content"))}
    if turn["role"] == "assistant" and turn.get("reasoning_content"):
        message["reasoning_content"] = str(turn["reasoning_content"])
    calls = turn.get("tool_calls") if turn["role"] == "assistant" else None
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
            raise RowProblem("an assistant turn's 'tool_calls' must be a list of calls")
        message["tool_calls"] = [tool_call(call.get("function"), call.get("id") or f"{call_prefix}_{position}_{n}")
                                 for n, call in enumerate(calls)]
    return message


# ---- what the options do to a conversation -------------------------------------------------------------------

def trim_after_last_assistant(messages: list[dict]) -> list[dict]:
    """The conversation up to its last assistant message (an unanswered last turn dropped)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages) - 1)
    return messages[: last + 1]


def drop_history_reasoning(messages: list[dict]) -> list[dict]:
    """Every assistant message but the last without its ``reasoning_content`` (as at inference, where a model
    does not see its earlier thinking)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return [{k: v for k, v in m.items() if k != "reasoning_content"} if m["role"] == "assistant" and i != last
            else m for i, m in enumerate(messages)]


def drop_oldest_exchanges(tokenizer: Any, messages: list[dict], tools: list[dict] | None, limit: int) -> list[dict]:
    """The conversation without its oldest exchanges (each starts at a user message) until it renders within
    ``limit`` tokens; leading system messages and the last exchange stay (the last may still be too long)."""
    if len(render(tokenizer, messages, tools=tools)) <= limit:
        return messages
    system = 0
    while system < len(messages) and messages[system]["role"] == "system":
        system += 1
    starts = [i for i in range(system + 1, len(messages)) if messages[i]["role"] == "user"]
    for start in starts:
        kept = messages[:system] + messages[start:]
        if len(render(tokenizer, kept, tools=tools)) <= limit or start == starts[-1]:
            return kept
    return messages


# ---- reading the rows ----------------------------------------------------------------------------------------

def _source(dataset_name: Any, path: Any) -> Given:
    return Given(dataset_name, "dataset.dataset_name") if path is None else Given(path, "dataset.path")


class AgentChatDataset(Dataset):
    """Function-calling conversations (chatml, ShareGPT or OpenAI rows with a ``tools`` column), rendered with the
    tokenizer's chat template and the row's tools; the loss on the assistant turns, tool calls included.

    Also upstream's ``make_agent_chat_dataset``: the same arguments, each of which acts. A row that cannot be read
    (an unknown role, a tool call without a name, malformed JSON) is refused, or skipped with ``on_bad_row: skip``.
    """

    argument_help = {
        **{k: v for k, v in ARGUMENT_HELP.items() if k in ("seq_length", "truncation", "padding", "on_bad_row")},
        "dataset_name": "a hub data set id, or a local JSON/JSONL/CSV/parquet file or directory (or give path)",
        "path": "a local JSON/JSONL file, or a list of them (read one after the other), instead of dataset_name",
        "split": "the split to read, with an optional row slice over all its files: train, train[64:], train[:10%]",
        "revision": "the branch, tag or commit of a hub data set (e.g. refs/convert/parquet)",
        "limit_dataset_samples": "use only the first N rows (of the split, after its slice)",
        "chat_template": "a Jinja chat template, inline or the path of a file (.jinja, or JSON with a chat_template "
                         "key), that renders tools and tool calls; it becomes the tokenizer's and is saved with it",
        "filter_no_assistant": "leave out rows without an assistant turn (else such a row is a bad row)",
        "filter_overlong": "leave out conversations longer than seq_length (after truncate_history) instead of "
                           "truncating or refusing them",
        "trim_incomplete_last_turn": "drop the turns after the last assistant turn (an unanswered last request)",
        "truncate_history": "drop the oldest exchanges (keeping system messages and the last exchange) until the "
                            "conversation fits seq_length",
        "mask_reasoning_content": "no loss on the assistant turns' reasoning_content as the chat template renders it",
        "train_on_last_turn_only": "the loss on the last assistant turn only (earlier ones are context)",
        "drop_history_reasoning_content": "render reasoning_content of the last assistant turn only",
    }
    requires_chat_template = True  # validation checks a local tokenizer for one unless chat_template is given

    @staticmethod
    def argument_problems(arguments: Mapping[str, Any]) -> list[tuple[str, str]]:
        """``(argument, problem)`` of what these arguments cannot do together (validation reports them too)."""
        problems = []
        if (arguments.get("dataset_name") is None) == (arguments.get("path") is None):
            problems.append(("dataset_name", "give exactly one of dataset_name (a hub id, or a local file or "
                                             "directory) and path (a local JSON/JSONL file or a list of them)"))
        local = arguments.get("path") or arguments.get("dataset_name")
        if arguments.get("revision") is not None and local is not None and (
                arguments.get("path") is not None or Path(str(local)).exists()):
            problems.append(("revision", f"'{arguments['revision']}' names a version of a hub data set, but the data "
                                         f"are local ('{local}'); remove revision"))
        problems += [(name, "acts on conversations longer than seq_length, which is not set; set seq_length")
                     for name in ("filter_overlong", "truncate_history")
                     if arguments.get(name) and arguments.get("seq_length") is None]
        return problems

    def __init__(self, tokenizer: Any = None, dataset_name: str | None = None, path: str | list[str] | None = None,
                 split: str = "train", revision: str | None = None, filter_no_assistant: bool = False,
                 filter_overlong: bool = False, trim_incomplete_last_turn: bool = False,
                 chat_template: str | None = None, seq_length: int | None = None,
                 limit_dataset_samples: int | None = None, padding: Padding = False, truncation: Truncation = False,
                 mask_reasoning_content: bool = False, train_on_last_turn_only: bool = False,
                 drop_history_reasoning_content: bool = False, truncate_history: bool = False,
                 on_bad_row: OnBadRow = "error"):
        raise_problems(self.argument_problems(locals()))
        source = _source(dataset_name, path)
        self.options = {"filter_no_assistant": filter_no_assistant, "filter_overlong": filter_overlong,
                        "trim_incomplete_last_turn": trim_incomplete_last_turn,
                        "truncate_history": truncate_history, "mask_reasoning_content": mask_reasoning_content,
                        "train_on_last_turn_only": train_on_last_turn_only,
                        "drop_history_reasoning_content": drop_history_reasoning_content}
        self.tokenizer = with_chat_template(tokenizer, chat_template)
        self.length = SampleLength(Given(seq_length, "dataset.seq_length"), truncation, padding)
        rows = read_rows(source, split, limit=limit_dataset_samples, revision=revision)
        self.samples = self._samples(rows, str(source.value), on_bad_row, self._conversation)

    @staticmethod
    def _conversation(row: dict, index: int) -> tuple[list[dict], list[dict] | None]:
        prefix = f"call_{row['id']}" if row.get("id") is not None else f"call_{index}"
        return openai_messages(row_turns(row), prefix), parse_tools(row.get("tools"))

    def _samples(self, rows: Any, where: str, on_bad_row: OnBadRow, conversation: Any) -> list[dict[str, list[int]]]:
        """One sample per usable row: its conversation (from ``conversation``) shaped by the options, rendered."""
        tokenizer, options, limit = self.tokenizer, self.options, self.length.limit.value
        samples, bad_rows = [], BadRows(on_bad_row, where)
        for index, row in enumerate(rows):
            try:
                messages, tools = conversation(row, index)
            except RowProblem as problem:
                bad_rows.bad(index, str(problem))
                continue
            if options["trim_incomplete_last_turn"]:
                messages = trim_after_last_assistant(messages)
            if not any(m["role"] == "assistant" for m in messages):
                if not options["filter_no_assistant"]:
                    bad_rows.bad(index, "the conversation has no assistant turn to learn from (set "
                                        "dataset.filter_no_assistant: true to leave such rows out)")
                continue
            if options["drop_history_reasoning_content"]:
                messages = drop_history_reasoning(messages)
            if options["truncate_history"]:
                messages = drop_oldest_exchanges(tokenizer, messages, tools, limit)
            ids, labels = tokenize_conversation(tokenizer, messages, options["mask_reasoning_content"], tools,
                                                options["train_on_last_turn_only"])
            if options["filter_overlong"] and len(ids) > limit:
                continue
            sample = self.length.fit(ids, labels, tokenizer.pad_token_id, f"conversation {index} of '{where}'",
                                     keep_end=getattr(tokenizer, "truncation_side", "right") == "left")
            if not learns_nothing(sample["labels"]):
                samples.append(sample)
        bad_rows.report()
        if not samples:
            raise AutomodelError(f"dataset: '{where}' has no conversation with assistant tokens left")
        return samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]

