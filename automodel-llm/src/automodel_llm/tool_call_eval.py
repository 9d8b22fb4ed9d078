"""``tool_call_eval:``: tool-call accuracy at every validation of agent fine-tuning (upstream NeMo AutoModel's
``ToolCallAccuracyEvaluator``), because the loss alone cannot tell a model that learned the call format but picks
the wrong tools from one that calls them right.

Each conversation of the data (the rows :class:`~automodel_llm.datasets.AgentChatDataset` reads) gives one sample
per assistant turn with tool calls: the conversation before that turn, the row's tools, and the turn's calls. The
sample is rendered with the chat template (``tools=``, generation prompt), the model continues it (greedy by
default), the calls are read from the text (:mod:`automodel_llm.tool_calls`) and scored against the expected ones.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from automodel.config import FieldErrors, require_positive
from automodel.errors import AutomodelError, ConfigIssue
from automodel.hf import greedy_answer
from automodel.training.dist import all_reduce_sum
from automodel_llm.datasets.agent_chat import openai_messages, row_turns
from automodel_llm.datasets.arguments import Given, read_rows
from automodel_llm.datasets.chat import RowProblem, parse_tools, render
from automodel_llm.tool_calls import METRIC_KEYS, parse_tool_calls, sample_scores

TARGET = "nemo_automodel.components.eval.tool_call_evaluator.ToolCallAccuracyEvaluator"
ONE_SOURCE = ("give exactly one of dataset_name (a hub id, or a local file or directory) and path (a local "
              "JSON/JSONL file or a list of them)")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class ToolCallEvalConfig:
    """The section; upstream's ``_target_`` (its evaluator class) may name it."""

    accepted_targets: ClassVar[dict] = {"ToolCallAccuracyEvaluator": {}}
    dataset_name: str | None = field(default=None, metadata=_help(
        "a hub data set id, or a local JSON/JSONL/CSV/parquet file or directory, of function-calling conversations "
        "(the rows the agent-chat data set reads); or give path"))
    path: str | list[str] | None = field(default=None, metadata=_help(
        "a local JSON/JSONL file, or a list of them, instead of dataset_name"))
    split: str = field(default="train", metadata=_help(
        "the split to read, with an optional slice of row numbers: train, train[:128]"))
    limit_dataset_samples: int | None = field(default=None, metadata=_help(
        "read only the first N conversations (of the split, after its slice)"))
    max_eval_samples: int | None = field(default=None, metadata=_help(
        "score at most N samples (one per assistant turn with tool calls), the first ones"))
    max_new_tokens: int = field(default=256, metadata=_help("generation length limit per sample"))
    max_prompt_tokens: int | None = field(default=None, metadata=_help(
        "skip samples whose rendered prompt is longer (counted in tool_call/_skipped)"))
    do_sample: bool = field(default=False, metadata=_help(
        "sample with the model's generation config instead of greedy decoding"))
    metric_prefix: str = field(default="tool_call", metadata=_help(
        "the metrics' prefix in validation.jsonl: PREFIX/name_correct, ..."))
    sample_shard: list[int] | None = field(default=None, metadata=_help(
        "upstream's (rank, world_size) split of the samples: null only (the samples are split over the "
        "data-parallel ranks when the model is replicated on each, as upstream's recipe sets it)"))
    raise_on_cuda_oom: bool = field(default=True, metadata=_help(
        "stop the run when generation runs out of memory; false: skip that sample (tool_call/_skipped)"))
    run_on_fsdp2: bool = field(default=False, metadata=_help(
        "generate with the model sharded by FSDP2 too (more than one process: every rank on the same samples, "
        "gathering the sharded weights at each token); false, as upstream, skips the evaluation there and records "
        "PREFIX/_disabled_fsdp2: 1.0 (one process shards nothing: the evaluation runs)"))

    def __post_init__(self) -> None:
        require_positive(self, "limit_dataset_samples", "max_eval_samples", "max_new_tokens", "max_prompt_tokens")
        errors = {}
        if self.dataset_name is not None and self.path is not None:
            errors["dataset_name"] = ONE_SOURCE
        if self.sample_shard is not None:
            errors["sample_shard"] = ("the samples are split over the data-parallel ranks by the recipe (when the "
                                      "model is replicated on each); a split given here is not taken: remove it")
        self.metric_prefix = self.metric_prefix.rstrip("/")
        if not self.metric_prefix:
            errors["metric_prefix"] = "must name something (the metrics are PREFIX/name_correct, ...)"
        if errors:
            raise FieldErrors(errors)


def given_settings(cfg: Any) -> ToolCallEvalConfig | None:
    """The section when the config gives it (an absent section reads as its defaults, and does nothing)."""
    return cfg.tool_call_eval if "tool_call_eval" in cfg else None


def tool_call_eval_issues(cfg: Any) -> list[ConfigIssue]:
    """``tool_call_eval`` acts at each validation: refused without its data or in a run that never validates."""
    settings = cfg.tool_call_eval
    if settings.dataset_name is None and settings.path is None:
        return [ConfigIssue("tool_call_eval.dataset_name", ONE_SOURCE)]
    if not any(name == "validation_dataset" or name.startswith("validation_dataset_")
               for name in cfg.section_names() if name in cfg):
        return [ConfigIssue("tool_call_eval", "the tool-call metrics are computed at each validation, and the "
                            "config has no validation_dataset; add one (validation then reports its loss and these "
                            "metrics) or remove the section")]
    if cfg.step_scheduler is not None and cfg.step_scheduler.val_check_interval is None:
        return [ConfigIssue("tool_call_eval", "the tool-call metrics are computed at each validation, and "
                            "step_scheduler.val_every_steps is not set, so validation never runs; set it or remove "
                            "the section")]
    return []


def conversation_samples(messages: list[dict], tools: list[dict] | None) -> list[dict[str, Any]]:
    """One sample per assistant message with tool calls: the messages before it, the tools, its calls."""
    return [{"prompt": messages[:index], "tools": tools,
             "expected": [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                          for call in message["tool_calls"]]}
            for index, message in enumerate(messages) if message["role"] == "assistant" and message.get("tool_calls")]


def load_samples(settings: ToolCallEvalConfig) -> list[dict[str, Any]]:
    """The evaluation samples of the section's data (the first ``max_eval_samples``)."""
    path, name = settings.path, settings.dataset_name  # one of them is given (validation checks)
    source = Given(path, "tool_call_eval.path") if path is not None else Given(name, "tool_call_eval.dataset_name")
    samples: list[dict[str, Any]] = []
    for index, row in enumerate(read_rows(source, settings.split, limit=settings.limit_dataset_samples)):
        try:
            messages = openai_messages(row_turns(row), f"call_{row.get('id', index)}")
            samples += conversation_samples(messages, parse_tools(row.get("tools")))
        except RowProblem as problem:
            raise AutomodelError(f"{source.key}: conversation {index} of '{source.value}': {problem}") from None
        if settings.max_eval_samples is not None and len(samples) >= settings.max_eval_samples:
            return samples[: settings.max_eval_samples]
    if not samples:
        raise AutomodelError(f"{source.key}: '{source.value}' has no assistant turn with tool calls to evaluate")
    return samples


@dataclass
class Tally:
    """What one rank scored: the samples, the sum of each metric over them, and why others were skipped."""

    count: int = 0
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(METRIC_KEYS, 0.0))
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _out_of_memory(err: RuntimeError) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


class ToolCallEvaluator:
    """The section's samples, scored on a model at each validation."""

    def __init__(self, settings: ToolCallEvalConfig, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise AutomodelError("tool_call_eval: the prompts are rendered with the tokenizer's chat template, and "
                                 "the tokenizer has none; give the data set's chat_template or a tokenizer with one")
        self.settings, self.tokenizer = settings, tokenizer
        self.skip_out_of_memory = not settings.raise_on_cuda_oom
        self.samples = load_samples(settings)

    def prompt_ids(self, sample: dict[str, Any], tally: Tally) -> list[int] | None:
        """The rendered prompt's token ids; None (and the reason counted) when it cannot be scored."""
        try:  # rendered as the training conversations are, the template writing the special tokens
            ids = render(self.tokenizer, sample["prompt"], generation_prompt=True, tools=sample["tools"])
        except Exception:  # noqa: BLE001 - a template that cannot render this conversation: counted, as upstream
            tally.skip("chat_template_raised")
            return None
        limit = self.settings.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            tally.skip("prompt_too_long")
            return None
        return ids

    def score(self, model: Any, device: torch.device, shard: tuple[int, int] | None, synced: bool) -> Tally:
        """Generate and score this rank's samples (every ``shard[1]``-th from ``shard[0]``; all when None).
        ``synced``: every rank runs the same samples together (sharded weights)."""
        tally = Tally()
        samples = self.samples if shard is None else self.samples[shard[0]::shard[1]]
        for sample in samples:
            ids = self.prompt_ids(sample, tally)
            if ids is None:
                continue
            try:
                text = greedy_answer(model, self.tokenizer, ids, self.settings.max_new_tokens, device, synced,
                                     do_sample=self.settings.do_sample, skip_special_tokens=False)
            except RuntimeError as err:
                if not (self.skip_out_of_memory and _out_of_memory(err)):
                    raise
                tally.skip("generate_cuda_oom")
                release_memory()
                continue
            for key, value in sample_scores(parse_tool_calls(text), sample["expected"]).items():
                tally.sums[key] += value
            tally.count += 1
        release_memory()
        return tally


def release_memory() -> None:
    """Drop what generation cached (under FSDP2, gathered weights) before training goes on."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def metrics(tally: Tally, prefix: str, sharded: bool, device: torch.device, group: Any = None) -> dict[str, float]:
    """Upstream's metrics: the mean of each metric over the scored samples, ``_count`` and ``_skipped``; summed
    over the data-parallel ranks when each scored its own share (``sharded``), else this rank's."""
    values = [float(tally.count), *tally.sums.values(), float(sum(tally.skipped.values()))]
    if sharded:
        values = [float(v) for v in all_reduce_sum(*values, device=device, group=group)]
    count, sums = values[0], values[1:-1]
    result = {f"{prefix}/{key}": total / count if count else 0.0 for key, total in zip(METRIC_KEYS, sums, strict=True)}
    return {**result, f"{prefix}/_count": count, f"{prefix}/_skipped": values[-1]}
