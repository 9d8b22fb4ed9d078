"""``checkpoint.v4_compatible`` (upstream's): model/'s config.json and generation_config.json are the pretrained
model's own files (its quantization_config dropped, the saved special-token ids), transformers 5's kept beside them
as *.v5.json; refused where there is nothing to copy."""

from __future__ import annotations

import json

import torch
from llm_testing import TOKENIZER_DIR, save_pretrained_base

from automodel.errors import ConfigError
from automodel.testing import load_config, train_inprocess
from automodel.v4_config import write_v4_configs


def _pretrained_base(directory, config_path):
    """A 'pre-trained' base whose config.json is in transformers 4's form, as the hub holds it."""
    save_pretrained_base(directory, config_path, seed=1)
    config = json.loads((directory / "config.json").read_text())
    config.pop("dtype", None)
    config.update({"torch_dtype": "float32", "transformers_version": "4.46.0", "eos_token_id": 99,
                   "rope_scaling": None, "rope_theta": 10000.0})
    (directory / "config.json").write_text(json.dumps(config))
    return directory, config


def test_model_dir_holds_the_pretrained_config_files_and_loads_as_the_v5_one(make_config, tiny_llama_config,
                                                                              tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, original = _pretrained_base(tmp_path / "base", tiny_llama_config)
    model = {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained", "config": None,
             "pretrained_model_name_or_path": str(base)}
    train_inprocess(make_config(model=model, step_scheduler={"max_steps": 2},
                                checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "v4_compatible": True}))
    saved = tmp_path / "ckpt" / "epoch_0_step_2" / "model"
    eos = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)).eos_token_id
    assert eos != 99
    assert json.loads((saved / "config.json").read_text()) == {**original, "eos_token_id": eos}
    v5 = json.loads((saved / "config.v5.json").read_text())
    assert v5["transformers_version"] != "4.46.0" and v5["eos_token_id"] == eos and "torch_dtype" not in v5
    assert json.loads((saved / "generation_config.json").read_text())["eos_token_id"] == eos
    assert (saved / "generation_config.v5.json").is_file()

    v5_dir = tmp_path / "v5"  # the same weights under transformers 5's own config
    v5_dir.mkdir()
    for file in saved.iterdir():
        target = v5_dir / file.name.replace(".v5.json", ".json")
        if not file.name.endswith(".json") or file.name.endswith(".v5.json") or not target.exists():
            target.write_bytes(file.read_bytes())
    inputs = torch.randint(4, 400, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(v5_dir)).eval()(input_ids=inputs).logits
        got = AutoModelForCausalLM.from_pretrained(str(saved)).eval()(input_ids=inputs).logits
    assert torch.equal(got, expected)


def test_a_quantized_base_s_quantization_config_is_dropped(tmp_path):
    base, saved = tmp_path / "base", tmp_path / "saved"
    base.mkdir()
    saved.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "pad_token_id": 0,
                                                  "quantization_config": {"quant_method": "fp8"}}))
    (saved / "config.json").write_text(json.dumps({"model_type": "llama", "pad_token_id": 2, "bos_token_id": None}))
    (saved / "generation_config.json").write_text("{}")  # the base ships none: kept as transformers 5 wrote it
    assert write_v4_configs(saved, {"pretrained_model_name_or_path": str(base)}) == ["config.json"]
    assert json.loads((saved / "config.json").read_text()) == {"model_type": "llama", "pad_token_id": 2}
    assert (saved / "generation_config.json").read_text() == "{}"
    assert not (saved / "generation_config.v5.json").exists()


def test_nothing_to_copy_is_refused_at_validation(make_config, tmp_path):
    def issues(**sections):
        try:
            load_config(make_config(**sections))
        except ConfigError as err:
            return [str(issue) for issue in err.issues if issue.key == "checkpoint.v4_compatible"]
        return []

    v4 = {"checkpoint": {"checkpoint_dir": str(tmp_path / "ckpt"), "v4_compatible": True}}
    assert issues(**v4) == ["checkpoint.v4_compatible: true: copies the pretrained model's config.json, and this model "
                            "has none to copy (it is not loaded with model.pretrained_model_name_or_path); remove it"]
    empty = tmp_path / "empty"
    empty.mkdir()
    model = {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained", "config": None,
             "pretrained_model_name_or_path": str(empty)}
    assert issues(model=model, **v4) == [f"checkpoint.v4_compatible: true: copies the pretrained model's "
                                         f"config.json, and model.pretrained_model_name_or_path '{empty}' has none "
                                         "here; remove it"]
    lora = issues(peft={"dim": 4, "alpha": 8, "target_modules": ["q_proj"]}, **v4)
    assert lora == ["checkpoint.v4_compatible: true: a LoRA run's model/ is the adapter (adapter_config.json), "
                    "which has no config.json to write in either form; remove it"]
    assert issues() == []
