"""A model built on the meta device is measured before it is materialised: what it holds, and the refusal when its
weights and gradients alone exceed the device's free memory (the whole-run case is tests/bad_configs/
model_does_not_fit.yaml)."""

from __future__ import annotations

import pytest
import torch

from automodel.errors import AutomodelError
from automodel.training import memory_fit
from automodel.training.host_memory import byte_size
from automodel.training.memory_fit import check_fits, model_bytes, optimizer_buffers
from automodel.training.parallel.materialize import parameters_on_meta


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)  # 40 fp32 values, tied to the head
        self.frozen = torch.nn.Linear(4, 4, dtype=torch.bfloat16)  # 16 + 4 bf16 values, no gradient
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(3))  # 3 fp32 values
        self.frozen.requires_grad_(False)


def test_model_bytes_counts_each_weight_once_and_gradients_of_trainable_ones():
    with parameters_on_meta():
        model = Tied()
    found = model_bytes(model)
    assert found.weights == 40 * 4 + 20 * 2 + 3 * 4
    assert found.gradients == 40 * 4
    assert found.total == found.weights + found.gradients


def fake_memory(monkeypatch, tmp_path, available_gib: float, swap_gib: float = 0.0) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {int(available_gib * 1024 ** 2)} kB\n"
                       f"SwapFree:       {int(swap_gib * 1024 ** 2)} kB\n")
    monkeypatch.setattr(memory_fit, "MEMINFO", meminfo)


def test_a_model_whose_weights_and_gradients_exceed_free_memory_is_refused_with_the_figures(monkeypatch, tmp_path):
    with parameters_on_meta():
        model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights, 4 MiB of gradients
    fake_memory(monkeypatch, tmp_path, available_gib=6 / 1024)
    with pytest.raises(AutomodelError) as info:
        check_fits(model, torch.device("cpu"))
    message = str(info.value)
    assert message.startswith("model: does not fit in the memory of cpu")
    assert "weights (4 MiB), their gradients (4 MiB) need 8 MiB, and 6 MiB is free there (the optimizer's state " \
        "and the activations would come on top)" in message
    assert "nothing was allocated" in message and "peft:" in message
    assert model.weight.is_meta  # nothing materialised

    fake_memory(monkeypatch, tmp_path, available_gib=4 / 1024, swap_gib=6 / 1024)  # swap counts: 10 MiB in all
    check_fits(model, torch.device("cpu"))
    model.requires_grad_(False)  # frozen: 4 MiB only
    fake_memory(monkeypatch, tmp_path, available_gib=5 / 1024)
    check_fits(model, torch.device("cpu"))


def test_the_processes_of_one_machine_share_its_memory(monkeypatch, tmp_path):
    with parameters_on_meta():
        model = torch.nn.Linear(1024, 1024, bias=False)  # 8 MiB with gradients, per process
    fake_memory(monkeypatch, tmp_path, available_gib=12 / 1024)
    check_fits(model, torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(AutomodelError, match="for each of the 2 processes of this machine"):
        check_fits(model, torch.device("cpu"))


def test_without_a_memory_figure_nothing_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_fit, "MEMINFO", tmp_path / "absent")
    with parameters_on_meta():
        model = torch.nn.Linear(1024, 1024)
    check_fits(model, torch.device("cpu"))
    assert memory_fit.host_free_bytes() is None


def test_sizes_read_in_the_largest_unit_under_them():
    assert [byte_size(n) for n in (256 << 10, 32 << 20, 1 << 30, int(221.34 * (1 << 30)))] == \
        ["256 KiB", "32 MiB", "1 GiB", "221.3 GiB"]


def test_torchs_adam_and_sgd_state_is_counted_with_the_gradients(monkeypatch, tmp_path):
    assert optimizer_buffers("torch.optim.AdamW", {}) == optimizer_buffers("torch.optim.Adam", {}) == 2
    assert optimizer_buffers("torch.optim.AdamW", {"amsgrad": True}) == 3
    assert optimizer_buffers("torch.optim.SGD", {"momentum": 0.9}) == 1
    assert optimizer_buffers("torch.optim.SGD", {}) == optimizer_buffers("automodel.optim.Muon", {}) == 0
    with parameters_on_meta():
        model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights, 4 MiB of gradients
    fake_memory(monkeypatch, tmp_path, available_gib=12 / 1024)
    check_fits(model, torch.device("cpu"), "torch.optim.SGD", {"lr": 0.1})  # 8 MiB
    check_fits(model, torch.device("cpu"), "torch.optim.SGD", {"momentum": 0.9})  # 12 MiB
    with pytest.raises(AutomodelError) as info:
        check_fits(model, torch.device("cpu"), "torch.optim.AdamW", {"lr": 1e-3})  # 16 MiB
    assert "weights (4 MiB), their gradients (4 MiB), AdamW's state (8 MiB) need 16 MiB, and 12 MiB is free there " \
        "(the activations would come on top)" in str(info.value)
