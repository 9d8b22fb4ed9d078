"""Upstream's nanoGPT pre-training form: build_gpt2_model and NanogptDataset over modded-nanogpt .bin shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llm_testing import assert_same_weights, run_finetune, validate_cli
from llm_testing import losses as train_losses

from automodel.errors import AutomodelError
from automodel.testing import train_inprocess, write_yaml
from automodel_llm.datasets.nanogpt import LEGACY_MAGIC, MAGIC, NanogptDataset

VOCAB, BOS = 300, 299


def write_shard(path: Path, tokens, magic: int = LEGACY_MAGIC, width: int = 2) -> Path:
    """A shard as modded-nanogpt writes it: 256 int32 header values (magic, version 1, token count, bytes per
    token), then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:4] = magic, 1, len(tokens), width
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=np.uint16 if width == 2 else np.uint32).tobytes())
    return path


def test_windows_are_consecutive_tokens(tmp_path):
    write_shard(tmp_path / "a.bin", range(23))
    write_shard(tmp_path / "b.bin", range(100, 112), magic=MAGIC, width=4)
    data = NanogptDataset(str(tmp_path / "*.bin"), seq_len=4)
    samples = [data[i] for i in range(len(data))]
    # windows of seq_len + 1 tokens, not overlapping; a shard's tail shorter than a window is dropped
    windows = [list(range(0, 5)), list(range(5, 10)), list(range(10, 15)), list(range(15, 20)),
               list(range(100, 105)), list(range(105, 110))]
    # upstream's pair: the model reads seq_len tokens, labelled with the next ones (pre-shifted: the loss keeps them)
    assert [s["input_ids"] for s in samples] == [w[:-1] for w in windows]
    assert [s["labels"] for s in samples] == [w[1:] for w in windows] and NanogptDataset.labels_shifted


@pytest.mark.parametrize("damage, words", [
    ("magic", "not a modded-nanogpt token shard (magic number 7"),
    ("truncated", "header announces 30 tokens"),
    ("short", "less than the 1024-byte header"),
    ("version", "format version 2"),
])
def test_bad_shards_are_refused_by_name(tmp_path, damage, words):
    path = write_shard(tmp_path / "shard.bin", range(30))
    raw = bytearray(path.read_bytes())
    if damage == "magic":
        raw[:4] = np.int32(7).tobytes()
    elif damage == "version":
        raw[4:8] = np.int32(2).tobytes()
    path.write_bytes(bytes(raw[:-6] if damage == "truncated" else raw[:100] if damage == "short" else raw))
    with pytest.raises(AutomodelError) as err:
        NanogptDataset([str(path)], seq_len=4)
    assert str(err.value).startswith(f"dataset.file_pattern: '{path}'") and words in str(err.value)


def test_align_to_bos_starts_every_window_at_bos(tmp_path):
    tokens = [1, 2, BOS, 3, 4, 5, 6, 7, BOS, 8, BOS, 9, 10, 11, 12, 13, 14]
    write_shard(tmp_path / "a.bin", tokens)
    aligned = NanogptDataset(str(tmp_path / "a.bin"), seq_len=2, align_to_bos=True, bos_token=BOS)
    # the first BOS, then the first BOS at or after each window's end (position 5 -> 8, 11 -> none)
    assert [aligned[i]["input_ids"] + aligned[i]["labels"][-1:] for i in range(len(aligned))] == [[BOS, 3, 4],
                                                                                                  [BOS, 8, BOS]]
    plain = NanogptDataset(str(tmp_path / "a.bin"), seq_len=2)
    assert plain[0]["input_ids"] == [1, 2] and plain[0]["labels"] == [2, BOS] and len(plain) == 5
    with pytest.raises(AutomodelError, match="dataset.bos_token: needed"):
        NanogptDataset(str(tmp_path / "a.bin"), seq_len=2, align_to_bos=True)


def test_shuffle_files_is_seeded(tmp_path):
    for shard in range(6):
        write_shard(tmp_path / f"s{shard}.bin", [shard] * 3)

    def order(**kwargs) -> list[int]:
        data = NanogptDataset(str(tmp_path / "*.bin"), seq_len=2, **kwargs)
        return [data[i]["input_ids"][0] for i in range(len(data))]

    assert order() == list(range(6))  # sorted file names
    shuffled = {seed: order(shuffle_files=True, run_seed=seed) for seed in range(4)}
    assert all(sorted(o) == list(range(6)) for o in shuffled.values())
    assert shuffled[0] == order(shuffle_files=True, run_seed=0)  # the same seed, the same order
    assert len({tuple(o) for o in shuffled.values()} | {tuple(range(6))}) > 2  # the seed changes the order


def test_two_ranks_read_disjoint_windows(tmp_path):
    """The engine's data-parallel sampler over the windows (what build_dataloader uses under torchrun)."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    write_shard(tmp_path / "a.bin", range(60))
    data = NanogptDataset(str(tmp_path / "a.bin"), seq_len=4)
    seen = [[tuple(data[i]["input_ids"]) for i in StatefulDistributedSampler(data, num_replicas=2, rank=rank,
                                                                               shuffle=True, seed=3, drop_last=True)]
            for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 6
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0]) | set(seen[1])) == 12


def test_upstream_form_config_trains_a_gpt2_that_transformers_loads(tmp_path):
    """Upstream's form as is (no tokenizer: the shards hold token ids); model/ is a transformers GPT-2."""
    import torch
    from transformers import GPT2LMHeadModel

    from automodel_llm.gpt2 import build_gpt2_model

    rng = np.random.default_rng(0)
    for shard in range(2):
        write_shard(tmp_path / f"train_{shard}.bin", rng.integers(0, VOCAB, 200))
    config = write_yaml(tmp_path / "nanogpt.yaml", {
        "recipe": "TrainFinetuneRecipeForNextTokenPrediction",
        "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2, "max_steps": 3, "num_epochs": 1,
                           "ckpt_every_steps": 2},
        "rng": {"seed": 5},
        "model": {"_target_": "nemo_automodel.components.models.gpt2.build_gpt2_model", "vocab_size": VOCAB,
                  "n_positions": 128, "n_embd": 32, "n_layer": 2, "n_head": 2, "bos_token_id": BOS,
                  "eos_token_id": BOS},
        "dataset": {"_target_": "nemo_automodel.components.datasets.llm.nanogpt_dataset.NanogptDataset",
                    "file_pattern": str(tmp_path / "train_*.bin"), "seq_len": 16, "shuffle_files": True,
                    "align_to_bos": False, "bos_token": BOS},
        "dataloader": {"_target_": "torchdata.stateful_dataloader.StatefulDataLoader", "shuffle": False,
                       "collate_fn": "nemo_automodel.components.datasets.utils.default_collater"},
        "loss_fn": {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1.0e-2},
        "eval_generation": {"enabled": False},
    })
    code, output = validate_cli(config, tmp_path)
    assert code == 0, output
    run_finetune(config, tmp_path, tmp_path / "ckpt")
    model_dir = tmp_path / "ckpt" / "epoch_0_step_3" / "model"
    trained, info = GPT2LMHeadModel.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    assert trained.config.bos_token_id == trained.config.eos_token_id == BOS
    assert not (model_dir / "tokenizer.json").exists()
    untrained = build_gpt2_model(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=2, seed=5)
    first = NanogptDataset(str(tmp_path / "train_*.bin"), seq_len=16)[0]
    window = torch.as_tensor(first["input_ids"] + first["labels"][-1:])[None]
    with torch.no_grad():
        losses = [m.eval()(window, labels=window).loss.item() for m in (trained, untrained)]
        assert not torch.allclose(trained(window).logits[0, -1], untrained(window).logits[0, -1])
    assert losses[0] < losses[1]  # three steps on these windows lowered their loss
    # resumed from step 2, step 3 reads the same windows: the same loss and weights as the run without a stop
    train_inprocess(config, "--checkpoint.checkpoint_dir", str(tmp_path / "resumed"), "--checkpoint.restore_from",
                    str(tmp_path / "ckpt" / "epoch_0_step_2"))
    assert train_losses(tmp_path / "resumed")[-1] == pytest.approx(train_losses(tmp_path / "ckpt")[-1], rel=1e-5)
    assert_same_weights(tmp_path / "resumed" / "epoch_0_step_3" / "model", model_dir)


def test_gpt2_keys_that_cannot_act_and_a_missing_tokenizer_are_refused(tmp_path):
    model = {"_target_": "build_gpt2_model", "n_embd": 30, "n_head": 4, "n_positions": 64, "n_ctx": 32,
             "flash_mode": True}
    sections = {"dataset": {"_target_": "NanogptDataset", "seq_len": 4, "run_seed": 7,
                            "file_pattern": str(write_shard(tmp_path / "a.bin", range(9)))},
                "step_scheduler": {"max_steps": 1}, "recipe": "TrainFinetuneRecipeForNextTokenPrediction"}
    code, output = validate_cli(write_yaml(tmp_path / "keys.yaml", {"model": model, **sections}), tmp_path)
    assert code == 2
    for words in ("model.flash_mode: not a GPT-2 setting", "model.n_head: 4 does not divide n_embd 30",
                  "model.n_ctx: 32 differs from model.n_positions: 64",
                  "dataset.run_seed: is given by the recipe (rng.seed"):
        assert words in output, output
    # a model built from keys has no directory to take a tokenizer from, and text data need one
    sections["dataset"] = {"_target_": "PretrainingTextDataset", "path_or_dataset_id": str(tmp_path / "t.jsonl")}
    code, output = validate_cli(write_yaml(tmp_path / "tok.yaml", {"model": {"_target_": "build_gpt2_model"},
                                                                   **sections}), tmp_path)
    assert code == 2 and "tokenizer: none found" in output, output
    # upstream's MockIterableDataset is token ids too: no tokenizer needed
    sections["dataset"] = {"_target_": "nemo_automodel.components.datasets.llm.mock_iterable_dataset."
                                       "MockIterableDataset", "vocab_size": VOCAB, "seq_len": 8}
    code, output = validate_cli(write_yaml(tmp_path / "mock.yaml", {"model": {"_target_": "build_gpt2_model"},
                                                                    **sections}), tmp_path)
    assert code == 0, output
