"""Two CPU ranks (gloo): the in-batch negatives are gathered across ranks with their gradients, so DDP and FSDP2
with batch B per rank train exactly as one process with batch 2B (same loss at every step)."""

from __future__ import annotations

import json

import pytest
from retrieval_testing import BI_ENCODER, DATA, write_config

from automodel.testing import free_port, read_jsonl, run_cli

STEPS = 4


def _rows() -> list[dict]:
    """32 rows with 0-3 hard negatives (ranks hold different document counts: the gather pads) and, in row 1,
    a second positive that is row 0's positive: rows 0 and 1 land on different ranks, and row 0's document must
    not count as a negative of row 1's query there either."""
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()[:32]]
    for index, row in enumerate(rows):
        row["negatives"] = row["negatives"][: index % 4]
    rows[1]["positives"] = [rows[1].pop("positive"), rows[0]["positive"]]
    return rows


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("gathered")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _rows()))
    return write_config(root / "cfg.yaml", BI_ENCODER, validation_dataset=None,
                        step_scheduler={"max_steps": STEPS, "checkpoint_interval": STEPS},
                        dataset={"path": str(data), "num_negatives": None, "expand_positives": False},
                        dataloader={"batch_size": 8, "shuffle": False},
                        model={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})


def _losses(directory) -> list[float]:
    return [row["loss"] for row in read_jsonl(directory / "training.jsonl")]


@pytest.fixture(scope="module")
def single_process(config, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "ckpt"
    result = run_cli("finetune", "retrieval", "-c", config, "--checkpoint.checkpoint_dir", out, cwd=config.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return _losses(out)


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])
def test_two_ranks_with_half_the_batch_equal_one_process(strategy, config, single_process, tmp_path):
    out = tmp_path / "ckpt"
    result = run_cli("finetune", "retrieval", "-c", config, "--dataloader.batch_size", 4, "--distributed.strategy",
                     strategy, "--nproc-per-node", 2, "--master-port", free_port(), "--checkpoint.checkpoint_dir", out,
                     cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"sharding [{strategy}]" in result.stderr
    assert len(single_process) == STEPS
    assert _losses(out) == pytest.approx(single_process, rel=1e-5)
