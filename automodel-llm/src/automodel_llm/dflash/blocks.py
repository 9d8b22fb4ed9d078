"""The blocks of DFlash training: which anchors a row offers, the blocks drawn from them (each row's draws from its
own generator), their tokens, positions and attention mask, and the decay-weighted cross entropy of the drafted
slots with the counts validation reports.

A block anchored at position ``a`` shows its first ``l`` tokens (``l = 1``, the anchor alone, under the ``dflash``
loss; a drawn prefix under ``variable_prefix``) and mask tokens after them; its slot ``k`` drafts the token at
``a + k``. Its positions attend to the target's states at positions ``< a`` (within ``sliding_window`` of their
own) and to all of the block's positions. Anchors are label tokens with a whole block after them
(``a <= length - block_size``, the row's real length), so every slot lies inside the row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


def anchor_candidates(supervised: torch.Tensor, block_size: int, lengths: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` booleans: the label tokens a block can start at, a whole block of the row's ``lengths``
    real tokens after them (so the candidates of a row do not depend on the padding of its batch)."""
    positions = torch.arange(supervised.shape[1], device=supervised.device)
    return supervised.bool() & (positions <= lengths.to(supervised.device).unsqueeze(1) - block_size)


@dataclass
class Blocks:
    anchors: torch.Tensor  # [batch, n] long: each block's first position (0 where unused)
    used: torch.Tensor  # [batch, n] bool: the block was drawn (rows with fewer candidates fill up with unused ones)
    shown: torch.Tensor  # [batch, n] long: how many of the block's first tokens are real (the rest are masks)

    def __len__(self) -> int:
        return self.anchors.shape[1]


def draw_blocks(candidates: torch.Tensor, num_anchors: int, block_size: int, generators: list[torch.Generator],
                prefix_weight_base: float | None) -> Blocks:
    """Each row's blocks: ``min(num_anchors, candidates)`` distinct anchors drawn from its generator, in order;
    with ``prefix_weight_base`` (``variable_prefix``) each block's shown prefix ``l`` in ``2 .. block_size - 1``
    (1 for blocks of 2) drawn from the same generator with weights ``base^l``, else 1. Drawn on the host. A row
    without candidates gets one unused block, so the draft always runs (every rank runs the same collectives)."""
    rows = candidates.shape[0]
    chosen = []
    for row in range(rows):
        positions = candidates[row].nonzero().flatten().cpu()
        order = torch.randperm(len(positions), generator=generators[row])[:num_anchors]
        chosen.append(positions[order].sort().values)
    n = max(1, max(len(c) for c in chosen))
    anchors = torch.zeros(rows, n, dtype=torch.long)
    used = torch.zeros(rows, n, dtype=torch.bool)
    shown = torch.ones(rows, n, dtype=torch.long)
    low = min(2, block_size - 1)
    lengths = torch.arange(low, block_size, dtype=torch.float64)
    for row, picked in enumerate(chosen):
        anchors[row, :len(picked)], used[row, :len(picked)] = picked, True
        if prefix_weight_base is not None and len(picked):
            weights = prefix_weight_base ** (lengths - low)
            shown[row, :len(picked)] = low + torch.multinomial(weights, len(picked), replacement=True,
                                                               generator=generators[row])
    device = candidates.device
    return Blocks(anchors.to(device), used.to(device), shown.to(device))


def slot_positions(blocks: Blocks, block_size: int) -> torch.Tensor:
    """``[batch, n, block_size]``: the row position each block slot stands at."""
    return blocks.anchors.unsqueeze(-1) + torch.arange(block_size, device=blocks.anchors.device)


def block_tokens(ids: torch.Tensor, blocks: Blocks, block_size: int, mask_token_id: int) -> torch.Tensor:
    """``[batch, n x block_size]``: each block's shown tokens, then mask tokens (an unused block: masks only)."""
    slots = slot_positions(blocks, block_size).clamp(max=ids.shape[1] - 1)  # (a DSpark block may run past the row)
    offsets = torch.arange(block_size, device=ids.device)
    real = torch.gather(ids.unsqueeze(1).expand(-1, len(blocks), -1), 2, slots)
    shown = (offsets < blocks.shown.unsqueeze(-1)) & blocks.used.unsqueeze(-1)
    return torch.where(shown, real, mask_token_id).flatten(1)


def block_positions(context_positions: torch.Tensor, blocks: Blocks, block_size: int) -> torch.Tensor:
    """``[batch, c + n x block_size]``: the context's positions, then each block slot's (its anchor's + offset)."""
    start = torch.gather(context_positions, 1, blocks.anchors)
    slots = start.unsqueeze(-1) + torch.arange(block_size, device=start.device)
    return torch.cat([context_positions, slots.flatten(1)], dim=1)


def block_visibility(blocks: Blocks, context_length: int, block_size: int, sliding_window: int | None,
                     causal: bool = False) -> torch.Tensor:
    """``[batch, 1, n x block_size, c + n x block_size]`` booleans: which keys each block slot sees (the context
    before its anchor, within ``sliding_window`` of its own position; its block's slots, with ``causal`` (JetSpec)
    only those up to its own). An unused block sees its own slots only, so no row of the softmax is empty."""
    rows, n = blocks.anchors.shape
    device = blocks.anchors.device
    slot = torch.arange(n * block_size, device=device)
    anchor = blocks.anchors.repeat_interleave(block_size, dim=1).unsqueeze(-1)  # [batch, q, 1]
    key = torch.arange(context_length, device=device)
    before = (key < anchor) & blocks.used.repeat_interleave(block_size, dim=1).unsqueeze(-1)
    if sliding_window is not None:
        own = anchor + (slot % block_size).view(1, -1, 1)
        before &= own - key < sliding_window
    same_block = slot.view(-1, 1) // block_size == slot.view(1, -1) // block_size
    if causal:
        same_block &= slot.view(1, -1) <= slot.view(-1, 1)
    same_block = same_block.expand(rows, -1, -1)
    return torch.cat([before, same_block], dim=-1).unsqueeze(1)


def flex_block_mask(blocks: Blocks, context_length: int, block_size: int, sliding_window: int | None,
                    causal: bool = False) -> object:
    """:func:`block_visibility` as a flex attention ``BlockMask`` (computed block-sparse, never materialised)."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors, used = blocks.anchors, blocks.used

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        block, anchor = q // block_size, anchors[b, q // block_size]
        before = (kv < context_length) & (kv < anchor) & used[b, block]
        if sliding_window is not None:
            before &= anchor + q % block_size - kv < sliding_window
        own = (kv >= context_length) & ((kv - context_length) // block_size == block)
        if causal:
            own &= kv - context_length <= q
        return before | own

    rows, n = anchors.shape
    return create_block_mask(visible, rows, None, n * block_size, context_length + n * block_size,
                             device=anchors.device)


def drafted_slots(ids: torch.Tensor, supervised: torch.Tensor, blocks: Blocks, block_size: int,
                  gamma: float | None, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(targets, drafted, weights)``, each ``[batch, n, block_size]``: the token each slot drafts (the row's at
    ``anchor + shift + k``); whether it counts (a slot from ``l - shift`` on, ``l`` the block's shown prefix, whose
    token is a label token inside the row, in a used block); its weight in the loss, ``exp(-(k - l + shift) /
    gamma)`` where it counts (1 without ``gamma``), else 0."""
    positions = slot_positions(blocks, block_size) + shift
    n = len(blocks)
    inside = positions < ids.shape[1]
    positions = positions.clamp(max=ids.shape[1] - 1)
    targets = torch.gather(ids.unsqueeze(1).expand(-1, n, -1), 2, positions)
    labelled = torch.gather(supervised.unsqueeze(1).expand(-1, n, -1), 2, positions).bool() & inside
    after = torch.arange(block_size, device=ids.device) - (blocks.shown.unsqueeze(-1) - shift)  # 0: first drafted
    drafted = (after >= 0) & labelled & blocks.used.unsqueeze(-1)
    weights = drafted.float()
    if gamma is not None:
        weights = weights * torch.exp(-after.clamp(min=0).float() / gamma)
    return targets, drafted, weights


@dataclass
class BlockLoss:
    loss: torch.Tensor  # the drafted slots' cross entropy, summed with their weights
    weight: torch.Tensor  # the weights' sum (the loss's denominator)
    correct: torch.Tensor  # drafted slots whose greedy token is right
    counted: torch.Tensor  # drafted slots (label tokens)
    accepted: torch.Tensor  # over the used blocks: 1 + the right drafts before the first wrong one
    blocks: torch.Tensor  # used blocks with a drafted slot
    extra: tuple[torch.Tensor, ...] = ()  # a variant's further validation counts (DSpark's)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # named terms, summed with the weights (logged)


def agreement(drafts: torch.Tensor, reference: torch.Tensor, drafted: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(correct, counted, accepted, blocks)`` of greedy ``drafts`` against ``reference`` tokens over the
    ``drafted`` slots (``[batch, n, block_size]`` each): the right ones, the drafted ones, and, over the blocks with a
    drafted slot, 1 + the right drafts before the first wrong one (what a verifier accepts)."""
    right = (drafts == reference) & drafted
    # a slot not drafted (the prefix, or not a label) neither breaks nor lengthens the accepted run
    run = (right | ~drafted).long().cumprod(dim=-1) * drafted
    has_draft = drafted.any(dim=-1)
    return right.sum(), drafted.sum(), ((run.sum(dim=-1) + 1) * has_draft).sum(), has_draft.sum()


def block_loss(logits: torch.Tensor, ids: torch.Tensor, supervised: torch.Tensor, blocks: Blocks, block_size: int,
               gamma: float | None) -> BlockLoss:
    """DFlash's loss: the weighted cross entropy of ``logits`` (``[batch, n x block_size, vocab]``) against the
    tokens the drafted slots draft (:func:`drafted_slots`; the mean is ``loss / weight``); the greedy drafts counted
    against those tokens."""
    targets, drafted, weights = drafted_slots(ids, supervised, blocks, block_size, gamma)
    logits = logits.float().view(*targets.shape, -1)
    nll = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view_as(weights)
    return BlockLoss((nll * weights).sum(), weights.sum(), *agreement(logits.argmax(-1), targets, drafted))


def distillation_loss(logits: torch.Tensor, target_logits: torch.Tensor, ids: torch.Tensor,
                      supervised: torch.Tensor, blocks: Blocks, block_size: int, kl: Any) -> BlockLoss:
    """JetSpec's loss: ``kl`` (the forward KL, summed) between the target's distribution of the token each drafted
    slot drafts (its logits at the position before that token, on the row's own tokens) and the draft's, every
    drafted slot alike; the greedy drafts counted against the target's greedy tokens (its own choice is what a
    verifier accepts)."""
    targets, drafted, weights = drafted_slots(ids, supervised, blocks, block_size, None)
    before = (slot_positions(blocks, block_size) - 1).clamp(min=0).flatten(1)  # slot 0 is never drafted
    teacher = torch.gather(target_logits, 1, before.unsqueeze(-1).expand(-1, -1, target_logits.shape[-1]))
    teacher = teacher.view(*targets.shape, -1)
    student = logits.view(*targets.shape, -1)
    loss = kl(student, teacher, torch.where(drafted, targets, -100))
    return BlockLoss(loss, weights.sum(), *agreement(student.argmax(-1), teacher.argmax(-1), drafted))


def corrected_loss(base_logits: torch.Tensor, correction: torch.Tensor, ids: torch.Tensor,
                   supervised: torch.Tensor, blocks: Blocks, block_size: int, gamma: float | None, shift: int,
                   base_weight: float) -> BlockLoss:
    """Domino's loss: the drafted slots' weighted cross entropy of the corrected logits (``base_logits`` plus
    ``correction`` on the last ``correction.shape[2]`` slots of each block) times ``1 - base_weight``, plus that of
    the backbone's own logits times ``base_weight``; the corrected logits' greedy drafts counted."""
    targets, drafted, weights = drafted_slots(ids, supervised, blocks, block_size, gamma, shift)
    base = base_logits.float().view(*targets.shape, -1)
    start = block_size - correction.shape[2]
    final = torch.cat([base[:, :, :start], base[:, :, start:] + correction.float()], dim=2)

    def nll(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view_as(weights)

    per_slot = (1 - base_weight) * nll(final) + (base_weight * nll(base) if base_weight else 0)
    return BlockLoss((per_slot * weights).sum(), weights.sum(), *agreement(final.argmax(-1), targets, drafted))


def selector_loss(logits: torch.Tensor, candidates: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor,
                  supervised: torch.Tensor, blocks: Blocks, block_size: int, gamma: float | None,
                  selector_weight: float) -> BlockLoss:
    """DFlash 2's loss: DFlash's weighted cross entropy of ``logits`` plus ``selector_weight`` times the
    selector's: the cross entropy of ``scores`` (``[batch, q, top_k]``, each slot's ``candidates`` scored after the
    row's token before it) towards the candidate that is the drafted token, over the drafted slots whose token is
    among the candidates (the same weights), as a mean over the micro-batch (upstream's) brought to the block loss's
    scale. The greedy path of the selector's choices is counted."""
    targets, drafted, weights = drafted_slots(ids, supervised, blocks, block_size, gamma)
    logits = logits.float().view(*targets.shape, -1)
    nll = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view_as(weights)
    candidates = candidates.view(*targets.shape, -1)
    scores = scores.float().view(*targets.shape, -1)
    found = candidates == targets.unsqueeze(-1)
    found_weights = weights * found.any(dim=-1)
    choice = F.cross_entropy(scores.flatten(0, 2), found.long().argmax(dim=-1).flatten(),
                             reduction="none").view_as(weights)
    selected = (choice * found_weights).sum() / (found_weights.sum() + 1e-6)
    loss = (nll * weights).sum() + selector_weight * selected * weights.sum()
    path = torch.gather(candidates, -1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return BlockLoss(loss, weights.sum(), *agreement(path, targets, drafted))


def spark_candidates(supervised: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """DSpark's anchors (``[batch, seq]`` booleans): label tokens followed, inside the row's ``lengths`` real
    tokens, by a label token (the anchor's slot drafts it); a block running past the row or the labels is cut
    there (:func:`spark_slots`)."""
    positions = torch.arange(supervised.shape[1], device=supervised.device)
    labelled = supervised.bool()
    followed = torch.zeros_like(labelled)
    followed[:, :-1] = labelled[:, 1:]
    return labelled & followed & (positions < lengths.to(supervised.device).unsqueeze(1) - 1)


def spark_slots(ids: torch.Tensor, supervised: torch.Tensor, blocks: Blocks, block_size: int,
                gamma: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`drafted_slots` of DSpark's blocks (slot ``k`` drafts the token at ``anchor + 1 + k``, weighing
    ``exp(-k / gamma)``), each block's drafted slots cut at its first slot that does not count (upstream's contiguous
    supervision: a verifier never reaches past a rejected token)."""
    targets, drafted, weights = drafted_slots(ids, supervised, blocks, block_size, gamma, shift=1)
    drafted = drafted.long().cumprod(dim=-1).bool()
    return targets, drafted, weights * drafted


def spark_loss(logits: torch.Tensor, confidence: torch.Tensor | None, target_logits: torch.Tensor,
               ids: torch.Tensor, supervised: torch.Tensor, blocks: Blocks, block_size: int, gamma: float | None,
               ce_weight: float, l1_weight: float, confidence_weight: float) -> BlockLoss:
    """DSpark's loss over the drafted slots (:func:`spark_slots`, with their weights): ``ce_weight`` x the cross
    entropy of ``logits`` (``[batch, n, block, vocab]``) against the data's tokens + ``l1_weight`` x the L1 distance
    between the draft's distribution and the target's (its logits on the row at the position before the drafted
    token) + ``confidence_weight`` x the binary cross entropy of the ``confidence`` logits towards the acceptance
    probability ``1 - L1 / 2`` (its target, not trained through). Counted: the greedy drafts against the data's
    tokens, and in ``extra`` the expected accepted length of the blocks (1 + the sum of the running products of the
    acceptance probabilities) and the confidence head's absolute error over the drafted slots; in ``parts`` each
    term's weighted sum (``ce``, ``l1``, ``confidence``; before the alphas)."""
    targets, drafted, weights = spark_slots(ids, supervised, blocks, block_size, gamma)
    logits = logits.float()
    cross_entropy = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view_as(weights)
    before = slot_positions(blocks, block_size).clamp(max=ids.shape[1] - 1).flatten(1)  # slot k: anchor + k
    teacher = torch.gather(target_logits, 1, before.unsqueeze(-1).expand(-1, -1, target_logits.shape[-1]))
    teacher = teacher.view_as(logits).detach().float()
    distance = torch.zeros_like(weights)
    distance[drafted] = (logits[drafted].softmax(-1) - teacher[drafted].softmax(-1)).abs().sum(-1)
    acceptance = (1 - distance / 2).clamp(0, 1)
    per_slot = ce_weight * cross_entropy + l1_weight * distance
    parts = {"ce": (cross_entropy * weights).sum(), "l1": (distance * weights).sum()}
    error = weights.new_zeros(())
    if confidence is not None:
        target = acceptance.detach()
        calibration = F.binary_cross_entropy_with_logits(confidence, target, reduction="none")
        per_slot = per_slot + confidence_weight * calibration
        parts["confidence"] = (calibration * weights).sum()
        error = ((confidence.detach().sigmoid() - target).abs() * drafted).sum()
    has_draft = drafted.any(dim=-1)
    expected = (((acceptance.detach() * drafted).cumprod(dim=-1).sum(dim=-1) + 1) * has_draft).sum()
    return BlockLoss((per_slot * weights).sum(), weights.sum(), *agreement(logits.argmax(-1), targets, drafted),
                     extra=(expected, error), parts=parts)
