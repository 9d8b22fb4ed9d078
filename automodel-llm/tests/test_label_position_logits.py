"""`logits.label_positions_only`: the LM head projects only the positions that carry a label.

The point is speed and memory; what must hold is that nothing else changes: the same losses, gradients and
trained weights as computing logits at every position, for plain models, LoRA, KD and models without a
separate head module.
"""

from __future__ import annotations

import pytest
import torch
from llm_testing import VALIDATION
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.testing import assert_states_equal, read_jsonl, train_inprocess
from automodel.training.loss import IGNORE_INDEX, MaskedCrossEntropy
from automodel.training.next_token import HeadOnPositions, label_positions


def tiny_llama(vocab: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config)


def padded_batch() -> dict[str, torch.Tensor]:
    """Two right-padded rows; labels only on each row's last few tokens (an SFT answer)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 10), generator=generator)
    mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 6:] = ids[0, 6:]
    labels[1, 4:7] = ids[1, 4:7]
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def test_label_positions_index_the_tokens_before_each_label():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6], [IGNORE_INDEX, 7, IGNORE_INDEX, IGNORE_INDEX]])
    index = label_positions(labels)
    assert index.tolist() == [1, 2, 4]  # row 0 positions 1, 2 predict 5, 6; row 1 position 0 predicts 7
    assert labels.view(-1)[index + 1].tolist() == [5, 6, 7]


def full_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return MaskedCrossEntropy()(logits[:, :-1], batch["labels"][:, 1:])


def test_head_projects_only_the_label_positions_with_the_same_loss_and_gradients():
    batch = padded_batch()
    reference, selected = tiny_llama(), tiny_llama()
    expected = full_loss(reference, batch)
    expected.backward()

    head = HeadOnPositions.attach(selected)
    assert head is not None
    index = label_positions(batch["labels"])
    with head.only(index):
        logits = selected(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert logits.shape == (index.numel(), 64)  # 6 + 2 label positions, not 2 x 10
    loss = MaskedCrossEntropy()(logits, batch["labels"].view(-1)[index + 1])
    loss.backward()

    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for (name, a), (_, b) in zip(reference.named_parameters(), selected.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)

    # Outside the block the head is the model's own again: logits for every position.
    full = selected(input_ids=batch["input_ids"]).logits
    assert full.shape == (2, 10, 64)


def test_no_separate_head_module_means_no_hook():
    class NoHead(torch.nn.Module):
        def get_output_embeddings(self):
            return None

    assert HeadOnPositions.attach(NoHead()) is None
    assert HeadOnPositions.attach(torch.nn.Linear(2, 2)) is None


def train(make_config, tmp_path, name, on, **sections):
    config = make_config(f"{name}.yaml", step_scheduler={"max_steps": 3, "val_check_interval": 3},
                         validation_dataset=VALIDATION, logits={"label_positions_only": on},
                         checkpoint={"enabled": False, "checkpoint_dir": str(tmp_path / name)}, **sections)
    recipe = train_inprocess(config)
    return recipe, read_jsonl(tmp_path / name / "training.jsonl"), read_jsonl(tmp_path / name / "validation.jsonl")


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_training_is_the_same_with_and_without(make_config, tmp_path, variant):
    extra = {"peft": {"dim": 4, "alpha": 8, "match_all_linear": True}} if variant == "lora" else {}
    on, on_rows, on_val = train(make_config, tmp_path, "on", True, **extra)
    off, off_rows, off_val = train(make_config, tmp_path, "off", False, **extra)
    assert on.head_positions is not None and off.head_positions is None
    assert len(on_rows) == len(off_rows) == 3 and len(on_val) == len(off_val) == 1
    for a, b in zip(on_rows, off_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for a, b in zip(on_val, off_val, strict=True):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    assert_states_equal(on.model.state_dict(), off.model.state_dict(), atol=1e-5)
