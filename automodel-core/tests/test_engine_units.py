"""Unit semantics of the engine: the masked loss, the warmup schedulers, the step scheduler (DESIGN §9)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

# ---- MaskedCrossEntropy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_masked_ce_all_ignored_is_zero_not_nan(reduction):
    from automodel.training.loss import MaskedCrossEntropy

    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.full((2, 5), -100)
    loss = MaskedCrossEntropy(reduction=reduction)(logits, labels)
    assert loss.item() == 0.0 and not torch.isnan(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() == 0


def test_masked_ce_matches_torch_on_label_tokens():
    from automodel.training.loss import MaskedCrossEntropy

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 13)
    labels = torch.randint(0, 13, (3, 7))
    labels[0, :4] = -100
    labels[2, 5:] = -100
    kept = labels != -100
    expected_sum = F.cross_entropy(logits[kept], labels[kept], reduction="sum")
    assert MaskedCrossEntropy()(logits, labels).item() == pytest.approx(expected_sum.item(), rel=1e-6)
    assert MaskedCrossEntropy(reduction="mean")(logits, labels).item() == pytest.approx(
        expected_sum.item() / int(kept.sum()), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_chunked_ce_gives_the_masked_losses_and_gradients_a_chunk_at_a_time(dtype, reduction):
    """ChunkedCrossEntropy (upstream's chunked_ce form): chunks of 5 rows over 26 (the last one shorter), ignored
    labels, bf16 logits upcast per chunk; the loss and the logits' gradient equal MaskedCrossEntropy's."""
    from automodel.training.loss import ChunkedCrossEntropy, MaskedCrossEntropy

    torch.manual_seed(0)
    logits = torch.randn(2, 13, 50, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (2, 13))
    labels[0, :4] = -100
    results = []
    for loss_fn in (ChunkedCrossEntropy(chunk_len=5, reduction=reduction), MaskedCrossEntropy(reduction=reduction)):
        loss = loss_fn(logits, labels)
        (grad,) = torch.autograd.grad(loss * 3.0, logits)
        results.append((loss.item(), grad.float()))
    (chunked, chunked_grad), (masked, masked_grad) = results
    assert chunked == pytest.approx(masked, rel=1e-6)
    assert torch.allclose(chunked_grad, masked_grad, atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert chunked_grad[0, :3].abs().sum() == 0  # positions whose labels are ignored get no gradient
    with pytest.raises(ValueError, match="chunk_len must be a positive integer"):
        ChunkedCrossEntropy(chunk_len=0)


def test_linear_ce_inside_the_head_refuses_a_model_that_changes_the_head_output_or_an_adapted_head():
    """The loss computed inside the output head (FusedLinearCrossEntropy) needs the model to return what the head
    returned, and a plain linear head: a model that scales its logits after the head, or a head LoRA wraps, stops
    with the reason instead of training on a wrong loss."""
    from types import SimpleNamespace

    from torch import nn

    from automodel.errors import AutomodelError
    from automodel.training.linear_ce import LinearCrossEntropy, LinearLossHead
    from automodel.training.next_token import next_token_logits

    class Scaled(nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.embed, self.head, self.scale = nn.Embedding(11, 4), nn.Linear(4, 11, bias=False), scale

        def get_output_embeddings(self) -> nn.Module:
            return self.head

        def forward(self, input_ids):
            logits = self.head(self.embed(input_ids))
            return SimpleNamespace(logits=logits * self.scale if self.scale != 1 else logits)

    labels = torch.randint(0, 11, (2, 6))
    inputs = {"input_ids": labels}
    plain = Scaled(1.0)
    rows, targets = next_token_logits(plain, inputs, labels, None, None, LinearLossHead.attach(plain,
                                                                                              LinearCrossEntropy()))
    logits = plain.head(plain.embed(labels))[:, :-1].reshape(-1, 11)
    assert rows.sum().item() == pytest.approx(F.cross_entropy(logits, targets, reduction="sum").item(), rel=1e-5)
    scaled = Scaled(2.0)
    with pytest.raises(AutomodelError, match="changes the head's output afterwards"):
        next_token_logits(scaled, inputs, labels, None, None, LinearLossHead.attach(scaled, LinearCrossEntropy()))
    assert scaled.head(torch.zeros(1, 4)).shape == (1, 11), "the head's own forward is back after the block"
    adapted = Scaled(1.0)
    adapted.head.base_layer = nn.Linear(4, 11)
    with pytest.raises(AutomodelError, match="must be a linear layer"):
        LinearLossHead.attach(adapted, LinearCrossEntropy())


def test_masked_ce_upcasts_half_precision():
    from automodel.training.loss import MaskedCrossEntropy

    logits = torch.randn(4, 9).to(torch.bfloat16)
    labels = torch.tensor([1, 2, -100, 3])
    loss = MaskedCrossEntropy()(logits, labels)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(F.cross_entropy(logits.float()[[0, 1, 3]], labels[[0, 1, 3]],
                                                        reduction="sum").item(), rel=1e-6)


def test_as_sum_loss_switches_torch_losses_to_sum_in_float32():
    from automodel.training.loss import Float32Loss, MaskedCrossEntropy, as_sum_loss

    assert isinstance(as_sum_loss(None), MaskedCrossEntropy)
    ce = as_sum_loss(torch.nn.CrossEntropyLoss())
    assert isinstance(ce, Float32Loss) and ce.loss.reduction == "sum" and ce.loss.ignore_index == -100
    assert ce(torch.randn(3, 4), torch.full((3,), -100)).item() == 0.0
    logits, labels = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), torch.arange(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward's precision does not reach the loss
        loss = ce(logits.bfloat16(), labels)
    assert loss.dtype == torch.float32
    assert loss.item() == F.cross_entropy(logits.bfloat16().float(), labels, reduction="sum").item()


# ---- CosineAnnealingWarmup and friends -------------------------------------------------------------------------


def lrs(scheduler_cls, steps, **kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = scheduler_cls(opt, **kwargs)
    values = [opt.param_groups[0]["lr"]]  # lr used by step 1
    for _ in range(steps):
        opt.step()
        scheduler.step()
        values.append(opt.param_groups[0]["lr"])
    return values, scheduler


def test_cosine_annealing_warmup_values():
    from automodel.optim import CosineAnnealingWarmup

    values, _ = lrs(CosineAnnealingWarmup, 14, warmup_steps=4, min_lr=0.1, total_steps=12)
    # linear warmup: 1/4, 2/4, 3/4, then the base lr at the end of warmup
    assert values[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    # half-way through the decay (step 8 of 12): min + (base - min) / 2
    assert values[8] == pytest.approx(0.55)
    assert values[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    # reaches min_lr at total_steps and stays there
    assert values[12] == pytest.approx(0.1) and values[13] == pytest.approx(0.1) and values[14] == pytest.approx(0.1)
    assert all(a >= b - 1e-12 for a, b in zip(values[4:-1], values[5:], strict=True)), "decay is monotone"


def test_cosine_annealing_warmup_without_warmup_and_state_round_trip():
    from automodel.optim import CosineAnnealingWarmup

    values, scheduler = lrs(CosineAnnealingWarmup, 5, warmup_steps=0, min_lr=0.0, total_steps=10)
    assert values[0] == pytest.approx(1.0) and values[5] == pytest.approx(0.5)
    state = scheduler.state_dict()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = CosineAnnealingWarmup(opt, warmup_steps=0, min_lr=0.0, total_steps=10)
    fresh.load_state_dict(state)
    opt.step()
    fresh.step()
    scheduler.optimizer.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(scheduler.optimizer.param_groups[0]["lr"])


def test_linear_and_constant_warmup():
    from automodel.optim import ConstantWarmup, LinearWarmup

    linear, _ = lrs(LinearWarmup, 10, warmup_steps=2, min_lr=0.0, total_steps=10)
    assert linear[:3] == pytest.approx([0.5, 1.0, 1.0]) and linear[6] == pytest.approx(0.5)
    assert linear[10] == pytest.approx(0.0)
    constant, _ = lrs(ConstantWarmup, 6, warmup_steps=2, total_steps=6)
    assert constant == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])


# ---- StepScheduler -----------------------------------------------------------------------------------------------


def scheduler(accumulation=1, steps_per_epoch=None, **config):
    from automodel.training.sections import StepSchedulerConfig
    from automodel.training.step_scheduler import StepScheduler

    return StepScheduler(StepSchedulerConfig(**config), accumulation, steps_per_epoch)


def drive(steps, data):
    """Run the loop's protocol; returns [(step, epoch, micro-batches)] per step."""
    seen = []
    for batches in steps.batches(data):
        step = steps.finish_step()
        seen.append((step, steps.epoch, list(batches)))
    return seen


def test_the_last_shorter_group_of_an_epoch_is_a_step():
    steps = scheduler(accumulation=3, steps_per_epoch=3, max_steps=5, num_epochs=10)
    seen = drive(steps, list(range(7)))  # 7 micro-batches: two full steps and one of a single micro-batch
    assert [s for s, _, _ in seen] == [1, 2, 3, 4, 5]
    assert [b for _, _, b in seen] == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2], [3, 4, 5]]
    assert [e for _, e, _ in seen] == [0, 0, 0, 1, 1]
    assert steps.step == 5


def test_steps_per_epoch_counts_the_shorter_group():
    from automodel.training.step_scheduler import steps_per_epoch

    assert (steps_per_epoch(7, 3), steps_per_epoch(6, 3), steps_per_epoch(1, 4)) == (3, 2, 1)


def test_num_epochs_limits_when_max_steps_unset():
    steps = scheduler(accumulation=2, steps_per_epoch=2, num_epochs=3)
    assert steps.max_steps == 6
    seen = drive(steps, list(range(4)))
    assert len(seen) == 6 and [e for _, e, _ in seen] == [0, 0, 1, 1, 2, 2]


def test_without_num_epochs_max_steps_decides_over_as_many_epochs_as_it_needs():
    steps = scheduler(steps_per_epoch=4, max_steps=10)
    seen = drive(steps, list(range(4)))
    assert len(seen) == 10 and [e for _, e, _ in seen] == [0] * 4 + [1] * 4 + [2] * 2
    assert steps.total_steps == 10 and steps.stop_reason() == "step_scheduler.max_steps: 10 reached"


def test_without_either_limit_one_epoch_runs():
    steps = scheduler(steps_per_epoch=4)
    assert (steps.max_steps, steps.num_epochs) == (4, 1)
    assert len(drive(steps, list(range(4)))) == 4


def test_first_limit_wins_and_says_which():
    steps = scheduler(steps_per_epoch=4, max_steps=100, num_epochs=2)
    assert steps.total_steps == 8
    assert len(drive(steps, list(range(4)))) == 8
    assert steps.stop_reason() == "step_scheduler.num_epochs: 2 done before max_steps: 100"
    steps = scheduler(steps_per_epoch=4, max_steps=3, num_epochs=2)
    assert steps.total_steps == 3
    assert len(drive(steps, list(range(4)))) == 3
    assert steps.stop_reason() == "step_scheduler.max_steps: 3 reached"


def test_streaming_data_without_max_steps_is_refused_and_an_empty_epoch_stops():
    from automodel.errors import AutomodelError

    with pytest.raises(AutomodelError, match="max_steps must be set"):
        scheduler(accumulation=2)
    steps = scheduler(accumulation=2, max_steps=5)
    with pytest.raises(AutomodelError, match="an epoch gave no batch"):
        drive(steps, [])


def test_log_val_checkpoint_predicates():
    steps = scheduler(steps_per_epoch=100, max_steps=10, log_interval=3, val_check_interval=5, checkpoint_interval=4)
    logs, vals, ckpts = [], [], []
    for _ in steps.batches(list(range(100))):
        s = steps.finish_step()
        logs += [s] if steps.is_log_step() else []
        vals += [s] if steps.is_val_step() else []
        ckpts += [s] if steps.is_checkpoint_step(last=s >= steps.max_steps) else []
    assert logs == [3, 6, 9, 10]  # and always the last step
    assert vals == [5, 10]
    assert ckpts == [4, 8, 10]


def test_no_validation_when_interval_unset():
    steps = scheduler(steps_per_epoch=10, max_steps=3)
    for _ in steps.batches(list(range(10))):
        steps.finish_step()
        assert not steps.is_val_step()


def test_step_scheduler_state_round_trip():
    steps = scheduler(steps_per_epoch=2, max_steps=5, num_epochs=10)
    drive_some = steps.batches(list(range(2)))
    for _ in range(3):
        next(drive_some)
        steps.finish_step()
    state = steps.state_dict()
    assert state == {"step": 3, "epoch": 1, "epoch_step": 1}  # one step into epoch 1
    other = scheduler(steps_per_epoch=2, max_steps=5, num_epochs=10)
    other.load_state_dict(state)
    assert (other.step, other.epoch, other.epoch_step) == (3, 1, 1)
    assert [s for s, _, _ in drive(other, list(range(2)))] == [4, 5]


def test_a_checkpoint_after_an_epochs_shorter_last_step_resumes_in_the_next_epoch():
    """The data ran out before that step: the loader's saved position is the end of its pass, so the resume
    starts the next epoch (its first pass over the restored loader is a whole new one)."""
    steps = scheduler(accumulation=2, steps_per_epoch=2, max_steps=6)
    drive_some = steps.batches(list(range(3)))
    for _ in range(2):
        next(drive_some)
        steps.finish_step()
    assert steps.is_epoch_end()
    assert steps.state_dict() == {"step": 2, "epoch": 1, "epoch_step": 0}


def steps_where(steps, data, predicate):
    """The steps after which ``predicate(steps)`` holds, driving the loop's protocol."""
    found = []
    for _ in steps.batches(data):
        steps.finish_step()
        found += [steps.step] if predicate(steps) else []
    return found


def test_epoch_end_checkpoints_when_asked():
    def checkpoint(steps):
        return steps.is_checkpoint_step(last=steps.step >= steps.total_steps)

    asked = scheduler(accumulation=2, steps_per_epoch=2, max_steps=5, save_checkpoint_every_epoch=True)
    assert steps_where(asked, list(range(3)), checkpoint) == [2, 4, 5]
    full_groups = scheduler(accumulation=2, steps_per_epoch=2, max_steps=5, save_checkpoint_every_epoch=True)
    assert steps_where(full_groups, list(range(4)), checkpoint) == [2, 4, 5]
    unasked = scheduler(accumulation=2, steps_per_epoch=2, max_steps=5)
    assert steps_where(unasked, list(range(3)), checkpoint) == [5]


def test_remote_logging_has_its_own_interval():
    steps = scheduler(steps_per_epoch=10, max_steps=7, log_interval=3, log_remote_every_steps=2)
    assert steps_where(steps, list(range(10)), lambda s: s.is_remote_log_step()) == [2, 4, 6, 7]
    steps = scheduler(steps_per_epoch=10, max_steps=7, log_interval=3, log_remote_every_steps=2)
    assert steps_where(steps, list(range(10)), lambda s: s.is_log_step()) == [3, 6, 7]
    steps = scheduler(steps_per_epoch=10, max_steps=7, log_interval=3)
    assert steps_where(steps, list(range(10)), lambda s: s.is_remote_log_step()) == [3, 6, 7]


def test_a_loader_without_batches_is_a_clear_error():
    from automodel.errors import AutomodelError

    with pytest.raises(AutomodelError, match="yields no batch"):
        scheduler(accumulation=4, steps_per_epoch=0, max_steps=3)


@pytest.mark.parametrize("key", ["max_steps", "grad_accumulation_steps", "log_interval", "checkpoint_interval",
                                 "num_epochs", "gc_every_steps", "log_remote_every_steps",
                                 "loss_average_window_steps"])
def test_step_scheduler_rejects_non_positive(key):
    from automodel.training.sections import StepSchedulerConfig

    with pytest.raises(ValueError, match=key):
        StepSchedulerConfig(**{key: 0})
