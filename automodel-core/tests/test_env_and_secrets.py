"""Environment interpolation and secret masking (table-driven)."""

from __future__ import annotations

import pytest

from automodel.config import (
    dump_yaml,
    interpolate,
    is_secret_key,
    mask_secrets,
    parse_yaml,
)
from automodel.errors import ConfigIssue

ENV = {"AMT_NAME": "bob", "AMT_N": "7", "AMT_LR": "1e-4", "AMT_EMPTY": "", "AMT_LIST": "[1, 2]",
       "AMT_TAG": "!!python/object/apply:os.system ['touch /tmp/amt_never']"}

INTERPOLATION = [
    ("${AMT_NAME}", "bob"),
    ("${AMT_MISSING,alice}", "alice"),
    ("${AMT_NAME,alice}", "bob"),  # the environment wins over the default
    ("${oc.env:AMT_NAME}", "bob"),
    ("${oc.env:AMT_MISSING,carol}", "carol"),
    ("${AMT_N,3}", 7),  # a whole-value placeholder takes the value's YAML type
    ("${AMT_MISSING,3}", 3),
    ("${AMT_MISSING,1e-4}", 1e-4),
    ("${AMT_LR}", 1e-4),
    ("${AMT_MISSING,null}", None),
    ("${AMT_MISSING,true}", True),
    ("${AMT_LIST}", [1, 2]),
    ("${AMT_EMPTY}", ""),
    ("${AMT_MISSING,}", ""),
    ("x-${AMT_NAME}-${AMT_N}", "x-bob-7"),  # inside text: always a string
    ("/data/${AMT_MISSING,d}/f.json", "/data/d/f.json"),
    ("${AMT_TAG}", ENV["AMT_TAG"]),  # an unsafe tag in a variable stays a plain string
    ("no placeholder", "no placeholder"),
    ("$AMT_NAME", "$AMT_NAME"),  # only ${...} is a placeholder
]


@pytest.mark.parametrize("value,expected", INTERPOLATION, ids=[v for v, _ in INTERPOLATION])
def test_interpolate(monkeypatch, value, expected):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AMT_MISSING", raising=False)
    issues: list[ConfigIssue] = []
    out = interpolate({"section": {"key": value}}, issues)
    assert issues == []
    assert out["section"]["key"] == expected
    assert type(out["section"]["key"]) is type(expected)


@pytest.mark.parametrize("value", ["${AMT_MISSING}", "${oc.env:AMT_MISSING}", "a/${AMT_MISSING}/b"])
def test_missing_variable_is_an_issue_naming_key_and_variable(monkeypatch, value):
    monkeypatch.delenv("AMT_MISSING", raising=False)
    issues: list[ConfigIssue] = []
    out = interpolate({"model": {"paths": [value]}}, issues)
    assert len(issues) == 1
    assert issues[0].key == "model.paths[0]"
    assert "AMT_MISSING" in issues[0].message and "not set" in issues[0].message
    assert out["model"]["paths"][0] == value  # left as written


def test_every_missing_variable_is_reported(monkeypatch):
    monkeypatch.delenv("AMT_A", raising=False)
    monkeypatch.delenv("AMT_B", raising=False)
    issues: list[ConfigIssue] = []
    interpolate({"a": "${AMT_A}", "b": {"c": "${AMT_B}"}}, issues)
    assert [i.key for i in issues] == ["a", "b.c"]


def test_interpolate_does_not_modify_input(monkeypatch):
    monkeypatch.setenv("AMT_NAME", "bob")
    data = {"a": "${AMT_NAME}"}
    interpolate(data, [])
    assert data == {"a": "${AMT_NAME}"}


def test_pkg_placeholder_finds_a_package_without_importing_it():
    issues: list[ConfigIssue] = []
    out = interpolate({"p": "${pkg:automodel}/x", "q": "${pkg:amt_no_such_package}"}, issues)
    assert out["p"].endswith("automodel/x")
    assert len(issues) == 1 and issues[0].key == "q" and "amt_no_such_package" in issues[0].message


# ---- secrets ------------------------------------------------------------------------------------------------

SECRET_KEYS = ["hf_token", "HF_TOKEN", "token", "access_token", "hub_token", "password", "db_passwd", "api_key",
               "apikey", "OPENAI_API_KEY", "secret", "client_secret", "authorization", "Authorization",
               "aws_credentials",
               # issue 21: credentials that are keys, passphrases and auth, whatever their spelling
               "private_key", "passphrase", "access_key", "hf_auth", "wandb_key", "api_key_id", "use_auth_token",
               "aws_secret_access_key", "apiKey", "ssh_key", "signing_key", "hfAuthToken"]
NOT_SECRET_KEYS = ["tokenizer_name_or_path", "tokenizer", "pad_token_id", "eos_token_id", "bos_token", "pad_token",
                   "max_tokens", "max_new_tokens", "num_tokens", "tokens", "additional_special_tokens",
                   "tokens_per_second", "name", "lr", "model",
                   # field names and model dimensions that mention keys or tokens
                   "add_eos_token", "num_key_value_heads", "past_key_values", "sort_keys", "key_map", "caption_key",
                   "image_key", "token_loss_weight", "skip_special_tokens", "mask_token_id",
                   "selected_token_ids_path", "author", "key", "keys"]


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", NOT_SECRET_KEYS)
def test_not_secret_keys(key):
    assert not is_secret_key(key)


def test_mask_secrets_masks_values_keeps_placeholders_and_structure():
    data = {
        "model": {"pretrained_model_name_or_path": "m", "hf_token": "hf_abcdef", "token": "${HF_TOKEN}",
                  "pad_token_id": 0, "tokenizer_name_or_path": "tok"},
        "logger": {"wandb": {"api_key": "k-123", "project": "p"}, "password": None},
        "headers": [{"authorization": "Bearer xyz"}, {"x": 1}],
        "secret": {"nested": "kept-structure"},  # a section named like a secret is walked, not blanked
        "max_tokens": 128,
    }
    masked = mask_secrets(data)
    assert masked["model"] == {"pretrained_model_name_or_path": "m", "hf_token": "***", "token": "${HF_TOKEN}",
                               "pad_token_id": 0, "tokenizer_name_or_path": "tok"}
    assert masked["logger"] == {"wandb": {"api_key": "***", "project": "p"}, "password": None}
    assert masked["headers"] == [{"authorization": "***"}, {"x": 1}]
    assert masked["secret"] == {"nested": "kept-structure"}
    assert masked["max_tokens"] == 128
    assert data["model"]["hf_token"] == "hf_abcdef"  # a copy

    text = dump_yaml(masked)
    assert "hf_abcdef" not in text and "k-123" not in text and "xyz" not in text
    assert "${HF_TOKEN}" in text
    assert parse_yaml(text) == masked
