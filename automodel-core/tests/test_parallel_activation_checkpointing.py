"""Activation checkpointing per transformer block: the same losses, a lower peak of tensor memory (measured by
torch's MemTracker, which follows every tensor storage created in its context: exact, unaffected by other processes).
With FSDP2 the same-losses property is checked in test_parallel_fsdp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parallel_workers import VOCAB, local_model, meta_model, tiny_config
from torch.distributed._tools.mem_tracker import MemTracker

from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing
from automodel.training.parallel.blocks import clean_name


def losses_and_peak(checkpointing: bool) -> tuple[list[float], int, int]:
    """Two AdamW steps on 2 x 256 tokens: the losses, the peak of all tensor memory and of activations."""
    model = local_model(tiny_config(tied=False, layers=4, hidden=64, intermediate=128), checkpointing=checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (2, 256), generator=torch.Generator().manual_seed(3))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    losses = []
    with tracker:
        for _ in range(2):
            logits = model(input_ids=tokens).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    activations = next(value for key, value in peak.items() if str(key).endswith("ACT"))
    return losses, peak["Total"], activations


def test_same_losses_and_lower_peak_memory():
    plain_losses, plain_peak, plain_activations = losses_and_peak(checkpointing=False)
    losses, peak, activations = losses_and_peak(checkpointing=True)
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    assert activations < 0.6 * plain_activations  # measured: 4.3 MB vs 9.8 MB
    assert peak < 0.8 * plain_peak  # measured: 7.7 MB vs 12.1 MB (parameters, gradients and Adam state included)


def test_each_block_is_wrapped_and_names_stay_clean():
    config = tiny_config(layers=3)
    plain, wrapped = meta_model(config), meta_model(config, checkpointing=True)  # asserts 3 blocks were wrapped
    assert type(wrapped.model.layers[0]).__name__ == "CheckpointWrapper"
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    names = [name for name, _ in wrapped.named_parameters()]
    assert any("_checkpoint_wrapped_module" in name for name in names)
    assert [clean_name(name) for name in names] == [name for name, _ in plain.named_parameters()]


def test_a_model_without_repeated_blocks_is_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert apply_activation_checkpointing(model) == 0
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
