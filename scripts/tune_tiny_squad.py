#!/usr/bin/env python
"""Hand-written PyTorch loop used to find the tiny SQuAD example's hyper-parameters.

It mirrors what the training tool does for the embedded ``tiny_squad`` example
(prompt format, masking, loss normalisation, optimiser, LR schedule, greedy
exact-match evaluation) without depending on the tool, so the numbers it prints
document how the example's defaults were chosen.

Usage (defaults are the chosen hyper-parameters)::

    python scripts/tune_tiny_squad.py
    python scripts/tune_tiny_squad.py --seeds 0 1 2
    python scripts/tune_tiny_squad.py --hidden-size 96 --layers 2 --max-steps 150

Options that change the model override the values in
``tiny_llama/config.json``.

Findings (2 CPU threads, torch 2.13 CPU, transformers 5.x; the training time
excludes imports and the intermediate validation-loss evaluations):

* Chosen: the 2-layer config.json model (hidden 128, 4 heads, MLP 256, tied
  embeddings, ~0.39M parameters), batch 64, no accumulation, 500 steps,
  AdamW lr 3e-3 betas (0.9, 0.95) weight_decay 0.1 (on all parameters),
  warmup 30 then cosine to 3e-4, grad clip 1.0.  ~25 s on an idle machine;
  validation EM 0.99-1.00 for seeds 0, 1, 2, 3, 4, 42; validation loss
  6.3 -> ~0.2-0.9 (step 100) -> <0.03 (step 500).
* Adam beta2 matters: with the default 0.999, 500 steps give EM 0.84-0.87;
  300 steps give 0.78-0.80.  weight_decay 0.01 instead of 0.1 leaves some
  seeds stuck at ~0.94 (one category memorised instead of copied).
* 300 steps (even with beta2 0.95) are seed dependent (0.84-1.00).
  lr 6e-3 and 1e-2 diverge / stall; batch 128 with half the steps is worse
  than batch 64: the number of optimizer steps is what counts here.
* Data design: shuffled fact order or "Who ...?" questions, and larger word
  lists, were much slower to generalise (the model memorises the 800 training
  rows before it learns to copy); see scripts/make_tiny_squad.py.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

ASSETS = (
    Path(__file__).resolve().parent.parent / "automodel-llm/src/automodel_llm/examples/assets"
)


def load_rows(path: Path):
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def encode(tok, row, max_seq_length):
    answer = row["answers"]["text"][0]
    prompt = f"Context: {row['context']} Question: {row['question']} Answer:"
    prompt_ids = tok(prompt)["input_ids"]
    answer_ids = tok(" " + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    input_ids = (prompt_ids + answer_ids)[:max_seq_length]
    labels = ([-100] * len(prompt_ids) + answer_ids)[:max_seq_length]
    qtype = " ".join(row["question"].split()[:2])
    return {"input_ids": input_ids, "labels": labels, "prompt_ids": prompt_ids, "answer": answer,
            "qtype": qtype}


def collate(examples, pad_id):
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return ids, labels, mask


def lr_at(step, max_steps, warmup_steps, lr, min_lr):
    """LR for 0-based optimizer step: linear warmup, then cosine to min_lr."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(1.0, progress)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def summed_loss(model, ids, labels, mask):
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=mask).logits
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100,
        reduction="sum",
    )
    return loss_sum, int((target != -100).sum())


def eval_loss(model, examples, pad_id, batch_size=128):
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            s, n = summed_loss(model, *collate(examples[i : i + batch_size], pad_id))
            total += float(s)
            count += n
    model.train()
    return total / max(1, count)


def exact_match(model, tok, examples, max_new_tokens=4):
    """Greedy generation per row (batched by left padding), EM on the answer."""
    import torch

    model.eval()
    correct = 0
    preds = []
    with torch.no_grad():
        for i in range(0, len(examples), 128):
            chunk = examples[i : i + 128]
            width = max(len(e["prompt_ids"]) for e in chunk)
            ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, e in enumerate(chunk):
                n = len(e["prompt_ids"])
                ids[j, width - n :] = torch.tensor(e["prompt_ids"])
                mask[j, width - n :] = 1
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            )
            for j, e in enumerate(chunk):
                new = out[j, width:].tolist()
                if tok.eos_token_id in new:
                    new = new[: new.index(tok.eos_token_id)]
                pred = tok.decode(new, skip_special_tokens=True).strip()
                preds.append(pred)
                correct += pred == e["answer"]
    model.train()
    return correct / max(1, len(examples)), preds


def run(args, seed):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    train = [encode(tok, r, args.max_seq_length) for r in load_rows(args.data / "train.jsonl")]
    val = [encode(tok, r, args.max_seq_length) for r in load_rows(args.data / "validation.jsonl")]

    cfg = json.loads(args.config.read_text())
    for key, value in (
        ("hidden_size", args.hidden_size),
        ("num_hidden_layers", args.layers),
        ("num_attention_heads", args.heads),
        ("num_key_value_heads", args.kv_heads),
        ("intermediate_size", args.intermediate_size),
    ):
        if value is not None:
            cfg[key] = value
    if args.heads is not None and args.kv_heads is None:
        cfg["num_key_value_heads"] = args.heads
    config = LlamaConfig(**cfg)
    assert config.vocab_size == len(tok), (config.vocab_size, len(tok))

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.float().train()
    n_params = sum(p.numel() for p in model.parameters())

    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}] if args.no_decay_norms
        else model.parameters(),
        lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, args.beta2),
    )

    gen = torch.Generator().manual_seed(seed)
    order, pos, epoch = [], 0, 0
    micro = args.batch_size

    def next_batch():
        nonlocal order, pos, epoch
        if pos + micro > len(order):  # new epoch (drop the ragged tail)
            order = torch.randperm(len(train), generator=gen).tolist()
            pos = 0
            epoch += 1
        batch = [train[k] for k in order[pos : pos + micro]]
        pos += micro
        return batch

    curve = [(0, eval_loss(model, val, tok.pad_token_id))]
    t0 = time.perf_counter()
    c0 = time.process_time()
    t_eval = c_eval = 0.0
    for step in range(args.max_steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.max_steps, args.warmup_steps, args.lr, args.min_lr)
        batches = [collate(next_batch(), tok.pad_token_id) for _ in range(args.grad_accum)]
        n_tokens = sum(int((b[1][:, 1:] != -100).sum()) for b in batches)
        step_loss = 0.0
        for ids, labels, mask in batches:
            s, _ = summed_loss(model, ids, labels, mask)
            (s / n_tokens).backward()
            step_loss += float(s.detach()) / n_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.max_steps:
            te, ce = time.perf_counter(), time.process_time()
            curve.append((step + 1, eval_loss(model, val, tok.pad_token_id)))
            if args.verbose:
                print(f"  step {step + 1:4d} train {step_loss:.3f} val {curve[-1][1]:.3f}", flush=True)
            t_eval += time.perf_counter() - te
            c_eval += time.process_time() - ce
    train_s = time.perf_counter() - t0 - t_eval
    train_cpu_s = time.process_time() - c0 - c_eval
    curve.append((args.max_steps, eval_loss(model, val, tok.pad_token_id)))
    te = time.perf_counter()
    em, preds = exact_match(model, tok, val)
    em_s = time.perf_counter() - te
    train_em, _ = exact_match(model, tok, train[:100])
    em_single = None
    if args.check_unbatched:  # one prompt at a time, no padding: must agree
        correct = 0
        model.eval()
        with torch.no_grad():
            for e in val:
                ids = torch.tensor([e["prompt_ids"]])
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=4, do_sample=False,
                                     pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
                if tok.eos_token_id in out:
                    out = out[: out.index(tok.eos_token_id)]
                correct += tok.decode(out, skip_special_tokens=True).strip() == e["answer"]
        em_single = correct / len(val)
    return {
        "seed": seed, "params": n_params, "train_s": train_s, "train_cpu_s": train_cpu_s, "eval_em_s": em_s,
        "em": em, "em_single": em_single, "train_em_100": train_em, "epochs": epoch, "curve": curve,
        "by_type": by_type(val, preds),
        "wrong": [(e["answer"], p) for e, p in zip(val, preds, strict=False) if p != e["answer"]][:5],
    }


def by_type(examples, preds):
    stats = {}
    for e, p in zip(examples, preds, strict=False):
        ok, n = stats.get(e["qtype"], (0, 0))
        stats[e["qtype"]] = (ok + (p == e["answer"]), n + 1)
    return " ".join(f"{k.replace(' ', '_')}={ok}/{n}" for k, (ok, n) in sorted(stats.items()))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=ASSETS / "tiny_squad")
    p.add_argument("--tokenizer", type=Path, default=ASSETS / "tiny_tokenizer")
    p.add_argument("--config", type=Path, default=ASSETS / "tiny_llama/config.json")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--no-decay-norms", action="store_true")
    p.add_argument("--max-seq-length", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[42])
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--check-unbatched", action="store_true",
                   help="also score EM generating one unpadded prompt at a time")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        r = run(args, seed)
        curve = " ".join(f"{s}:{loss:.3f}" for s, loss in r["curve"])
        print(
            f"seed {seed}: params {r['params']} train {r['train_s']:.1f}s wall / {r['train_cpu_s']:.1f}s cpu, "
            f"epochs {r['epochs']} "
            f"EM {r['em']:.2f}"
            + (f" (unbatched {r['em_single']:.2f})" if r["em_single"] is not None else "")
            + f" (train EM {r['train_em_100']:.2f}, eval {r['eval_em_s']:.1f}s) "
            f"val loss {curve}\n    by type: {r['by_type']}\n    wrong: {r['wrong']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
