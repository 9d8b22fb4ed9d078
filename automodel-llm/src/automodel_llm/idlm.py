"""I-DLM (introspective diffusion LM, ``dllm.mode: idlm``): a causal LM fine-tuned to decode masked tokens, upstream's
all-masked objective (Yu et al., 2026).

Each row runs once as ``[x_t | x_0]``: ``x_t`` is the row with every supervised token replaced by the mask token,
``x_0`` the clean row, both at positions ``0 .. L-1``. The attention mask (:func:`idlm_attention`) lets an ``x_t``
token see its own block of ``x_t`` causally and the clean tokens of earlier blocks; the clean copy is plain causal.
Position ``i`` of either half predicts token ``i + 1``, supervised where that token is an answer token: the loss is
``CE(x_t) + clean_loss_weight * CE(x_0)`` (or, ``auto_balance_clean_loss``, the weight ``CE(x_t) / CE(x_0)`` of the
micro-batch, not differentiated), over the step's answer tokens.
"""

from __future__ import annotations

import torch

# The attention implementations the dense ``[2L, 2L]`` mask is given to (a boolean mask to SDPA, an additive one to
# eager attention); FlashAttention ignores a 4D mask and flex attention takes a BlockMask.
MASKED_ATTENTION = ("sdpa", "eager")


def idlm_attention(length: int, block: int, valid: torch.Tensor, additive: bool) -> torch.Tensor:
    """``[rows, 1, 2L, 2L]``: which keys each query of ``[x_t | x_0]`` attends (True; with ``additive``, 0 and -inf
    in float32 instead). An ``x_t`` query attends the ``x_t`` keys of its own block up to itself and the ``x_0``
    keys of strictly earlier blocks; an ``x_0`` query the ``x_0`` keys up to itself. Padding keys (``valid`` 0, per
    copy ``[rows, L]``) are attended by nothing."""
    position = torch.arange(2 * length, device=valid.device)
    clean = position >= length
    block_of = torch.where(clean, position - length, position) // block
    query, key = position[:, None], position[None, :]
    noisy_query, clean_key = ~clean[:, None], clean[None, :]
    same_block = (block_of[:, None] == block_of[None, :]) & noisy_query & ~clean_key & (query >= key)
    earlier_clean = (block_of[:, None] > block_of[None, :]) & noisy_query & clean_key
    clean_causal = clean[:, None] & clean_key & (query >= key)
    keys = torch.cat([valid, valid], dim=1).bool()[:, None, None, :]
    allowed = (same_block | earlier_clean | clean_causal)[None, None] & keys
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, device=valid.device).masked_fill(~allowed, float("-inf"))


def idlm_inputs(ids: torch.Tensor, answers: torch.Tensor, valid: torch.Tensor, mask_token_id: int, block: int,
                additive: bool) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for rows ``ids`` whose answer tokens (``answers``) are masked in ``x_t``."""
    length = ids.shape[1]
    noisy = torch.where(answers, mask_token_id, ids)
    positions = torch.arange(length, device=ids.device).repeat(2).expand(ids.shape[0], -1)
    return {"input_ids": torch.cat([noisy, ids], dim=1), "position_ids": positions,
            "attention_mask": idlm_attention(length, block, valid, additive), "use_cache": False}


def idlm_targets(labels: torch.Tensor) -> torch.Tensor:
    """``[rows, 2L]``: each position's target in both halves, the next token where it is an answer token
    (``labels`` holds the answer tokens at their own positions), ``-100`` elsewhere."""
    following = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    return torch.cat([following, following], dim=1)
