"""Fixtures for the VLM domain's tests (helpers live in vlm_testing.py, importable from every test module)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import vlm_testing  # noqa: E402


def pytest_configure(config):
    # torchdata calls a deprecated torch API on every dataloader iterator (the engine filters it for users too)
    config.addinivalue_line("filterwarnings", "ignore:'set_vital' is deprecated:UserWarning")
    # peft asks transformers a deprecated question on every LoRA model
    config.addinivalue_line("filterwarnings", "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
    # The models here are tiny: one thread is as fast as two, and far steadier on a shared machine.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def processor():
    return vlm_testing.tiny_processor()


@pytest.fixture
def make_config(tmp_path):
    """``make_config(name="cfg.yaml", **sections)``: the example YAML with test-sized overrides, in tmp_path."""

    def make(name: str = "cfg.yaml", **sections) -> Path:
        return vlm_testing.write_config(tmp_path / name, tmp_path / "ckpt", **sections)

    return make
