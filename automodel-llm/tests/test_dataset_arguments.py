"""The LLM data sets' shared arguments: one set of names (the old spellings as aliases), every accepted argument
acts, and what validation refuses (both spellings, a tokenizer in the data set, bad values, a chat data set whose
local tokenizer has no chat template, a tokenizer larger than the model's vocabulary)."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest
import yaml
from llm_testing import SQUAD_DIR, TOKENIZER_DIR

from automodel.data import load_rows
from automodel.errors import AutomodelError, ConfigError
from automodel.testing import deep_update, load_config, losses_by_step, run_cli_inprocess, train_inprocess, write_yaml
from automodel_llm import datasets

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
# renders an assistant turn's reasoning_content (the "conv" rows carry one) before its answer
REASONING_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{% if m.reasoning_content %} think: "
                      "{{ m.reasoning_content }}.{% endif %} {{ m['content'] }}{{ eos_token }}{% endfor %}")


def _rows(split: str, limit: int) -> list[dict]:
    return [json.loads(line) for line in (SQUAD_DIR / f"{split}.jsonl").read_text().splitlines()[:limit]]


def _write_jsonl(path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


BAD_ROW = {"squad": {"context": None, "question": "q", "answers": {"text": ["a"]}},
           "instruction": {"ctx": "c", "q": None, "a": "a"},
           "chat": {"messages": None, "conv": None, "turns": None},
           "text": {"text": None, "other": "o"}}


def _formats(rows: list[dict]) -> dict[str, list[dict]]:
    return {
        "squad": rows,
        "instruction": [{"ctx": r["context"], "q": r["question"], "a": r["answers"]["text"][0]} for r in rows],
        "chat": [{"messages": [{"role": "user", "content": f"{r['context']} {r['question']}"},
                               {"role": "assistant", "content": r["answers"]["text"][0]}],
                  "conv": [{"role": "user", "content": r["context"]},
                           {"role": "assistant", "content": r["answers"]["text"][0],
                            "reasoning_content": f"the answer to {r['question']}"}],
                  "turns": [{"role": "user", "content": r["context"]}, {"role": "assistant", "content": "Ask."},
                            {"role": "user", "content": r["question"]},
                            {"role": "assistant", "content": r["answers"]["text"][0]}]} for r in rows],
        "text": [{"text": f"{r['context']} {r['answers']['text'][0]}", "other": r["question"]} for r in rows],
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Per format: a directory with train and validation splits, one with two subsets (``name``), a file."""
    root = tmp_path_factory.mktemp("data")
    splits = {"train": _formats(_rows("train", 24)), "validation": _formats(_rows("validation", 6))}
    subsets = {"first": _formats(_rows("train", 12)), "second": _formats(_rows("validation", 6))}
    paths = {}
    for kind in splits["train"]:
        for split, formats in splits.items():
            _write_jsonl(root / kind / f"{split}.jsonl", formats[kind])
        for subset, formats in subsets.items():
            _write_jsonl(root / f"{kind}_subsets" / subset / "train.jsonl", formats[kind])
        configs = [{"config_name": s, "data_files": [{"split": "train", "path": f"{s}/train.jsonl"}]} for s in subsets]
        (root / f"{kind}_subsets" / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': configs})}---\n")
        paths[kind] = str(root / kind)
        paths[f"{kind}_subsets"] = str(root / f"{kind}_subsets")
        paths[f"{kind}_file"] = _write_jsonl(root / f"{kind}_file.jsonl", splits["train"][kind][:8])
        paths[f"{kind}_bad"] = _write_jsonl(root / f"{kind}_bad.jsonl", splits["train"][kind][:8] + [BAD_ROW[kind]])
        paths[f"{kind}_malformed"] = str(root / f"{kind}_malformed.jsonl")  # a cut-off line, then a JSON list
        (root / f"{kind}_malformed.jsonl").write_text((root / f"{kind}_file.jsonl").read_text()[:-40] + "\n[1, 2]\n"
                                                      + json.dumps(splits["train"][kind][8]) + "\n")
    return paths


@pytest.fixture
def tokenizer():
    """A fresh one per test: ChatDataset's chat_template becomes the tokenizer's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def plain_tokenizer_dir(tmp_path_factory):
    """The shipped tokenizer without a chat template and with another EOS (so its samples differ)."""
    directory = tmp_path_factory.mktemp("plain_tokenizer")
    shutil.copytree(TOKENIZER_DIR, directory, dirs_exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((directory / name).read_text())
        config.pop("chat_template", None)
        config["eos_token"] = "<unk>"
        (directory / name).write_text(json.dumps(config))
    return directory


# ---- every argument acts -------------------------------------------------------------------------------------

FORMAT = {"ColumnMappedTextInstructionDataset": "instruction", "ChatDataset": "chat", "PretrainingTextDataset": "text"}
SOURCE = {"make_squad_dataset": "dataset_name"}  # the others' canonical name: path_or_dataset_id


def _base(data, kind: str) -> dict:
    source = {SOURCE.get(kind, "path_or_dataset_id"): data[FORMAT.get(kind, "squad")]}
    return {
        "SquadDataset": {**source, "seq_length": 128},
        "make_squad_dataset": {**source, "seq_length": 128},
        "ColumnMappedTextInstructionDataset": {**source, "seq_length": 128,
                                               "column_mapping": {"context": "ctx", "question": "q", "answer": "a"}},
        "ChatDataset": {**source, "seq_length": 128},
        "PretrainingTextDataset": {**source, "seq_length": 32},
        "MockDataset": {"num_samples": 8, "seq_length": 16},
    }[kind]


# argument -> (its value, base arguments changed first); <placeholders> are filled in by the test
SHARED = {
    "path_or_dataset_id": ("<file>", {"dataset_name": None}),
    "dataset_name": ("<file>", {"path_or_dataset_id": None}),
    "split": ("validation", {}),
    "name": ("second", {"<source>": "<subsets>", "name": "first"}),
    "seq_length": ("<longest-1>", {"truncation": True}),
    "max_seq_length": ("<longest-1>", {"seq_length": None, "truncation": True}),
    "truncation": (True, {"seq_length": "<longest-1>"}),
    "padding": ("max_length", {}),
    "limit_dataset_samples": (5, {}),
    "shuffle_seed": (7, {}),
    "on_bad_row": ("skip", {"<source>": "<bad file>"}),
}
OWN = {
    "SquadDataset": {"tokenizer_name_or_path": ("<plain tokenizer>", {}), "seed": (7, {}),
                     "chat_template": (TEMPLATE, {})},
    "make_squad_dataset": {"chat_template": (TEMPLATE, {}), "fp8": (True, {})},
    "ColumnMappedTextInstructionDataset": {"column_mapping": ({"question": "q", "answer": "a"}, {}),
                                           "answer_only_loss_mask": (False, {}),
                                           "use_hf_chat_template": (True, {})},
    "ChatDataset": {"messages_column": ("conv", {}), "chat_template": (TEMPLATE, {}),
                    "mask_reasoning_content": (True, {"messages_column": "conv", "chat_template": REASONING_TEMPLATE}),
                    "mask_history": (True, {"messages_column": "turns"}),
                    "skip_invalid_samples": (True, {"<source>": "<malformed file>"}),
                    "start_of_turn_token": ("<s>", {})},
    "PretrainingTextDataset": {"text_column": ("other", {}), "seq_length": (16, {}),
                               "max_seq_length": (16, {"seq_length": None})},
    "MockDataset": {"num_samples": (4, {}), "seq_length": (8, {}), "max_seq_length": (8, {"seq_length": None}),
                    "vocab_size": (50, {}), "seed": (3, {})},
}


def _cases() -> list[tuple[str, str]]:
    cases = []
    for kind, own in OWN.items():
        for name in inspect.signature(getattr(datasets, kind)).parameters:
            if name != "tokenizer" and (name in own or name in SHARED):
                cases.append((kind, name))
    return cases


def _outcome(kind: str, kwargs: dict):
    """The samples a data set built with ``kwargs`` holds, or the error it raised."""
    try:
        built = getattr(datasets, kind)(**kwargs)
    except AutomodelError as err:
        return ("error", str(err))
    return [built[i] for i in range(len(built))]


# Arguments that change no sample but what a recipe accepts, each tested where that recipe is: upstream's
# unshifted form, which the diffusion-LM recipe takes (false refused) and the next-token recipes refuse (test_dllm.py).
RECIPE_LEVEL = {("ChatDataset", "unshifted")}


def test_the_table_below_covers_every_argument_of_every_llm_dataset():
    for kind in OWN:
        for name in inspect.signature(getattr(datasets, kind)).parameters:
            if name != "tokenizer" and (kind, name) not in RECIPE_LEVEL:
                assert (kind, name) in _cases(), f"{kind}({name}=...) has no case in test_every_argument_acts"


@pytest.mark.parametrize(("kind", "argument"), _cases())
def test_every_argument_acts(kind, argument, data, tokenizer, plain_tokenizer_dir):
    base = {**_base(data, kind), "tokenizer": tokenizer}
    fmt = FORMAT.get(kind, "squad")
    places = {"<file>": data[f"{fmt}_file"], "<subsets>": data[f"{fmt}_subsets"], "<bad file>": data[f"{fmt}_bad"],
              "<malformed file>": data[f"{fmt}_malformed"],
              "<source>": SOURCE.get(kind, "path_or_dataset_id"), "<plain tokenizer>": str(plain_tokenizer_dir),
              "<longest-1>": max(len(sample["input_ids"]) for sample in _outcome(kind, base)) - 1}
    fill = lambda v: places.get(v, v) if isinstance(v, str) else v  # noqa: E731
    value, first = OWN[kind].get(argument) or SHARED[argument]
    base.update({fill(k): fill(v) for k, v in first.items()})
    base = {k: v for k, v in base.items() if v is not None}
    before = _outcome(kind, base)  # first: a chat_template given below becomes the tokenizer's
    changed = _outcome(kind, {**base, argument: fill(value)})
    assert changed != before, f"{kind}({argument}={fill(value)!r}) changed nothing"
    assert not isinstance(changed, tuple) or f"dataset.{argument}" in changed[1], changed


def test_both_spellings_build_the_same_samples(data, tokenizer):
    for kind in ("SquadDataset", "ColumnMappedTextInstructionDataset", "ChatDataset", "PretrainingTextDataset"):
        new = {**_base(data, kind), "tokenizer": tokenizer}
        old = {**new, "dataset_name": new["path_or_dataset_id"], "max_seq_length": new["seq_length"]}
        del old["path_or_dataset_id"], old["seq_length"]
        assert _outcome(kind, old) == _outcome(kind, new), kind
    with pytest.raises(AutomodelError, match="dataset.dataset_name: the same argument as path_or_dataset_id"):
        datasets.SquadDataset(path_or_dataset_id=data["squad"], dataset_name=data["squad"], tokenizer=tokenizer)


def test_a_slice_in_the_split_of_a_single_file_selects_its_rows(data, tokenizer):
    """A single file is its only split, whatever the config calls it; a row slice in ``split`` still acts, taken
    over all the files of a list and after shuffle_seed's shuffle."""
    def samples(split, **kwargs):
        built = datasets.SquadDataset(path_or_dataset_id=data["squad_file"], split=split, tokenizer=tokenizer,
                                      **kwargs)
        return [built[i]["input_ids"] for i in range(len(built))]

    every = samples("train")
    assert len(every) == 8 and samples("validation") == every
    assert samples("train[2:5]") == every[2:5] and samples("validation[:3]") == every[:3]
    assert samples("train[50%:]") == every[4:] and samples("train[-2:]") == every[-2:]
    with pytest.raises(AutomodelError, match=r"dataset.split: 'train\[20:\]' selects none of the 8 rows of '.*"
                                             r"squad_file.jsonl' \(a single file is its only split\)"):
        samples("train[20:]")
    # a list of files is read one after the other (upstream's ChatDataset takes one), a slice over all their rows
    chat = datasets.ChatDataset([data["chat_file"], data["chat_file"]], tokenizer=tokenizer, split="train[6:10]")
    one = datasets.ChatDataset(data["chat_file"], tokenizer=tokenizer)
    assert [chat[i] for i in range(4)] == [one[6], one[7], one[0], one[1]]
    # with shuffle_seed the slice is taken of the shuffled split (upstream's): one seed makes a random partition
    shuffled = samples("train", shuffle_seed=7)
    assert sorted(shuffled) == sorted(every) and shuffled[:5] != every[:5]
    assert samples("train[:5]", shuffle_seed=7) == shuffled[:5]
    assert samples("validation[5:]", shuffle_seed=7) == shuffled[5:]


def test_an_error_names_the_spelling_the_config_used(data, tokenizer):
    with pytest.raises(AutomodelError, match=r"dataset.max_seq_length: sample 0 .* more than 8"):
        datasets.SquadDataset(dataset_name=data["squad"], max_seq_length=8, tokenizer=tokenizer)
    with pytest.raises(AutomodelError, match=r"dataset.seq_length: sample 0 .* more than 8"):
        datasets.SquadDataset(path_or_dataset_id=data["squad"], seq_length=8, tokenizer=tokenizer)


def test_padding_to_max_length_masks_the_padding_and_trains_to_the_same_losses(make_config):
    unpadded = make_config("unpadded.yaml")
    padded = make_config("padded.yaml", dataset={"padding": "max_length"},
                         checkpoint={"checkpoint_dir": str(unpadded.parent / "padded")})
    recipe = train_inprocess(padded, "--step_scheduler.max_steps", "3")
    sample = recipe.train_dataset[0]
    assert len(sample["input_ids"]) == 64 and sample["attention_mask"][-1] == 0 and sample["labels"][-1] == -100
    train_inprocess(unpadded, "--step_scheduler.max_steps", "3")
    with_padding = losses_by_step(unpadded.parent / "padded" / "training.jsonl")
    without = losses_by_step(unpadded.parent / "ckpt" / "training.jsonl")
    assert with_padding.keys() == without.keys() == {1, 2, 3}
    for step, loss in without.items():
        assert with_padding[step] == pytest.approx(loss, rel=1e-4), step


def test_a_chat_template_given_to_the_dataset_renders_and_is_saved_with_the_tokenizer(data, tmp_path,
                                                                                        plain_tokenizer_dir):
    from transformers import AutoTokenizer

    template_file, json_file = tmp_path / "template.jinja", tmp_path / "tokenizer_config.json"
    template_file.write_text(TEMPLATE)
    json_file.write_text(json.dumps({"chat_template": TEMPLATE}))
    for given in (TEMPLATE, str(template_file), str(json_file)):
        tokenizer = AutoTokenizer.from_pretrained(plain_tokenizer_dir)  # has no template of its own
        sample = datasets.ChatDataset(data["chat_file"], tokenizer=tokenizer, chat_template=given)[0]
        assert tokenizer.decode(sample["input_ids"]).startswith("[user] ")
        tokenizer.save_pretrained(tmp_path / "saved")
        assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == TEMPLATE


def _learned(tokenizer, sample) -> str:
    """The text of the sample's tokens that carry a loss."""
    return tokenizer.decode([t for t, label in zip(sample["input_ids"], sample["labels"], strict=True)
                             if label != -100])


def test_mask_history_keeps_the_loss_on_the_last_assistant_turn_only(data, tokenizer):
    every = datasets.ChatDataset(data["chat"], tokenizer=tokenizer, messages_column="turns", chat_template=TEMPLATE)
    last = datasets.ChatDataset(data["chat"], tokenizer=tokenizer, messages_column="turns", mask_history=True)
    assert every[0]["input_ids"] == last[0]["input_ids"]
    answer = _rows("train", 1)[0]["answers"]["text"][0]
    assert _learned(tokenizer, every[0]) == f"[assistant] Ask.</s>[assistant] {answer}</s>"
    assert _learned(tokenizer, last[0]) == f"[assistant] {answer}</s>"


def test_skip_invalid_samples_leaves_out_malformed_lines_of_json_lines_files_only(data, tokenizer, tmp_path,
                                                                                  capfd):
    good = datasets.ChatDataset(data["chat_file"], tokenizer=tokenizer)  # rows 1-8
    with pytest.raises(AutomodelError, match=r"chat_malformed.jsonl' line 8, column \d+: malformed JSON"):
        datasets.ChatDataset(data["chat_malformed"], tokenizer=tokenizer)
    skipped = datasets.ChatDataset(data["chat_malformed"], tokenizer=tokenizer, skip_invalid_samples=True)
    assert "skipped 2 malformed line(s) of" in capfd.readouterr().err
    assert [skipped[i] for i in range(7)] == [good[i] for i in range(7)]  # row 8 was cut, row 9 read
    assert len(skipped) == 8 and skipped[7] != good[7]
    both = datasets.ChatDataset([data["chat_malformed"], data["chat_file"]], tokenizer=tokenizer,
                                skip_invalid_samples=True, split="train[6:10]")
    assert [both[i] for i in range(4)] == [skipped[6], skipped[7], good[0], good[1]]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [\n[1]\n')
    with pytest.raises(AutomodelError, match=r"no line of '.*broken.jsonl' is a JSON object \(the first: line 1"):
        datasets.ChatDataset(str(broken), tokenizer=tokenizer, skip_invalid_samples=True)
    for source in (data["chat"], [data["chat_file"], data["chat"]]):  # a directory is not a JSON Lines file
        with pytest.raises(AutomodelError, match=r"dataset.skip_invalid_samples: true leaves out malformed lines "
                                                 r"of local JSON Lines files \(.jsonl\), and '.*/chat' is not one"):
            datasets.ChatDataset(source, tokenizer=tokenizer, skip_invalid_samples=True)
    (tmp_path / "rows.csv").write_text("a,b\n1,2\n")
    with pytest.raises(AutomodelError, match=r"rows.csv' is not a JSON Lines file \(.jsonl\)"):
        load_rows(str(tmp_path / "rows.csv"), skip_malformed_lines=True)


def test_column_mapped_rows_with_the_chat_template_are_system_user_and_assistant_turns(data, tokenizer,
                                                                                          plain_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer.chat_template = TEMPLATE
    mapping = {"context": "ctx", "question": "q", "answer": "a"}
    chat = datasets.ColumnMappedTextInstructionDataset(data["instruction_file"], mapping, tokenizer=tokenizer,
                                                       use_hf_chat_template=True)
    row = json.loads(open(data["instruction_file"]).readline())
    assert tokenizer.decode(chat[0]["input_ids"]) == f"[system] {row['ctx']}</s>[user] {row['q']}</s>" \
                                                    f"[assistant] {row['a']}</s>"
    assert _learned(tokenizer, chat[0]) == f"[assistant] {row['a']}</s>"
    assert chat.qa_pairs[0] == (f"[system] {row['ctx']}</s>[user] {row['q']}</s>", row["a"])
    no_context = datasets.ColumnMappedTextInstructionDataset(data["instruction_file"], {"question": "q", "answer": "a"},
                                                             tokenizer=tokenizer, use_hf_chat_template=True,
                                                             answer_only_loss_mask=False)
    assert _learned(tokenizer, no_context[0]) == f"[system] </s>[user] {row['q']}</s>[assistant] {row['a']}</s>"
    with pytest.raises(AutomodelError, match=r"dataset.use_hf_chat_template: true renders each row with the "
                                             r"tokenizer's chat template, and the tokenizer \('.*'\) has none"):
        datasets.ColumnMappedTextInstructionDataset(data["instruction_file"], mapping, use_hf_chat_template=True,
                                                    tokenizer=AutoTokenizer.from_pretrained(plain_tokenizer_dir))


TOOLS_TEMPLATE = ("{% if tools %}[tools] {% for t in tools %}{{ t.function.name }} {% endfor %}{{ eos_token }}"
                  "{% endif %}" + TEMPLATE)


def test_a_chat_row_s_tools_reach_the_template_sharegpt_rows_and_content_parts_are_read(tmp_path, tokenizer):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    chat = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}]
    sharegpt = [{"from": "human", "value": "Weather in Paris?"}, {"from": "gpt", "value": "Sunny."}]
    rows = {"tools_list": [{"messages": chat, "tools": [tool]}],
            "tools_json": [{"messages": chat, "tools": json.dumps([tool])}],
            "no_tools": [{"messages": chat, "tools": ""}],
            "sharegpt": [{"conversations": sharegpt}],
            "parts": [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Weather"},
                                                                 {"type": "text", "text": "in Paris?"}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}]}],
            "image_part": [{"messages": [{"role": "user", "content": [{"type": "image", "url": "a.png"}]}, chat[1]]}],
            "sharegpt_tool_turn": [{"conversations": [*sharegpt, {"from": "function_call", "value": "{}"}]}]}
    files = {name: _write_jsonl(tmp_path / f"{name}.jsonl", records) for name, records in rows.items()}
    text = {name: tokenizer.decode(datasets.ChatDataset(files[name], tokenizer=tokenizer,
                                                        chat_template=TOOLS_TEMPLATE)[0]["input_ids"])
            for name in ("tools_list", "tools_json", "no_tools", "sharegpt", "parts")}
    assert text["tools_list"] == text["tools_json"] == "[tools] get_weather </s>" + text["no_tools"]
    assert text["sharegpt"] == text["parts"] == text["no_tools"] == "[user] Weather in Paris?</s>[assistant] Sunny.</s>"
    with pytest.raises(AutomodelError, match=r"row 1 of .*content part .*'image'.* is not text"):
        datasets.ChatDataset(files["image_part"], tokenizer=tokenizer)
    with pytest.raises(AutomodelError, match=r"row 1 of .*a turn from 'function_call', which is not a chat role.*"
                                             "AgentChatDataset"):
        datasets.ChatDataset(files["sharegpt_tool_turn"], tokenizer=tokenizer)
    bad = _write_jsonl(tmp_path / "bad_tools.jsonl", [{"messages": chat, "tools": "{not json"}])
    with pytest.raises(AutomodelError, match=r"row 1 of .*'tools' is not valid JSON"):
        datasets.ChatDataset(bad, tokenizer=tokenizer)


def test_squad_with_a_chat_template_is_a_user_and_an_assistant_turn_with_the_loss_on_the_answer(data,
                                                                                                 plain_tokenizer_dir):
    from transformers import AutoTokenizer

    from automodel.training.loss import IGNORE_INDEX

    tokenizer = AutoTokenizer.from_pretrained(plain_tokenizer_dir)
    built = datasets.make_squad_dataset(tokenizer, dataset_name=data["squad"], chat_template=TEMPLATE)
    prompt, answer = built.qa_pairs[0]
    sample = built[0]
    learned = [t for t, label in zip(sample["input_ids"], sample["labels"], strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(sample["input_ids"]).startswith("[user] Context: ")
    assert tokenizer.decode(learned) == f"[assistant] {answer}{tokenizer.eos_token}"
    assert prompt.startswith("[user] Context: ") and prompt.endswith(tokenizer.eos_token)  # as the model saw it
    assert tokenizer.chat_template == TEMPLATE  # saved with the tokenizer, so generation renders the same way


def test_a_prompt_that_holds_its_bos_token_is_not_given_another(tokenizer):
    from types import SimpleNamespace

    import torch

    from automodel.hf import greedy_answer

    asked = []
    model = SimpleNamespace(generate=lambda ids, **kwargs: asked.append(ids[0].tolist()) or ids)  # records the ask
    assert tokenizer.bos_token and tokenizer("Q")["input_ids"][0] == tokenizer.bos_token_id
    greedy_answer(model, tokenizer, "Q", 4, torch.device("cpu"))
    greedy_answer(model, tokenizer, f"{tokenizer.bos_token}Q", 4, torch.device("cpu"))  # a chat render holds it
    assert asked[0] == asked[1] == tokenizer("Q")["input_ids"]


def test_a_tokenizer_in_the_training_dataset_is_the_runs_tokenizer_as_upstream(make_config, plain_tokenizer_dir,
                                                                                 tmp_path):
    tokenizer = {"pretrained_model_name_or_path": str(plain_tokenizer_dir)}
    config = make_config(tokenizer=None, dataset={"tokenizer": tokenizer})
    recipe = train_inprocess(config, setup_only=True)
    assert recipe.tokenizer.eos_token == "<unk>" and recipe.train_dataset[0]["input_ids"][-1] == 3
    validation = {"_target_": "SquadDataset", "dataset_name": str(SQUAD_DIR), "split": "validation",
                  "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER_DIR)}}
    assert _issues(make_config("two.yaml", tokenizer=None, validation_dataset=validation)) == [
        "validation_dataset.tokenizer: the run has one tokenizer, and only the training data set's counts; give it "
        "once, in tokenizer: (or dataset.tokenizer, upstream's form)"]
    # upstream repeats the run's tokenizer in each data set: written the same, it is that tokenizer
    validation["tokenizer"] = tokenizer
    recipe = train_inprocess(make_config("same.yaml", tokenizer=None, dataset={"tokenizer": tokenizer},
                                         validation_dataset=validation),
                             "--checkpoint.checkpoint_dir", str(tmp_path / "same"), setup_only=True)
    assert recipe.val_dataloaders["validation"].dataset[0]["input_ids"][-1] == 3  # the plain tokenizer's EOS
    assert _issues(make_config("both.yaml", tokenizer=tokenizer, dataset={"tokenizer": tokenizer})) == []


# ---- validation ----------------------------------------------------------------------------------------------

def _issues(config, *overrides) -> list[str]:
    try:
        load_config(config, *overrides)
    except ConfigError as err:
        return [str(issue) for issue in err.issues]
    return []


def test_validation_refuses_both_spellings_a_tokenizer_unknown_arguments_and_bad_values(make_config, data):
    config = make_config(dataset={"path_or_dataset_id": data["squad"], "truncation": "sometimes",
                                  "padding": "max_length", "max_seq_length": None,
                                  "tokenizer": {"_target_": "transformers.AutoTokenizer.from_pretrained",
                                                "pretrained_model_name_or_path": str(TOKENIZER_DIR)}},
                         validation_dataset={"_target_": "ChatDataset", "path_or_dataset_id": data["chat"],
                                             "chat_template": "no-such-file.jinja", "start_of_turn_token": "<s>"})
    issues = "\n".join(_issues(config))
    assert "dataset.dataset_name: the same argument as path_or_dataset_id, which is also given" in issues
    assert "dataset.tokenizer: the run has one tokenizer, and the tokenizer: section is given too" in issues
    assert "dataset.truncation: expected bool | 'do_not_truncate' | 'longest_first' | 'only_first', found " \
           "'sometimes'" in issues
    assert "dataset.padding: max_length pads each sample to seq_length, which is not set" in issues
    assert "validation_dataset.chat_template: 'no-such-file.jinja' is neither a Jinja template" in issues
    assert "validation_dataset.start_of_turn_token: upstream's ChatDataset keeps it and never reads it" in issues
    for fp8, refused in ((False, False), (True, True)):  # upstream documents it as unused
        upstream = make_config("upstream.yaml", dataset={
            "_target_": "nemo_automodel.components.datasets.llm.squad.make_squad_dataset", "fp8": fp8})
        assert any(issue.startswith("dataset.fp8: upstream's make_squad_dataset documents it as unused")
                   for issue in _issues(upstream)) is refused


def test_a_chat_dataset_whose_local_tokenizer_has_no_template_fails_validation_saying_what_to_set(
        make_config, data, plain_tokenizer_dir, tmp_path):
    config = make_config(tokenizer={"pretrained_model_name_or_path": str(plain_tokenizer_dir)},
                         dataset={"_target_": "ChatDataset", "path_or_dataset_id": data["chat"],
                                  "dataset_name": None, "max_seq_length": None, "split": "train",
                                  "limit_dataset_samples": None})
    result = run_cli_inprocess("validate", "finetune", "llm", "-c", config, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "dataset.chat_template: ChatDataset renders each conversation with the tokenizer's chat template" in \
        result.stderr
    assert "Set dataset.chat_template" in result.stderr and "Traceback" not in result.stderr
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(TEMPLATE)
    for fixed in ({"tokenizer": {"chat_template": TEMPLATE}}, {"dataset": {"chat_template": str(template_file)}}):
        assert _issues(write_yaml(tmp_path / "fixed.yaml", deep_update(yaml.safe_load(config.read_text()), fixed))) \
            == []


def test_a_tokenizer_larger_than_the_models_vocabulary_fails_validation(make_config, tiny_llama_config, tmp_path):
    small = json.loads(tiny_llama_config.read_text())
    small["vocab_size"] = 100
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(small))
    config = make_config(model={"config": str(tmp_path / "small" / "config.json")})
    assert _issues(config) == ["tokenizer.pretrained_model_name_or_path: 482 tokens but the model's vocab_size is "
                               "100: token ids past 100 have no embedding; use the model's own tokenizer, or a "
                               "model whose vocabulary holds the tokenizer's"]
    assert _issues(config, "--model.vocab_size", "482") == []
    assert _issues(make_config()) == []
