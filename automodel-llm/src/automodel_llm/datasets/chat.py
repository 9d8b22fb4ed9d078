"""Chat data: a ``messages`` column rendered with the tokenizer's chat template; loss on assistant turns only."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset

from automodel.chat_template import resolve_chat_template
from automodel.data import BadRows, OnBadRow, is_json_lines
from automodel.errors import AutomodelError
from automodel_llm.datasets.arguments import (
    ALIASES,
    ARGUMENT_HELP,
    IGNORE_INDEX,
    Padding,
    SampleLength,
    Truncation,
    given,
    learns_nothing,
    raise_problems,
    read_rows,
)

# ShareGPT's plain-chat speakers (``from``) as chat roles; tool turns are AgentChatDataset's.
SHAREGPT_CHAT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                       "assistant": "assistant", "chatgpt": "assistant", "model": "assistant", "bot": "assistant"}


class RowProblem(ValueError):
    """A row that cannot become a conversation (the message says why)."""


def parse_json(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise RowProblem(f"{what} is not valid JSON: {value[:80]!r}") from None


def parse_tools(value: Any) -> list[dict] | None:
    """The row's tools (a list, or a JSON string of one); none for an empty or missing value."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    tools = parse_json(value, "'tools'")
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RowProblem("'tools' must be a list of tool definitions (or a JSON string of one)")
    return tools or None


def text_content(content: Any) -> str:
    """A message's content as the text a chat template renders: a string as is, none as empty, OpenAI's list of
    content parts as its text parts joined with spaces (as upstream joins them); a part that is not text (an image)
    is refused, where upstream drops it."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return str(content)
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise RowProblem(f"a message's content part {str(part)[:80]} is not text; the LLM recipes train on text "
                             "(pictures: finetune vlm)")
    return " ".join(texts)


def turns_of(value: Any, column: str) -> list[dict]:
    """A row's column of turns, which must be a list of mappings."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise RowProblem(f"'{column}' must be a list of turns (mappings)")
    return value


def sharegpt_chat_messages(conversations: Any) -> list[dict]:
    """``{role, content}`` messages of a ShareGPT ``conversations`` list of ``{from, value}`` plain-chat turns."""
    messages = []
    for turn in turns_of(conversations, "conversations"):
        speaker = turn.get("from", turn.get("role"))
        if speaker not in SHAREGPT_CHAT_ROLES:
            raise RowProblem(f"'conversations' has a turn from {speaker!r}, which is not a chat role "
                             f"({', '.join(SHAREGPT_CHAT_ROLES)}); tool-calling conversations are AgentChatDataset's")
        messages.append({"role": SHAREGPT_CHAT_ROLES[speaker],
                         "content": text_content(turn.get("value", turn.get("content")))})
    return messages


def render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False, tools: list[dict] | None = None
           ) -> list[int]:
    """The token ids of ``messages`` (and the ``tools`` the template shows the model) as the chat template renders
    them."""
    if not messages:
        return []
    extra = {"tools": tools} if tools else {}
    result = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt, **extra)
    if isinstance(result, dict) or hasattr(result, "keys"):
        result = result["input_ids"]
    return list(result)


def tokenize_conversation(tokenizer: Any, messages: list[dict], mask_reasoning: bool = False,
                          tools: list[dict] | None = None, last_turn_only: bool = False
                          ) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that keep only the assistant turns.

    Each assistant turn's tokens are the difference between the conversation rendered through that turn and
    rendered up to it with the generation prompt, so any template whose renders extend each other works.
    ``mask_reasoning`` also leaves out each assistant turn's rendered ``reasoning_content`` (upstream's
    ``mask_reasoning_content``): the tokens that differ from the conversation rendered with that turn's reasoning
    emptied, as upstream finds them. ``tools`` go to the template with every render; ``last_turn_only`` keeps only
    the last assistant turn's labels.
    """
    ids = render(tokenizer, messages, tools=tools)
    labels = [IGNORE_INDEX] * len(ids)
    turns = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    for i in turns[-1:] if last_turn_only else turns:
        start = len(render(tokenizer, messages[:i], generation_prompt=True, tools=tools))
        end = len(render(tokenizer, messages[: i + 1], tools=tools))
        labels[start:end] = ids[start:end]
    for i, message in enumerate(messages):
        if mask_reasoning and message.get("role") == "assistant" and message.get("reasoning_content"):
            emptied = [*messages[:i], {**message, "reasoning_content": ""}, *messages[i + 1:]]
            start, end = _differing_span(ids, render(tokenizer, emptied, tools=tools))
            labels[start:end] = [IGNORE_INDEX] * (end - start)
    return ids, labels


def _differing_span(ids: list[int], other: list[int]) -> tuple[int, int]:
    """The span of ``ids`` between its longest common prefix and suffix with ``other`` (empty if they agree)."""
    prefix = next((n for n, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b),
                  min(len(ids), len(other)))
    limit = min(len(ids), len(other)) - prefix
    suffix = next((n for n in range(limit) if ids[-1 - n] != other[-1 - n]), limit)
    return prefix, max(prefix, len(ids) - suffix)


class ChatDataset(Dataset):
    """Rows with a list of ``{role, content}`` messages, rendered with the tokenizer's chat template; the loss on
    the assistant turns.

    ``chat_template`` (inline, or a .jinja file) becomes the tokenizer's template, so the tokenizer saved with the
    checkpoint renders conversations as training did. As upstream's ChatDataset: a row's ``tools`` (a list or a JSON
    string of one) go to the template with its conversation, rows without a ``messages`` column are read from
    ShareGPT's ``conversations`` (``{from, value}`` plain-chat turns), and a message's content given as OpenAI's
    list of parts is its text (:func:`text_content`). A row whose messages are null, not a list of
    mappings, or hold no assistant turn is refused, or skipped with ``on_bad_row: skip``.
    """

    argument_aliases = ALIASES
    argument_help = {**ARGUMENT_HELP, "messages_column": "the column holding each row's list of messages (by "
                                                         "default messages, else ShareGPT's conversations)",
                     "chat_template": "a Jinja chat template, inline or the path of a file (.jinja, or JSON with a "
                                      "chat_template key); it becomes the tokenizer's and is saved with it",
                     "mask_reasoning_content": "no loss on the assistant turns' reasoning_content as the chat "
                                               "template renders it (upstream's); the answers keep theirs",
                     "unshifted": "upstream's sample form for diffusion LMs: true, each token supervised at its own "
                                  "position, is what the diffusion recipe (finetune dllm) trains on and the "
                                  "next-token recipes refuse; the samples here have that form either way (their "
                                  "labels are the input tokens; a next-token loss shifts them)",
                     "mask_history": "the loss on each conversation's last assistant turn only; the earlier turns "
                                     "are context (upstream's)",
                     "skip_invalid_samples": "leave out the lines of local JSON Lines files (.jsonl) that are not "
                                             "JSON objects, counted on stderr, instead of stopping (upstream's); "
                                             "on_bad_row: skip leaves out rows that parse but cannot be used",
                     "start_of_turn_token": "upstream's argument, which its ChatDataset keeps and never reads: "
                                            "refused (the loss is on the assistant turns as the template renders "
                                            "them)"}
    requires_chat_template = True  # validation checks a local tokenizer for one unless chat_template is given

    @staticmethod
    def argument_problems(arguments: Mapping[str, Any]) -> list[tuple[str, str]]:
        """``(argument, problem)`` of the arguments that cannot act (validation reports them too)."""
        problems = []
        if arguments.get("start_of_turn_token") is not None:
            problems.append(("start_of_turn_token", "upstream's ChatDataset keeps it and never reads it; the loss "
                                                    "here is on each assistant turn as the chat template renders it "
                                                    "(mask_history: the last one only): remove it"))
        if arguments.get("skip_invalid_samples"):
            source = arguments.get("path_or_dataset_id") or arguments.get("dataset_name")
            others = [value for value in (source if isinstance(source, list) else [source])
                      if not is_json_lines(value)]
            if others:
                problems.append(("skip_invalid_samples", f"true leaves out malformed lines of local JSON Lines "
                                                         f"files (.jsonl), and '{others[0]}' is not one: remove it "
                                                         "(on_bad_row: skip leaves out rows that cannot be used)"))
        return problems

    def __init__(self, path_or_dataset_id: str | list[str] | None = None, split: str = "train", name: str | None = None,
                 tokenizer: Any = None, seq_length: int | None = None, messages_column: str = "messages",
                 chat_template: str | None = None, truncation: Truncation = False, padding: Padding = "do_not_pad",
                 limit_dataset_samples: int | None = None, shuffle_seed: int | None = None,
                 on_bad_row: OnBadRow = "error", dataset_name: str | None = None,
                 max_seq_length: int | None = None, mask_reasoning_content: bool = False, unshifted: bool = False,
                 mask_history: bool = False, skip_invalid_samples: bool = False,
                 start_of_turn_token: str | None = None):
        raise_problems(self.argument_problems(locals()))
        source = given("path_or_dataset_id", path_or_dataset_id, "dataset_name", dataset_name)
        length = SampleLength(given("seq_length", seq_length, "max_seq_length", max_seq_length), truncation, padding)
        tokenizer = with_chat_template(tokenizer, chat_template)
        rows = read_rows(source, split, name, shuffle_seed, limit_dataset_samples,
                         skip_malformed_lines=skip_invalid_samples)
        column = _messages_column(messages_column, rows.column_names, source.value)
        self.samples: list[dict[str, list[int]]] = []
        bad_rows = BadRows(on_bad_row, source.value)
        for index, row in enumerate(rows):
            if bad_rows.missing(index, row, (column,)):
                continue
            try:
                messages = [{**m, "content": text_content(m.get("content"))} for m in turns_of(row[column], column)] \
                    if column == messages_column else sharegpt_chat_messages(row[column])
                tools = parse_tools(row.get("tools"))
            except RowProblem as problem:
                bad_rows.bad(index, str(problem))
                continue
            if not any(m.get("role") == "assistant" for m in messages):
                bad_rows.bad(index, "the conversation has no assistant turn to learn from")
                continue
            ids, labels = tokenize_conversation(tokenizer, messages, mask_reasoning_content, tools, mask_history)
            sample = length.fit(ids, labels, tokenizer.pad_token_id, f"conversation {index} of '{source.value}'")
            if learns_nothing(sample["labels"]):
                continue
            self.samples.append(sample)
        bad_rows.report()
        if not self.samples:
            raise AutomodelError(f"{source.key}: '{source.value}' has no conversation with assistant tokens left")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]


def _messages_column(messages_column: str, columns: list[str], source: Any) -> str:
    """The column the conversations are read from: ``messages_column``, or ShareGPT's ``conversations`` when the
    default ``messages`` is absent (upstream reads both)."""
    if messages_column in columns:
        return messages_column
    if messages_column == "messages" and "conversations" in columns:
        return "conversations"
    raise AutomodelError(f"dataset.messages_column: '{source}' has no column '{messages_column}' "
                         f"(found: {', '.join(columns)})")


def with_chat_template(tokenizer: Any, chat_template: str | None) -> Any:
    """The tokenizer, with ``chat_template`` (inline or a file) as its template when given; refused when it has
    none (a chat data set renders with it)."""
    if tokenizer is None:
        raise AutomodelError("dataset: a chat data set needs a tokenizer (tokenizer: section)")
    template = resolve_chat_template(chat_template)
    if template is not None:
        tokenizer.chat_template = template
    if not getattr(tokenizer, "chat_template", None):
        raise AutomodelError(f"dataset.chat_template: {missing_template_problem(tokenizer.name_or_path)}")
    return tokenizer


def missing_template_problem(tokenizer_source: Any) -> str:
    """What to do when the tokenizer has no chat template (shared by validation and the data set)."""
    return (f"ChatDataset renders each conversation with the tokenizer's chat template, and the tokenizer "
            f"('{tokenizer_source}') has none. Set dataset.chat_template to a Jinja template or the path of a "
            ".jinja file (it is saved with the tokenizer), or tokenizer.chat_template to an inline template, or use "
            "the tokenizer of an instruct/chat model, which ships one")
