"""Fixtures for the VLM domain's tests; its helpers are in vlm_testing.py (on pytest.ini's pythonpath)."""

from __future__ import annotations

from pathlib import Path

import pytest
import vlm_testing


def pytest_configure(config):
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
