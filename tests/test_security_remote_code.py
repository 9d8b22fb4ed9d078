"""Remote code and pickles only by the person running (issue 21): `trust_remote_code: true` and every other key that
makes a library run a model's code or unpickle is refused at validation unless the command line says
`--trust-remote-code`, in `validate`, `--dry-run`, a run and `export`; with the flag the key acts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import reliability_helpers as h
import security_helpers as s
import yaml

from automodel.testing import write_yaml


def _remote_code_config(cwd: Path) -> Path:
    model = s.write_remote_code_model(cwd)
    config = h.run_config(h.write_tiny_llama(cwd / "tiny"), step_scheduler={"max_steps": 1})
    config["model"] = {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                       "pretrained_model_name_or_path": str(model), "trust_remote_code": True}
    return write_yaml(cwd / "remote.yaml", config)


MODES = {"validate": ["validate", "finetune", "llm"], "dry-run": ["finetune", "llm", "--dry-run"],
         "run": ["finetune", "llm"], "print-config": ["finetune", "llm", "--print-config"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_local_model_with_its_own_code_does_not_run_it_without_the_flag(cwd, mode):
    config = _remote_code_config(cwd)
    rc, text = s.run_main(*MODES[mode], "-c", config)
    assert rc == 2, text
    assert "model.trust_remote_code: true runs the Python code a model ships" in text
    assert "pass --trust-remote-code on the command line" in text and "Traceback" not in text
    assert not s.marker(cwd).exists()
    assert not (cwd / "ckpt").exists()


def test_the_flag_lets_the_key_act(cwd):
    """The positive control: with --trust-remote-code the model's configuration_*.py is imported (the marker)."""
    config = _remote_code_config(cwd)
    assert s.run_main("validate", "finetune", "llm", "-c", config, "--trust-remote-code")[0] == 0
    assert not s.marker(cwd).exists()  # validating imports nothing
    s.run_main("finetune", "llm", "-c", config, "--trust-remote-code")  # its model class is unknown: it stops there
    assert s.marker(cwd).exists()


def test_the_flag_alone_asks_for_nothing(cwd):
    """--trust-remote-code permits; the config must still ask (a model without trust_remote_code stays safe)."""
    config = yaml.safe_load(_remote_code_config(cwd).read_text())
    del config["model"]["trust_remote_code"]
    rc, text = s.run_main("finetune", "llm", "-c", write_yaml(cwd / "no.yaml", config), "--trust-remote-code")
    assert rc == 1 and not s.marker(cwd).exists(), text


@pytest.mark.parametrize("key,value,fragment", [
    ("trust_remote_code", "yes", "runs the Python code a model ships"),
    ("use_safetensors", False, "loads the weights from pickle files"),
    ("weights_only", False, "unpickles whatever the file holds"),
    ("allow_pickle", True, "unpickles whatever the file holds"),
    ("custom_pipeline", "./evil_pipeline", "imports and runs a pipeline's Python file"),
])
@pytest.mark.parametrize("place", ["model", "tokenizer", "validation_dataset"])
def test_every_code_loading_key_anywhere_is_refused(cwd, key, value, fragment, place):
    config = h.run_config(h.write_tiny_llama(cwd / "tiny"), step_scheduler={"max_steps": 1})
    config["validation_dataset"] = dict(config["dataset"], split="validation")
    node = config
    for part in place.split("."):
        node = node.setdefault(part, {})
    node[key] = value
    path = write_yaml(cwd / "cfg.yaml", config)
    rc, text = s.run_main("validate", "finetune", "llm", "-c", path)
    assert rc == 2 and f"{place}.{key}: " in text and fragment in text, text
    _, trusted = s.run_main("validate", "finetune", "llm", "-c", path, "--trust-remote-code")
    assert fragment not in trusted, trusted  # (a callable without that argument may still refuse it by name)


def test_a_code_loading_key_in_a_section_nothing_reads_loads_nothing_and_is_left_alone(cwd):
    """Upstream's CI settings carry trust_remote_code for their own tooling (ci.checkpoint_robustness); nothing
    here reads ci:, so the key governs nothing and validation names the section in its note."""
    config = h.run_config(h.write_tiny_llama(cwd / "tiny"), step_scheduler={"max_steps": 1})
    config["ci"] = {"checkpoint_robustness": {"trust_remote_code": True, "tokenizer_name": "org/model"}}
    rc, text = s.run_main("validate", "finetune", "llm", "-c", write_yaml(cwd / "cfg.yaml", config))
    assert rc == 0 and "not validated and read by nothing in the run: 'ci'" in text, text


def test_a_model_directory_with_only_pickle_weights_is_refused(cwd):
    import torch

    from automodel_llm import AutoModelForCausalLM

    model_dir = cwd / "pickled"
    model = AutoModelForCausalLM.from_config(str(h.write_tiny_llama(cwd / "tiny")), seed=0)
    model.config.save_pretrained(model_dir)
    torch.save(model.state_dict(), model_dir / "pytorch_model.bin")
    config = h.run_config(h.write_tiny_llama(cwd / "tiny"), step_scheduler={"max_steps": 1})
    config["model"] = {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                       "pretrained_model_name_or_path": str(model_dir)}
    path = write_yaml(cwd / "cfg.yaml", config)
    rc, text = s.run_main("validate", "finetune", "llm", "-c", path)
    assert rc == 2, text
    assert "model.pretrained_model_name_or_path: " in text and "holds weights only as pickle files " \
        "(pytorch_model.bin)" in text, text
    assert s.run_main("validate", "finetune", "llm", "-c", path, "--trust-remote-code")[0] == 0
    model.save_pretrained(model_dir)  # safetensors beside the pickle: the loaders take the safetensors
    assert s.run_main("validate", "finetune", "llm", "-c", path)[0] == 0


def _hostile_checkpoint(cwd: Path, model_node: dict) -> Path:
    """A received LoRA checkpoint: its model/ holds an adapter, its config.yaml is the attacker's."""
    step = cwd / "received" / "epoch_0_step_1"
    (step / "model").mkdir(parents=True)
    (step / "model" / "adapter_model.safetensors").write_bytes(b"")
    (step / "model" / "adapter_config.json").write_text("{}")
    config = h.run_config(h.write_tiny_llama(cwd / "tiny"), step_scheduler={"max_steps": 1})
    config["model"] = model_node
    config["peft"] = {"dim": 4, "alpha": 8, "target_modules": ["q_proj"]}
    write_yaml(step / "config.yaml", config)
    (cwd / "received" / "LATEST").write_text("epoch_0_step_1")
    return cwd / "received"


def test_export_refuses_remote_code_in_a_received_checkpoint(cwd):
    model = s.write_remote_code_model(cwd)
    received = _hostile_checkpoint(cwd, {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                                         "pretrained_model_name_or_path": str(model), "trust_remote_code": True})
    rc, text = s.run_main("export", received, cwd / "out")
    assert rc == 2, text
    assert f"{received / 'epoch_0_step_1' / 'config.yaml'}: model.trust_remote_code: true runs" in text, text
    assert not s.marker(cwd).exists() and not (cwd / "out").exists() and not (cwd / "out.partial").exists()


@pytest.mark.parametrize("gid", s.GADGET_IDS)
def test_export_refuses_every_gadget_in_a_received_checkpoint(cwd, gid):
    gadgets = dict(s.gadgets(cwd))
    received = _hostile_checkpoint(cwd, gadgets[gid])
    rc, text = s.run_main("export", received, cwd / "out")
    assert rc == 2, text
    assert f"config.yaml: model._target_: '{gadgets[gid]['_target_']}' is refused" in text, text
    assert not s.marker(cwd).exists() and not (cwd / "out").exists()
    sys.modules.pop("evilpkg", None)
