"""P-EAGLE's parallel drafting (speculators' P-EAGLE, arXiv 2602.01469): the draft drafts ``num_depths`` tokens in
one forward. Its first slot is EAGLE-3's (the next token with the target's fused states); the later ones hold the
mask token and a learned placeholder state (``mask_hidden``). Training runs all depths of many chains in one
forward over a flat sequence per row, deeper depths subsampled (COD sampling, :func:`cod_elements`).

In this recipe's indexing (:mod:`automodel_llm.eagle3.unroll`) the element at position ``p`` of a chain anchored at
``a`` (depth ``d = p - a``) reads the token at ``p + 1`` with the target's states of ``p`` at depth 0, the mask token
and the placeholder deeper, sits at rotary position ``p``, and is trained towards the target's distribution at
``p + 1`` (over the draft vocabulary), the token at ``p + 2`` being a label token. It sees the depth-0 elements at
or before its anchor and its own chain's elements up to its depth (:func:`visibility`), what the serving engine's
one forward sees. The loss is the forward KL from the target's distribution, summed over the counted elements (the
loop divides by their number: :func:`counted_elements`).
"""

from __future__ import annotations

import torch

from automodel_llm.eagle3.unroll import UnrollSums


def reference_positions(supervised: torch.Tensor, length: int) -> torch.Tensor:
    """``[length - 1]`` booleans: the positions ``p`` of a row of ``length`` real tokens whose element drafts a
    label token (the token at ``p + 2``)."""
    valid = torch.zeros(max(length - 1, 0), dtype=torch.bool)
    if length > 2:
        valid[:length - 2] = supervised[2:length].bool().cpu()
    return valid


def cod_elements(valid: torch.Tensor, num_depths: int, ratio: float, floor: float, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """COD sampling of one row (speculators' ``generate_cod_sample_indices``): ``(anchors, depths)`` of its elements.
    Depth 0 holds every position; depth ``d`` a random ``max(ratio^d, floor)`` share of the ``len - d`` counted
    positions, drawn (from ``generator``) among those whose chain reached depth ``d - 1`` the position before
    (position 0 never: its chain would start before the row)."""
    length = len(valid)
    counted = valid.nonzero().flatten()
    anchors, depths = [torch.arange(length)], [torch.zeros(length, dtype=torch.long)]
    pool = counted[counted != 0]
    for depth in range(1, num_depths):
        size = int(max(0, len(counted) - depth) * max(ratio ** depth, floor))
        if size <= 0:
            break
        picked = pool
        if len(pool) >= size:
            picked = pool[torch.randperm(len(pool), generator=generator)[:size]].sort().values
        following = picked + 1
        following = following[following < length]
        pool = following[valid[following]]
        anchors.append(picked - depth)
        depths.append(torch.full((len(picked),), depth, dtype=torch.long))
    return torch.cat(anchors), torch.cat(depths)


def visibility(anchors: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` booleans: element ``q`` sees element ``k`` when ``k`` is a depth-0 element at or before ``q``'s
    anchor, or ``k`` is of ``q``'s chain at a depth up to ``q``'s (speculators' ``create_peagle_mask_mod``)."""
    before = (depths == 0).unsqueeze(0) & (anchors.unsqueeze(0) <= anchors.unsqueeze(1))
    chain = (anchors.unsqueeze(0) == anchors.unsqueeze(1)) & (depths.unsqueeze(0) <= depths.unsqueeze(1))
    return before | chain


def counted_elements(valid: torch.Tensor, anchors: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Which elements count in the loss: those drafting a label token."""
    return valid[anchors + depths]


def parallel_sums(draft: torch.nn.Module, input_ids: torch.Tensor, supervised: torch.Tensor,
                  aux_states: torch.Tensor, target_logits: torch.Tensor,
                  elements: list[tuple[torch.Tensor, torch.Tensor]]) -> UnrollSums:
    """The batch's sums, row by row (``elements``: each row's ``(anchors, depths)``; a row's real length is its
    depth-0 count + 1): the KL loss, each depth's loss, and per depth the counts behind accuracy and accept length
    (an element is a chain hit when it and its chain's shallower elements are right and counted)."""
    num_depths = draft.config.num_depths
    draft_ids = draft.draft_token_ids()
    zero = aux_states.new_zeros((), dtype=torch.float32)
    sums = UnrollSums(loss=zero, step_losses=[zero] * num_depths,
                      **{name: [zero.detach()] * num_depths for name in ("correct", "counted", "chain_hits", "chains")})
    placeholder = draft.fuse(draft.mask_hidden.view(1, -1).to(draft.fc.weight.dtype))
    sums.loss = sums.loss + 0 * placeholder.sum()  # a batch of rows too short to draft still runs a backward
    for row, (anchors, depths) in enumerate(elements):
        if not len(anchors):
            continue
        device = input_ids.device
        anchors, depths = anchors.to(device), depths.to(device)
        length = int((depths == 0).sum()) + 1
        valid = reference_positions(supervised[row], length).to(device)
        positions = anchors + depths
        first = depths == 0
        tokens = torch.where(first, input_ids[row, (positions + 1).clamp(max=length - 1)], draft.config.mask_token_id)
        states = torch.where(first.unsqueeze(-1), draft.fuse(aux_states[row, positions].to(draft.fc.weight.dtype)),
                             placeholder)
        logits = draft.parallel(tokens[None], states[None], positions[None],
                                visibility(anchors, depths)[None, None])[0].float()
        teacher = target_logits[row, positions + 1].index_select(-1, draft_ids).float()
        teacher_log = torch.log_softmax(teacher, dim=-1)
        kl = (teacher_log.exp() * (teacher_log - torch.log_softmax(logits, dim=-1))).sum(-1)
        counted = counted_elements(valid, anchors, depths)
        right = (logits.argmax(-1) == teacher.argmax(-1)) & counted
        hit_by_anchor = torch.zeros(length, dtype=torch.bool, device=device)
        ok_by_anchor = torch.zeros(length, dtype=torch.bool, device=device)
        for depth in range(num_depths):
            at = depths == depth
            if not at.any():
                break
            ok = counted[at] & (ok_by_anchor[anchors[at]] if depth else True)
            hit = right[at] & (hit_by_anchor[anchors[at]] if depth else True)
            ok_by_anchor, hit_by_anchor = torch.zeros_like(ok_by_anchor), torch.zeros_like(hit_by_anchor)
            ok_by_anchor[anchors[at]], hit_by_anchor[anchors[at]] = ok, hit & ok
            depth_loss = (kl[at] * counted[at]).sum()
            sums.step_losses[depth] = sums.step_losses[depth] + depth_loss
            sums.loss = sums.loss + depth_loss
            for name, value in (("correct", right[at]), ("counted", counted[at]), ("chain_hits", hit & ok),
                                ("chains", ok)):
                getattr(sums, name)[depth] = getattr(sums, name)[depth] + value.sum().detach().float()
    return sums
