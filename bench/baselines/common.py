"""What the baselines share: the same data, model, schedule and loss as an `automodel finetune llm` run.

Deliberately free of any `automodel` import: the baselines are what a user would write by hand with plain
PyTorch / transformers, so that comparing against them measures the framework, not a shared code path.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

IGNORE_INDEX = -100


def now() -> float:
    return time.time()


def read_rows(path: str, split: str) -> list[dict[str, Any]]:
    """SQuAD-style rows from ``<dir>/<split>.jsonl`` or a single ``.jsonl`` file."""
    p = Path(path)
    file = p if p.is_file() else p / f"{split}.jsonl"
    with open(file, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenize_squad(tokenizer: Any, rows: list[dict[str, Any]], max_seq_length: int | None,
                   truncation: bool) -> list[dict[str, list[int]]]:
    """``<bos> Context: .. Question: .. Answer:`` + `` answer </s>``, loss on the answer tokens only."""
    samples = []
    for row in rows:
        answers = row["answers"]
        answer = answers["text"][0] if isinstance(answers, dict) else answers[0]
        prompt = f"Context: {row['context']} Question: {row['question']} Answer:"
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer_ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, labels = prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids
        if max_seq_length is not None and len(ids) > max_seq_length:
            if not truncation:
                raise SystemExit(f"sample with {len(ids)} tokens > max_seq_length {max_seq_length}")
            ids, labels = ids[:max_seq_length], labels[:max_seq_length]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            continue
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def pad_collate(batch: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, Any]:
    import torch

    longest = max(len(s["input_ids"]) for s in batch)
    input_ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, s in enumerate(batch):
        n = len(s["input_ids"])
        input_ids[i, :n] = torch.tensor(s["input_ids"])
        labels[i, :n] = torch.tensor(s["labels"])
        mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(config_path: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(Path(config_path).read_text(encoding="utf-8"))
    model_type = data.pop("model_type")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **data))


def cosine_warmup(warmup_steps: int, total_steps: int, base_lr: float, min_lr: float):
    """LambdaLR factor: linear warmup, then cosine to ``min_lr`` at ``total_steps``."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps <= warmup_steps:
            decay = 1.0
        else:
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return (min_lr + (base_lr - min_lr) * decay) / base_lr

    return factor


class EpochShuffle:
    """A seeded shuffle: each epoch one ``torch.randperm`` from a single generator (what the engine's stateful
    sampler draws too; torch's own RandomSampler draws one extra permutation per epoch, so its later epochs
    would differ and the sides would not see the same batches)."""

    def __init__(self, n: int, seed: int):
        import torch

        self.n = n
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import torch

        return iter(torch.randperm(self.n, generator=self.generator).tolist())


def add_common_args(parser: Any) -> None:
    parser.add_argument("--model-config", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--val-data", default=None, help="also load (tokenize) this validation split")
    parser.add_argument("--max-seq-length", type=int, default=None)
    parser.add_argument("--truncation", action="store_true")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), help="AdamW betas")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", required=True, help="JSONL: one line per optimizer step")


def prepare(description: str) -> tuple[Any, StepLog, Any, Any, list[dict[str, Any]]]:
    """Parse the common arguments and build, in the engine's order, what every baseline starts from:
    ``(args, log, tokenizer, model, samples)`` (the validation split is tokenized as the engine's setup does)."""
    import argparse

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=description)
    add_common_args(parser)
    args = parser.parse_args()
    log = StepLog(args.out)
    seed_everything(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = build_model(args.model_config)
    samples = tokenize_squad(tokenizer, read_rows(args.data, "train"), args.max_seq_length, args.truncation)
    if args.val_data:
        tokenize_squad(tokenizer, read_rows(args.val_data, "validation"), args.max_seq_length, args.truncation)
    return args, log, tokenizer, model, samples


class StepLog:
    """One JSON line per optimizer step: step, loss, tokens (non-padding input tokens), timestamp, cpu (the
    process's CPU seconds so far)."""

    def __init__(self, path: str):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115

    def write(self, **record: Any) -> None:
        record["timestamp"] = now()
        record["cpu"] = time.process_time()
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def env_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS")
    return int(value) if value else None
