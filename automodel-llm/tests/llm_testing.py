"""Helpers for the LLM domain's tests: tiny configs in tmp_path that point at the shipped assets.

Every training run here is a few seconds on a CPU: a 1-layer, 32-wide Llama, a few dozen samples, ~10 steps.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PKG_DIR = Path(importlib.util.find_spec("automodel_llm").submodule_search_locations[0])
ASSETS = PKG_DIR / "examples" / "assets"
SQUAD_DIR = ASSETS / "tiny_squad"
TOKENIZER_DIR = ASSETS / "tiny_tokenizer"
LLAMA_CONFIG = ASSETS / "tiny_llama" / "config.json"
AUTOMODEL_BIN = Path(sys.executable).with_name("automodel")

# Small enough that a step takes milliseconds; vocabulary and special ids stay those of the shipped tokenizer.
TINY_LLAMA_OVERRIDES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}

METRIC_FIELDS = ("step", "epoch", "loss", "grad_norm", "lr", "mem", "tps", "mfu", "timestamp")


def deep_update(base: dict, extra: dict) -> dict:
    """``extra`` merged into a copy of ``base``; a value of None removes the key."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_update(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_tiny_llama_config(directory: Path) -> Path:
    data = json.loads(LLAMA_CONFIG.read_text())
    data.update(TINY_LLAMA_OVERRIDES)
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def base_config(model_config: Path, checkpoint_dir: Path) -> dict[str, Any]:
    return {
        "step_scheduler": {"max_steps": 10, "grad_accumulation_steps": 1, "log_interval": 1, "num_epochs": 100},
        "rng": {"seed": 1234},
        "model": {"_target_": "automodel_llm.AutoModelForCausalLM.from_config", "config": str(model_config)},
        "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER_DIR)},
        "dataset": {"_target_": "automodel_llm.datasets.SquadDataset", "dataset_name": str(SQUAD_DIR),
                    "split": "train", "max_seq_length": 64, "limit_dataset_samples": 32},
        "dataloader": {"batch_size": 4},
        "clip_grad_norm": {"max_norm": 1.0},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3.0e-3, "weight_decay": 0.01},
        "lr_scheduler": {"_target_": "automodel.optim.CosineAnnealingWarmup", "warmup_steps": 3, "min_lr": 1.0e-4},
        "checkpoint": {"checkpoint_dir": str(checkpoint_dir)},
        "eval_generation": {"enabled": False},
    }


VALIDATION = {"_target_": "automodel_llm.datasets.SquadDataset", "dataset_name": str(SQUAD_DIR),
              "split": "validation", "max_seq_length": 64, "limit_dataset_samples": 8}


def write_config(path: Path, model_config: Path, checkpoint_dir: Path, **sections: Any) -> Path:
    """A tiny run's YAML (``sections`` deep-merged into the base; None removes a section) written to ``path``."""
    data = deep_update(base_config(model_config, checkpoint_dir), sections)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(path)


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    env.pop("AUTOMODEL_DEBUG", None)
    return env


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``automodel <args>`` in a subprocess (the installed console script)."""
    return subprocess.run([str(AUTOMODEL_BIN), *map(str, args)], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def train_inprocess(config: Path, *overrides: str, before_run=None):
    """Validate and run ``finetune llm`` in this process, as the CLI does; returns the recipe after training."""
    from automodel.cli.execute import import_recipe, load_and_validate
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    recipe_cls = import_recipe(manager.routes.get("finetune", "llm").recipe)
    cfg = load_and_validate(recipe_cls, Path(config), [str(o) for o in overrides], manager)
    recipe = recipe_cls(cfg)
    recipe.setup()
    if before_run is not None:
        before_run(recipe)
    recipe.run_train_validation_loop()
    return recipe


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def checkpoint_dirs(root: Path) -> list[str]:
    return sorted((p.name for p in Path(root).iterdir() if p.is_dir() and p.name.startswith("epoch_")),
                  key=lambda n: int(n.rsplit("_", 1)[1]))


def load_safetensors_state(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def assert_states_equal(a: dict, b: dict, atol: float = 0.0) -> None:
    import torch

    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    for key in a:
        x, y = a[key].detach().cpu(), b[key].detach().cpu()
        assert x.shape == y.shape, key
        if atol == 0.0:
            assert torch.equal(x, y), f"{key}: max |diff| {float((x.float() - y.float()).abs().max())}"
        else:
            assert torch.allclose(x, y, atol=atol, rtol=0), f"{key}: max |diff| {float((x - y).abs().max())}"
