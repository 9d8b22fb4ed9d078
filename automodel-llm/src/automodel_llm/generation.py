"""Greedy-generation evaluation: answer held-out questions and report exact match."""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def greedy_answer(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, device: torch.device) -> str:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def exact_match(model: Any, tokenizer: Any, pairs: list[tuple[str, str]], max_new_tokens: int,
                device: torch.device) -> tuple[float, list[tuple[str, str, str]]]:
    """Accuracy over (prompt, answer) pairs and the (prompt, expected, generated) triples."""
    was_training = model.training
    model.eval()
    try:
        results = [(prompt, answer, greedy_answer(model, tokenizer, prompt, max_new_tokens, device))
                   for prompt, answer in pairs]
    finally:
        model.train(was_training)
    correct = sum(1 for _, expected, got in results if got.strip() == expected.strip())
    return correct / max(len(results), 1), results
