"""The same job as `automodel finetune llm` / hand_loop.py, run by `transformers.Trainer`.

Same model (config.json after seeding), same tokenized samples in the same shuffled order (the train sampler is
the same seeded per-epoch randperm as the other two), same batch size, the same torch AdamW and LR schedule (passed in
through ``optimizers=``), grad-norm clipping (``max_grad_norm``) and token-weighted cross entropy (the model's
loss with Trainer's ``num_items_in_batch``). Logs one JSON line per optimizer step like hand_loop.py.
"""

from __future__ import annotations

import functools
import tempfile

from common import EpochShuffle, cosine_warmup, pad_collate, prepare  # the script's directory is on sys.path


def main() -> None:
    args, log, tokenizer, model, samples = prepare(__doc__)

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    collated_tokens: list[int] = []  # in batch order; the loader may run one batch ahead of the step

    def collate(batch):
        out = pad_collate(batch, pad_token_id=tokenizer.pad_token_id)
        collated_tokens.append(int(out["attention_mask"].sum()))
        return out

    class SeededSamplerTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return EpochShuffle(len(train_dataset if train_dataset is not None else self.train_dataset), args.seed)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.pending: dict[int, float] = {}

        def on_step_end(self, targs, state, control, **kwargs):
            self.pending[state.global_step] = 0.0  # loss arrives in on_log just after

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and state.global_step in self.pending:
                step = state.global_step
                log.write(step=step, loss=float(logs["loss"]), tokens=collated_tokens[step - 1])
                del self.pending[step]

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=tuple(args.betas),
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_warmup(args.warmup_steps, args.max_steps, args.lr, args.min_lr))
    with tempfile.TemporaryDirectory() as out_dir:
        targs = TrainingArguments(
            output_dir=out_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=1, learning_rate=args.lr, max_grad_norm=args.max_norm,
            logging_strategy="steps", logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
            dataloader_pin_memory=False, dataloader_num_workers=0, remove_unused_columns=False, seed=args.seed,
            use_cpu=True, disable_tqdm=False)
        trainer = SeededSamplerTrainer(model=model, args=targs, train_dataset=samples,
                                       data_collator=functools.partial(collate), optimizers=(optimizer, scheduler),
                                       callbacks=[StepTimes()])
        trainer.train()
    log.close()


if __name__ == "__main__":
    main()
