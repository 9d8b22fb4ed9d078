"""``distributed.*`` at validation and in ``--dry-run``: the device mesh checked against the launch's world size
(--nproc-per-node x --nnodes, else WORLD_SIZE, else 1 for a run and the layout's own size for validate), the
precision, what is refused and why; and how the CLI turns launch options into a torchrun command line. All
in-process on the toy recipe (nothing is launched)."""

from __future__ import annotations

import sys

import pytest

from automodel.cli.launch import needs_torchrun, planned_world, strip_launch_options, torchrun_command
from automodel.cli.main import main


def _cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_bare_validate_checks_the_layouts_own_size_and_says_so(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out = _cli(capsys, "validate", "-c", make_toy())
    assert code == 0 and "checked for 1 process: the layout's own size, as neither --nproc-per-node" in out
    config = make_toy(distributed={"strategy": "fsdp2", "dp_size": 4, "dp_replicate_size": 2})
    code, out = _cli(capsys, "validate", "-c", config)
    assert code == 0, out
    assert "checked for 4 processes: the layout's own size" in out and "launch with --nproc-per-node 4" in out
    code, out = _cli(capsys, "validate", "-c", config, "--distributed.dp_size", "auto")
    assert code == 0 and "checked for 2 processes" in out  # HSDP's 2 replicas of 1 shard: the fewest ranks
    # a launch given keeps the check against it: the same config for 2 or 3 processes is refused
    code, out = _cli(capsys, "validate", "-c", config, "--nproc-per-node", "2")
    assert code == 2 and "the run has 2" in out
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, out = _cli(capsys, "validate", "-c", config)
    assert code == 2 and "the run has 3" in out
    monkeypatch.delenv("WORLD_SIZE")
    code, out = _cli(capsys, "run", "-c", config, "--dry-run")  # a run in this one process
    assert code == 2 and "the run has 1" in out
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, out = _cli(capsys, "validate", "-c", make_toy(distributed={"dp_size": 4}))
    assert code == 0 and "checked for 4 processes: WORLD_SIZE=4" in out


def test_dp_size_is_checked_against_the_launch(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_toy(distributed={"strategy": "fsdp2", "dp_size": 3})
    code, out = _cli(capsys, "validate", "-c", config, "--nproc-per-node", "2")
    assert code == 2 and "distributed.dp_size" in out and "the run has 2" in out
    code, out = _cli(capsys, "validate", "-c", config, "--nproc-per-node", "1", "--nnodes", "3")
    assert code == 0 and "checked for 3 processes: --nproc-per-node 1 x --nnodes 3" in out
    code, out = _cli(capsys, "run", "-c", config, "--nproc-per-node", "4", "--dry-run")
    assert code == 2 and "distributed.dp_size" in out


def test_dry_run_prints_the_hsdp_mesh_and_the_precision(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_toy(distributed={"strategy": "fsdp2", "dp_replicate_size": 2,
                                   "mp_policy": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
                      step_scheduler={"global_batch_size": 32})
    code, out = _cli(capsys, "run", "-c", config, "--nproc-per-node", "2", "--nnodes", "2", "--dry-run")
    assert code == 0, out
    assert "world size: 4 (--nproc-per-node 2 x --nnodes 2)" in out
    assert "pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 1 = 4 ranks" in out and "HSDP shards over 2" in out
    assert "rank 3: pp 0, dp_replicate 1, dp_shard 1, cp 0, tp 0 (dp 3)" in out
    assert "batch: 4 per micro-batch x 4 ranks x 2 accumulation = 32 samples per step" in out
    assert "mixed precision (FSDP2 MixedPrecisionPolicy): params bf16" in out
    assert "pipeline sharding: fsdp2" in out


@pytest.mark.parametrize(("distributed", "key", "fragment"), [
    ({"strategy": "ddp", "tp_size": 2}, "distributed.strategy", "ddp: tensor parallelism (tp_size 2) composes with "
                                                                "FSDP2"),
    ({"strategy": "fsdp2", "tp_size": 2}, "distributed.tp_size", "needs a Hugging Face model"),
    ({"strategy": "fsdp2", "tp_size": 2}, "distributed.tp_size", "not set up for tensor parallelism"),
    ({"strategy": "ddp", "pp_size": 2}, "distributed.strategy", "ddp: pipeline parallelism (pp_size 2) composes with "
                                                                "FSDP2"),
    ({"strategy": "fsdp2", "pp_size": 2}, "distributed.pp_size", "not set up for pipeline parallelism"),
    ({"sequence_parallel": True}, "distributed.sequence_parallel", "needs tensor parallelism"),
    ({"ep_size": 2}, "distributed.ep_size", "expert parallelism"),
    ({"strategy": "ddp", "dp_replicate_size": 2}, "distributed.dp_replicate_size", "needs distributed.strategy: fsdp2"),
    ({"mp_policy": {"param_dtype": "int8"}}, "distributed.mp_policy.param_dtype", "not a training dtype"),
    ({"mp_policy": {"param_dtype": "bf16", "reduce_dtype": "bf16"}}, "distributed.mp_policy.reduce_dtype",
     "needs distributed.strategy: fsdp2"),
    ({"autocast_dtype": "fp32"}, "distributed.autocast_dtype", "not an autocast dtype"),
    ({"mp_policy": {"param_dtype": "bf16"}, "autocast_dtype": "fp16"}, "distributed.autocast_dtype", "disagrees"),
    ({"activation_checkpointing": "partial"}, "distributed.activation_checkpointing",
     "expected bool | 'full' | 'selective'"),
])
def test_what_cannot_act_is_refused_with_its_reason(make_toy, capsys, monkeypatch, distributed, key, fragment):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out = _cli(capsys, "validate", "-c", make_toy(distributed=distributed), "--nproc-per-node", "2")
    assert code == 2, out
    assert key in out and fragment in out, out


def test_an_unset_strategy_is_ddp_or_fsdp2_where_model_parallelism_needs_it():
    from automodel.training.distributed_section import DistributedConfig

    assert DistributedConfig().strategy == "ddp" and DistributedConfig(dp_size=4).strategy == "ddp"
    for size in ("tp_size", "pp_size", "cp_size", "ep_size"):
        assert DistributedConfig(**{size: 2}).strategy == "fsdp2", size
    assert DistributedConfig(strategy="ddp", tp_size=2).strategy == "ddp"  # given: kept (and refused at validation)


def test_upstream_mixed_precision_policy_target_is_absorbed(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    policy = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy", "param_dtype": "bfloat16",
              "reduce_dtype": "float32", "output_dtype": "float32", "cast_forward_inputs": True}
    config = make_toy(distributed={"strategy": "fsdp2", "mp_policy": policy, "autocast_dtype": "bfloat16"})
    code, out = _cli(capsys, "run", "-c", config, "--nproc-per-node", "2", "--dry-run")
    assert code == 0, out
    assert "FSDP2 MixedPrecisionPolicy + torch.autocast bf16): params bf16 (stored fp32), reduce fp32, output fp32" \
        in out


def test_single_process_bf16_autocast_runs_and_says_so(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_toy(distributed={"mp_policy": {"param_dtype": "bf16"}}, step_scheduler={"max_steps": 2})
    code, out = _cli(capsys, "run", "-c", config)
    assert code == 0, out
    assert "mixed precision (torch.autocast): params bf16 (stored fp32), reduce fp32, output bf16, loss fp32" in out


# ---- launching ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("launch", "relaunch"), [
    ({"nproc_per_node": 1}, False), ({}, False), ({"nproc_per_node": 2}, True), ({"nnodes": 2}, True),
    ({"nproc_per_node": 1, "node_rank": 0}, True), ({"master_addr": "10.0.0.1"}, True), ({"master_port": 1234}, True),
    ({"rdzv_endpoint": "host:29400"}, True),
])
def test_every_node_or_rendezvous_option_means_torchrun(launch, relaunch):
    assert needs_torchrun(launch) is relaunch


def test_two_nodes_of_one_process_each_get_a_real_torchrun_command():
    argv = ["finetune", "llm", "-c", "x.yaml", "--nnodes", "2", "--node-rank=1", "--nproc-per-node", "1",
            "--master-addr", "10.1.2.3", "--master-port", "4567", "--optimizer.lr", "1e-3"]
    launch = {"nproc_per_node": 1, "nnodes": 2, "node_rank": 1, "master_addr": "10.1.2.3", "master_port": 4567}
    command = torchrun_command(launch, argv)
    assert command[:3] == [sys.executable, "-m", "automodel.cli.torchrun"]  # torch.distributed.run's main
    assert command[3:8] == ["--nproc-per-node=1", "--nnodes=2", "--node-rank=1", "--master-addr=10.1.2.3",
                            "--master-port=4567"]
    assert command[8:] == ["-m", "automodel.cli.main", "finetune", "llm", "-c", "x.yaml", "--optimizer.lr", "1e-3"]
    assert planned_world(launch) == (2, "--nproc-per-node 1 x --nnodes 2")


def test_dist_env_gives_the_rendezvous_address_when_the_flags_are_absent():
    command = torchrun_command({"nproc_per_node": 2}, ["run", "-c", "x.yaml"], "10.9.8.7", 31337)
    assert "--master-addr=10.9.8.7" in command and "--master-port=31337" in command
    flags = torchrun_command({"nproc_per_node": 2, "master_port": 2222}, [], "10.9.8.7", 31337)
    assert "--master-port=2222" in flags and "--master-addr=10.9.8.7" in flags


def test_rendezvous_options_pass_through_and_are_stripped_for_the_ranks():
    argv = ["run", "-c", "x.yaml", "--rdzv-backend", "c10d", "--rdzv-endpoint=h:29400", "--rdzv-id", "job7"]
    launch = {"nproc_per_node": 2, "nnodes": 2, "rdzv_backend": "c10d", "rdzv_endpoint": "h:29400",
              "rdzv_id": "job7"}
    command = torchrun_command(launch, argv)
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--rdzv-id=job7"} <= set(command)
    assert strip_launch_options(argv) == ["run", "-c", "x.yaml"]


def test_fp16_trains_with_a_grad_scaler_unscaled_before_clipping(make_toy, tmp_path, capsys, monkeypatch):
    """A step whose fp16 gradients overflow is skipped and halves the scale (and is counted); the logged gradient
    norm is the true one: the scaler unscales before clipping."""
    import math

    import torch

    from automodel.testing import ToyRecipe, read_jsonl, train_inprocess

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plain = train_inprocess(make_toy(checkpoint={"checkpoint_dir": str(tmp_path / "fp32")}), recipe=ToyRecipe)
    recipe = train_inprocess(make_toy(distributed={"mp_policy": {"param_dtype": "fp16"}}, clip_grad_norm={
        "max_norm": 1.0}), recipe=ToyRecipe)
    assert plain.grad_scaler is None and isinstance(recipe.grad_scaler, torch.amp.GradScaler)
    rows = read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    reference = read_jsonl(tmp_path / "fp32" / "training.jsonl")
    skipped = rows[-1]["skipped_steps"]
    overflowed = capsys.readouterr().err.count("fp16 gradients overflowed")
    assert overflowed == skipped and recipe.grad_scaler.get_scale() == 65536.0 * 0.5 ** skipped
    assert all(math.isfinite(row["loss"]) for row in rows)
    first = next(row for row in rows if row["grad_norm"] is not None)  # an overflowed step logs none
    assert first["grad_norm"] == pytest.approx(reference[first["step"] - 1]["grad_norm"], rel=0.5)


@pytest.mark.parametrize(("sizes", "nodes", "world"), [
    ({}, 1, 1),
    ({"tp_size": 2, "cp_size": 2, "pp_size": 2}, 1, 8),
    ({"dp_size": 3, "tp_size": 2}, 1, 6),  # a fixed dp_size: exactly the product
    ({"dp_size": "none", "dp_replicate_size": 2, "tp_size": 2}, 1, 4),
    ({"ep_size": 8, "tp_size": 2}, 1, 8),  # experts over dp x cp x tp: dp 4
    ({"ep_size": 8, "cp_size": 2, "pp_size": 4}, 1, 32),  # dp 4 x cp 2 = 8 expert ranks, per pipeline stage
    ({"ep_size": 6, "dp_replicate_size": 4}, 1, 12),  # dp a multiple of 4 that 6 divides
    ({"tp_size": 8}, 16, 16),  # over 16 nodes: one each
    ({"tp_size": 8, "ep_size": 32}, 16, 32),
    ({"tp_size": 4, "dp_size": "auto"}, 2, 4),
    ({"tp_size": "x", "ep_size": None}, 1, 1),  # malformed: validation reports it, the size counts 1
])
def test_smallest_world_is_the_fewest_ranks_the_layout_needs(sizes, nodes, world):
    from automodel.training.parallel.mesh import mesh_issues, smallest_world

    found = smallest_world(**sizes, nodes=nodes)
    assert found == world
    valid = {k: v for k, v in sizes.items() if k != "ep_size" and not isinstance(v, str) or v in ("auto", "none")}
    assert not mesh_issues(found, **valid)  # the layout fits the world it was sized for


def test_dp_replicate_size_none_is_upstreams_spelling_of_one(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_toy(distributed={"strategy": "fsdp2", "dp_size": "none", "dp_replicate_size": "none"})
    code, out = _cli(capsys, "run", "-c", config, "--nproc-per-node", "2", "--dry-run")
    assert code == 0 and "dp_replicate 1 x dp_shard 2" in out and "(FSDP shards over 2)" in out
    code, out = _cli(capsys, "validate", "-c", config, "--distributed.dp_replicate_size", "nine")
    assert code == 2 and "distributed.dp_replicate_size" in out


def test_a_refused_distributed_section_does_not_add_batch_arithmetic_errors(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_toy(distributed={"strategy": "fsdp2", "dp_size": 4, "multimodal": {"frozen_sharding": True}},
                      step_scheduler={"global_batch_size": 1})
    code, out = _cli(capsys, "validate", "-c", config)
    assert code == 2 and "distributed.multimodal" in out
    assert "global_batch_size" not in out  # dp is unknown while the section is refused: no second, bogus error
    code, out = _cli(capsys, "validate", "-c", config, "--distributed.multimodal", "null")
    assert code == 2 and "step_scheduler.global_batch_size: 1 is not divisible" in out


def test_multimodal_is_refused_by_a_recipe_whose_models_have_no_towers(make_toy, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_toy(distributed={"strategy": "fsdp2", "multimodal": {"frozen_sharding": "replicate"}})
    code, out = _cli(capsys, "validate", "-c", config, "--nproc-per-node", "2")
    assert code == 2 and "distributed.multimodal: this recipe's models have no vision / audio towers" in out
