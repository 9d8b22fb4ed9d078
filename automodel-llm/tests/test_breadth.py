"""LLM breadth: every dataset kind, packing, LoRA + export, knowledge distillation, the benchmark recipe."""

from __future__ import annotations

import json

import pytest
import torch
from llm_testing import SQUAD_DIR, TOKENIZER_DIR

from automodel.testing import read_jsonl, run_cli, train_inprocess


def _squad_rows(limit: int = 48) -> list[dict]:
    return [json.loads(line) for line in (SQUAD_DIR / "train.jsonl").read_text().splitlines()[:limit]]


@pytest.fixture
def data_files(tmp_path):
    rows = _squad_rows()
    files = {
        "instruction": [{"ctx": r["context"], "q": r["question"], "a": r["answers"]["text"][0]} for r in rows],
        "chat": [{"messages": [{"role": "user", "content": f"{r['context']} {r['question']}"},
                               {"role": "assistant", "content": r["answers"]["text"][0]}]} for r in rows],
        "text": [{"text": f"{r['context']} {r['question']} {r['answers']['text'][0]}"} for r in rows],
    }
    paths = {}
    for name, records in files.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


DATASETS = {
    "instruction": lambda p: {"_target_": "automodel_llm.datasets.ColumnMappedTextInstructionDataset",
                              "path_or_dataset_id": str(p["instruction"]), "seq_length": 64,
                              "column_mapping": {"context": "ctx", "question": "q", "answer": "a"}},
    "chat": lambda p: {"_target_": "automodel_llm.datasets.ChatDataset", "path_or_dataset_id": str(p["chat"]),
                       "seq_length": 64},
    "pretraining": lambda p: {"_target_": "automodel_llm.datasets.PretrainingTextDataset",
                              "path_or_dataset_id": str(p["text"]), "seq_length": 32},
    "mock": lambda p: {"_target_": "automodel_llm.datasets.MockDataset", "num_samples": 32, "seq_length": 16},
}


@pytest.mark.smoke
@pytest.mark.parametrize("kind", sorted(DATASETS))
def test_each_dataset_kind_trains_a_few_steps(kind, data_files, make_config, tmp_path):
    import yaml

    config = make_config()
    data = yaml.safe_load(config.read_text())
    data["dataset"] = DATASETS[kind](data_files)
    config.write_text(yaml.safe_dump(data))
    train_inprocess(config, "--step_scheduler.max_steps", "3")
    rows = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)


def test_chat_loss_is_on_assistant_turns_only(data_files):
    from transformers import AutoTokenizer

    from automodel_llm.datasets import ChatDataset

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    sample = ChatDataset(str(data_files["chat"]), tokenizer=tokenizer)[0]
    learned = tokenizer.decode([t for t, label in zip(sample["input_ids"], sample["labels"], strict=True)
                                if label != -100], skip_special_tokens=True).strip()
    assert learned == _squad_rows(1)[0]["answers"]["text"][0]


def test_column_mapping_needs_an_answer(data_files):
    from transformers import AutoTokenizer

    from automodel.errors import AutomodelError
    from automodel_llm.datasets import ColumnMappedTextInstructionDataset

    with pytest.raises(AutomodelError, match="column_mapping.answer"):
        ColumnMappedTextInstructionDataset(str(data_files["instruction"]), {"question": "q"},
                                           tokenizer=AutoTokenizer.from_pretrained(TOKENIZER_DIR))


def _batch_loss(recipe, batches):
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            tokens += recipe.count_label_tokens(batch)
            total += float(recipe.compute_loss(recipe.model, batch))
    return total / tokens


def test_packed_loss_equals_unpacked_loss_and_packing_raises_useful_tokens(make_config):
    from automodel_llm.datasets.collate import pad_collate
    from automodel_llm.datasets.packing import PackedDataset, packed_collate

    recipe = train_inprocess(make_config(), "--step_scheduler.max_steps", "2")
    recipe.model.eval()
    samples = [recipe.train_dataset[i] for i in range(12)]
    unpacked = _batch_loss(recipe, [pad_collate(samples, pad_token_id=0)])
    packed_rows = PackedDataset(samples, pack_size=128)
    packed = _batch_loss(recipe, [packed_collate([packed_rows[i] for i in range(len(packed_rows))], 128)])
    assert len(packed_rows) < len(samples)
    assert packed == pytest.approx(unpacked, abs=1e-5)
    # variable-length data: padding wastes what packing fills
    lengths = [8, 50, 12, 44, 6, 30, 48, 10, 20, 40, 14, 36]
    varied = [{"input_ids": s["input_ids"][:n], "labels": s["labels"][:n]}
              for n, s in zip(lengths, samples, strict=True)]
    padded = [pad_collate(varied[i:i + 4], pad_token_id=0) for i in range(0, len(varied), 4)]
    useful_padded = sum(int(b["attention_mask"].sum()) for b in padded) / sum(b["input_ids"].numel() for b in padded)
    rows = PackedDataset(varied, pack_size=64)
    packed_batch = packed_collate([rows[i] for i in range(len(rows))], 64)
    useful_packed = int(packed_batch["token_count"].sum()) / packed_batch["input_ids"].numel()
    assert useful_packed > useful_padded


@pytest.mark.smoke
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_adapter_loads_with_peft_gives_the_trained_logits_and_exports_merged(make_config, tmp_path, dora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = make_config(peft={"dim": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_dora": dora})
    recipe = train_inprocess(config, "--step_scheduler.max_steps", "4")
    trained = recipe.model
    changed = {n for n, p in trained.named_parameters() if p.requires_grad}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_magnitude_vector" in n for n in changed) == dora  # DoRA's magnitudes train beside A and B
    adapter_dir = tmp_path / "ckpt" / "epoch_0_step_4" / "model"
    assert (adapter_dir / "adapter_model.safetensors").is_file() and (adapter_dir / "adapter_config.json").is_file()
    base = trained.get_base_model()
    torch.manual_seed(0)
    inputs = torch.randint(3, 500, (1, 12))
    with torch.no_grad():
        expected = trained(input_ids=inputs).logits
        # a fresh base with the same (frozen) weights, adapter loaded by peft from the checkpoint
        fresh = type(base)(base.config)
        fresh.load_state_dict({k.replace("base_layer.", ""): v for k, v in base.state_dict().items()
                               if "lora_" not in k}, strict=True)
        loaded = PeftModel.from_pretrained(fresh, adapter_dir)
        assert torch.allclose(loaded(input_ids=inputs).logits, expected, atol=1e-5)
    out = tmp_path / "merged"
    result = run_cli("export", tmp_path / "ckpt", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=inputs).logits, expected, atol=1e-4)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_resume_continues(make_config, tmp_path, dora):
    config = make_config(peft={"dim": 4, "use_dora": dora})  # DoRA's magnitudes are saved under peft's own key
    train_inprocess(config, "--step_scheduler.max_steps", "4", "--step_scheduler.checkpoint_interval", "2")
    first = [r["loss"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    train_inprocess(config, "--step_scheduler.max_steps", "4", "--checkpoint.checkpoint_dir", str(tmp_path / "r"),
                    "--restore_from.path", str(tmp_path / "ckpt" / "epoch_0_step_2"))
    assert [r["loss"] for r in read_jsonl(tmp_path / "r" / "training.jsonl")] == first[2:]


def test_knowledge_distillation(make_config, tmp_path, tiny_llama_config):
    import yaml

    teacher = {"_target_": "automodel_llm.AutoModelForCausalLM.from_config", "config": str(tiny_llama_config),
               "seed": 7}
    config = make_config()
    data = yaml.safe_load(config.read_text())
    data.update(teacher_model=teacher, kd_ratio=0.5, temperature=2.0)
    kd_config = tmp_path / "kd.yaml"
    kd_config.write_text(yaml.safe_dump(data))

    from automodel.cli.execute import import_recipe, load_and_validate
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    recipe_cls = import_recipe(manager.routes.get("kd", "llm").recipe)

    def run(path, *overrides):
        cfg = load_and_validate(recipe_cls, path, list(overrides), manager)
        recipe = recipe_cls(cfg)
        recipe.setup()
        before = {k: v.clone() for k, v in recipe.teacher.state_dict().items()}
        recipe.run_train_validation_loop()
        return recipe, before

    recipe, teacher_before = run(kd_config, "--step_scheduler.max_steps", "6")
    assert all(torch.equal(teacher_before[k], v) for k, v in recipe.teacher.state_dict().items())
    assert not recipe.teacher.training
    assert recipe.teacher_head is not None  # the teacher's head projects only label positions too
    losses = [r["loss"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    assert losses[-1] < losses[0]
    run(kd_config, "--step_scheduler.max_steps", "6", "--logits.label_positions_only", "false",
        "--checkpoint.checkpoint_dir", str(tmp_path / "all_positions"))
    every = [r["loss"] for r in read_jsonl(tmp_path / "all_positions" / "training.jsonl")]
    assert every == pytest.approx(losses, rel=1e-5)
    run(kd_config, "--step_scheduler.max_steps", "3", "--kd_ratio", "0", "--checkpoint.checkpoint_dir",
        str(tmp_path / "kd0"))
    train_inprocess(config, "--step_scheduler.max_steps", "3", "--checkpoint.checkpoint_dir", str(tmp_path / "sft"))
    kd0 = [r["loss"] for r in read_jsonl(tmp_path / "kd0" / "training.jsonl")]
    sft = [r["loss"] for r in read_jsonl(tmp_path / "sft" / "training.jsonl")]
    assert kd0 == sft


def test_a_resumed_run_distils_from_the_same_fresh_teacher(make_config, tmp_path, tiny_llama_config):
    """A teacher with fresh weights and no seed of its own (``from_config``) is built from the run's seed: the
    resumed run (whose random state is the checkpoint's when the teacher is built) has the uninterrupted run's
    losses (it had another teacher before)."""
    import yaml

    data = yaml.safe_load(make_config().read_text())
    data.update(teacher_model={"_target_": "automodel_llm.AutoModelForCausalLM.from_config",
                               "config": str(tiny_llama_config)}, kd_ratio=0.5)
    config = tmp_path / "kd.yaml"
    config.write_text(yaml.safe_dump(data))
    kd = ("kd", "llm")
    train_inprocess(config, "--step_scheduler.max_steps", "4", "--step_scheduler.checkpoint_interval", "2", route=kd)
    first = [r["loss"] for r in read_jsonl(tmp_path / "ckpt" / "training.jsonl")]
    train_inprocess(config, "--step_scheduler.max_steps", "4", "--checkpoint.checkpoint_dir", str(tmp_path / "r"),
                    "--restore_from.path", str(tmp_path / "ckpt" / "epoch_0_step_2"), route=kd)
    assert [r["loss"] for r in read_jsonl(tmp_path / "r" / "training.jsonl")] == first[2:]


def test_benchmark_recipe_writes_json(make_config, tmp_path):
    import yaml

    data = yaml.safe_load(make_config().read_text())
    data.pop("dataset")
    data["benchmark"] = {"warmup_steps": 1, "seq_length": 16, "num_samples": 64,
                         "output": str(tmp_path / "bench.json")}
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump(data))
    result = run_cli("benchmark", "llm", "-c", config, "--step_scheduler.max_steps", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    for key in ("tokens_per_second", "step_time_p50", "step_time_p90", "peak_memory_gib", "mfu"):
        assert key in report
    assert report["tokens_per_second"] > 0 and report["steps_timed"] == 4
    assert not list((tmp_path / "ckpt").glob("epoch_*"))


def test_falcon_h1_lora_with_upstreams_glob_trains_without_the_mamba_out_proj(tmp_path):
    """Upstream's Falcon-H1 LoRA (``target_modules: '*_proj'``) also matches the Mamba mixers' out_proj, which
    peft refuses on a falcon_h1 model: the run leaves it out, says so, and trains the other projections."""
    from llm_testing import LLAMA_CONFIG, write_config

    llama = json.loads(LLAMA_CONFIG.read_text())
    falcon = {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "vocab_size": llama["vocab_size"],
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "mamba_d_ssm": 32, "mamba_n_heads": 2, "mamba_d_head": 16,
              "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 8}
    (tmp_path / "falcon").mkdir()
    (tmp_path / "falcon" / "config.json").write_text(json.dumps(falcon))
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "falcon" / "config.json", tmp_path / "ckpt",
                          peft={"target_modules": "*_proj", "dim": 4, "alpha": 8})
    result = run_cli("finetune", "llm", "-c", config, "--step_scheduler.max_steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "peft.target_modules leaves out out_proj (x 1)" in result.stdout + result.stderr
    saved = json.loads((tmp_path / "ckpt" / "epoch_0_step_2" / "model" / "adapter_config.json").read_text())
    targets = {name.rsplit(".", 1)[-1] for name in saved["target_modules"]}
    assert "in_proj" in targets and "q_proj" in targets and "out_proj" not in targets
