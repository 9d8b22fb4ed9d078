"""Function-calling chat data (AgentChatDataset = upstream's make_agent_chat_dataset, XlamDataset = upstream's
make_xlam_dataset): the three row schemas become the same OpenAI messages, the loss covers exactly the assistant
turns (tool calls included), every argument acts, and upstream-form configs validate and train."""

from __future__ import annotations

import inspect
import json

import pytest
import yaml
from llm_testing import TOKENIZER_DIR, write_tiny_llama_config

from automodel.errors import AutomodelError
from automodel.testing import run_cli, run_cli_inprocess, train_inprocess, write_yaml
from automodel_llm.datasets import AgentChatDataset, XlamDataset
from automodel_llm.datasets.agent_chat import openai_messages, row_turns
from automodel_llm.datasets.xlam import openai_tool, xlam_conversation

# Qwen-2.5-like: tools in the system turn, tool calls as <tool_call> JSON, tool results grouped in a user turn;
# the end of a turn is the EOS token (a special token, so renders extend each other token for token)
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ eos_token }}
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}{{ eos_token }}
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ eos_token }}
{% endif %}
{%- else %}<|im_start|>{{ m.role }}
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>
{% endif %}{{ m.content }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}
</tool_call>
{%- endfor %}{{ eos_token }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
                                                                           "properties": {"a": {"type": "integer"}}}}}]
# one conversation in each schema: a system turn, two parallel calls after assistant text, their results, an answer
CHATML = {"tools": json.dumps(TOOLS), "messages": [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "add one and two"},
    {"role": "assistant", "content": "sure"},
    {"role": "tool_call", "content": json.dumps({"name": "add", "arguments": {"a": 1}})},
    {"role": "tool_call", "content": json.dumps({"name": "add", "arguments": {"a": 2}})},
    {"role": "tool_response", "content": "r1"}, {"role": "tool_response", "content": "r2"},
    {"role": "assistant", "content": "it is r1"}]}
SHAREGPT = {"tools": json.dumps(TOOLS), "conversations": [
    {"from": "system", "value": "be brief"}, {"from": "human", "value": "add one and two"},
    {"from": "gpt", "value": "sure"},
    {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1}})},
    {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2}})},
    {"from": "observation", "value": "r1"}, {"from": "observation", "value": "r2"},
    {"from": "gpt", "value": "it is r1"}]}
OPENAI = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "add one and two"},
    {"role": "assistant", "content": "sure", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "r1"}, {"role": "tool", "tool_call_id": "call_1",
                                                                 "content": "r2"},
    {"role": "assistant", "content": "it is r1"}]}
EXPECTED = [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "add one and two"},
    {"role": "assistant", "content": "sure", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
    {"role": "tool", "content": "r1", "tool_call_id": "call_0"}, {"role": "tool", "content": "r2",
                                                                  "tool_call_id": "call_1"},
    {"role": "assistant", "content": "it is r1"}]
ASSISTANT_TEXT = ('sure<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><tool_call>\n'
                  '{"name": "add", "arguments": {"a": 2}}\n</tool_call></s>\nit is r1</s>\n')


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _labelled(tokenizer, sample) -> str:
    return tokenizer.decode([t for t in sample["labels"] if t != -100])


def _texts(tokenizer, dataset) -> list[str]:
    return [tokenizer.decode(dataset[i]["input_ids"]) for i in range(len(dataset))]


# ---- schemas and labels --------------------------------------------------------------------------------------

@pytest.mark.parametrize("row", [CHATML, SHAREGPT, OPENAI], ids=["chatml", "sharegpt", "openai"])
def test_each_schema_becomes_openai_messages_with_merged_calls_and_paired_results(row):
    assert openai_messages(row_turns(row)) == EXPECTED


def test_calls_without_text_before_them_are_one_new_assistant_message_and_results_pair_in_order():
    turns = [{"role": "user", "content": "u"}, {"role": "tool_call", "content": '{"name": "f", "arguments": {}}'},
             {"role": "tool_call", "content": '{"name": "g"}'}, {"role": "tool_response", "content": "x"},
             {"role": "tool_response", "content": "y"}, {"role": "assistant", "content": "done"}]
    messages = openai_messages(turns, "call_7")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["name"] for c in messages[1]["tool_calls"]] == ["f", "g"]
    assert [m["tool_call_id"] for m in messages[2:4]] == [c["id"] for c in messages[1]["tool_calls"]]


def test_content_given_as_openai_parts_is_its_text_not_the_list_printed():
    turns = [{"role": "user", "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "these"}]},
             {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    messages = openai_messages(turns)
    assert messages[0]["content"] == "add these" and messages[1]["content"] == ""
    with pytest.raises(ValueError, match="content part .*'image_url'.* is not text"):
        openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}])


@pytest.mark.parametrize("row", [CHATML, SHAREGPT, OPENAI], ids=["chatml", "sharegpt", "openai"])
def test_the_loss_covers_exactly_the_assistant_turns_tool_calls_included(row, tokenizer, tmp_path):
    dataset = AgentChatDataset(tokenizer, path=_write(tmp_path / "rows.jsonl", [row]), chat_template=TEMPLATE)
    sample = dataset[0]
    assert _labelled(tokenizer, sample) == ASSISTANT_TEXT
    learned = [i for i, t in enumerate(sample["labels"]) if t != -100]
    assert sample["labels"][learned[0]:learned[-1] + 1] != sample["input_ids"][learned[0]:learned[-1] + 1]  # a gap
    text = tokenizer.decode(sample["input_ids"])
    for unlearned in ("be brief", "add one and two", "r1\n</tool_response>", '"integer"'):
        assert unlearned in text and unlearned not in _labelled(tokenizer, sample)


# ---- every argument acts -------------------------------------------------------------------------------------

def _conversation(n: int, answer: str = "ok") -> dict:
    return {"messages": [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": answer}]}


TWO_EXCHANGES = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "sys"}, {"role": "user", "content": "first question here"},
    {"role": "assistant", "content": "first answer", "reasoning_content": "early thought"},
    {"role": "user", "content": "second"}, {"role": "assistant", "content": "final", "reasoning_content": "late"}]}


def _build(tokenizer, rows_path, **kwargs):
    try:
        return AgentChatDataset(tokenizer, chat_template=TEMPLATE, **{"path": rows_path, **kwargs})
    except AutomodelError as err:
        return err


def test_path_takes_a_list_of_files_and_dataset_name_a_local_file_or_a_hub_id(tokenizer, tmp_path):
    one = _write(tmp_path / "one.jsonl", [_conversation(1)])
    two = _write(tmp_path / "two.jsonl", [_conversation(2), _conversation(3)])
    assert len(_build(tokenizer, [one, two])) == 3
    assert _texts(tokenizer, _build(tokenizer, None, dataset_name=two)) == _texts(tokenizer, _build(tokenizer, two))
    assert "exactly one of dataset_name" in str(_build(tokenizer, one, dataset_name=two))


def test_split_takes_a_slice_and_limit_dataset_samples_the_first_rows_of_it(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [_conversation(n) for n in range(5)])
    everything = _texts(tokenizer, _build(tokenizer, rows))
    assert _texts(tokenizer, _build(tokenizer, rows, split="train[1:4]")) == everything[1:4]
    assert _texts(tokenizer, _build(tokenizer, rows, split="train[3:]")) == everything[3:]
    assert _texts(tokenizer, _build(tokenizer, rows, split="train[1:]", limit_dataset_samples=2)) == everything[1:3]
    assert _texts(tokenizer, _build(tokenizer, rows, split="train[:40%]")) == everything[:2]
    assert "dataset.split: 'train[one:]' is not a split with a row slice" in \
        str(_build(tokenizer, rows, split="train[one:]"))
    # a slice past the rows (upstream's train[64:] on a smaller file) selects nothing: said so, not an IndexError
    assert f"dataset.split: 'train[64:]' selects none of the 5 rows of '{rows}'" in \
        str(_build(tokenizer, rows, split="train[64:]"))


def test_revision_goes_to_the_hub_and_is_refused_for_a_local_file(tokenizer, tmp_path, monkeypatch):
    import datasets

    rows = _write(tmp_path / "rows.jsonl", [_conversation(1)])
    assert "remove revision" in str(_build(tokenizer, rows, revision="refs/convert/parquet"))
    asked = {}

    def load_dataset(name, subset=None, **kwargs):
        asked.update(kwargs, name=name)
        return datasets.Dataset.from_list([_conversation(1)])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert len(_build(tokenizer, None, dataset_name="org/traces", revision="refs/convert/parquet")) == 1
    assert asked == {"name": "org/traces", "split": "train", "revision": "refs/convert/parquet"}


def test_seq_length_truncation_padding_and_the_tokenizers_truncation_side(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [_conversation(1, "a long answer " * 4)])
    full = _build(tokenizer, rows)[0]["input_ids"]
    short = len(full) - 3
    assert f"has {len(full)} tokens, more than {short}" in str(_build(tokenizer, rows, seq_length=short))
    assert _build(tokenizer, rows, seq_length=short, truncation=True)[0]["input_ids"] == full[:short]
    padded = _build(tokenizer, rows, seq_length=len(full) + 5, padding="max_length")[0]
    assert len(padded["input_ids"]) == len(full) + 5 and padded["attention_mask"][-5:] == [0] * 5
    tokenizer.truncation_side = "left"  # upstream's synthtraces config keeps the end of a long trace
    assert _build(tokenizer, rows, seq_length=short, truncation=True)[0]["input_ids"] == full[-short:]


def test_chat_template_becomes_the_tokenizers(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [_conversation(1)])
    template_file = tmp_path / "tools.jinja"
    template_file.write_text(TEMPLATE.replace("<|im_start|>", "<<"))
    text = _texts(tokenizer, AgentChatDataset(tokenizer, path=rows, chat_template=str(template_file)))[0]
    assert text.startswith("<<user") and tokenizer.chat_template == template_file.read_text()


def test_filter_no_assistant_leaves_out_what_is_otherwise_a_bad_row(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [_conversation(1), {"messages": [{"role": "user", "content": "hi"}]}])
    assert "set dataset.filter_no_assistant: true" in str(_build(tokenizer, rows))
    assert len(_build(tokenizer, rows, filter_no_assistant=True)) == 1
    assert len(_build(tokenizer, rows, on_bad_row="skip")) == 1


def test_on_bad_row_skips_a_row_that_cannot_be_read(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [_conversation(1), {"messages": [{"role": "robot", "content": "x"}]}])
    assert "row 2 of" in str(_build(tokenizer, rows)) and "unknown role 'robot'" in str(_build(tokenizer, rows))
    assert len(_build(tokenizer, rows, on_bad_row="skip")) == 1


def test_filter_overlong_leaves_out_what_truncation_would_cut(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [_conversation(1), _conversation(2, "a much longer answer " * 3)])
    limit = len(_build(tokenizer, rows)[0]["input_ids"]) + 2
    assert len(_build(tokenizer, rows, seq_length=limit, truncation=True)) == 2
    kept = _build(tokenizer, rows, seq_length=limit, truncation=True, filter_overlong=True)
    assert len(kept) == 1 and "question 1" in _texts(tokenizer, kept)[0]
    assert "set seq_length" in str(_build(tokenizer, rows, filter_overlong=True))


def test_trim_incomplete_last_turn_drops_the_unanswered_request(tokenizer, tmp_path):
    row = _conversation(1)
    row["messages"].append({"role": "user", "content": "unanswered"})
    rows = _write(tmp_path / "rows.jsonl", [row])
    assert "unanswered" in _texts(tokenizer, _build(tokenizer, rows))[0]
    assert "unanswered" not in _texts(tokenizer, _build(tokenizer, rows, trim_incomplete_last_turn=True))[0]


def test_truncate_history_drops_the_oldest_exchange_and_keeps_the_system_turn_and_the_answer(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [TWO_EXCHANGES])
    limit = len(_build(tokenizer, rows)[0]["input_ids"]) - 5
    cut = _texts(tokenizer, _build(tokenizer, rows, seq_length=limit, truncation=True))[0]
    assert "first question" in cut and "final" not in cut
    kept = _build(tokenizer, rows, seq_length=limit, truncation=True, truncate_history=True)
    text = _texts(tokenizer, kept)[0]
    assert "first question" not in text and "sys" in text and "final" in _labelled(tokenizer, kept[0])
    assert "set seq_length" in str(_build(tokenizer, rows, truncate_history=True))


def test_the_reasoning_and_last_turn_options(tokenizer, tmp_path):
    rows = _write(tmp_path / "rows.jsonl", [TWO_EXCHANGES])
    plain = _build(tokenizer, rows)[0]
    assert "early thought" in _labelled(tokenizer, plain) and "first answer" in _labelled(tokenizer, plain)
    masked = _build(tokenizer, rows, mask_reasoning_content=True)[0]
    assert "early thought" not in _labelled(tokenizer, masked) and "late" not in _labelled(tokenizer, masked)
    assert "early thought" in tokenizer.decode(masked["input_ids"]) and "final" in _labelled(tokenizer, masked)
    last = _build(tokenizer, rows, train_on_last_turn_only=True)[0]
    assert "first answer" not in _labelled(tokenizer, last) and "final" in _labelled(tokenizer, last)
    dropped = tokenizer.decode(_build(tokenizer, rows, drop_history_reasoning_content=True)[0]["input_ids"])
    assert "early thought" not in dropped and "late" in dropped


TESTED = {"tokenizer", "path", "dataset_name", "split", "limit_dataset_samples", "revision", "seq_length",
          "truncation", "padding", "chat_template", "filter_no_assistant", "on_bad_row", "filter_overlong",
          "trim_incomplete_last_turn", "truncate_history", "mask_reasoning_content", "train_on_last_turn_only",
          "drop_history_reasoning_content", "fp8"}


@pytest.mark.parametrize("dataset", [AgentChatDataset, XlamDataset])
def test_every_argument_has_a_test_above_or_below(dataset):
    assert set(inspect.signature(dataset).parameters) <= TESTED


# ---- xLAM ----------------------------------------------------------------------------------------------------

XLAM = {"query": "weather in Oslo?", "answers": json.dumps([{"name": "weather", "arguments": {"city": "Oslo"}}]),
        "tools": json.dumps([{"name": "weather", "description": "now", "parameters": {
            "city": {"type": "str", "description": "where"},
            "days": {"type": "List[int], optional", "description": "which"},
            "unit": {"type": "str", "description": "c or f", "default": "c"}}}])}


def test_an_xlam_row_is_a_request_and_the_tool_calls_with_openai_tools(tokenizer, tmp_path):
    messages, tools = xlam_conversation(XLAM, 4)
    assert messages == [{"role": "user", "content": "weather in Oslo?"},
                        {"role": "assistant", "content": "", "tool_calls": [{
                            "id": "call_4_0", "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}]
    assert tools == [openai_tool(json.loads(XLAM["tools"])[0])]
    parameters = tools[0]["function"]["parameters"]
    assert parameters["required"] == ["city"] and parameters["properties"]["days"]["type"] == "array"
    assert parameters["properties"]["unit"] == {"type": "string", "description": "c or f", "default": "c"}
    sample = XlamDataset(tokenizer, dataset_name=_write(tmp_path / "x.jsonl", [XLAM]), chat_template=TEMPLATE)[0]
    assert _labelled(tokenizer, sample) == '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n' \
                                           '</tool_call></s>\n'


def test_xlam_arguments_act(tokenizer, tmp_path):
    rows = _write(tmp_path / "x.jsonl", [XLAM, {**XLAM, "query": "second"}, {**XLAM, "query": "third"}])
    build = lambda **kw: XlamDataset(tokenizer, **{"dataset_name": rows, "chat_template": TEMPLATE, **kw})  # noqa
    full = build()
    assert _texts(tokenizer, build(split="train[1:]", limit_dataset_samples=1)) == _texts(tokenizer, full)[1:2]
    assert build(seq_length=len(full[0]["input_ids"]) - 4, truncation=True)[0]["input_ids"] == full[0]["input_ids"][:-4]
    assert len(build(seq_length=len(full[0]["input_ids"]) + 3, padding="max_length")[0]["input_ids"]) == \
        len(full[0]["input_ids"]) + 3
    with pytest.raises(AutomodelError, match="dataset.fp8: upstream's make_xlam_dataset accepts it and does nothing"):
        build(fp8=True)
    bad = _write(tmp_path / "bad.jsonl", [XLAM, {**XLAM, "answers": "not json"}])
    with pytest.raises(AutomodelError, match="'answers' is not valid JSON"):
        build(dataset_name=bad)
    assert len(build(dataset_name=bad, on_bad_row="skip")) == 1


# ---- upstream-form configs -----------------------------------------------------------------------------------

def _upstream_config(tmp_path, dataset: dict):
    model = write_tiny_llama_config(tmp_path)
    data = json.loads(model.read_text())
    model.write_text(json.dumps({**data, "max_position_embeddings": 512}))
    return write_yaml(tmp_path / "upstream.yaml", {
        "recipe": "TrainFinetuneRecipeForNextTokenPrediction",
        "step_scheduler": {"max_steps": 3, "global_batch_size": 2, "local_batch_size": 2},
        "model": {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config", "config": str(model)},
        "dataset": {**dataset, "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER_DIR)}},
        "dataloader": {"_target_": "torchdata.stateful_dataloader.StatefulDataLoader", "batch_size": 2},
        "optimizer": {"_target_": "torch.optim.Adam", "lr": 1.0e-3},
        "checkpoint": {"enabled": False, "checkpoint_dir": str(tmp_path / "ckpt")}})


@pytest.mark.parametrize("kind", ["agent_chat", "xlam"])
def test_an_upstream_form_config_validates_and_trains(kind, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(TEMPLATE)
    if kind == "agent_chat":
        dataset = {"_target_": "nemo_automodel.components.datasets.llm.agent_chat.make_agent_chat_dataset",
                   "path": _write(tmp_path / "rows.jsonl", [CHATML, SHAREGPT, OPENAI, TWO_EXCHANGES]),
                   "split": "train", "chat_template": str(template), "seq_length": 256, "truncation": True,
                   "filter_no_assistant": True, "trim_incomplete_last_turn": True, "truncate_history": True}
    else:
        dataset = {"_target_": "nemo_automodel.components.datasets.llm.xlam.make_xlam_dataset",
                   "dataset_name": _write(tmp_path / "x.jsonl", [XLAM] * 4), "split": "train[:4]",
                   "chat_template": str(template)}
    config = _upstream_config(tmp_path, dataset)
    checked = run_cli_inprocess("validate", "-c", config, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    if kind == "agent_chat":  # the command itself once; the xLAM run in this process (the same path, seconds less)
        trained = run_cli("finetune", "llm", "-c", config, cwd=tmp_path, OMP_NUM_THREADS="1")
        assert trained.returncode == 0, trained.stderr[-3000:]
    else:
        train_inprocess(config)
    assert json.loads((tmp_path / "ckpt" / "training.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_validation_refuses_arguments_that_cannot_act(tmp_path):
    from automodel.errors import ConfigError
    from automodel.testing import load_config

    rows = _write(tmp_path / "rows.jsonl", [CHATML])
    config = _upstream_config(tmp_path, {"_target_": "make_agent_chat_dataset", "path": rows, "dataset_name": rows,
                                         "chat_template": TEMPLATE, "truncate_history": True,
                                         "revision": "refs/convert/parquet"})
    validation = {"_target_": "make_xlam_dataset", "dataset_name": rows, "fp8": True}
    write_yaml(config, {**yaml.safe_load(config.read_text()), "validation_dataset": validation})
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert sorted(issue.key for issue in refused.value.issues) == [
        "dataset.dataset_name", "dataset.revision", "dataset.truncate_history", "validation_dataset.fp8"]
