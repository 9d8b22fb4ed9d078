"""A hand-written PyTorch training loop: the baseline for `automodel finetune llm`'s framework overhead.

Same job as the engine's: model built from the same config.json after seeding python/numpy/torch with the same
seed, the same tokenized SQuAD samples, the same shuffled order (one seeded randperm per epoch), the same batch size,
torch AdamW, linear-warmup + cosine LR schedule, global grad-norm clipping and token-weighted cross entropy
(sum over label tokens / label tokens). It logs one JSON line per optimizer step (step, loss, tokens =
non-padding input tokens, timestamp), like the engine's training.jsonl with log_interval 1.
"""

from __future__ import annotations

import functools

from common import EpochShuffle, cosine_warmup, pad_collate, prepare  # the script's directory is on sys.path


def main() -> None:
    args, log, tokenizer, model, samples = prepare(__doc__)

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    loader = DataLoader(samples, batch_size=args.batch_size, sampler=EpochShuffle(len(samples), args.seed),
                        collate_fn=functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=tuple(args.betas),
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_warmup(args.warmup_steps, args.max_steps, args.lr, args.min_lr))

    model.train()
    step = 0
    while step < args.max_steps:
        for batch in loader:
            tokens = int(batch["attention_mask"].sum())
            labels = batch["labels"]
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           use_cache=False).logits
            shift_labels = labels[:, 1:].reshape(-1)
            loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shift_labels,
                                       ignore_index=-100, reduction="sum")
            loss = loss_sum / max(int((shift_labels != -100).sum()), 1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            log.write(step=step, loss=loss.item(), tokens=tokens)
            if step >= args.max_steps:
                break
    log.close()


if __name__ == "__main__":
    main()
