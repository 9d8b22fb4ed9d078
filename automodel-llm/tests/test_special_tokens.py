"""A model whose config names other special tokens than its tokenizer: the saved config.json and
generation_config.json carry the tokenizer's (the ones training used), so plain ``generate()`` stops at EOS."""

from __future__ import annotations

import json

import pytest

from automodel.testing import checkpoint_dirs, train_inprocess

STEPS, MAX_NEW = 40, 12


def _yes_rows(directory) -> None:
    """Every question's answer is 'yes': a few dozen steps teach the tiny model to answer 'yes' and end."""
    directory.mkdir()
    rows = [{"context": f"Item {i} is on shelf {i % 7}.", "question": f"Is item {i} on a shelf?",
             "answers": {"text": ["yes"], "answer_start": [0]}} for i in range(48)]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_saved_model_has_the_tokenizers_special_tokens_and_generate_stops_at_eos(make_config, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _yes_rows(tmp_path / "yes")
    config = make_config(
        model={"bos_token_id": 5, "eos_token_id": 6, "pad_token_id": 7},  # not the tokenizer's 1, 2, 0
        dataset={"dataset_name": str(tmp_path / "yes"), "limit_dataset_samples": None},
        dataloader={"batch_size": 8}, optimizer={"lr": 1.0e-2}, step_scheduler={"max_steps": STEPS})
    recipe = train_inprocess(config)
    log = capsys.readouterr().err
    assert "special tokens: the model's config.bos_token_id 5 -> 1" in log
    assert "config.eos_token_id 6 -> 2" in log and "generation_config.eos_token_id 6 -> 2" in log
    tokenizer = recipe.tokenizer
    model_dir = tmp_path / "ckpt" / checkpoint_dirs(tmp_path / "ckpt")[-1] / "model"
    saved = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    wanted = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}
    assert wanted == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    for name, value in wanted.items():
        assert saved[name] == value and generation[name] == value, name

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = loaded_tokenizer("Context: Item 3 is on shelf 3. Question: Is item 3 on a shelf? Answer:",
                              return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=MAX_NEW, do_sample=False)  # no eos / pad arguments
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert new[-1] == tokenizer.eos_token_id and len(new) < MAX_NEW, new
    assert loaded_tokenizer.decode(new, skip_special_tokens=True).strip() == "yes"


@pytest.mark.parametrize(("model_eos", "kept"), [([2, 9], [2, 9]), (2, 2)])
def test_an_eos_list_holding_the_tokenizers_eos_is_kept(model_eos, kept):
    from types import SimpleNamespace

    from automodel.hf import align_special_tokens

    config = SimpleNamespace(bos_token_id=1, eos_token_id=model_eos, pad_token_id=0)
    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert align_special_tokens(SimpleNamespace(config=config), tokenizer) == []
    assert config.eos_token_id == kept
