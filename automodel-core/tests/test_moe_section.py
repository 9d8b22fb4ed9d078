"""Upstream's ``distributed.moe`` keys under expert parallelism (``ep_size > 1``): reshard_after_forward and mp_policy
become the section's engine keys, ignore_router_for_ac keeps the routing top-k through activation checkpointing's
recomputation, lm_head_precision float32 runs the output head in fp32, wrap_outer_model false makes the inner model
the FSDP2 root; values that cannot act are refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from automodel.training.distributed_section import DistributedConfig, moe_head_fp32, moe_inner_root, moe_saves_routing
from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing


def test_reshard_after_forward_and_mp_policy_act_as_the_engine_keys_under_ep():
    moe = {"reshard_after_forward": False, "mp_policy": {"param_dtype": "bf16"}}
    settings = DistributedConfig(ep_size=2, moe=dict(moe))
    assert settings.reshard_after_forward is False and settings.mp_policy == {"param_dtype": "bf16"}
    off = DistributedConfig(moe=dict(moe))  # no expert parallelism: they govern nothing (the run notes it)
    assert off.reshard_after_forward is None and off.mp_policy is None
    same = DistributedConfig(ep_size=2, reshard_after_forward=False, moe={"reshard_after_forward": False})
    assert same.reshard_after_forward is False
    with pytest.raises(ValueError, match="moe.reshard_after_forward: False differs from distributed"):
        DistributedConfig(ep_size=2, reshard_after_forward=True, moe={"reshard_after_forward": False})
    with pytest.raises(ValueError, match="moe.mp_policy: .* differs from distributed.mp_policy"):
        DistributedConfig(ep_size=2, mp_policy={"param_dtype": "fp32"}, moe=dict(moe))


@pytest.mark.parametrize("moe, message", [
    ({"wrap_outer_model": 0}, "moe.wrap_outer_model: 0: must be true or false"),
    ({"lm_head_precision": "bfloat16"}, "moe.lm_head_precision: bfloat16: only float32 is taken"),
    ({"ignore_router_for_ac": "yes"}, "moe.ignore_router_for_ac: 'yes': must be true or false"),
    ({"reshard_after_forward": "no"}, "moe.reshard_after_forward: 'no': must be true or false"),
])
def test_values_that_cannot_act_are_refused(moe, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(ep_size=2, moe=moe)


def test_what_the_other_keys_switch_on():
    settings = DistributedConfig(ep_size=2, activation_checkpointing=True,
                                 moe={"wrap_outer_model": True, "ignore_router_for_ac": True,
                                      "lm_head_precision": "torch.float32"})
    assert moe_saves_routing(settings) and moe_head_fp32(settings)
    assert not moe_saves_routing(DistributedConfig(ep_size=2, activation_checkpointing=True,
                                                   moe={"ignore_router_for_ac": False}))
    assert not moe_saves_routing(DistributedConfig(ep_size=2, moe={"ignore_router_for_ac": True}))
    assert not moe_head_fp32(DistributedConfig(moe={"lm_head_precision": "float32"}))
    assert not moe_inner_root(settings) and moe_inner_root(DistributedConfig(ep_size=2,
                                                                            moe={"wrap_outer_model": False}))
    assert not moe_inner_root(DistributedConfig(moe={"wrap_outer_model": False}))


class _Routed(torch.nn.Module):
    """A block that routes each token to its top-2 of 4 linear experts (tokens: rows)."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 8) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        chosen = torch.einsum("th,tkoh->tko", x, self.experts[index])
        return x + (chosen * weights[..., None]).sum(-2)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Routed() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _CountTopk(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.topk.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("save_routing, recomputed", [(False, 3), (True, 0)])
def test_ignore_router_for_ac_keeps_the_routing_of_the_forward(save_routing, recomputed):
    torch.manual_seed(0)
    model = _Model()
    reference = _Model()
    reference.load_state_dict(model.state_dict())
    assert apply_activation_checkpointing(model, save_routing=save_routing) == 3
    x = torch.randn(5, 8)
    model(x).sum().backward()  # a first pass outside the counter (lazy initialisation)
    model.zero_grad()
    counter = _CountTopk()
    out = model(x)
    with counter:
        out.sum().backward()
    assert counter.calls == recomputed  # the recomputation in backward runs topk again, or reuses the saved one
    reference(x).sum().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(param.grad, ref.grad, atol=1e-6), name


@pytest.mark.parametrize("fp32_head, dtype", [(False, torch.bfloat16), (True, torch.float32)])
def test_lm_head_precision_float32_runs_the_head_in_fp32(fp32_head, dtype):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from automodel.testing import free_port
    from automodel.training.parallel.fsdp import apply_fsdp2
    from automodel.training.parallel.precision import Precision

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.lm_head = torch.nn.Linear(8, 16, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(x)

    seen = []
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = LM()
        model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
        apply_fsdp2(model, init_device_mesh("cpu", (1,)), Precision(torch.bfloat16, torch.float32),
                    own_dtype={model.lm_head: torch.float32} if fp32_head else None)
        logits = model(torch.randn(3, 8))
        assert logits.dtype == dtype and seen == [dtype]  # the head's weight as it computes, and its output
        logits.float().sum().backward()
        assert model.lm_head.weight.grad.dtype == torch.float32
    finally:
        dist.destroy_process_group()


def test_the_run_notes_values_that_describe_what_it_does_anyway():
    from types import SimpleNamespace

    from automodel.training.inert_notes import inert_distributed_notes

    def notes(**settings) -> str:
        return "\n".join(inert_distributed_notes(SimpleNamespace(model=None, distributed=DistributedConfig(
            **settings)), fsdp2=True))

    moe = {"wrap_outer_model": True, "ignore_router_for_ac": True}
    assert "distributed.moe.wrap_outer_model: true is what FSDP2 here does anyway" in notes(ep_size=2, moe=moe)
    assert "distributed.moe.ignore_router_for_ac governs nothing this run" in notes(ep_size=2, moe=moe)
    assert "ignore_router_for_ac" not in notes(ep_size=2, activation_checkpointing=True, moe=moe)
    assert notes(moe=moe) == ("note: distributed.moe governs nothing this run: expert parallelism (ep_size) is off, "
                              "and upstream ignores these settings then too")


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return x


class _CausalLM(torch.nn.Module):
    """The shape of a Hugging Face causal LM: an inner model under ``base_model`` and an output head."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.model = _Inner()
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def base_model(self) -> torch.nn.Module:
        return self.model

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def test_wrap_outer_model_false_makes_the_inner_model_the_root():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from automodel.testing import free_port
    from automodel.training.parallel.fsdp import apply_fsdp2, inner_root_issue

    assert "tie_word_embeddings" in inner_root_issue(_CausalLM(tied=True))
    extra = _CausalLM()
    extra.scale = torch.nn.Parameter(torch.ones(()))
    assert "parameters of its own (scale)" in inner_root_issue(extra)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        units = {}
        for outer_root in (True, False):
            torch.manual_seed(0)
            model = _CausalLM()
            assert inner_root_issue(model) is None
            apply_fsdp2(model, init_device_mesh("cpu", (1,)), outer_root=outer_root)
            units[outer_root] = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
            model(torch.tensor([[1, 2, 3]])).sum().backward()
            units[outer_root].append(model.lm_head.weight.grad.full_tensor())
        assert units[True][:-1] == ["", "model.layers.0", "model.layers.1"]
        assert units[False][:-1] == ["model", "model.layers.0", "model.layers.1", "lm_head"]
        assert torch.equal(units[True][-1], units[False][-1])  # the same gradients, through other units
    finally:
        dist.destroy_process_group()
