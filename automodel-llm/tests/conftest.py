"""Fixtures for the LLM domain's tests (helpers live in llm_testing.py, importable from every test module)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import llm_testing  # noqa: E402


def pytest_configure(config):
    # torchdata calls a deprecated torch API on every dataloader iterator (the engine filters it for users too)
    config.addinivalue_line("filterwarnings", "ignore:'set_vital' is deprecated:UserWarning")


@pytest.fixture(scope="session")
def tiny_llama_config(tmp_path_factory) -> Path:
    """config.json of a 1-layer, 32-wide Llama with the shipped tokenizer's vocabulary."""
    return llm_testing.write_tiny_llama_config(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def make_config(tmp_path, tiny_llama_config):
    """``make_config(name="cfg.yaml", **sections)``: a tiny run's YAML in tmp_path, checkpoints in tmp_path/ckpt."""

    def make(name: str = "cfg.yaml", **sections) -> Path:
        return llm_testing.write_config(tmp_path / name, tiny_llama_config, tmp_path / "ckpt", **sections)

    return make
