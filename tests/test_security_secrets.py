"""Secrets are never written (issue 21): secret-looking keys and passwords inside URLs are masked in printed and
saved configs and in what the metric backends receive; `${VAR}` placeholders stay; a token given to a model
constructor never reaches the `config.json` that `save_pretrained` writes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import reliability_helpers as h
import security_helpers as s
import yaml

from automodel.testing import write_yaml

# Which keys are secrets: automodel-core/tests/test_env_and_secrets.py.


def test_url_credentials_are_masked_wherever_they_appear():
    from automodel.config import mask_secrets

    data = {"tracking": "https://alice:s3cr3t@mlflow.example.com/x", "list": ["postgres://u:pw@db:5432/runs"],
            "text": "see http://bob:hunter2@host:8080/p and https://plain.example.com", "kept": "https://u:${PW}@h/",
            "user_only": "https://user@host/x", "flag": True, "use_auth_token": True}
    masked = mask_secrets(data)
    assert masked["tracking"] == "https://alice:***@mlflow.example.com/x"
    assert masked["list"] == ["postgres://u:***@db:5432/runs"]
    assert masked["text"] == "see http://bob:***@host:8080/p and https://plain.example.com"
    assert masked["kept"] == "https://u:${PW}@h/" and masked["user_only"] == "https://user@host/x"
    assert masked["flag"] is True and masked["use_auth_token"] is True  # a switch is not a secret


# ---- a real run: printed config, saved config, metric backends, the saved model ---------------------------------

LITERALS = {"private_key": "PRIVATE-0001", "passphrase": "PASSPHRASE-0002", "access_key": "ACCESS-0003",
            "hf_auth": "HFAUTH-0004", "wandb_key": "WANDBKEY-0005", "api_key_id": "APIKEYID-0006"}
URL_PASSWORD = "URLPASS-0007"
ENV_TOKEN = "hf_ENVTOKEN-0008"


def _backends_available() -> dict:
    logging: dict = {"backends": []}
    if importlib.util.find_spec("tensorboard"):
        logging["backends"].append("tensorboard")
    if importlib.util.find_spec("mlflow"):
        logging["mlflow"] = {"tracking_uri": "file:./mlruns", "experiment_name": "secrets"}
    return logging


@pytest.fixture
def secret_run(cwd, tmp_path, monkeypatch):
    monkeypatch.setenv("AMT_SEC_TOKEN", ENV_TOKEN)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = h.run_config(h.write_tiny_llama(tmp_path / "model"), step_scheduler={"max_steps": 1})
    config["model"]["token"] = "${AMT_SEC_TOKEN}"  # a hub argument: from_config must keep it out of config.json
    config["ci"] = {**LITERALS, "tracker": f"https://user:{URL_PASSWORD}@tracker.example.com/api",
                    "num_key_value_heads": 2, "caption_key": "caption"}
    config["logging"] = _backends_available()
    if importlib.util.find_spec("wandb"):
        config["wandb"] = {"project": "p", "name": "n", "save_dir": str(tmp_path / "wb"), "mode": "offline"}
    return write_yaml(tmp_path / "cfg.yaml", config), tmp_path


def _secrets() -> list[bytes]:
    return [v.encode() for v in [*LITERALS.values(), URL_PASSWORD, ENV_TOKEN]]


def test_print_config_masks_every_secret_and_keeps_placeholders(secret_run):
    config, _ = secret_run
    rc, text = s.run_main("finetune", "llm", "-c", config, "--print-config")
    assert rc == 0, text
    printed = yaml.safe_load(text)
    assert printed["model"]["token"] == "${AMT_SEC_TOKEN}"
    assert {k: printed["ci"][k] for k in LITERALS} == {k: "***" for k in LITERALS}
    assert printed["ci"]["tracker"] == "https://user:***@tracker.example.com/api"
    assert printed["ci"]["num_key_value_heads"] == 2 and printed["ci"]["caption_key"] == "caption"
    assert not any(secret.decode() in text for secret in _secrets())


def test_no_file_of_a_run_holds_a_secret(secret_run):
    config, cwd = secret_run
    rc, text = s.run_main("finetune", "llm", "-c", config)
    assert rc == 0, text
    assert not any(secret.decode() in text for secret in _secrets()), text
    saved = yaml.safe_load((cwd / "ckpt" / "epoch_0_step_1" / "config.yaml").read_text())
    assert saved["model"]["token"] == "${AMT_SEC_TOKEN}" and saved["ci"]["private_key"] == "***"
    model_config = json.loads((cwd / "ckpt" / "epoch_0_step_1" / "model" / "config.json").read_text())
    assert "token" not in model_config
    written = [p for p in cwd.rglob("*") if p.is_file() and p.name not in ("cfg.yaml",)]
    assert any("mlruns" in p.parts for p in written) or not importlib.util.find_spec("mlflow")
    for path in written:
        data = path.read_bytes()
        for secret in _secrets():
            assert secret not in data, (path, secret)


# ---- model constructors keep hub arguments out of the saved config ---------------------------------------------

HUB = {"token": "hf_CTOR-0009", "cache_dir": "/tmp/amt-cache", "revision": "main"}


def _saved_config(model, directory: Path) -> str:
    model.save_pretrained(directory)
    return (directory / "config.json").read_text()


def test_llm_constructors_do_not_save_hub_arguments(tmp_path):
    from automodel_llm import AutoModelForCausalLM

    config = h.write_tiny_llama(tmp_path / "tiny")
    for name, model in [
        ("from_config", AutoModelForCausalLM.from_config(str(config), **HUB)),
        ("from_pretrained-config-only", AutoModelForCausalLM.from_pretrained(str(config.parent), **HUB)),
    ]:
        text = _saved_config(model, tmp_path / name)
        assert HUB["token"] not in text and "cache_dir" not in text and '"revision"' not in text, name


def test_vlm_and_retrieval_constructors_do_not_save_hub_arguments(tmp_path):
    from automodel_retrieval import CrossEncoder
    from automodel_vlm import AutoModelForImageTextToText

    vlm_config = Path(importlib.util.find_spec("automodel_vlm").submodule_search_locations[0]) / "examples" / \
        "assets" / "tiny_llava" / "config.json"
    bert = Path(importlib.util.find_spec("automodel_retrieval").submodule_search_locations[0]) / "examples" / \
        "assets" / "tiny_bert" / "config.json"
    for name, model in [("vlm", AutoModelForImageTextToText.from_config(str(vlm_config), **HUB)),
                        ("cross", CrossEncoder.from_config(str(bert), **HUB))]:
        assert HUB["token"] not in _saved_config(model, tmp_path / name), name
