"""Bad data is refused with where it is, or skipped by the user's policy (issue 21): a row missing a required field
names the file, the row (counted from 1) and the field; `on_bad_row: skip` leaves such rows out and says how many;
malformed JSON Lines name the line; every bad interval is reported at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reliability_helpers as h
import security_helpers as s

from automodel.testing import write_yaml


def _squad_rows(count: int = 16) -> list[dict]:
    lines = (h.llm_assets() / "tiny_squad" / "train.jsonl").read_text().splitlines()[:count]
    return [json.loads(line) for line in lines]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(h.llm_assets() / "tiny_tokenizer"))


def _squad_config(cwd: Path, data: Path, **dataset) -> Path:
    config = h.run_config(h.write_tiny_llama(cwd / "model"), step_scheduler={"max_steps": 1})
    config["dataset"] = {**config["dataset"], "dataset_name": str(data), **dataset}
    return write_yaml(cwd / "cfg.yaml", config)


def test_a_squad_row_without_question_is_refused_with_file_row_and_field(cwd):
    rows = _squad_rows()
    del rows[2]["question"]
    data = _write_jsonl(cwd / "train.jsonl", rows)
    rc, text = s.run_main("finetune", "llm", "-c", _squad_config(cwd, data))
    assert rc == 1, text
    assert f"dataset: row 3 of '{data}': the field 'question' is missing or null" in text
    assert "on_bad_row: skip" in text and "Traceback" not in text
    assert not list((cwd / "ckpt").glob("epoch_*"))  # before: it trained on the text "None"


def test_skipping_bad_rows_is_the_users_choice_and_is_counted(cwd):
    rows = _squad_rows()
    del rows[2]["question"]
    rows[5]["context"] = None
    data = _write_jsonl(cwd / "train.jsonl", rows)
    rc, text = s.run_main("finetune", "llm", "-c", _squad_config(cwd, data, on_bad_row="skip"))
    assert rc == 0, text
    assert "dataset: skipped 2 bad row(s) (on_bad_row: skip); the first: row 3 of" in text
    from automodel_llm.datasets import SquadDataset

    dataset = SquadDataset(str(data), tokenizer=_tokenizer(), on_bad_row="skip")
    assert len(dataset) == len(rows) - 2
    assert not any("None" in prompt for prompt, _ in dataset.qa_pairs)


def test_an_unknown_policy_is_refused_at_validation(cwd):
    data = _write_jsonl(cwd / "train.jsonl", _squad_rows())
    rc, text = s.run_main("validate", "finetune", "llm", "-c", _squad_config(cwd, data, on_bad_row="skp"))
    assert rc == 2 and "dataset.on_bad_row: expected 'error' | 'skip', found 'skp'" in text, text


def test_malformed_json_lines_name_the_file_and_line(cwd):
    rows = [json.dumps(r) for r in _squad_rows(6)]
    rows[3] = rows[3].replace('", "question"', '" "question"')
    data = _write_jsonl(cwd / "train.jsonl", rows)
    rc, text = s.run_main("finetune", "llm", "-c", _squad_config(cwd, data))
    assert rc == 1, text
    assert f"dataset.dataset_name: '{data}' line 4, column" in text and "malformed JSON: Expecting ','" in text
    folder = cwd / "folder"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", rows)
    rc, text = s.run_main("finetune", "llm", "-c", _squad_config(cwd, folder))
    assert rc == 1 and f"'{folder / 'train.jsonl'}' line 4, column" in text, text


def test_a_pretty_printed_json_file_names_its_line(cwd):
    from automodel.data import json_problem

    path = cwd / "rows.json"
    path.write_text('[\n  {"a": 1},\n  {"a": 2,,}\n]\n')
    assert json_problem(path).startswith("line 3, column 11: malformed JSON: Expecting property name")


def test_column_mapped_row_with_a_null(cwd):
    from automodel.errors import AutomodelError
    from automodel_llm.datasets import ColumnMappedTextInstructionDataset

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(4)]
    rows[1]["completion"] = None
    data = _write_jsonl(cwd / "pc.jsonl", rows)
    mapping = {"question": "prompt", "answer": "completion"}
    with pytest.raises(AutomodelError, match=r"row 2 of .*pc.jsonl': the field 'completion' is missing or null"):
        ColumnMappedTextInstructionDataset(str(data), mapping, tokenizer=_tokenizer())
    kept = ColumnMappedTextInstructionDataset(str(data), mapping, tokenizer=_tokenizer(), on_bad_row="skip")
    assert [answer for _, answer in kept.qa_pairs] == ["a0", "a2", "a3"]  # before: the row trained on "None"


def test_chat_and_pretraining_rows(cwd):
    from automodel.errors import AutomodelError
    from automodel_llm.datasets import PretrainingTextDataset

    data = _write_jsonl(cwd / "text.jsonl", [{"text": "alpha beta gamma " * 20}, {"text": None},
                                             {"text": "delta " * 40}])
    with pytest.raises(AutomodelError, match=r"row 2 of .*text.jsonl': the field 'text' is null"):
        PretrainingTextDataset(str(data), tokenizer=_tokenizer(), seq_length=16)
    assert len(PretrainingTextDataset(str(data), tokenizer=_tokenizer(), seq_length=16, on_bad_row="skip")) > 0


def test_retrieval_row_without_query(cwd):
    from automodel.errors import AutomodelError
    from automodel_retrieval.data import RetrievalDataset

    rows = [{"query": f"q{i}", "positive": f"d{i}"} for i in range(4)]
    rows[2] = {"positive": "d2"}
    rows[3]["query"] = None
    data = _write_jsonl(cwd / "r.jsonl", rows)
    with pytest.raises(AutomodelError, match=r"row 3 of .*r.jsonl': the field 'query' is missing or null"):
        RetrievalDataset(str(data))
    assert RetrievalDataset(str(data), on_bad_row="skip").queries == ["q0", "q1"]


def test_vlm_and_diffusion_rows_can_be_skipped(cwd):
    import importlib.util

    from automodel.errors import AutomodelError
    from automodel_diffusion.datasets import ImageCaptionDataset
    from automodel_vlm.datasets import ImageTextChatDataset

    shapes = Path(importlib.util.find_spec("automodel_vlm").submodule_search_locations[0]) / "examples" / \
        "assets" / "tiny_shapes"
    turn = [{"role": "user", "content": "what?"}, {"role": "assistant", "content": "a shape"}]
    rows = [{"messages": turn, "image": "images/train_0000.png"}, {"messages": None, "image": None},
            {"messages": turn, "image": "images/train_0001.png"}]
    data = _write_jsonl(cwd / "vlm.jsonl", rows)
    with pytest.raises(AutomodelError, match=r"row 2 of .*on_bad_row: skip"):
        ImageTextChatDataset(str(data), image_root=str(shapes))
    kept = ImageTextChatDataset(str(data), image_root=str(shapes), on_bad_row="skip")
    assert len(kept) == 2 and kept.row_indices == [0, 2]
    image = shapes / "images" / "train_0000.png"
    captions = _write_jsonl(cwd / "captions.jsonl", [{"image": str(image), "caption": "c"}, {"image": str(image)},
                                                     {"image": "gone.png", "caption": "c"}])
    with pytest.raises(AutomodelError, match=r"row 2 of .*captions.jsonl'.*needs 'image'"):
        ImageCaptionDataset(str(captions), resolution=8)
    assert len(ImageCaptionDataset(str(captions), resolution=8, on_bad_row="skip")) == 1


def test_every_bad_interval_is_reported_at_once(cwd):
    data = _write_jsonl(cwd / "train.jsonl", _squad_rows())
    path = _squad_config(cwd, data)
    rc, text = s.run_main("validate", "finetune", "llm", "-c", path, "--step_scheduler.val_check_interval", "0",
                     "--step_scheduler.checkpoint_interval", "-2", "--step_scheduler.log_interval", "0",
                     "--checkpoint.keep_last", "0", "--distributed.tp_size", "0", "--distributed.cp_size", "0")
    assert rc == 2, text
    for key in ("step_scheduler.val_check_interval", "step_scheduler.checkpoint_interval",
                "step_scheduler.log_interval", "checkpoint.keep_last", "distributed.tp_size", "distributed.cp_size"):
        assert f"  - {key}: must be >= 1, found " in text, (key, text)
