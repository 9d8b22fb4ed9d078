"""Upstream's MegatronPretraining: Megatron's indexed .bin / .idx files, GPT samples, splits, blends, samplers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
from llm_testing import TOKENIZER_DIR, assert_same_weights, grad_norms, run_finetune, val_losses, validate_cli
from llm_testing import losses as train_losses

from automodel.errors import AutomodelError
from automodel.testing import run_cli, train_inprocess, write_yaml
from automodel_llm.datasets.indexed import IndexedTokens, write_indexed
from automodel_llm.datasets.megatron import MegatronPretraining, parse_split, split_ranges
from automodel_llm.datasets.write_megatron import jsonl_to_indexed

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old green tree".split()


def write_jsonl(path: Path, count: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(count):
            out.write(json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(5, 30))))}) + "\n")
    return path


def test_jsonl_written_and_read_back_are_the_tokenizers_ids(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    jsonl = write_jsonl(tmp_path / "t.jsonl", 12)
    assert jsonl_to_indexed(jsonl, tmp_path / "data" / "t", tokenizer) == 12
    data = IndexedTokens(tmp_path / "data" / "t")
    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    assert data.dtype is np.uint16 and len(data) == 12
    for i, text in enumerate(texts):
        assert data.get(i).tolist() == tokenizer(text, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id]
    assert IndexedTokens(tmp_path / "data" / "t", mmap=False).get(3, 2, 4).tolist() == data.get(3)[2:6].tolist()
    # a line without text is named, and no data file is left without its index
    with open(jsonl, "a", encoding="utf-8") as out:
        out.write(json.dumps({"body": "no text key"}) + "\n")
    with pytest.raises(AutomodelError, match=f"{jsonl}:13: the field 'text' is missing or not text"):
        jsonl_to_indexed(jsonl, tmp_path / "bad", tokenizer)
    assert not list(tmp_path.glob("bad.*"))


def hand_written(prefix: Path, sequences: list[list[int]], ends: list[int], code: int = 4) -> Path:
    """An index and data file built byte by byte per megatron-core's layout (not by our writer): magic, version
    1, dtype code, counts, int32 lengths, int64 byte pointers, int64 document indices."""
    dtype = {4: np.int32, 8: np.uint16}[code]
    width = np.dtype(dtype).itemsize
    lengths = [len(s) for s in sequences]
    pointers = [sum(lengths[:i]) * width for i in range(len(lengths))]
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(ends))
    idx += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(ends)}q", *ends)
    Path(str(prefix) + ".idx").write_bytes(idx)
    Path(str(prefix) + ".bin").write_bytes(b"".join(np.asarray(s, dtype).tobytes() for s in sequences))
    return prefix


def test_the_reader_follows_megatrons_layout(tmp_path):
    # three sequences in two documents (a document of two sentences, as preprocess_data --split-sentences writes)
    prefix = hand_written(tmp_path / "h", [[5, 6, 7], [70000, 9], [1, 2, 3, 4]], [0, 2, 3])
    data = IndexedTokens(prefix)
    assert data.dtype is np.int32 and data.document_indices.tolist() == [0, 2, 3]
    assert [data.get(i).tolist() for i in range(3)] == [[5, 6, 7], [70000, 9], [1, 2, 3, 4]]
    small = IndexedTokens(hand_written(tmp_path / "u", [[1, 2], [65535]], [0, 1, 2], code=8))
    assert small.dtype is np.uint16 and small.get(1).tolist() == [65535]


@pytest.mark.parametrize("damage, file, words", [
    ("magic", "idx", "is not a Megatron index (it does not start with MMIDIDX)"),
    ("version", "idx", "is index version 2; only version 1"),
    ("dtype", "idx", "names token dtype code 9"),
    ("short", "idx", "less than the 34-byte header"),
    ("truncated idx", "idx", "but its header announces 3 sequences and 4 document indices"),
    ("pointers", "idx", "sequence pointers that do not follow its sequence lengths"),
    ("truncated bin", "bin", "announces 80 (20 tokens of int32)"),
])
def test_damaged_files_are_refused_by_name(tmp_path, damage, file, words):
    prefix = tmp_path / "d"
    write_indexed(prefix, [list(range(5)), list(range(7)), list(range(8))])
    path = Path(f"{prefix}.{file}")
    raw = bytearray(path.read_bytes())
    if damage == "magic":
        raw[0:1] = b"X"
    elif damage == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif damage == "dtype":
        raw[17] = 9
    elif damage == "pointers":
        raw[34 + 12 + 8:34 + 12 + 16] = struct.pack("<q", 4)  # the second pointer
    cut = {"short": 20, "truncated idx": len(raw) - 8, "truncated bin": len(raw) - 4}.get(damage, len(raw))
    path.write_bytes(bytes(raw[:cut]))
    with pytest.raises(AutomodelError) as err:
        IndexedTokens(prefix)
    assert str(err.value).startswith(f"dataset.paths: '{path}'") and words in str(err.value), err.value


def test_a_missing_file_is_named(tmp_path):
    write_indexed(tmp_path / "m", [[1, 2, 3]])
    (tmp_path / "m.bin").unlink()
    with pytest.raises(AutomodelError, match=f"dataset.paths: '{tmp_path / 'm.bin'}' does not exist"):
        MegatronPretraining(str(tmp_path / "m"), seq_length=2, splits_to_build="train")
    with pytest.raises(AutomodelError, match="dataset.splits_to_build: missing; say which split"):
        MegatronPretraining(str(tmp_path / "m"), seq_length=2)


def test_split_strings_and_ranges():
    assert parse_split("99,1,0") == pytest.approx([0.99, 0.01, 0.0])
    assert parse_split("0.99, 0.01, 0.00") == pytest.approx([0.99, 0.01, 0.0])
    assert parse_split("900,50,50") == pytest.approx([0.9, 0.05, 0.05])
    assert split_ranges(parse_split("90,10,0"), 20) == [(0, 18), (18, 20), (20, 20)]
    # each size rounded (3, 3, 3); every end shifted by the shortfall, so the first split takes it
    assert split_ranges(parse_split("1,1,1"), 10) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(AutomodelError, match="dataset.split"):
        parse_split("a,b")


def test_samples_span_documents_of_their_split_only(tmp_path):
    documents = [[d * 100 + t for t in range(3 + d % 4)] for d in range(20)]  # token // 100 is the document
    write_indexed(tmp_path / "s", documents)
    train = MegatronPretraining(str(tmp_path / "s"), seq_length=8, split="90,10,0", splits_to_build="train",
                                seed=3, run_samples=40)
    valid = MegatronPretraining(str(tmp_path / "s"), seq_length=8, split="90,10,0", splits_to_build="validation")
    assert len(train) == 40  # more than one epoch's worth (11 samples): epochs of the 18 documents
    # upstream's pair: the model reads seq_length tokens, each labelled with the next (the sample's seq_length + 1)
    pairs = [train[i] for i in range(len(train))]
    assert all(len(p["input_ids"]) == len(p["labels"]) == 8 for p in pairs) and MegatronPretraining.labels_shifted
    assert all(p["input_ids"][1:].tolist() == p["labels"][:-1].tolist() for p in pairs)
    samples = [p["input_ids"].tolist() + p["labels"][-1:].tolist() for p in pairs]
    assert {t // 100 for s in samples for t in s} == set(range(18))
    val_tokens = [t for i in range(len(valid)) for t in valid[i]["labels"].tolist()]
    assert {t // 100 for t in val_tokens} <= {18, 19}
    assert len(valid) == (len(documents[18]) + len(documents[19]) - 1) // 8  # one pass over the split
    # unshuffled, consecutive samples share one token: the stream, every seq_length tokens
    part = train.parts[0]
    stream = [t for d in part.order for t in documents[d]]
    assert samples[0] == stream[int(part.shuffle[0]) * 8: int(part.shuffle[0]) * 8 + 9]
    # the same seed, the same samples; another seed, another order
    again = MegatronPretraining(str(tmp_path / "s"), seq_length=8, split="90,10,0", splits_to_build="train",
                                seed=3, run_samples=40)
    other = MegatronPretraining(str(tmp_path / "s"), seq_length=8, split="90,10,0", splits_to_build="train",
                                seed=4, run_samples=40)
    assert [again[i]["input_ids"].tolist() + again[i]["labels"][-1:].tolist() for i in range(40)] == samples
    assert [other[i]["input_ids"].tolist() for i in range(40)] != [sample[:-1] for sample in samples]


def test_a_blend_follows_its_weights_and_the_index_cache_is_reused(tmp_path):
    write_indexed(tmp_path / "a", [[1] * 30] * 10)
    write_indexed(tmp_path / "b", [[2] * 30] * 10)
    blend = MegatronPretraining([3, str(tmp_path / "a"), 1, str(tmp_path / "b")], seq_length=4, split="1,0,0",
                                splits_to_build="train", run_samples=100, index_mapping_dir=str(tmp_path / "map"))
    firsts = [blend[i]["input_ids"][0].item() for i in range(100)]
    assert firsts.count(1) == 75 and firsts.count(2) == 25
    assert all(firsts[:n].count(1) in (3 * n // 4 - 1, 3 * n // 4, 3 * n // 4 + 1) for n in range(4, 100, 4))
    cached = sorted(p.name for p in (tmp_path / "map").iterdir())
    assert len(cached) == 4  # order and shuffle of each file
    again = MegatronPretraining([3, str(tmp_path / "a"), 1, str(tmp_path / "b")], seq_length=4, split="1,0,0",
                                splits_to_build="train", run_samples=100, index_mapping_dir=str(tmp_path / "map"))
    assert sorted(p.name for p in (tmp_path / "map").iterdir()) == cached and len(again) == 100
    # unweighted prefixes weigh by their tokens; a paths mapping gives each split its own files whole
    write_indexed(tmp_path / "c", [[3] * 10] * 10)
    mixed = MegatronPretraining(str(tmp_path / "[ac].bin"), seq_length=4, split="1,0,0", splits_to_build="train",
                                run_samples=40)
    assert [mixed[i]["input_ids"][0].item() for i in range(40)].count(1) == 30
    per_split = MegatronPretraining({"train": [str(tmp_path / "a")], "valid": [str(tmp_path / "b")]}, seq_length=4,
                                    splits_to_build="validation")
    assert len(per_split) == (300 - 1) // 4 and per_split[0]["input_ids"][0].item() == 2
    # a JSON file holds either form: upstream's mapping of splits, or Megatron's flat weighted list with split
    (tmp_path / "blend.json").write_text(json.dumps({"train": ["1", str(tmp_path / "a"), "1", str(tmp_path / "c")],
                                                     "dev": [str(tmp_path / "b")]}))
    (tmp_path / "flat.json").write_text(json.dumps(["1", str(tmp_path / "a"), "1", str(tmp_path / "c")]))
    for name in ("blend.json", "flat.json"):
        half = MegatronPretraining(str(tmp_path / name), seq_length=4, split="1,0,0", splits_to_build="train",
                                   run_samples=20)
        assert [half[i]["input_ids"][0].item() for i in range(20)].count(3) == 10


def upstream_form(tmp_path: Path, model_config: Path) -> Path:
    """Upstream's megatron_pretrain_gpt2.yaml form: the dataset and validation_dataset sections, samplers by
    dataloader_type, default_collate; a tiny Llama, the shipped tokenizer and data written from JSONL here."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    for shard in range(2):
        jsonl_to_indexed(write_jsonl(tmp_path / f"{shard}.jsonl", 60, shard), tmp_path / "data" /
                         f"processed_data_{shard}_text_document", tokenizer)
    data = {"_target_": "nemo_automodel.components.datasets.llm.megatron_dataset.MegatronPretraining",
            "paths": str(tmp_path / "data" / "processed_data_*_text_document*"),
            "index_mapping_dir": str(tmp_path / "data" / "mapping_dir"),
            "tokenizer": {"_target_": "nemo_automodel._transformers.auto_tokenizer.NeMoAutoTokenizer.from_pretrained",
                          "pretrained_model_name_or_path": str(TOKENIZER_DIR)},
            "seq_length": 32, "split": "0.9, 0.1, 0.00"}
    loader = {"_target_": "torchdata.stateful_dataloader.StatefulDataLoader",
              "collate_fn": "torch.utils.data.default_collate", "dataloader_type": "single"}
    return write_yaml(tmp_path / "megatron.yaml", {
        "recipe": "TrainFinetuneRecipeForNextTokenPrediction",
        "step_scheduler": {"global_batch_size": 4, "local_batch_size": 4, "ckpt_every_steps": 2,
                           "val_every_steps": 2, "num_epochs": 1, "max_steps": 3},
        "seed": 1111,
        "model": {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config", "config": str(model_config)},
        "checkpoint": {"enabled": True, "checkpoint_dir": str(tmp_path / "ckpt"), "save_consolidated": True},
        "loss_fn": {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"},
        "dataset": {**data, "splits_to_build": "train"},
        "dataloader": loader,
        "validation_dataset": {**data, "splits_to_build": "validation", "num_val_samples": 8},
        "validation_dataloader": dict(loader),
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3.0e-3},
        "eval_generation": {"enabled": False},
    })


def test_upstream_form_pretrains_three_steps_and_resumes(tmp_path, tiny_llama_config):
    config = upstream_form(tmp_path, tiny_llama_config)
    result = run_cli("pretrain", "llm", "-c", config, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "ckpt" / "epoch_0_step_3" / "model").is_dir()
    assert [step for step, _ in val_losses(tmp_path / "ckpt")] == [2]  # val_every_steps: 2, 8 samples
    # resumed from step 2, step 3 reads the same samples: the same loss and weights as the run without a stop
    train_inprocess(config, "--checkpoint.checkpoint_dir", str(tmp_path / "resumed"), "--checkpoint.restore_from",
                    str(tmp_path / "ckpt" / "epoch_0_step_2"))
    assert train_losses(tmp_path / "resumed")[-1] == pytest.approx(train_losses(tmp_path / "ckpt")[-1], rel=1e-5)
    assert_same_weights(tmp_path / "resumed" / "epoch_0_step_3" / "model",
                        tmp_path / "ckpt" / "epoch_0_step_3" / "model")


def test_dataloader_type_acts_and_what_cannot_act_is_refused(tmp_path, tiny_llama_config):
    config = upstream_form(tmp_path, tiny_llama_config)

    def first_loss(name: str, *overrides: str) -> float:
        train_inprocess(config, "--step_scheduler.max_steps", "1", "--dataset.num_train_samples", "40",
                        "--validation_dataset", "null",
                        "--validation_dataloader", "null", "--checkpoint.checkpoint_dir", str(tmp_path / name),
                        *overrides)
        return train_losses(tmp_path / name)[0]

    # of 40 samples (num_train_samples; max_steps x global batch is 4), single reads the first batch in order,
    # cyclic a shuffled one (seeded): the same as shuffle false / true
    single, cyclic = first_loss("single"), first_loss("cyclic", "--dataloader.dataloader_type", "cyclic")
    assert cyclic != pytest.approx(single, rel=1e-6)
    assert first_loss("shuffled", "--dataloader.dataloader_type", "null", "--dataloader.shuffle", "true") == \
        pytest.approx(cyclic, rel=1e-6)
    code, output = validate_cli(config, tmp_path, "--dataloader.dataloader_type", "random",
                                "--validation_dataloader.shuffle", "true", "--dataset.create_attention_mask", "true",
                                "--dataset.trainer_max_steps", "5", "--dataset.splits_to_build", "training",
                                "--validation_dataset.object_storage_config", "{path_to_idx_cache: /tmp}")
    assert code == 2
    for words in ("dataloader.dataloader_type: 'random'; single (in order) or cyclic",
                  "validation_dataloader.dataloader_type: single contradicts validation_dataloader.shuffle: True",
                  "dataset.create_attention_mask: the models here build their causal attention mask",
                  "dataset.trainer_max_steps: upstream's constructor takes it from its recipe's schedule",
                  "dataset.splits_to_build: 'training'; say which split this section reads: train, validation",
                  "validation_dataset.object_storage_config: reading .bin / .idx from S3"):
        assert words in output, output


def test_upstream_gpt2_form_fills_the_learned_position_table_and_trains(tmp_path):
    # upstream's megatron_pretrain_gpt2.yaml: seq_length 1024 = GPT-2's n_positions. The model reads seq_length
    # tokens (the labels are the next ones, pre-shifted), so seq_length = n_positions fits; one more is refused
    from transformers import GPT2Config

    GPT2Config(vocab_size=482, n_positions=32, n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path / "gpt2")
    config = upstream_form(tmp_path, tmp_path / "gpt2" / "config.json")  # seq_length 32
    data = yaml.safe_load(config.read_text())  # upstream's model form: the config from AutoConfig.from_pretrained
    data["model"]["config"] = {"_target_": "transformers.AutoConfig.from_pretrained",
                               "pretrained_model_name_or_path": str(tmp_path / "gpt2")}
    write_yaml(config, data)
    result = run_cli("pretrain", "llm", "-c", config, "--step_scheduler.log_interval", "1", cwd=tmp_path,
                     OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(train_losses(tmp_path / "ckpt")) == 3 and [step for step, _ in val_losses(tmp_path / "ckpt")] == [2]
    code, output = validate_cli(config, tmp_path, "--dataset.seq_length", "33")
    assert code == 2 and "Traceback" not in output, output
    assert "dataset.seq_length: 33: each sample feeds the model 33 tokens, but its learned positions stop at " \
           "n_positions = 32; set seq_length to at most 32" in output, output
    assert "validation_dataset.seq_length" not in output, output


@pytest.mark.parametrize("loss", ["MaskedCrossEntropy", "FusedLinearCrossEntropy"])
@pytest.mark.parametrize("positions_only", [True, False])
def test_a_preshifted_sample_has_the_loss_of_its_full_row(tmp_path, tiny_llama_config, loss, positions_only):
    """A rotary model reads seq_length tokens and pairs each position with its own (pre-shifted) label: the loss of
    the row of seq_length + 1 tokens fed whole (the loss shifting), by hand and through the recipe's old form."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import default_collate

    from automodel.training.modules import unwrap

    config = upstream_form(tmp_path, tiny_llama_config)
    run = train_inprocess(config, "--validation_dataset", "null", "--validation_dataloader", "null",
                          "--loss_fn._target_", loss, "--logits.label_positions_only", str(positions_only).lower(),
                          setup_only=True)
    assert run.labels_shifted and run.label_offset == 0
    batch = default_collate([run.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)  # seq_length, what the model reads
    rows = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)  # Megatron's 33-token samples
    model = unwrap(run.model)
    with torch.no_grad():
        preshifted = run.compute_loss(run.model, run.move_to_device(batch)).item()
        assert run.count_label_tokens(batch) == 4 * 32
        by_hand = F.cross_entropy(model(input_ids=rows[:, :-1]).logits.flatten(0, 1).float(), rows[:, 1:].flatten(),
                                  reduction="sum").item()
        run.labels_shifted, run.label_offset = False, 1  # the old form: whole rows, the loss shifting
        full_row = run.compute_loss(run.model, run.move_to_device({"input_ids": rows, "labels": rows})).item()
        assert run.count_label_tokens({"input_ids": rows, "labels": rows}) == 4 * 32
    assert preshifted == pytest.approx(by_hand, rel=1e-5) and preshifted == pytest.approx(full_row, rel=1e-5)


@pytest.mark.slow
def test_context_parallel_over_two_ranks_trains_preshifted_samples_like_one_process(tmp_path, tiny_llama_config):
    """cp_size 2 splits each row of seq_length tokens (a multiple of 2 x cp_size, as upstream needs) with its labels
    as they are, not shifted again before the split: the losses, gradient norms and validation loss of one
    process (fp32, the all-gather attention on this CPU)."""
    config = upstream_form(tmp_path, tiny_llama_config)
    fp32 = ["--distributed.mp_policy.param_dtype", "float32", "--checkpoint.enabled", "false",
            "--step_scheduler.log_interval", "1"]
    run_finetune(config, tmp_path, tmp_path / "one", *fp32)
    run_finetune(config, tmp_path, tmp_path / "cp2", *fp32, "--nproc-per-node", "2", "--distributed.strategy",
                 "fsdp2", "--distributed.cp_size", "2", "--distributed.cp_attention", "all_gather")
    assert len(train_losses(tmp_path / "one")) == 3
    assert train_losses(tmp_path / "cp2") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)
    assert grad_norms(tmp_path / "cp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)
    assert [v for _, v in val_losses(tmp_path / "cp2")] == pytest.approx(
        [v for _, v in val_losses(tmp_path / "one")], rel=1e-5)


def test_validation_data_of_the_other_label_form_is_refused(tmp_path, tiny_llama_config):
    """One run computes its loss one way: pre-shifted training data with text validation (its labels the input
    tokens, the loss shifting) is refused at validation, and by the recipe for data sets it is handed."""
    import yaml

    from automodel.training.next_token import shifted_labels
    from automodel_llm.datasets.pretraining import PretrainingTextDataset

    config = upstream_form(tmp_path, tiny_llama_config)
    data = yaml.safe_load(config.read_text())
    data["validation_dataset"] = {"_target_": "PretrainingTextDataset", "seq_length": 16,
                                  "path_or_dataset_id": str(write_jsonl(tmp_path / "text.jsonl", 20))}
    code, output = validate_cli(write_yaml(tmp_path / "mixed.yaml", data), tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert "validation_dataset._target_: MegatronPretraining's labels are the next tokens already" in output, output
    assert "while PretrainingTextDataset's are the input tokens themselves" in output
    train = MegatronPretraining(str(tmp_path / "data" / "processed_data_0_text_document"), seq_length=8,
                                splits_to_build="train")
    with pytest.raises(AutomodelError, match="MegatronPretraining's labels are the next tokens already"):
        shifted_labels(train, [object.__new__(PretrainingTextDataset)])
    assert shifted_labels(train, [train]) and not shifted_labels(object(), [None])
    # a rank that builds no data (distillation's separate teacher ranks) reads the form from the config, and gives
    # the student the logits of every position then, none dropped for a shift
    import torch

    from automodel.testing import load_config
    from automodel.training.distillation.teacher import student_logits
    from automodel_llm.recipe import config_labels_shifted

    assert config_labels_shifted(load_config(config)[1]) and not config_labels_shifted(load_config(
        write_yaml(tmp_path / "text.yaml", {**data, "dataset": data["validation_dataset"], "dataloader": None,
                                            "validation_dataset": None, "validation_dataloader": None}))[1])
    logits = torch.arange(24.0).view(1, 4, 6)
    assert student_logits(logits, {}, offset=0).shape == (4, 6) and student_logits(logits, {}).shape == (3, 6)


def test_packing_keeps_every_label_of_preshifted_samples(tmp_path):
    from automodel_llm.datasets.packing import IGNORE_INDEX, PackedDataset

    write_indexed(tmp_path / "s", [list(range(d * 10, d * 10 + 9)) for d in range(4)])
    data = MegatronPretraining(str(tmp_path / "s"), seq_length=4, split="1,0,0", splits_to_build="train")
    packed = PackedDataset(data, pack_size=8)
    assert packed.labels_shifted and all(IGNORE_INDEX not in row["labels"] for row in packed.rows)
    row, first, second = packed[0], data[0], data[1]
    assert row["labels"] == first["labels"].tolist() + second["labels"].tolist()
    assert row["position_ids"] == [0, 1, 2, 3] * 2
