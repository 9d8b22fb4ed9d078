"""The engine's training loop and the hand-written loop in ONE process, interleaved step by step.

On a shared machine two runs minutes apart meet different competition; here every engine step is immediately
followed by a hand-loop step on the same batch order, so whatever else runs hits both within milliseconds.
The engine runs its real ``run_train_validation_loop`` (built from the same config the CLI uses); its data
loader is wrapped so that each time the loop asks for the next batch, one hand-loop step runs first. The engine's
step time = from handing it a batch to its next request, plus fetching that batch from its own loader (so its
data loading, train_step, logging, progress bar and schedulers all count); the hand step time is the wrapped
call. Wall and thread-CPU seconds are both recorded. Prints one JSON object.

  .venv/bin/python bench/interleave.py --model-config C --tokenizer T --data D --steps 100 [-- --a.b value ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "baselines"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-config", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("overrides", nargs="*", help="more engine overrides (--a.b value)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from common import EpochShuffle, build_model, cosine_warmup, pad_collate, read_rows, seed_everything, tokenize_squad
    from torch.utils.data import DataLoader

    from automodel.cli.execute import import_recipe, load_and_validate, resolve_config_path
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    recipe_cls = import_recipe(manager.routes.get("finetune", "llm").recipe)
    overrides = ["--checkpoint.checkpoint_dir", args.run_dir, "--checkpoint.enabled", "false",
                 "--eval_generation.enabled", "false", "--step_scheduler.max_steps", str(args.steps),
                 "--step_scheduler.log_interval", str(args.log_interval),
                 "--step_scheduler.val_check_interval", "null", "--model.config", args.model_config,
                 "--tokenizer.pretrained_model_name_or_path", args.tokenizer, "--dataset.dataset_name", args.data,
                 "--validation_dataset.dataset_name", args.data,
                 "--dataset.max_seq_length", str(args.max_seq_length), "--dataloader.batch_size",
                 str(args.batch_size), "--rng.seed", str(args.seed), *args.overrides]
    cfg = load_and_validate(recipe_cls, resolve_config_path("llm/tiny_squad", manager), overrides, manager)
    recipe = recipe_cls(cfg)
    recipe.setup()

    # the hand loop: same seed before its model, same data, schedule and optimizer settings as the config
    seed_everything(args.seed)
    model = build_model(args.model_config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    samples = tokenize_squad(tokenizer, read_rows(args.data, "train"), args.max_seq_length, False)
    loader = DataLoader(samples, batch_size=args.batch_size, sampler=EpochShuffle(len(samples), args.seed),
                        collate_fn=functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id))
    opt_cfg, sched_cfg = cfg.optimizer, cfg.lr_scheduler
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]),
                                  weight_decay=opt_cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_warmup(
        sched_cfg["warmup_steps"], args.steps, opt_cfg["lr"], sched_cfg["min_lr"]))
    max_norm = cfg.clip_grad_norm.max_norm
    model.train()

    def batches():
        while True:
            yield from loader

    hand_batches = batches()
    hand_losses: list[float] = []

    def hand_step() -> int:
        batch = next(hand_batches)
        tokens = int(batch["attention_mask"].sum())
        labels = batch["labels"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        shift = labels[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shift, ignore_index=-100,
                               reduction="sum") / max(int((shift != -100).sum()), 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if len(hand_losses) % args.log_interval == args.log_interval - 1:
            hand_losses.append(loss.item())  # the engine syncs .item() on its log steps too
        else:
            hand_losses.append(float("nan"))
        return tokens

    records: list[dict[str, float]] = []

    class Interleaved:
        """The engine's loader; each request for a batch first runs one hand step."""

        def __init__(self, inner):
            self.inner = inner
            self.last_yield: tuple[float, float] | None = None

        def __len__(self):
            return len(self.inner)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __iter__(self):
            iterator = iter(self.inner)
            while True:
                try:
                    batch = next(iterator)  # the engine's own data loading counts as the engine's
                except StopIteration:
                    return
                got = (time.perf_counter(), time.thread_time())
                tokens = hand_step()
                h1 = (time.perf_counter(), time.thread_time())
                if self.last_yield is not None:
                    records.append({
                        "engine_wall": got[0] - self.last_yield[0],
                        "engine_cpu": got[1] - self.last_yield[1],
                        "hand_wall": h1[0] - got[0], "hand_cpu": h1[1] - got[1], "hand_tokens": tokens})
                self.last_yield = (time.perf_counter(), time.thread_time())
                yield batch

    recipe.dataloader = Interleaved(recipe.dataloader)
    recipe.run_train_validation_loop()
    timed = records[args.warmup:]
    out = {"steps": len(records), "timed_steps": len(timed), "records": records}
    for key in ("wall", "cpu"):
        engine, hand = sum(r[f"engine_{key}"] for r in timed), sum(r[f"hand_{key}"] for r in timed)
        out[f"engine_{key}_s"], out[f"hand_{key}_s"] = engine, hand
        out[f"throughput_ratio_{key}"] = hand / engine  # same tokens each step: automodel/hand tokens per second
        out[f"median_step_ratio_{key}"] = statistics.median(r[f"hand_{key}"] / r[f"engine_{key}"] for r in timed)
        out[f"engine_minus_hand_ms_per_step_{key}"] = (engine - hand) / len(timed) * 1e3
    engine_losses = [json.loads(line)["loss"] for line in (Path(args.run_dir) / "training.jsonl").open()]
    logged = [x for x in hand_losses if x == x]
    out["same_losses"] = len(logged) >= len(engine_losses) - 1 and all(
        abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(engine_losses, logged, strict=False))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
