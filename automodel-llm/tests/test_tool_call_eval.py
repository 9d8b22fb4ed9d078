"""tool_call_eval (upstream's ToolCallAccuracyEvaluator): tool calls read from exact generated strings in each form,
the metrics of hand-made generations against values worked out by hand, the samples of each row schema, and an
upstream-form config whose validation records the tool_call/* metrics; what cannot act is refused."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from llm_testing import TOKENIZER_DIR, write_tiny_llama_config
from test_agent_chat import CHATML, OPENAI, SHAREGPT, TEMPLATE, TOOLS

from automodel.errors import ConfigError
from automodel.testing import free_port, load_config, read_jsonl, run_cli, write_yaml
from automodel_llm.tool_call_eval import (
    TARGET,
    Tally,
    ToolCallEvalConfig,
    ToolCallEvaluator,
    conversation_samples,
    load_samples,
    metrics,
)
from automodel_llm.tool_calls import ToolCall, parse_tool_calls, sample_scores

ADD_1 = {"name": "add", "arguments": {"a": 1}}
ADD_2 = {"name": "add", "arguments": {"a": 2}}


# ---- reading the calls -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', [ToolCall("add", {"a": 1}, True)]),
    ('sure<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "mul", '
     '"arguments": "{\\"b\\": 2}"}</tool_call>', [ToolCall("add", {"a": 1}, True), ToolCall("mul", {"b": 2}, True)]),
    ('<tool_call>[{"name": "f", "arguments": {}}, {"name": "g"}]</tool_call>',
     [ToolCall("f", {}, True), ToolCall("g", {}, True)]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', [ToolCall(None)]),
    ('<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>', [ToolCall("add", {}, False)]),
    ('<|python_tag|>{"name": "f", "parameters": {"x": "}{"}}<|eom_id|>', [ToolCall("f", {"x": "}{"}, True)]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"k": [1, 2]}}, {"name": "g", "arguments": 3}]',
     [ToolCall("f", {"k": [1, 2]}, True), ToolCall("g", {}, False)]),
    ('<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Oslo"}<|call|>',
     [ToolCall("get_weather", {"city": "Oslo"}, True)]),
    ('I will call {"name": "f", "arguments": {"a": {"b": 1}}} and {"other": 1}',
     [ToolCall("f", {"a": {"b": 1}}, True)]),
    ("The answer is 3.", []),
    ("", []),
], ids=["qwen", "qwen-two-calls", "qwen-list", "malformed-json", "arguments-not-json", "llama", "mistral", "harmony",
        "bare-json", "no-call", "empty"])
def test_tool_calls_are_read_from_each_form(text, calls):
    assert parse_tool_calls(text) == calls


# ---- scoring -----------------------------------------------------------------------------------------------------

def _scores(text: str, expected: list[dict]) -> dict[str, float]:
    return sample_scores(parse_tool_calls(text), expected)


def test_a_perfect_call_scores_one_everywhere_and_no_call_zero():
    perfect = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert set(_scores(perfect, [ADD_1]).values()) == {1.0}
    assert set(_scores("I cannot help", [ADD_1]).values()) == {0.0}


def test_a_wrong_name_or_wrong_arguments_score_as_worked_out_by_hand():
    wrong_name = _scores('<tool_call>{"name": "sub", "arguments": {"a": 1}}</tool_call>', [ADD_1])
    assert wrong_name == {"has_call": 1.0, "name_correct": 0.0, "args_json_valid": 1.0, "args_field_recall": 1.0,
                          "args_field_precision": 1.0, "args_exact_match": 1.0}
    # expected keys {a, b}, given {a, c}: one of two in common each way; a differs from the expected value anyway
    expected = [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]  # arguments as the data hold them: JSON text
    wrong_arguments = _scores('<tool_call>{"name": "add", "arguments": {"a": 1, "c": 3}}</tool_call>', expected)
    assert wrong_arguments == {"has_call": 1.0, "name_correct": 1.0, "args_json_valid": 1.0,
                               "args_field_recall": 0.5, "args_field_precision": 0.5, "args_exact_match": 0.0}
    malformed = _scores('<tool_call>{"name": "add", "arguments": {"a": </tool_call>', [ADD_1])
    assert malformed == {"has_call": 1.0, "name_correct": 0.0, "args_json_valid": 0.0, "args_field_recall": 0.0,
                         "args_field_precision": 0.0, "args_exact_match": 0.0}


def test_calls_are_matched_in_order_a_missing_one_scores_zero_and_an_extra_one_nothing():
    one_of_two = _scores('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', [ADD_1, ADD_2])
    assert set(one_of_two.values()) == {0.5}
    swapped = _scores('<tool_call>[{"name": "add", "arguments": {"a": 2}}, {"name": "add", "arguments": {"a": 1}}, '
                      '{"name": "x"}]</tool_call>', [ADD_1, ADD_2])
    assert swapped["name_correct"] == 1.0 and swapped["args_exact_match"] == 0.0
    assert _scores("", []) == dict.fromkeys(swapped, 0.0)


def test_the_means_over_samples_and_the_counts_are_upstreams_metrics():
    tally = Tally()
    for text in ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
                 '<tool_call>{"name": "sub", "arguments": {"a": 5}}</tool_call>', "no call"):
        for key, value in _scores(text, [ADD_1]).items():
            tally.sums[key] += value
        tally.count += 1
    tally.skip("prompt_too_long")
    found = metrics(tally, "agent", sharded=False, device=torch.device("cpu"))
    assert found == {"agent/has_call": 2 / 3, "agent/name_correct": 1 / 3, "agent/args_json_valid": 2 / 3,
                     "agent/args_field_recall": 2 / 3, "agent/args_field_precision": 2 / 3,
                     "agent/args_exact_match": 1 / 3, "agent/_count": 3.0, "agent/_skipped": 1.0}
    # one process: the all-reduce of a sharded tally is the identity
    assert metrics(tally, "agent", sharded=True, device=torch.device("cpu")) == found


# ---- samples and generation ---------------------------------------------------------------------------------------

def _rows(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("row", [CHATML, SHAREGPT, OPENAI], ids=["chatml", "sharegpt", "openai"])
def test_each_schema_gives_one_sample_per_turn_of_tool_calls(row, tmp_path):
    two_turns = {**row, "id": 7}
    samples = load_samples(ToolCallEvalConfig(path=_rows(tmp_path / "rows.jsonl", [two_turns])))
    assert len(samples) == 1
    assert [m["role"] for m in samples[0]["prompt"]] == ["system", "user"]
    assert samples[0]["tools"] == TOOLS
    assert [(c["name"], json.loads(c["arguments"])) for c in samples[0]["expected"]] == [("add", {"a": 1}),
                                                                                        ("add", {"a": 2})]


def test_limits_take_the_first_rows_and_samples_and_an_absent_file_is_named(tmp_path):
    messages = [{"role": "user", "content": "u"}]
    for n in range(3):
        messages += [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": f"f{n}", "arguments": "{}"}}]}, {"role": "tool", "content": "r"}]
    assert [s["expected"][0]["name"] for s in conversation_samples(messages, None)] == ["f0", "f1", "f2"]
    rows = _rows(tmp_path / "rows.jsonl", [{"messages": messages}, CHATML])
    assert len(load_samples(ToolCallEvalConfig(path=rows))) == 4
    assert len(load_samples(ToolCallEvalConfig(path=rows, limit_dataset_samples=1))) == 3
    assert len(load_samples(ToolCallEvalConfig(path=rows, max_eval_samples=2))) == 2
    assert len(load_samples(ToolCallEvalConfig(dataset_name=rows, split="train[1:]"))) == 1
    with pytest.raises(Exception, match=r"tool_call_eval.split: 'train\[50%\]' is not a split with a row slice"):
        load_samples(ToolCallEvalConfig(path=rows, split="train[50%]"))
    with pytest.raises(Exception, match="tool_call_eval.path: '/nowhere.jsonl' does not exist"):
        load_samples(ToolCallEvalConfig(path="/nowhere.jsonl"))


class CannedModel(torch.nn.Module):
    """Generates the same text whatever the prompt; records the prompts and options it was given."""

    def __init__(self, tokenizer, text: str):
        super().__init__()
        self.answer = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.calls = []

    def generate(self, ids, **options):
        self.calls.append((ids, options))
        return torch.cat([ids, torch.tensor([self.answer])], dim=1)


def test_the_evaluator_renders_with_tools_generates_and_skips_long_prompts(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.chat_template = TEMPLATE
    rows = _rows(tmp_path / "rows.jsonl", [CHATML, {**SHAREGPT, "tools": "[]"}])
    evaluator = ToolCallEvaluator(ToolCallEvalConfig(path=rows, max_new_tokens=40, do_sample=True), tokenizer)
    model = CannedModel(tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    tally = evaluator.score(model, torch.device("cpu"), None, synced=False)
    assert tally.count == 2 and tally.sums["name_correct"] == 1.0  # each sample: one of its two calls
    prompt = tokenizer.decode(model.calls[0][0][0])
    assert prompt.startswith("<|im_start|>system\nbe brief\n# Tools\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "# Tools" not in tokenizer.decode(model.calls[1][0][0])  # no tools: the template shows none
    assert model.calls[0][1]["max_new_tokens"] == 40 and model.calls[0][1]["do_sample"] is True
    assert evaluator.score(model, torch.device("cpu"), (1, 2), synced=False).count == 1  # this rank's half
    short = ToolCallEvaluator(ToolCallEvalConfig(path=rows, max_prompt_tokens=len(model.calls[1][0][0])), tokenizer)
    assert short.score(model, torch.device("cpu"), None, synced=False).skipped == {"prompt_too_long": 1}
    tokenizer.chat_template = "{{ raise_exception('tools are not rendered') }}"
    assert evaluator.score(model, torch.device("cpu"), None, synced=False).skipped == {"chat_template_raised": 2}
    tokenizer.chat_template = None
    with pytest.raises(Exception, match="tool_call_eval: the prompts are rendered with the tokenizer's chat template"):
        ToolCallEvaluator(ToolCallEvalConfig(path=rows), tokenizer)


# ---- in a run ----------------------------------------------------------------------------------------------------

def _config(tmp_path, **sections):
    """An upstream-form agent SFT config (tiny model) with a tool_call_eval section, validation after steps 1, 2."""
    template = tmp_path / "tools.jinja"
    template.write_text(TEMPLATE)
    rows = _rows(tmp_path / "rows.jsonl", [CHATML, SHAREGPT, OPENAI, CHATML])
    data = {"_target_": "nemo_automodel.components.datasets.llm.agent_chat.make_agent_chat_dataset",
            "path": rows, "split": "train", "chat_template": str(template), "seq_length": 256, "truncation": True}
    model = write_tiny_llama_config(tmp_path)
    model.write_text(json.dumps({**json.loads(model.read_text()), "max_position_embeddings": 512}))
    return write_yaml(tmp_path / "agent.yaml", {
        "recipe": "TrainFinetuneRecipeForNextTokenPrediction",
        "step_scheduler": {"max_steps": 2, "global_batch_size": 2, "local_batch_size": 2, "val_every_steps": 1},
        # output_hidden_states as upstream's function-calling config: generate then returns a GenerateOutput
        "model": {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config", "config": str(model),
                  "output_hidden_states": True},
        "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER_DIR)},
        "dataset": data, "validation_dataset": {**data, "split": "train[:2]"},
        "dataloader": {"_target_": "torchdata.stateful_dataloader.StatefulDataLoader", "batch_size": 2},
        "optimizer": {"_target_": "torch.optim.Adam", "lr": 1.0e-3},
        "checkpoint": {"enabled": False, "checkpoint_dir": str(tmp_path / "ckpt")},
        "tool_call_eval": {"_target_": TARGET, "path": rows, "split": "train", "limit_dataset_samples": 3,
                           "max_eval_samples": 2, "max_new_tokens": 8, "max_prompt_tokens": 2048,
                           "do_sample": False, "metric_prefix": "tool_call", "run_on_fsdp2": False},
        **sections})


def test_validation_records_the_tool_call_metrics(tmp_path):
    """In one process strategy fsdp2 shards nothing (upstream's FSDP2 wraps the model even then, and skips): the
    evaluation runs."""
    result = run_cli("finetune", "llm", "-c", _config(tmp_path, distributed={"strategy": "fsdp2"}), cwd=tmp_path,
                     OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tool_call_eval: 2 tool-call turns scored at each validation" in result.stderr
    rows = read_jsonl(tmp_path / "ckpt" / "validation.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["tool_call/_count"] == 2.0 and row["tool_call/_skipped"] == 0.0
        for key in ("has_call", "name_correct", "args_json_valid", "args_field_recall", "args_field_precision",
                    "args_exact_match"):
            assert 0.0 <= row[f"tool_call/{key}"] <= 1.0
    assert "tool_call/name_correct=" in result.stderr  # the console's validation line


def _refusals(config, *overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, *overrides)
    return {issue.key: issue.message for issue in info.value.issues}


def test_what_cannot_act_is_refused_with_the_reason(tmp_path):
    config = _config(tmp_path)
    data = yaml.safe_load(config.read_text())
    found = _refusals(config, "--tool_call_eval.dataset_name", "x", "--tool_call_eval.sample_shard", "[0, 2]")
    assert "exactly one of dataset_name" in found["tool_call_eval.dataset_name"]
    assert "split over the data-parallel ranks by the recipe" in found["tool_call_eval.sample_shard"]
    assert "must be >= 1" in _refusals(config, "--tool_call_eval.max_new_tokens", "0")["tool_call_eval.max_new_tokens"]
    no_data = write_yaml(tmp_path / "no_data.yaml", {**data, "tool_call_eval": {"_target_": TARGET}})
    assert "exactly one of dataset_name" in _refusals(no_data)["tool_call_eval.dataset_name"]
    no_validation = write_yaml(tmp_path / "no_val.yaml", {k: v for k, v in data.items() if k != "validation_dataset"})
    assert "has no validation_dataset" in _refusals(no_validation)["tool_call_eval"]
    never = write_yaml(tmp_path / "never.yaml", {**data, "step_scheduler": {
        k: v for k, v in data["step_scheduler"].items() if k != "val_every_steps"}})
    assert "validation never runs" in _refusals(never)["tool_call_eval"]
    assert "sequence parallelism cannot split" in _refusals(
        config, "--distributed.tp_size", "2", "--distributed.sequence_parallel", "true")["tool_call_eval"]
    # context parallelism: generation runs outside its region, on whole sequences with the model's mask
    assert "tool_call_eval" not in _refusals(config, "--distributed.cp_size", "2")
    assert "pipeline stages (pp_size 2)" in _refusals(config, "--distributed.pp_size", "2")["tool_call_eval"]
    found = _refusals(config, "--tool_call_eval._target_", "my.Evaluator")
    assert "a _target_ may only name: ToolCallAccuracyEvaluator" in found["tool_call_eval._target_"]


@pytest.mark.parametrize("strategy, run_on_fsdp2", [pytest.param("ddp", "false", marks=pytest.mark.slow),
                                                    ("fsdp2", "true"),
                                                    pytest.param("fsdp2", "false", marks=pytest.mark.slow)])
def test_two_ranks_split_the_samples_under_ddp_and_generate_together_under_fsdp2(tmp_path, strategy, run_on_fsdp2):
    """DDP: each rank scores one of the two samples and the sums are all-reduced (count 2 on rank 0's record);
    FSDP2 with run_on_fsdp2: both ranks generate both samples together (each forward gathers the weights); without
    it the sharded model is not evaluated, as upstream, and the record says so."""
    result = run_cli("finetune", "llm", "-c", _config(tmp_path), "--nproc-per-node", "2", "--distributed.strategy",
                     strategy, "--tool_call_eval.run_on_fsdp2", run_on_fsdp2, "--step_scheduler.max_steps", "1",
                     "--step_scheduler.local_batch_size", "1", "--dataloader.batch_size", "1",
                     "--master-port", str(free_port()), cwd=tmp_path,
                     OMP_NUM_THREADS="1", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    row = read_jsonl(tmp_path / "ckpt" / "validation.jsonl")[0]
    if strategy == "fsdp2" and run_on_fsdp2 == "false":
        assert "Set tool_call_eval.run_on_fsdp2: true to evaluate anyway" in result.stderr
        assert row["tool_call/_disabled_fsdp2"] == 1.0 and "tool_call/name_correct" not in row
        return
    how = "split over the 2 ranks" if strategy == "ddp" else "every rank generating each together"
    assert f"tool_call_eval: 2 tool-call turns scored at each validation, {how}" in result.stderr
    assert row["tool_call/_count"] == 2.0 and "tool_call/_disabled_fsdp2" not in row
