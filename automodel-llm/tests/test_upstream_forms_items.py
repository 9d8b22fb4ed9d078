"""Upstream forms of issue 20 beyond the config-level ones: `distributed.pipeline` / `moe` (inert at size 1, named in
a note), `checkpoint.restore_from`, upstream's `benchmark:` keys, HellaSwag, MockIterableDataset, fp8 keys and the
upstream names refused because they need a GPU. Each form validates and acts, or is refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from automodel.errors import AutomodelError, ConfigError
from automodel.testing import load_config, read_jsonl, train_inprocess, write_yaml

FORMS = Path(__file__).parent / "upstream_forms"


def refusals(config: Path, *overrides, route=("finetune", "llm")) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, *overrides, route=route)
    return {issue.key: issue.message for issue in info.value.issues}


def variant(tmp_path: Path, source: Path, **sections) -> Path:
    data = yaml.safe_load(source.read_text())
    for name, value in sections.items():
        data[name] = value
    return write_yaml(tmp_path / f"variant_{source.name}", data)


def test_pipeline_and_moe_sections_are_inert_at_size_one_and_say_so(tmp_path, monkeypatch, capsys):
    data = yaml.safe_load((FORMS / "distributed_pipeline_replicate.yaml").read_text())
    data["distributed"]["moe"] = {"reshard_after_forward": False, "wrap_outer_model": False}
    data["distributed"]["ep_size"] = 1
    config = write_yaml(tmp_path / "pipeline_moe.yaml", data)
    monkeypatch.chdir(tmp_path)
    train_inprocess(config)
    assert read_jsonl(tmp_path / "checkpoints" / "training.jsonl")[-1]["step"] == 3
    err = capsys.readouterr().err
    assert "note: distributed.pipeline governs nothing this run: pipeline parallelism (pp_size) is off" in err
    assert "note: distributed.moe governs nothing this run: expert parallelism (ep_size) is off" in err


def test_pipeline_and_moe_keys_are_upstreams_and_sizes_above_one_are_checked(tmp_path):
    config = FORMS / "distributed_pipeline_replicate.yaml"
    found = refusals(config, "--distributed.pp_size", "2")
    assert "2 stages, but the model has 1 layers (num_hidden_layers)" in found["distributed.pp_size"]
    found = refusals(config, "--distributed.pp_size", "2", "--distributed.pipeline.dtype", "bf16",
                     "--distributed.pipeline.pp_schedule_csv", "s.csv",
                     "--distributed.pipeline.scale_grads_in_schedule", "true")
    assert "upstream's setting, which this build's pipeline does not implement" in \
        found["distributed.pipeline.pp_schedule_csv"]
    assert "distributed.pipeline.dtype" not in found  # static shapes of each batch's length (upstream's VLM form)
    assert "scales every micro-batch's loss" in found["distributed.pipeline.scale_grads_in_schedule"]
    data = yaml.safe_load(config.read_text())
    data["distributed"]["pipeline"]["pp_shedule"] = "1f1b"
    data["distributed"]["moe"] = {"wrap_outer_modle": True}
    found = refusals(write_yaml(tmp_path / "typo.yaml", data))
    assert "pp_shedule: not a key of upstream's pipeline settings" in found["distributed.pipeline"]
    assert "wrap_outer_modle: not a key of upstream's moe settings" in found["distributed.moe"]


@pytest.mark.parametrize("key, words", [("enable_async_tensor_parallel", "tp_size > 1"),
                                        ("patch_is_packed_sequence", "CUDA synchronisation")])
def test_upstream_fsdp2_switches_that_cannot_act_are_refused_with_the_reason(key, words):
    found = refusals(FORMS / "distributed_pipeline_replicate.yaml", f"--distributed.{key}", "true")
    assert words in found[f"distributed.{key}"]
    load_config(FORMS / "distributed_pipeline_replicate.yaml", f"--distributed.{key}", "false")  # off: fine


def test_per_block_compile_is_refused_with_whole_model_compile_which_tensor_parallelism_refuses(capsys):
    """Alone it acts (the plan says so; test_compile_blocks.py trains with it, test_tensor_parallel.py under tp 2)."""
    from automodel.cli.main import main

    form = FORMS / "distributed_pipeline_replicate.yaml"
    found = refusals(form, "--distributed.enable_compile", "true", "--compile.enabled", "true")
    assert "a model is compiled one way: set one of them false" in found["distributed.enable_compile"]
    found = refusals(form, "--compile.enabled", "true", "--distributed.tp_size", "2")
    assert "true with tp_size 2: torch.compile of the whole tensor-parallel model stops in dynamo" in \
        found["compile.enabled"]
    try:  # per-block compile composes with tensor parallelism
        load_config(form, "--distributed.enable_compile", "true", "--distributed.tp_size", "2")
    except ConfigError as error:
        assert not [issue for issue in error.issues if "compile" in issue.key], error.issues
    assert main(["finetune", "llm", "-c", str(form), "--distributed.enable_compile", "true", "--dry-run"]) == 0
    assert "compile: each transformer block in place (after sharding)" in "".join(capsys.readouterr())


def test_fsdp2_prefetch_needs_fsdp2_processes_and_its_depths_need_it():
    found = refusals(FORMS / "distributed_pipeline_replicate.yaml", "--distributed.enable_fsdp2_prefetch", "true")
    assert "needs distributed.strategy: fsdp2 and more than one process" in found["distributed.enable_fsdp2_prefetch"]
    found = refusals(FORMS / "distributed_pipeline_replicate.yaml", "--distributed.fsdp2_forward_prefetch_depth", "2")
    assert "acts only with enable_fsdp2_prefetch: true" in found["distributed.fsdp2_forward_prefetch_depth"]


def test_checkpoint_restore_from_is_restore_from_path(tmp_path, monkeypatch, capsys):
    form = FORMS / "checkpoint_restore_from.yaml"
    _, cfg = load_config(form)
    assert cfg.restore_from.path == "LATEST" and "restore_from" not in vars(cfg.checkpoint)
    monkeypatch.chdir(tmp_path)
    train_inprocess(form)  # LATEST with no checkpoint yet: a fresh start
    assert "starting fresh" in capsys.readouterr().err
    train_inprocess(form, "--step_scheduler.max_steps", "4")  # LATEST now names step 3: resumed from it
    steps = [r["step"] for r in read_jsonl(tmp_path / "checkpoints" / "training.jsonl")]
    assert steps == [3, 4]  # each run logs its last step; the second trained step 4 only
    found = refusals(form, "--restore_from.path", "elsewhere")
    assert "disagrees with restore_from.path" in found["checkpoint.restore_from"]
    _, cfg = load_config(form, "--checkpoint.restore_from", "null")
    assert cfg.restore_from is None or cfg.restore_from.path is None


def test_benchmark_upstream_keys_and_mock_iterable_dataset(tmp_path, monkeypatch):
    form = FORMS / "benchmark_upstream.yaml"
    route = ("benchmark", "llm")
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(form, route=route)
    assert len(recipe.train_dataset) == 64
    sample = recipe.train_dataset[5]
    assert len(sample["input_ids"]) == 32 and max(sample["input_ids"]) < 482 and sample["labels"] == \
        sample["input_ids"] and recipe.train_dataset[5] == sample  # the same sample every time it is read
    result = json.loads((tmp_path / "benchmark" / "result.json").read_text())  # json_output_path
    assert result["steps_timed"] == 2
    found = refusals(form, "--benchmark.nsys_start", "5", "--benchmark.nsys_ranks", "[0]", route=route)
    assert "Nsight Systems capture needs a CUDA GPU" in found["benchmark.nsys_start"]
    assert "benchmark.nsys_ranks" in found
    found = refusals(form, "--benchmark.num_nodes", "2", route=route)
    assert "launched on 1 node" in found["benchmark.num_nodes"] and "--nnodes 2" in found["benchmark.num_nodes"]
    # upstream's data set yields batches of batch_size rows, which must match local_batch_size (2 here)
    assert train_inprocess(form, "--dataset.batch_size", "2", route=route, setup_only=True) is not None
    found = refusals(form, "--dataset.batch_size", "4", route=route)
    assert "4 differs from the run's rows per micro-batch (2" in found["dataset.batch_size"], found


def test_mock_iterable_dataset_drawing_ids_past_the_model_vocabulary_is_refused():
    # upstream's default vocab_size (1024) suits its models; the embedding of a smaller one failed on the first batch
    form, route = FORMS / "benchmark_upstream.yaml", ("benchmark", "llm")
    found = refusals(form, "--dataset.vocab_size", "null", route=route)
    assert found["dataset.vocab_size"].startswith("1024 (unset): token ids are drawn below it, but the model's "
                                                  "vocabulary has 482"), found
    assert "set it to at most 482" in refusals(form, "--dataset.vocab_size", "483", route=route)["dataset.vocab_size"]
    load_config(form, "--dataset.vocab_size", "482", route=route)


def test_benchmark_num_nodes_is_checked_against_the_planned_launch():
    from automodel.training.dist import planned_world_size

    form = FORMS / "benchmark_upstream.yaml"
    with planned_world_size(2, "--nproc-per-node 1 x --nnodes 2", nodes=2):
        found = refusals(form, route=("benchmark", "llm"))
    assert "benchmark.num_nodes" in found  # num_nodes: 1, but the launch has 2 nodes


def test_bare_validate_plans_benchmark_num_nodes_machines(tmp_path, capsys, monkeypatch):
    from automodel.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    form = str(FORMS / "benchmark_upstream.yaml")
    assert main(["validate", "benchmark", "llm", "-c", form, "--benchmark.num_nodes", "2"]) == 2
    assert "global_batch_size: 2 is not divisible by batch_size (2) * dp_size (2)" in capsys.readouterr().err
    form = str(variant(tmp_path, FORMS / "benchmark_upstream.yaml",
                       step_scheduler={"global_batch_size": 4, "local_batch_size": 2, "max_steps": 3}))
    assert main(["validate", "benchmark", "llm", "-c", form, "--benchmark.num_nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "checked for 2 processes: the layout's own size" in out and "--nproc-per-node 1 --nnodes 2" in out
    assert main(["validate", "benchmark", "llm", "-c", form, "--benchmark.num_nodes", "2", "--nnodes", "1"]) == 2
    assert "benchmark.num_nodes" in capsys.readouterr().err  # a launch given is checked as given
    assert main(["validate", "benchmark", "llm", "-c", form, "--benchmark.num_nodes", "2",
                 "--distributed.dp_size", "3", "--step_scheduler.global_batch_size", "6"]) == 2
    assert "do not split evenly over 2 nodes" in capsys.readouterr().err


def _hellaswag_rows(path: Path) -> Path:
    rows = [{"ctx": "A man is sitting on a roof. He", "endings": [" is using wrap.", " starts pulling up roofing.",
                                                                   " is ripping level tiles.", " holds a rope."],
             "label": "1"},
            {"ctx": "A woman walks into the kitchen and", "endings": [" cooks.", " sings.", " sleeps.", " reads."],
             "label": 0}] * 8
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hellaswag_is_the_context_then_the_correct_ending_with_the_loss_on_the_ending(tmp_path):
    import automodel_llm
    from automodel.hf import load_tokenizer
    from automodel_llm.datasets import HellaSwag

    tokenizer = load_tokenizer(str(Path(automodel_llm.__file__).parent / "examples" / "assets" / "tiny_tokenizer"),
                               "tokenizer")
    data = _hellaswag_rows(tmp_path / "hellaswag.jsonl")
    unpadded = HellaSwag(str(data), tokenizer=tokenizer, pad_to_max_length=False)
    first = unpadded[0]
    context = tokenizer("A man is sitting on a roof. He")["input_ids"]
    ending = [t for t in tokenizer(" starts pulling up roofing.")["input_ids"] if t not in tokenizer.all_special_ids]
    assert first["input_ids"] == context + ending  # endings[label]; label given as text
    assert first["labels"] == [-100] * len(context) + ending
    assert len(unpadded) == 16 and unpadded[1]["labels"][-len(ending):] != ending
    padded = HellaSwag(str(data), tokenizer=tokenizer, num_samples_limit=4)
    lengths = {len(s["input_ids"]) for s in padded.samples}
    assert len(padded) == 4 and len(lengths) == 1 and lengths.pop() % 8 == 0
    assert sum(padded[1]["attention_mask"]) == len(unpadded[1]["input_ids"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ctx": "x", "endings": ["a"], "label": 3}) + "\n")
    with pytest.raises(AutomodelError, match="'label' \\(3\\) is not an index of 'endings'"):
        HellaSwag(str(bad), tokenizer=tokenizer)


def test_hellaswag_under_upstreams_name_trains(tmp_path, monkeypatch):
    data = _hellaswag_rows(tmp_path / "hellaswag.jsonl")
    node = {"_target_": "nemo_automodel.components.datasets.llm.hellaswag.HellaSwag", "path_or_dataset": str(data),
            "split": "train", "num_samples_limit": 12}
    config = variant(tmp_path, FORMS / "recipe_bare_name.yaml", dataset=node,
                     validation_dataset={**node, "num_samples_limit": 4})
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(config)
    assert len(recipe.train_dataset) == 12
    assert read_jsonl(tmp_path / "checkpoints" / "training.jsonl")[-1]["step"] == 3


@pytest.mark.parametrize("section, key, target, words", [
    ("loss_fn", "_target_", "nemo_automodel.components.loss.te_parallel_ce.TEParallelCrossEntropy", "CUDA GPU"),
    ("optimizer", "_target_", "transformer_engine.pytorch.optimizers.FusedAdam", "torch.optim.AdamW"),
    ("optimizer", "_target_", "flashoptim.FlashAdamW", "fused Triton kernels on CUDA GPUs"),
    ("dataset", "_target_", "nemo_automodel.components.datasets.llm.mock_prefix_tree.build_mock_rollout_dataset",
     "MagiAttention's prefix-tree masks"),
    ("optimizer", "_target_", "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam", "torch.optim.AdamW"),
])
def test_upstream_names_without_an_equivalent_here_are_refused_with_what_to_use(tmp_path, section, key, target,
                                                                                 words):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data[section] = {"_target_": target}
    found = refusals(write_yaml(tmp_path / "c.yaml", data))
    assert "is not supported here" in found[f"{section}._target_"] and words in found[f"{section}._target_"]


def test_transformer_engine_fp8_recipe_target_is_refused_as_needing_cuda(tmp_path):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["model"]["backend"] = {"te_fp8": {"_target_": "nemo_automodel.components.models.common.utils.TEFp8Config",
                                           "recipe": "block"}}
    found = refusals(write_yaml(tmp_path / "c.yaml", data))
    assert "needs a CUDA GPU with compute capability >= 8.9" in found["model.backend.te_fp8._target_"], found


def test_thd_collater_is_refused_as_needing_transformer_engine(tmp_path):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["dataloader"]["collate_fn"] = "nemo_automodel.components.datasets.utils.packed_sequence_thd_collater"
    found = refusals(write_yaml(tmp_path / "c.yaml", data))
    assert "Transformer Engine" in found["dataloader.collate_fn"]


def test_fp8_upstream_keys_are_validated_and_refused_on_cpu_for_the_hardware(tmp_path):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["fp8"] = {"enabled": True, "recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": True,
                   "precompute_float8_dynamic_scale_for_fsdp": False, "force_recompute_fp8_weight_in_bwd": True,
                   "filter_fqns": ["lm_head"], "emulate": False}
    found = refusals(write_yaml(tmp_path / "c.yaml", data))
    assert list(found) == ["fp8.enabled"] and "FP8 training needs a CUDA GPU" in found["fp8.enabled"]


def test_fp8_layer_filter_is_upstreams():
    import torch

    from automodel.training.stages.fp8 import converts_to_float8

    assert converts_to_float8(torch.nn.Linear(32, 16), "model.layers.0.mlp.up_proj", [])
    assert not converts_to_float8(torch.nn.Linear(32, 16), "lm_head", ["lm_head"])
    assert not converts_to_float8(torch.nn.Linear(30, 16), "model.layers.0.mlp.up_proj", [])  # not a multiple of 16
    assert not converts_to_float8(torch.nn.LayerNorm(32), "model.norm", [])


def test_packing_strategy_thd_is_the_packing_here_and_neat_is_refused(tmp_path, monkeypatch):
    form = FORMS / "recipe_bare_name.yaml"
    found = refusals(form, "--packed_sequence.packed_sequence_size", "64", "--packed_sequence.packing_strategy",
                     "neat")
    assert "neat (upstream's bin-packing" in found["packed_sequence.packing_strategy"]
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(form, "--packed_sequence.packed_sequence_size", "256",
                             "--packed_sequence.packing_strategy", "thd", setup_only=True)
    rows = [recipe.train_dataset[i] for i in range(len(recipe.train_dataset))]
    assert all(len(r["input_ids"]) <= 256 for r in rows)
    assert any(list(r["position_ids"]).count(0) > 1 for r in rows)  # several samples a row, positions restarting


def test_a_section_given_as_none_is_absent_as_upstreams_loader_reads_it(tmp_path, monkeypatch):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["validation_dataset"] = "none"
    data["validation_dataloader"] = "None"
    data["step_scheduler"].pop("val_every_steps", None)
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(write_yaml(tmp_path / "none.yaml", data))
    assert recipe.cfg.validation_dataset is None and not recipe.val_dataloaders
    assert read_jsonl(tmp_path / "checkpoints" / "training.jsonl")[-1]["step"] == 3
    assert not (tmp_path / "checkpoints" / "validation.jsonl").exists() or \
        not read_jsonl(tmp_path / "checkpoints" / "validation.jsonl")
    data["validation_dataset"] = "nothing"  # any other text is refused (it crashed the tokenizer check before)
    found = refusals(write_yaml(tmp_path / "text.yaml", data))
    assert "expected a section with _target_, found 'nothing'" in found["validation_dataset"]


def test_none_words_are_null_for_a_key_that_may_be_null_as_upstreams_loader_reads_them(tmp_path):
    """upstream's mrpc_roberta_lora.yaml writes max_steps: None (YAML's string 'None'): no step limit there."""
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["step_scheduler"]["max_steps"] = "None"
    _, cfg = load_config(write_yaml(tmp_path / "c.yaml", data))
    assert cfg.step_scheduler.max_steps is None
    data["dist_env"] = {"timeout_minutes": "none"}  # a key that may not be null stays refused
    assert "dist_env.timeout_minutes" in refusals(write_yaml(tmp_path / "e.yaml", data))


def test_a_benchmark_section_under_the_fine_tuning_recipe_is_named_in_the_note_as_upstream_ignores_it(tmp_path):
    data = yaml.safe_load((FORMS / "benchmark_upstream.yaml").read_text())
    data["recipe"] = "TrainFinetuneRecipeForNextTokenPrediction"
    data["benchmark"]["nsys_start"] = 5  # not validated: nothing in a fine-tuning run reads the section
    _, cfg = load_config(write_yaml(tmp_path / "c.yaml", data))
    assert len(cfg.notes) == 1 and "'benchmark' (the benchmark recipe's settings; fine-tuning ignores them" in \
        cfg.notes[0] and "automodel benchmark llm -c FILE" in cfg.notes[0]


def test_autopipeline_section_upstream_no_longer_reads_is_named_in_a_note(tmp_path):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["autopipeline"] = {"_target_": "nemo_automodel.components.distributed.pipelining.AutoPipeline",
                            "pp_schedule": "interleaved1f1b", "layers_per_stage": 2}
    _, cfg = load_config(write_yaml(tmp_path / "c.yaml", data))
    assert any("'autopipeline'" in note and "distributed.pipeline with distributed.pp_size" in note
               for note in cfg.notes), cfg.notes


@pytest.mark.parametrize("section, node, words", [
    ("quantization", {"load_in_4bit": True}, "need a CUDA GPU and bitsandbytes"),
])
def test_upstream_sections_without_an_equivalent_are_refused_with_the_reason(tmp_path, section, node, words):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data[section] = node
    found = refusals(write_yaml(tmp_path / "c.yaml", data))
    assert words in found[section]


PARALLELIZE_MODEL = "nemo_automodel.components.moe.parallelizer.parallelize_model"


def with_parallelizer(tmp_path: Path, distributed: dict | None = None, **arguments) -> Path:
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["parallelizer"] = {"_target_": PARALLELIZE_MODEL, **arguments}
    if distributed is not None:
        data["distributed"] = distributed
    return write_yaml(tmp_path / "parallelizer.yaml", data)


def test_parallelizer_activation_checkpointing_checkpoints_the_blocks(tmp_path, capsys):
    from automodel.cli.main import main

    for flag in (False, True):
        assert main(["finetune", "llm", "-c", str(with_parallelizer(tmp_path, activation_checkpointing=flag)),
                     "--dry-run"]) == 0
        plan = "".join(capsys.readouterr())
        assert ("activation checkpointing: every transformer block" in plan) is flag
    recipe = train_inprocess(with_parallelizer(tmp_path, activation_checkpointing=True), setup_only=True)
    assert sum("CheckpointWrapper" in type(m).__name__ for m in recipe.model.modules()) == 1


@pytest.mark.parametrize("argument, value, read", [
    ("reshard_after_forward", False, lambda d: d.reshard_after_forward),
    ("mp_policy", {"param_dtype": "bf16"}, lambda d: d.mp_policy),
    ("ignore_router_for_ac", False, lambda d: d.moe["ignore_router_for_ac"]),
    ("lm_head_precision", "float32", lambda d: d.moe["lm_head_precision"]),
    ("wrap_outer_model", False, lambda d: d.moe["wrap_outer_model"]),
])
def test_parallelizer_arguments_are_the_distributed_keys_they_stand_for(tmp_path, argument, value, read):
    _, cfg = load_config(with_parallelizer(tmp_path, **{argument: value}))
    assert read(cfg.distributed) == value


@pytest.mark.parametrize("argument, words", [("enable_async_tensor_parallel", "tp_size > 1"),
                                             ("sequence_parallel", "needs tensor parallelism")])
def test_parallelizer_arguments_are_refused_where_the_distributed_keys_are(tmp_path, argument, words):
    """At tp_size 1 both switches are refused, as distributed.* would be: the argument is the key."""
    found = refusals(with_parallelizer(tmp_path, **{argument: True}))
    assert words in found[f"distributed.{argument}"]


def test_parallelizer_arguments_that_disagree_with_distributed_are_refused_naming_both(tmp_path):
    found = refusals(with_parallelizer(tmp_path, {"activation_checkpointing": False, "reshard_after_forward": True},
                                       activation_checkpointing=True, reshard_after_forward=False))
    assert "True disagrees with distributed.activation_checkpointing: False" in \
        found["parallelizer.activation_checkpointing"]
    assert "False disagrees with distributed.reshard_after_forward: True" in \
        found["parallelizer.reshard_after_forward"]
    _, cfg = load_config(with_parallelizer(tmp_path, {"activation_checkpointing": True},
                                           activation_checkpointing=True))  # the same value twice: fine
    assert cfg.distributed.activation_checkpointing


def test_parallelizer_other_targets_and_arguments_without_an_equivalent_are_refused(tmp_path):
    found = refusals(with_parallelizer(tmp_path, tp_shard_plan={"lm_head": "colwise"}, moe_mesh=None,
                                       activation_checkpointing_scope="all", offload_polcy=None))
    assert "the model's own plan (distributed.tp_size)" in found["parallelizer.tp_shard_plan"]
    assert "here distributed.*_size make the mesh" in found["parallelizer.moe_mesh"]
    assert "every transformer block" in found["parallelizer.activation_checkpointing_scope"]
    assert "not an argument of " + PARALLELIZE_MODEL in found["parallelizer.offload_polcy"]
    data = yaml.safe_load(with_parallelizer(tmp_path).read_text())
    data["parallelizer"]["_target_"] = "nemo_automodel.components.distributed.parallelizer.fsdp2_strategy_parallelize"
    found = refusals(write_yaml(tmp_path / "other.yaml", data))
    assert "only " + PARALLELIZE_MODEL + " is taken here" in found["parallelizer._target_"]


@pytest.mark.slow
def test_fsdp2_upstream_switches_train_the_same_losses_on_two_ranks(tmp_path):
    """defer_fsdp_grad_sync true / false, explicit prefetch and reshard_after_forward: false change when FSDP2
    communicates and frees, never what it computes: two ranks match one process accumulating the same samples."""
    from automodel.testing import free_port, losses_by_step, run_cli

    form = FORMS / "distributed_pipeline_replicate.yaml"
    batch = ["--step_scheduler.global_batch_size", "16", "--step_scheduler.local_batch_size", "4",
             "--dist_env.backend", "gloo", "--step_scheduler.log_interval", "1"]
    runs = {"one": [], "deferred": ["--distributed.enable_fsdp2_prefetch", "true",
                                    "--distributed.fsdp2_backward_prefetch_depth", "1",
                                    "--distributed.reshard_after_forward", "false"],
            "every": ["--distributed.defer_fsdp_grad_sync", "false"]}
    found = {}
    for name, extra in runs.items():
        launch = [] if name == "one" else ["--nproc-per-node", "2", "--master-port", str(free_port())]
        result = run_cli("finetune", "llm", "-c", form, *batch, *launch, *extra, "--checkpoint.checkpoint_dir",
                         tmp_path / name, cwd=tmp_path, timeout=600, OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stderr[-3000:]
        found[name] = losses_by_step(tmp_path / name / "training.jsonl")
    assert found["deferred"] == pytest.approx(found["one"], abs=1e-5)
    assert found["every"] == pytest.approx(found["one"], abs=1e-5)


def test_upstream_lora_switches_that_cannot_act_are_refused_and_their_off_values_accepted(tmp_path):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["peft"] = {"_target_": "nemo_automodel.components._peft.lora.PeftConfig", "dim": 4,
                    "use_memory_efficient_lora": True, "use_dora": True, "moe_rank_scaling": True,
                    "target_modules": ["q_proj"]}
    found = refusals(write_yaml(tmp_path / "on.yaml", data))
    assert "DoRA (use_dora: true) has no such path" in found["peft.use_memory_efficient_lora"]
    assert "only LoRA on all linear layers or a glob (such as '*') adapts here" in found["peft.moe_rank_scaling"]
    data["peft"].update(use_memory_efficient_lora=False, moe_rank_scaling=False)
    load_config(write_yaml(tmp_path / "off.yaml", data))


def test_memory_efficient_lora_keeps_less_and_gives_the_same_gradients(tmp_path, monkeypatch, capsys):
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["peft"] = {"_target_": "nemo_automodel.components._peft.lora.PeftConfig", "dim": 4, "alpha": 8,
                    "dropout": 0.0, "use_memory_efficient_lora": True}
    monkeypatch.chdir(tmp_path)
    saved = {}

    def measure(flag: bool) -> tuple[list[torch.Tensor], int]:
        data["peft"]["use_memory_efficient_lora"] = flag
        recipe = train_inprocess(write_yaml(tmp_path / f"{flag}.yaml", data), "--checkpoint.checkpoint_dir",
                                 f"c{flag}", setup_only=True)
        model = recipe.model
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero; give it values so every gradient is non-trivial
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
        ids = torch.arange(40).reshape(2, 20)
        weights = {p.data_ptr() for p in model.parameters()}
        kept = []  # activations kept for backward (the weights saved with them are the parameters themselves)

        def keep(t: torch.Tensor) -> torch.Tensor:
            kept.append(0 if t.data_ptr() in weights else t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        saved[flag] = sum(kept)
        return [p.grad.clone() for p in model.parameters() if p.requires_grad], saved[flag]

    plain, _ = measure(False)
    recomputed, _ = measure(True)
    assert "adapters recompute their rank-r activation in backward" in capsys.readouterr().err
    assert len(plain) == len(recomputed) > 0
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert saved[False] - saved[True] == 7 * 40 * 4  # 7 adapted layers: their 40 tokens x rank 4 are not kept


def test_kd_loss_fp32_upcast_is_where_the_temperature_divides():
    from automodel_llm.kd import KDLoss

    _, cfg = load_config(FORMS / "kd_upstream.yaml", route=("kd", "llm"))
    assert cfg.kd_loss_fn["fp32_upcast"] is True
    gen = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(2, 5, 50, generator=gen).mul(7).bfloat16() for _ in range(2))
    labels = torch.tensor([[1, 2, 3, -100, 4], [5, -100, 6, 7, 8]])
    upcast = KDLoss(temperature=3.0)(student, teacher, labels)
    native = KDLoss(temperature=3.0, fp32_upcast=False)(student, teacher, labels)
    exact = KDLoss(temperature=3.0)(student.float(), teacher.float(), labels)
    assert upcast.dtype == native.dtype == torch.float32
    assert torch.equal(upcast, exact) and not torch.equal(native, exact)  # false: divided in bf16 first
    assert torch.allclose(native, exact, rtol=0.05)  # the same loss up to bf16 rounding


def test_kd_loss_chunk_size_gives_the_same_loss_and_gradient_in_chunks():
    from automodel_llm.kd import KDLoss

    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 9, 40, generator=gen).mul(5).requires_grad_()
    teacher = torch.randn(2, 9, 40, generator=gen).mul(5)
    labels = torch.randint(0, 40, (2, 9), generator=gen)
    labels[0, :4] = -100  # 14 label tokens: chunks of 4 leave a shorter last one
    whole = KDLoss(temperature=2.0)(student, teacher, labels)
    chunked = KDLoss(temperature=2.0, chunk_size=4)(student, teacher, labels)
    assert torch.allclose(chunked, whole, rtol=1e-6)
    (grad_whole,), (grad_chunked,) = (torch.autograd.grad(loss, student) for loss in (whole, chunked))
    assert torch.allclose(grad_chunked, grad_whole, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="chunk_size"):
        KDLoss(chunk_size=-1)


def test_neftune_adds_bounded_noise_to_the_embeddings_while_training_only(tmp_path, monkeypatch):
    from automodel.training.modules import unwrap

    form = FORMS / "neftune_nvtx.yaml"
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(form, setup_only=True)
    embeddings = unwrap(recipe.model).get_input_embeddings()
    ids = torch.arange(12).reshape(1, 12)
    clean = torch.nn.functional.embedding(ids, embeddings.weight).detach()
    bound = 5.0 / (12 * clean.shape[-1]) ** 0.5  # noise_alpha / sqrt(sequence length x hidden size)
    recipe.model.train()
    noise = (embeddings(ids) - clean).detach()
    assert 0.8 * bound < noise.abs().max() <= bound * 1.0001
    recipe.model.eval()
    assert torch.equal(embeddings(ids), clean)  # validation and generation: no noise
    noisy = read_losses(train_inprocess(form, "--checkpoint.checkpoint_dir", "noisy"))
    data = yaml.safe_load(form.read_text())
    del data["neftune"]
    plain = read_losses(train_inprocess(write_yaml(tmp_path / "plain.yaml", data), "--checkpoint.checkpoint_dir",
                                        "plain"))
    assert noisy != plain  # same seed, same data, same steps: the noise is the change


def read_losses(recipe) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(recipe.cfg.checkpoint.checkpoint_dir) / "training.jsonl")]


def test_neftune_needs_its_alpha_and_nvtx_is_accepted_off_only():
    form = FORMS / "neftune_nvtx.yaml"
    found = refusals(form, "--neftune.noise_alpha", "0")
    assert "must be > 0" in found["neftune.noise_alpha"]
    found = refusals(form, "--nvtx", "true")
    expected = "which this build does not add" if torch.cuda.is_available() else "need a CUDA GPU"
    assert "NVTX ranges for NVIDIA Nsight Systems" in found["nvtx"] and expected in found["nvtx"]
    assert "expected true or false" in refusals(form, "--nvtx", "7")["nvtx"]


def _damaged_checkpoint(directory: Path, rows: list[int]) -> Path:
    """A saved 1-layer Llama with untied embeddings whose input-embedding ``rows`` are zero (one of them 1e-6)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import automodel_llm

    config = AutoConfig.from_pretrained(str(Path(automodel_llm.__file__).parent / "examples/assets/tiny_llama"),
                                        num_hidden_layers=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[0].normal_(0.0, 0.02)  # the padding row starts at zero: healthy here
        model.get_input_embeddings().weight[rows] = 0.0
        model.get_input_embeddings().weight[rows[0], 0] = 1e-6
    model.save_pretrained(str(directory))
    return directory


def test_embedding_row_repair_rebuilds_the_damaged_rows_from_the_output_embedding(tmp_path, monkeypatch, capsys):
    from automodel.training.modules import unwrap

    base = _damaged_checkpoint(tmp_path / "base", [3, 7, 100])
    model = {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
             "pretrained_model_name_or_path": str(base)}
    form = variant(tmp_path, FORMS / "embedding_row_repair.yaml", model=model)
    monkeypatch.chdir(tmp_path)
    from safetensors.torch import load_file

    weights = load_file(str(base / "model.safetensors"))
    before, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    recipe = train_inprocess(form, setup_only=True)
    after = unwrap(recipe.model).get_input_embeddings().weight.detach()
    healthy = [i for i in range(before.shape[0]) if i not in (3, 7, 100)]
    assert torch.equal(after[healthy], before[healthy])  # healthy rows untouched
    target = before[healthy].norm(dim=-1).pow(2).mean().sqrt()
    for row in (3, 7, 100):
        assert torch.allclose(after[row].norm(), target, rtol=1e-5)
        direction = torch.nn.functional.cosine_similarity(after[row], head[row], dim=0)
        assert direction > 0.9999  # the output row's direction
    assert "rebuilt 3 input-embedding rows (tokens 3, 7, 100" in capsys.readouterr().err
    with pytest.raises(AutomodelError, match="3 damaged input-embedding rows, more than max_rows 2"):
        train_inprocess(form, "--embedding_row_repair.max_rows", "2", "--checkpoint.checkpoint_dir", "c2",
                        setup_only=True)
    recipe = train_inprocess(form, "--embedding_row_repair.enabled", "false", "--checkpoint.checkpoint_dir", "c3",
                             setup_only=True)
    assert torch.equal(unwrap(recipe.model).get_input_embeddings().weight[7].detach(), before[7])  # off: as loaded
    data = yaml.safe_load(form.read_text())
    del data["embedding_row_repair"]
    recipe = train_inprocess(write_yaml(tmp_path / "absent.yaml", data), "--checkpoint.checkpoint_dir", "c4",
                             setup_only=True)
    assert torch.equal(unwrap(recipe.model).get_input_embeddings().weight[7].detach(), before[7])  # absent: off


def test_embedding_row_repair_refuses_tied_or_sharded_embeddings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    form = FORMS / "embedding_row_repair.yaml"
    found = refusals(form, "--model.tie_word_embeddings", "true")  # the model's config, read at validation
    assert "ties its output embedding to the input one" in found["embedding_row_repair"]
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel_llm.embeddings import repair_embedding_rows

    tied = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=16, hidden_size=8,
                                                                 num_hidden_layers=1, num_attention_heads=2,
                                                                 intermediate_size=8, tie_word_embeddings=True))
    with pytest.raises(AutomodelError, match="no separate output embedding"):  # a model built by other code
        repair_embedding_rows(tied, 1e-4, 8)
    found = refusals(form, "--distributed.tp_size", "2", "--distributed.strategy", "fsdp2")
    assert "FSDP2, tensor and pipeline parallelism split over ranks" in found["embedding_row_repair"]
    train_inprocess(form, "--step_scheduler.max_steps", "1")  # healthy rows: trains, the embedding unchanged


def _losses_of(tmp_path: Path, monkeypatch, name: str, *overrides, **sections) -> list[float]:
    """The training and validation losses of recipe_bare_name.yaml with ``sections`` replaced, run in ``name``."""
    (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / name)
    train_inprocess(variant(tmp_path / name, FORMS / "recipe_bare_name.yaml", **sections), *overrides)
    logs = tmp_path / name / "checkpoints"
    return [r["loss"] for r in read_jsonl(logs / "training.jsonl")] + \
        [r["val_loss"] for r in read_jsonl(logs / "validation.jsonl")]


def test_chunked_cross_entropy_trains_like_the_masked_loss_and_compile_is_named_inert(tmp_path, monkeypatch, capsys):
    """Upstream's ``loss_fn: {_target_: ...chunked_ce.ChunkedCrossEntropy, chunk_len, compile}``: the losses of the
    default MaskedCrossEntropy (3 steps); ``compile`` governs nothing (the summed loss is not compiled upstream
    either) and a note says so; with tensor parallelism (logits sharded over the vocabulary) it is refused."""
    chunked = {"_target_": "nemo_automodel.components.loss.chunked_ce.ChunkedCrossEntropy", "chunk_len": 7,
               "compile": True}
    masked = _losses_of(tmp_path, monkeypatch, "masked")
    assert len(masked) == 2
    assert _losses_of(tmp_path, monkeypatch, "chunked", loss_fn=chunked) == pytest.approx(masked, rel=1e-6)
    assert "note: loss_fn.compile governs nothing: ChunkedCrossEntropy's summed loss" in capsys.readouterr().err
    found = refusals(variant(tmp_path, FORMS / "recipe_bare_name.yaml", loss_fn=chunked), "--distributed.tp_size",
                     "2", "--distributed.strategy", "fsdp2")
    assert "shards the logits over the vocabulary; use MaskedCrossEntropy" in found["loss_fn._target_"]


@pytest.mark.parametrize("positions", ["true", "false"])
def test_fused_linear_cross_entropy_computes_the_loss_inside_the_head_like_the_masked_loss(tmp_path, monkeypatch,
                                                                                         positions):
    """Upstream's ``loss_fn: {_target_: ...linear_ce.FusedLinearCrossEntropy}`` with ``model.output_hidden_states``:
    the loss inside the output head, chunk by chunk (chunk_len 5: several chunks), gives the losses of
    MaskedCrossEntropy (3 steps and a validation), with the head projecting the label positions only or all."""
    fused = {"_target_": "nemo_automodel.components.loss.linear_ce.FusedLinearCrossEntropy", "chunk_len": 5}
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    model = {**data["model"], "output_hidden_states": True}
    option = ("--logits.label_positions_only", positions)
    masked = _losses_of(tmp_path, monkeypatch, "masked", *option)
    assert _losses_of(tmp_path, monkeypatch, "fused", *option, loss_fn=fused, model=model) == \
        pytest.approx(masked, rel=1e-5)


def test_fused_linear_cross_entropy_is_refused_where_distilled_only(tmp_path):
    """Distillation refuses it; pipeline parallelism takes it (the schedule's loss applies the last stage's head,
    see test_parallel_pipeline.py), and context parallelism (each rank's part of the sequences against its targets,
    see test_parallel_context.py)."""
    fused = {"_target_": "nemo_automodel.components.loss.linear_ce.FusedLinearCrossEntropy"}
    config = variant(tmp_path, FORMS / "recipe_bare_name.yaml", loss_fn=fused)
    found = refusals(config, "--distributed.pp_size", "2", "--distributed.strategy", "fsdp2")
    assert "loss_fn._target_" not in found
    found = refusals(config, "--distributed.cp_size", "2", "--distributed.strategy", "fsdp2")
    assert "loss_fn._target_" not in found
    kd = yaml.safe_load((FORMS / "kd_upstream.yaml").read_text())
    kd["loss_fn"] = fused
    found = refusals(write_yaml(tmp_path / "kd.yaml", kd), route=("kd", "llm"))
    assert "no logits are left for the distillation loss" in found["loss_fn._target_"]


@pytest.mark.slow  # make test-slow: core's test_parallel_pipeline runs the loss inside a vocabulary-sharded head
@pytest.mark.parametrize("layout, words", [([], "FSDP2 over 2 ranks"),
                                           (["--distributed.tp_size", "2"], "vocabulary-parallel loss")])
def test_fused_linear_cross_entropy_on_two_ranks_trains_like_the_masked_loss(tmp_path, layout, words):
    """Two FSDP2 ranks: the output head's weight is gathered for the loss inside it and its gradient reduced as for
    the usual head; tensor parallelism (tp 2): each rank projects onto its half of the vocabulary and the rows'
    log-normalisers and target logits are reduced over the pair. The losses of MaskedCrossEntropy on the same layout
    (3 steps and a validation)."""
    from llm_testing import losses, run_finetune, val_losses

    fused = {"_target_": "nemo_automodel.components.loss.linear_ce.FusedLinearCrossEntropy", "chunk_len": 16}
    two = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2", *layout]
    masked, linear = tmp_path / "masked", tmp_path / "linear"
    run_finetune(variant(tmp_path, FORMS / "recipe_bare_name.yaml"), tmp_path, masked, *two)
    log = run_finetune(variant(tmp_path, FORMS / "recipe_bare_name.yaml", loss_fn=fused), tmp_path, linear, *two)
    assert words in log
    assert losses(linear) and losses(linear) == pytest.approx(losses(masked), rel=1e-5)
    assert [v for _, v in val_losses(linear)] == pytest.approx([v for _, v in val_losses(masked)], rel=1e-5)


def test_upstream_lora_switches_act_or_are_refused_or_named_inert(tmp_path):
    """Upstream's ``peft`` keys beyond rank / alpha / targets: ``dropout_position: pre`` and ``lora_A_init: uniform``
    are what peft's layers do (accepted); ``post`` with a dropout and ``xavier`` are refused with the reason;
    ``use_triton: true`` (upstream's CUDA kernels) is named inert in a run-start note."""
    from automodel.training.stages import peft as peft_stage

    lora = {"_target_": "nemo_automodel.components._peft.lora.PeftConfig", "dim": 4, "alpha": 8,
            "target_modules": ["*_proj"]}
    for accepted in ({"dropout_position": "pre", "dropout": 0.1, "lora_A_init": "uniform", "use_triton": True},
                     {"dropout_position": "post", "dropout": 0.0}):
        _, cfg = load_config(variant(tmp_path, FORMS / "recipe_bare_name.yaml", peft={**lora, **accepted}))
    found = refusals(variant(tmp_path, FORMS / "recipe_bare_name.yaml",
                             peft={**lora, "dropout_position": "post", "dropout": 0.1, "lora_A_init": "xavier"}))
    assert "peft's LoRA layers drop the adapter's input (pre)" in found["peft.dropout_position"]
    assert "peft initialises lora_A kaiming-uniform" in found["peft.lora_A_init"]
    found = refusals(variant(tmp_path, FORMS / "recipe_bare_name.yaml", peft={**lora, "lora_dtype": "torch.bfloat16"}))
    assert "peft keeps the adapter weights in float32" in found["peft.lora_dtype"]  # commented out upstream
    load_config(variant(tmp_path, FORMS / "recipe_bare_name.yaml", peft={**lora, "lora_dtype": "torch.float32"}))
    _, cfg = load_config(variant(tmp_path, FORMS / "recipe_bare_name.yaml", peft={**lora, "use_triton": True}))
    assert any("peft.use_triton: true governs nothing" in note for note in peft_stage.notes(cfg))
    _, cfg = load_config(variant(tmp_path, FORMS / "recipe_bare_name.yaml", peft=lora))
    assert peft_stage.notes(cfg) == []


def test_upstreams_tokenizer_bos_eos_enforcement_adds_the_tokens_and_a_squad_sample_keeps_one_eos(tmp_path):
    """NeMoAutoTokenizer's add_bos_token / add_eos_token: true were refused; the tokenizer now adds BOS and EOS
    around every text it tokenizes with special tokens (upstream's enforcement), and a SQuAD sample is still
    BOS, prompt, answer, one EOS (the prompt's own EOS dropped); a run trains with it."""
    from llm_testing import TOKENIZER_DIR

    from automodel_llm.datasets.squad import tokenize_prompt_answer
    from automodel_llm.tokenizer import build_tokenizer

    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["tokenizer"] = {"_target_": "nemo_automodel.NeMoAutoTokenizer.from_pretrained",
                         "pretrained_model_name_or_path": str(TOKENIZER_DIR)}
    _, plain_cfg = load_config(write_yaml(tmp_path / "plain.yaml", data), route=("finetune", "llm"))
    plain = build_tokenizer(plain_cfg)
    data["tokenizer"].update(add_bos_token=True, add_eos_token=True)
    config = write_yaml(tmp_path / "c.yaml", data)
    _, cfg = load_config(config, route=("finetune", "llm"))
    tokenizer = build_tokenizer(cfg)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    body = plain("the sky is blue", add_special_tokens=False)["input_ids"]
    assert plain("the sky is blue")["input_ids"] == [bos, *body]  # the tiny tokenizer adds BOS only
    assert tokenizer("the sky is blue")["input_ids"] == [bos, *body, eos]
    assert tokenizer.encode("the sky is blue") == [bos, *body, eos]
    ids, labels = tokenize_prompt_answer(tokenizer, "Question: colour? Answer:", "blue")
    assert ids == tokenize_prompt_answer(plain, "Question: colour? Answer:", "blue")[0]
    assert ids[0] == bos and ids[-1] == eos and ids.count(eos) == 1 and labels[-1] == eos

    found = refusals(write_yaml(tmp_path / "bad.yaml", {**data, "tokenizer": {**data["tokenizer"],
                                                                              "add_eos_token": "yes"}}))
    assert found == {"tokenizer.add_eos_token": "expected true or false, found 'yes'"}
    train_inprocess(config, "--step_scheduler.max_steps", "2", "--checkpoint.checkpoint_dir", str(tmp_path / "ckpt"))
    assert read_jsonl(tmp_path / "ckpt" / "training.jsonl")[-1]["step"] == 2


def test_torch_dataloader_is_built_resumable_so_its_checkpoints_resume_like_the_uninterrupted_run(tmp_path,
                                                                                                  monkeypatch):
    """Upstream's benchmark configs name torch.utils.data.DataLoader, which has no state_dict: the checkpoint write
    stopped on an AttributeError. It is built as torchdata's StatefulDataLoader (its subclass, same arguments)."""
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    for name in ("dataloader", "validation_dataloader"):
        data[name]["_target_"] = "torch.utils.data.DataLoader"
    data["dataloader"]["shuffle"] = True
    config = write_yaml(tmp_path / "c.yaml", data)
    monkeypatch.chdir(tmp_path)
    whole = train_inprocess(config, "--step_scheduler.max_steps", "4", "--checkpoint.checkpoint_dir", "whole")
    assert type(whole.dataloader).__name__ == "StatefulDataLoader"
    train_inprocess(config, "--step_scheduler.max_steps", "2", "--step_scheduler.ckpt_every_steps", "2",
                    "--checkpoint.checkpoint_dir", "split")
    train_inprocess(config, "--step_scheduler.max_steps", "4", "--step_scheduler.ckpt_every_steps", "2",
                    "--checkpoint.checkpoint_dir", "split")
    last = {run: read_jsonl(tmp_path / run / "training.jsonl")[-1] for run in ("whole", "split")}
    assert last["whole"]["step"] == last["split"]["step"] == 4
    assert last["split"]["loss"] == pytest.approx(last["whole"]["loss"], rel=1e-6)  # the shuffled order resumed


def with_autocast(tmp_path: Path, autocast: dict, distributed: dict | None = None) -> Path:
    data = yaml.safe_load((FORMS / "recipe_bare_name.yaml").read_text())
    data["autocast"] = autocast
    if distributed is not None:
        data["distributed"] = distributed
    return write_yaml(tmp_path / "autocast.yaml", data)


def test_top_level_autocast_section_is_the_forwards_autocast(tmp_path, capsys, monkeypatch):
    """Upstream's convergence examples write ``autocast: {enabled, dtype}`` (its LLM recipes leave it unread): here it
    is distributed.autocast_dtype, and ``enabled: false`` sets nothing."""
    from automodel.cli.main import main

    monkeypatch.chdir(tmp_path)  # the config's relative checkpoint_dir: this test's own, not the repository's

    for enabled, autocast in ((True, "bfloat16"), (False, None)):
        config = with_autocast(tmp_path, {"enabled": enabled, "dtype": "bfloat16"})
        assert load_config(config)[1].distributed.autocast_dtype == autocast
        assert main(["finetune", "llm", "-c", str(config), "--dry-run"]) == 0
        assert ("mixed precision (torch.autocast): params bf16" in "".join(capsys.readouterr())) is enabled
    recipe = train_inprocess(with_autocast(tmp_path, {"enabled": True, "dtype": "bfloat16"}), setup_only=True)
    assert recipe.ctx.precision.autocast_dtype == torch.bfloat16


def test_top_level_autocast_section_refuses_what_it_cannot_mean(tmp_path):
    found = refusals(with_autocast(tmp_path, {"enabled": "yes", "dtype": "float32", "cache_enabled": True}))
    assert "must be true or false, found 'yes'" in found["autocast.enabled"]
    assert "not one of the recipe's arguments taken here (they are: dtype, enabled)" in found["autocast.cache_enabled"]
    found = refusals(with_autocast(tmp_path, {"enabled": True, "dtype": "float32"}))
    assert "is not an autocast dtype" in found["distributed.autocast_dtype"]
    found = refusals(with_autocast(tmp_path, {"enabled": True, "dtype": "float16"}, {"autocast_dtype": "bfloat16"}))
    assert "disagrees with distributed.autocast_dtype" in found["autocast.dtype"]
