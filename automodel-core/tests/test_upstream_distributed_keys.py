"""Upstream's FSDP2 switches that act here: ``distributed.defer_fsdp_grad_sync`` (the gradient reduce-scatter after
a step's last micro-batch only), ``model.backend.enable_fsdp_optimizations`` (no resharding between micro-batches
either) and ``enable_fsdp2_prefetch`` with its depths (explicit prefetch between blocks); DDP's own options
(``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ``gradient_as_bucket_view``,
``broadcast_buffers``); upstream's keys that choose nothing here, accepted at the value that is what happens and
refused otherwise with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from automodel.config import ConfigError
from automodel.testing import free_port, load_config, train_inprocess
from automodel.testing.toy import ToyRecipe
from automodel.training.distributed_section import DistributedConfig
from automodel.training.loop import TrainingLoop
from automodel.training.parallel.fsdp import set_prefetch


@pytest.fixture
def sharded_blocks():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def _reduces(model: torch.nn.Module) -> list[bool]:
    return [m._get_fsdp_state()._fsdp_param_group.reduce_grads for m in model]


@pytest.mark.parametrize("defer, expected", [(True, [False, True]), (False, [True, True])])
def test_defer_fsdp_grad_sync_reduces_after_the_last_micro_batch_only(sharded_blocks, defer, expected):
    loop = SimpleNamespace(cfg=SimpleNamespace(distributed=DistributedConfig(defer_fsdp_grad_sync=defer),
                                               model=None), model=sharded_blocks)
    seen = []
    for last in (False, True):
        TrainingLoop.prepare_micro_batch(loop, last=last)
        seen.append(all(_reduces(sharded_blocks)))
        assert len(set(_reduces(sharded_blocks))) == 1  # every unit alike
    assert seen == expected


@pytest.mark.parametrize("backend, expected", [({"enable_fsdp_optimizations": True}, [False, True]),
                                               ({"enable_fsdp_optimizations": False}, [True, True]),
                                               (None, [True, True])])
@pytest.mark.parametrize("defer", [True, False])
def test_enable_fsdp_optimizations_keeps_parameters_gathered_until_the_last_micro_batch(sharded_blocks, backend,
                                                                                       expected, defer):
    """upstream's model.backend.enable_fsdp_optimizations: no resharding after a micro-batch's backward (and no
    gradient sync, whatever defer_fsdp_grad_sync says, as upstream's models with it) but the step's last one."""
    model_section = {"_target_": "automodel_llm.AutoModelForCausalLM.from_config", "backend": backend}
    loop = SimpleNamespace(cfg=SimpleNamespace(distributed=DistributedConfig(defer_fsdp_grad_sync=defer),
                                               model=model_section), model=sharded_blocks)
    seen = []
    for last in (False, True):
        TrainingLoop.prepare_micro_batch(loop, last=last)
        reshards = [m._get_fsdp_state()._fsdp_param_group.reshard_after_backward for m in sharded_blocks]
        optimized = bool(backend and backend["enable_fsdp_optimizations"])
        assert len(set(reshards)) == 1 and all(_reduces(sharded_blocks)) == (last or not (defer or optimized))
        seen.append(reshards[0])
    assert seen == expected


@pytest.mark.parametrize("defer, fsdp2, noted", [(False, True, True), (True, True, False), (False, False, False)])
def test_defer_false_beside_enable_fsdp_optimizations_is_named_in_a_note(defer, fsdp2, noted):
    from automodel.training.inert_notes import inert_distributed_notes

    cfg = SimpleNamespace(model={"backend": {"enable_fsdp_optimizations": True}},
                          distributed=DistributedConfig(defer_fsdp_grad_sync=defer))
    notes = inert_distributed_notes(cfg, fsdp2=fsdp2)
    assert any("false governs nothing this run: model.backend.enable_fsdp_optimizations" in note
               for note in notes) is noted


def test_explicit_prefetch_orders_the_gathers_by_depth(sharded_blocks):
    blocks = list(sharded_blocks)
    set_prefetch(blocks, forward_depth=2, backward_depth=1)
    states = [b._get_fsdp_state() for b in blocks]
    assert [s._states_to_forward_prefetch for s in states] == [states[1:3], states[2:4], states[3:4], []]
    assert [s._states_to_backward_prefetch for s in states] == [[], [states[0]], [states[1]], [states[2]]]


def test_prefetch_depths_and_upstream_sections_validate():
    with pytest.raises(ValueError, match="enable_fsdp2_prefetch: true"):
        DistributedConfig(fsdp2_backward_prefetch_depth=3)
    settings = DistributedConfig(enable_fsdp2_prefetch=True, fsdp2_backward_prefetch_depth=3,
                                 pipeline={"pp_schedule": "1f1b"}, moe={"reshard_after_forward": False})
    assert settings.defer_fsdp_grad_sync  # upstream's default


@pytest.mark.parametrize("setting, expected", [(None, [True, True, False]), (True, [True, True, True]),
                                               (False, [False, False, False])])
def test_reshard_after_forward_chooses_which_blocks_free_their_parameters(setting, expected):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from automodel.testing import free_port
    from automodel.training.parallel.fsdp import apply_fsdp2

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = Blocks()
        apply_fsdp2(model, init_device_mesh("cpu", (1,)), reshard_after_forward=setting)
        groups = [block._get_fsdp_state()._fsdp_param_group for block in model.layers]
        assert [g.post_forward_mesh_info is not None for g in groups] == expected
    finally:
        dist.destroy_process_group()


def test_ddp_options_reach_distributed_data_parallel():
    import torch.distributed as dist

    from automodel.training.stages.sharding import wrap_ddp

    def wrap(settings: DistributedConfig) -> tuple[torch.nn.Module, str]:
        ctx = SimpleNamespace(device=torch.device("cpu"), device_mesh=None, mesh=SimpleNamespace(dp=1),
                              cfg=SimpleNamespace(distributed=settings))
        return wrap_ddp(ctx, torch.nn.Linear(4, 4))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        given, described = wrap(DistributedConfig(find_unused_parameters=True, bucket_cap_mb=4.0,
                                                  gradient_as_bucket_view=True))
        assert given.find_unused_parameters and given.gradient_as_bucket_view and not given.static_graph
        assert given.bucket_bytes_cap == 4 * 1024 * 1024
        assert described == ("DDP over 1 ranks (find_unused_parameters=True, bucket_cap_mb=4.0, "
                             "gradient_as_bucket_view=True)")
        static, _ = wrap(DistributedConfig(static_graph=True))
        assert static.static_graph
        quiet, described = wrap(DistributedConfig(broadcast_buffers=False))  # upstream's default
        assert not quiet.broadcast_buffers and described == "DDP over 1 ranks (broadcast_buffers=False)"
        default, described = wrap(DistributedConfig())
        assert not (default.find_unused_parameters or default.gradient_as_bucket_view or default.static_graph)
        assert default.broadcast_buffers  # torch's default
        assert default.bucket_bytes_cap == 25 * 1024 * 1024 and described == "DDP over 1 ranks"
    finally:
        dist.destroy_process_group()


def test_ddp_options_without_ddp_are_refused_or_noted(make_toy, capsys):
    with pytest.raises(ConfigError) as refused:
        load_config(make_toy(distributed={"strategy": "fsdp2", "static_graph": True, "bucket_cap_mb": 400}),
                    recipe=ToyRecipe)
    for name, value in (("static_graph", "true"), ("bucket_cap_mb", "400.0")):
        assert (f"distributed.{name}: {value} is an option of torch's DistributedDataParallel (strategy ddp); "
                "strategy fsdp2 does not run DDP") in str(refused.value)
    with pytest.raises(ConfigError, match="bucket_cap_mb: must be > 0"):
        load_config(make_toy(distributed={"bucket_cap_mb": 0}), recipe=ToyRecipe)
    train_inprocess(make_toy(distributed={"strategy": "ddp", "find_unused_parameters": True}), recipe=ToyRecipe,
                    setup_only=True)
    assert ("note: distributed.find_unused_parameters: true governs nothing this run: it is an option of DDP, "
            "which runs with more than one process") in capsys.readouterr().err


@pytest.mark.parametrize("key, value, needle", [
    ("tp_plan", {"model.layers.*.mlp.up_proj": "colwise"}, "TP_PLANS.register"),
    ("activation_checkpointing_scope", "vision", "not chosen by scope"),
    ("zero_dp_strategy", 3, "upstream's Megatron-FSDP (strategy megatron_fsdp)"),
])
def test_upstreams_keys_that_choose_nothing_here_are_refused_unless_null(make_toy, key, value, needle):
    """Never "unknown key" for a key of upstream's FSDP2Config / MegatronFSDPConfig (null, its default, is valid)."""
    with pytest.raises(ConfigError) as refused:
        load_config(make_toy(distributed={key: value}), recipe=ToyRecipe)
    assert f"distributed.{key}: {value!r}: " in str(refused.value) and needle in str(refused.value)
    load_config(make_toy(distributed={key: None}), recipe=ToyRecipe)


def test_cpu_offload_takes_upstreams_form_and_needs_fsdp2_alone_on_several_ranks(make_toy, monkeypatch):
    """``distributed.offload_policy`` acts: two ranks with and without it train alike (test_distributed.py in
    automodel-llm); here the forms and layouts it is refused with."""
    def refusal(**distributed):
        with pytest.raises(ConfigError) as refused:
            load_config(make_toy(distributed=distributed), recipe=ToyRecipe)
        return str(refused.value)

    upstream = {"_target_": "torch.distributed.fsdp.CPUOffloadPolicy"}
    assert "distributed.offload_policy: offloads FSDP2's parameter shards, so it needs distributed.strategy: fsdp2 " \
           "and more than one process" in refusal(strategy="fsdp2", offload_policy=upstream)
    monkeypatch.setenv("WORLD_SIZE", "2")
    load_config(make_toy(distributed={"strategy": "fsdp2", "offload_policy": {**upstream, "pin_memory": False}}),
                recipe=ToyRecipe)
    assert "needs distributed.strategy: fsdp2" in refusal(strategy="ddp", offload_policy=upstream)
    assert "CPU offload is applied with FSDP2 data parallelism (and tensor parallelism) here, not with cp_size 2" \
        in refusal(strategy="fsdp2", cp_size=2, dp_size=1, offload_policy=upstream)
    for value, needle in (({"_target_": "torch.nn.Linear"}, "_target_ 'torch.nn.Linear' is not FSDP2's CPU offload"),
                          ({"offload_params": True}, "offload_params: not an argument of CPUOffloadPolicy"),
                          ({"pin_memory": "yes"}, "pin_memory: expected true or false, found 'yes'"),
                          (True, "expected dict | null, found bool True")):
        assert f"distributed.offload_policy: {needle}" in refusal(strategy="fsdp2", offload_policy=value)
