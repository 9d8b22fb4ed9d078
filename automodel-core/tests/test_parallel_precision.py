"""``distributed.mp_policy`` -> FSDP2's MixedPrecisionPolicy or torch.autocast (runs with FSDP2 on two ranks are in
test_parallel_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from automodel.errors import ConfigError
from automodel.training.parallel.precision import Precision, default_precision, precision_issues, resolve_precision

CPU = torch.device("cpu")


def test_upstream_mp_policy_becomes_fsdp2s_policy():
    upstream = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy", "param_dtype": "bfloat16",
                "reduce_dtype": "float32", "output_dtype": "bfloat16", "cast_forward_inputs": True}
    precision = resolve_precision(upstream, CPU, fsdp2=True)
    assert precision.fsdp_policy() == MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.bfloat16, True)
    assert precision.describe(torch.float32, fsdp2=True) == (
        "mixed precision (FSDP2 MixedPrecisionPolicy): params bf16 (stored fp32), reduce fp32, output bf16, loss fp32")


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("torch.float16", torch.float16),
                                             ("half", torch.float16), ("FP32", torch.float32)])
def test_dtype_spellings(name, dtype):
    assert resolve_precision({"param_dtype": name}, CPU, fsdp2=True).param_dtype == dtype


def test_unset_dtypes_keep_torchs_meaning():
    precision = resolve_precision({"param_dtype": "bf16"}, CPU, fsdp2=True)
    assert precision.fsdp_policy() == MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert "reduce bf16, output bf16" in precision.describe(torch.float32, fsdp2=True)


def test_defaults_fp32_on_cpu_and_model_dtype_is_kept():
    assert default_precision(CPU) == Precision() == resolve_precision(None, CPU, fsdp2=False)
    assert Precision().describe(torch.float32, fsdp2=False) == "precision: fp32 (no mixed precision), loss fp32"
    # a model loaded in bf16 (model.torch_dtype) trains in bf16 without any cast
    assert Precision().describe(torch.bfloat16, fsdp2=True) == "precision: bf16 (no mixed precision), loss fp32"
    assert Precision().compute_dtype(torch.bfloat16, fsdp2=False) == torch.bfloat16


def test_wrong_values_are_refused_with_their_keys():
    issues = precision_issues({"_target_": "os.system", "param_dtype": "int8", "reduce_dtyp": "fp32",
                               "cast_forward_inputs": "yes"}, CPU, fsdp2=True)
    assert [i.key for i in issues] == ["distributed.mp_policy._target_", "distributed.mp_policy.reduce_dtyp",
                                       "distributed.mp_policy.param_dtype",
                                       "distributed.mp_policy.cast_forward_inputs"]
    assert "'int8' is not a training dtype" in str(issues[2])
    with pytest.raises(ConfigError):
        resolve_precision({"param_dtype": "int8"}, CPU, fsdp2=True)


def test_without_fsdp2_what_autocast_cannot_do_is_refused():
    issues = precision_issues({"param_dtype": "bf16", "reduce_dtype": "bf16", "output_dtype": "bf16",
                               "cast_forward_inputs": False}, CPU, fsdp2=False)
    assert [i.key.rsplit(".", 1)[1] for i in issues] == ["reduce_dtype", "output_dtype", "cast_forward_inputs"]
    assert all("needs distributed.strategy: fsdp2 and more than one process" in i.message for i in issues)
    fine = resolve_precision({"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "fp32"}, CPU, False)
    assert fine.describe(torch.float32, fsdp2=False) == \
        "mixed precision (torch.autocast): params bf16 (stored fp32), reduce fp32, output bf16, loss fp32"


def test_autocast_runs_the_forward_in_param_dtype_on_cpu():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with resolve_precision({"param_dtype": "bf16"}, CPU, fsdp2=False).autocast("cpu"):
        assert layer(x).dtype == torch.bfloat16
    with Precision().autocast("cpu"):
        assert layer(x).dtype == torch.float32


def test_fp16_gets_a_grad_scaler_that_works_on_cpu():
    fp16 = resolve_precision({"param_dtype": "fp16"}, CPU, fsdp2=False)
    assert "gradient scaler" in fp16.describe(torch.float32, fsdp2=False)
    assert resolve_precision({"param_dtype": "bf16"}, CPU, False).grad_scaler("cpu", torch.float32, False) is None
    assert isinstance(fp16.grad_scaler("cpu", torch.float32, fsdp2=True), ShardedGradScaler)
    scaler = fp16.grad_scaler("cpu", torch.float32, fsdp2=False)
    layer = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(20):  # a step whose fp16 gradients overflow is skipped and the scale halved
        with fp16.autocast("cpu"):
            loss = layer(inputs).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert not torch.equal(layer.weight, before)
    assert torch.isfinite(layer.weight).all() and scaler.get_scale() <= 65536.0
