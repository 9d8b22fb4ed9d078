"""``distributed.activation_checkpointing: true`` through the real recipe in one process: every transformer block
recomputes its activations in backward, so the losses stay those of the run without it while the peak memory of a
long-sequence run drops (training.jsonl's ``mem``: the process's peak resident memory). The same with FSDP2 is in
test_fsdp.py (HSDP), with DDP in test_distributed.py."""

from __future__ import annotations

import json

import pytest
from llm_testing import losses

from automodel.testing import read_jsonl, run_cli

# A 4-block Llama on 1024-token rows: eager attention keeps a [4, 4, 1024, 1024] probability tensor per block for
# backward (64 MB each), which checkpointing recomputes instead of keeping.
LONG_ROWS = ["--dataset._target_", "automodel_llm.datasets.MockDataset", "--dataset.num_samples", "8",
             "--dataset.seq_length", "1024", "--dataloader.batch_size", "4", "--step_scheduler.max_steps", "2",
             "--model.attn_implementation", "eager", "--checkpoint.enabled", "false"]


@pytest.mark.slow  # make test-slow: three CLI runs of 1024-token rows; the default run compares checkpointed
# losses with one process's on two ranks (test_distributed.py) and counts the recomputed matmuls (below)
def test_checkpointing_keeps_the_losses_and_lowers_the_peak_memory(tmp_path, tiny_llama_config, make_config):
    model_config = json.loads(tiny_llama_config.read_text())
    model_config.update(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=16, max_position_embeddings=1024)
    (tmp_path / "model.json").write_text(json.dumps(model_config))
    config = make_config(model={"config": str(tmp_path / "model.json")},
                         dataset={"dataset_name": None, "split": None, "max_seq_length": None,
                                  "limit_dataset_samples": None})
    runs = {}
    for name, flag in (("plain", "false"), ("checkpointed", "true"), ("selective", "selective")):
        result = run_cli("finetune", "llm", "-c", config, *LONG_ROWS, "--distributed.activation_checkpointing", flag,
                         "--checkpoint.checkpoint_dir", tmp_path / name, cwd=tmp_path, OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = result.stderr
    assert "activation checkpointing on 4 transformer blocks" in runs["checkpointed"]
    assert "activation checkpointing" not in runs["plain"]
    assert "selective activation checkpointing on 4 transformer blocks" in runs["selective"]
    for name in ("checkpointed", "selective"):
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "plain"), rel=1e-6, abs=1e-6)
    peak = {name: max(row["mem"] for row in read_jsonl(tmp_path / name / "training.jsonl")) for name in runs}
    # the plain run keeps 4 blocks' attention probabilities (256 MB); checkpointing keeps about one block's
    assert peak["checkpointed"] < peak["plain"] - 0.1, peak  # GiB



def _backward_matmuls_and_grads(selective: bool | None) -> tuple[int, list]:
    """Matmuls run during one backward of a tiny 2-block Llama (None: not checkpointed) and the gradients."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing

    class CountMatmuls(TorchDispatchMode):
        """Counts the matmuls run once ``counting`` is set (the mode is on in forward too, so that both passes
        dispatch the same ops, which selective checkpointing's replay relies on)."""
        counting, count = False, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.counting and func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                          torch.ops.aten.bmm.default):
                self.count += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    if selective is not None:
        assert apply_activation_checkpointing(model, selective=selective) == 2
    ids = torch.randint(0, 64, (2, 16))
    with CountMatmuls() as mode:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as the recipe calls it
        mode.counting = True
        loss.backward()
    return mode.count, [p.grad.clone() for p in model.parameters()]


def test_selective_checkpointing_recomputes_fewer_matmuls_than_full_with_the_same_gradients():
    """upstream's activation_checkpointing: selective keeps attention's and every other matmul's outputs: its
    backward reruns some of the forward's matmuls (more than none), fewer than full checkpointing, and the
    gradients are those of the model without checkpointing."""
    import torch

    plain, plain_grads = _backward_matmuls_and_grads(None)
    full, full_grads = _backward_matmuls_and_grads(False)
    selective, selective_grads = _backward_matmuls_and_grads(True)
    assert plain < selective < full, (plain, selective, full)
    for grads in (full_grads, selective_grads):
        for got, want in zip(grads, plain_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
