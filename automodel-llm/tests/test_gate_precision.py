"""``model.backend.gate_precision``: the routers of a tiny Qwen3-MoE compute their logits in that dtype in a bf16
model (stored bf16; stored fp32 under bf16 autocast; under FSDP2's bf16 policy, each router its own unit), train
through the CLI on two FSDP2 ranks, and a model without routers is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_testing import LLAMA_CONFIG, validate_cli, write_config, write_tiny_moe_config

from automodel.testing import free_port, run_cli


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory) -> Path:
    return write_tiny_moe_config(tmp_path_factory.mktemp("tiny_moe"))


def _logit_dtypes(model, autocast: bool = False) -> list:
    """The dtypes of the routers' logits (their first output) in one forward and backward."""
    import torch

    from automodel.gate_precision import is_router

    seen = []
    for module in model.modules():
        if is_router(module):
            module.register_forward_hook(lambda m, args, out: seen.append(out[0].dtype))
    tokens = torch.randint(0, 400, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return seen


@pytest.mark.parametrize("precision, stored, autocast, expected", [
    (None, "bfloat16", False, "bfloat16"), ("float32", "bfloat16", False, "float32"),
    ("torch.float32", "float32", True, "float32"), (None, "float32", True, "bfloat16"),
    ("bf16", "float32", False, "bfloat16")])
def test_the_routers_compute_their_logits_in_gate_precision(moe_config, precision, stored, autocast, expected):
    import torch

    from automodel_llm import AutoModelForCausalLM

    backend = {"gate_precision": precision} if precision else None
    model = AutoModelForCausalLM.from_config(str(moe_config), torch_dtype=stored, backend=backend)
    assert _logit_dtypes(model, autocast) == [getattr(torch, expected)] * 2  # both MoE layers
    router = model.model.layers[0].mlp.gate.weight
    assert router.dtype == getattr(torch, stored) and router.grad.dtype == router.dtype  # storage unchanged
    assert router.grad.abs().max().item() > 0.0


def test_a_model_without_routers_is_refused(moe_config, tmp_path):
    from automodel.errors import AutomodelError
    from automodel_llm import AutoModelForCausalLM

    with pytest.raises(AutomodelError, match="gate_precision: .*LlamaForCausalLM has no router"):
        AutoModelForCausalLM.from_config(str(LLAMA_CONFIG), backend={"gate_precision": "float32"})
    for model_config, refused in ((LLAMA_CONFIG, True), (moe_config, False)):  # by validation, from the config
        config = write_config(tmp_path / "cfg.yaml", model_config, tmp_path / "ckpt",
                              model={"backend": {"gate_precision": "float32"}})
        code, out = validate_cli(config, tmp_path)
        assert (code, "model.backend.gate_precision: sets the dtype" in out) == ((2, True) if refused else (0, False))


def test_under_fsdp2_each_router_is_a_float32_unit_in_a_bf16_policy(moe_config):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from automodel.gate_precision import routers_in_precision
    from automodel.testing import free_port
    from automodel.training.parallel.fsdp import apply_fsdp2
    from automodel.training.parallel.precision import Precision
    from automodel_llm import AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_config(str(moe_config), backend={"gate_precision": "float32"})
        weights = []
        for module in model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.register_forward_pre_hook(lambda m, args: weights.append(m.weight.dtype))
        routers = routers_in_precision(model)
        assert len(routers) == 2 and set(routers.values()) == {torch.float32}
        apply_fsdp2(model, init_device_mesh("cpu", (1,)), Precision(torch.bfloat16, torch.float32),
                    own_dtype=routers)
        assert _logit_dtypes(model) == [torch.float32] * 2
        assert weights == [torch.float32] * 2  # gathered in float32: the policy's bf16 never touched them
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gate_precision_trains_on_two_fsdp2_ranks_in_bf16(moe_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", moe_config, tmp_path / "ckpt",
                          model={"backend": {"gate_precision": "float32"}}, checkpoint={"enabled": False},
                          distributed={"strategy": "fsdp2", "mp_policy": {"param_dtype": "bf16"}})
    result = run_cli("finetune", "llm", "-c", config, "--step_scheduler.max_steps", "3", "--nproc-per-node", "2",
                     "--master-port", str(free_port()), cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 routers in float32 (model.backend.gate_precision)" in result.stderr
    assert "step 3" in result.stderr
