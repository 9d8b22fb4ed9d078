"""EAGLE-3's training-time-test unroll over one batch, and its draft vocabulary.

Slot ``t`` of step ``k`` drafts the token at ``t + 2 + k``: it is fed the token at ``t + 1 + k`` (step 0 with the
target's fused hidden states of position ``t``, later steps with the draft's own state of the step before) and is
trained towards the target's distribution at ``t + 1 + k``, restricted to the draft vocabulary, by soft cross
entropy. A slot counts where the token it drafts is a supervised (label) token and the target's own choice there is
in the draft vocabulary. Step ``k`` weighs ``0.8 ** k`` of the total weight (upstream's and SpecForge's decay, as a
weighted mean). In packed rows (``position_ids`` restarting at 0 for each sample) a slot counts only where the token
it drafts is in its own sample, and attention stays within each sample.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError

DECAY = 0.8


def shifted(tensor: torch.Tensor, by: int) -> torch.Tensor:
    """``tensor`` moved ``by`` positions left along dimension 1, zeros (False) coming in at the end."""
    if by == 0:
        return tensor
    tail = torch.zeros_like(tensor[:, :by])
    return torch.cat([tensor[:, by:], tail], dim=1)


@dataclass
class UnrollSums:
    """One batch's sums: the weighted loss, each step's loss, and the counts behind accuracy and accept length."""

    loss: torch.Tensor
    step_losses: list[torch.Tensor] = field(default_factory=list)
    correct: list[torch.Tensor] = field(default_factory=list)  # slots whose greedy draft is the target's choice
    counted: list[torch.Tensor] = field(default_factory=list)  # slots that count (the loss's)
    chain_hits: list[torch.Tensor] = field(default_factory=list)  # slots right at every step up to this one
    chains: list[torch.Tensor] = field(default_factory=list)  # slots supervised at every step up to this one


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sample in a packed row (1, 2, ...: a sample starts where its position is 0)."""
    return (position_ids == 0).long().cumsum(dim=1)


def same_document(docs: torch.Tensor | None, by: int) -> torch.Tensor | bool:
    """Whether the token ``by`` positions on is in the same sample (True everywhere for unpacked rows)."""
    return True if docs is None else shifted(docs, by) == docs


def drafted_slots(supervised: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The slots a draft's first step trains on: those whose token two positions on is a label token (of the same
    sample)."""
    docs = documents(position_ids) if position_ids is not None else None
    return shifted(supervised, 2) & same_document(docs, 2)


def unroll(draft: Any, input_ids: torch.Tensor, supervised: torch.Tensor, aux_states: torch.Tensor,
           target_logits: torch.Tensor, steps: int, position_ids: torch.Tensor | None = None) -> UnrollSums:
    """The unroll's sums over ``steps`` steps. ``supervised[b, t]``: token ``t`` of row ``b`` is a label token;
    ``aux_states`` / ``target_logits``: the target's three hidden states (side by side) and logits at every position;
    ``draft``: a :class:`~automodel_llm.eagle3.draft.LlamaForCausalLMEagle3`; ``position_ids``: a packed batch's."""
    draft_ids = draft.draft_token_ids()
    in_vocab = draft.t2d[target_logits.argmax(dim=-1)]  # the target's choice at each position can be drafted
    probs = torch.softmax(target_logits.index_select(-1, draft_ids).float(), dim=-1)
    choice = probs.argmax(dim=-1)
    length = input_ids.shape[1]
    visible = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
    docs = None
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    else:
        docs = documents(position_ids)
        visible = visible & (docs[:, None, :, None] == docs[:, None, None, :])
    hidden = draft.fuse(aux_states.to(draft.fc.weight.dtype))
    cache: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    total_weight = sum(DECAY ** k for k in range(steps))
    sums = UnrollSums(loss=hidden.new_zeros((), dtype=torch.float32))
    hits = chain = None
    for k in range(steps):
        logits, hidden = draft.step(shifted(input_ids, 1 + k), hidden, position_ids, cache, visible)
        label = shifted(supervised, 2 + k) & same_document(docs, 2 + k)
        counts = label & shifted(in_vocab, 1 + k)
        step_probs = shifted(probs, 1 + k)
        cross_entropy = -(step_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        step_loss = (cross_entropy * counts).sum()
        sums.loss = sums.loss + DECAY ** k / total_weight * step_loss
        right = (logits.argmax(dim=-1) == shifted(choice, 1 + k)) & counts
        hits = right if hits is None else hits & right
        chain = label if chain is None else chain & label
        sums.step_losses.append(step_loss)
        for name, value in (("correct", right), ("counted", counts), ("chain_hits", hits), ("chains", chain)):
            getattr(sums, name).append(value.sum().detach().float())
    return sums


def supervised_tokens(labels: torch.Tensor, label_offset: int) -> torch.Tensor:
    """Which tokens are label tokens: ``labels`` pair with their own positions (``label_offset`` 1) or hold the
    next token (0, pre-shifted data), which then belongs to the position after."""
    marked = labels != -100
    if label_offset == 1:
        return marked
    return torch.cat([torch.zeros_like(marked[:, :1]), marked[:, :-1]], dim=1)


# ---- the draft vocabulary ---------------------------------------------------------------------------------------


def most_frequent_tokens(samples: Iterable[dict], size: int, vocab_size: int, label_offset: int) -> torch.Tensor:
    """The ``size`` target ids the draft vocabulary keeps (sorted): the most frequent label tokens of ``samples``,
    ties to the smaller id, then the smallest ids not yet taken when the data has fewer distinct ones."""
    counts: Counter[int] = Counter()
    for sample in samples:
        labels = torch.as_tensor(sample["labels"]).reshape(1, -1)
        ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
        counts.update(ids[supervised_tokens(labels, label_offset)].tolist())
    chosen = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
              if 0 <= token < vocab_size][:size]
    taken = set(chosen)
    chosen += [token for token in range(vocab_size) if token not in taken][:size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def read_token_ids(path: Path, size: int, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary written by :func:`write_token_ids`, checked against the run's sizes."""
    try:
        raw = path.read_bytes()
        if raw[:2] in (b"PK", b"\x80\x02", b"\x80\x04", b"\x80\x05"):
            raise AutomodelError(f"eagle3.selected_token_ids_path: {path} is a torch / pickle file (upstream's "
                                 "format), which this build never unpickles: delete it or name another path, and "
                                 "this run writes the vocabulary there as JSON")
        data = json.loads(raw)
        ids = [int(i) for i in data["token_ids"]]
        sizes = int(data["target_vocab_size"]), len(ids)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise AutomodelError(f"eagle3.selected_token_ids_path: {path} is not a draft vocabulary written by this "
                             f"recipe ({type(err).__name__}: {err}); delete it (the next run writes it) or name "
                             "another file") from None
    if sizes != (vocab_size, size) or len(set(ids)) != size or not all(0 <= i < vocab_size for i in ids):
        raise AutomodelError(f"eagle3.selected_token_ids_path: {path} holds {sizes[1]} ids of a {sizes[0]}-token "
                             f"vocabulary; this run drafts {size} of {vocab_size}: delete the file (the next run "
                             "writes it) or name another")
    return torch.tensor(sorted(ids), dtype=torch.long)


def write_token_ids(path: Path, token_ids: torch.Tensor, vocab_size: int) -> None:
    """Write the draft vocabulary as JSON (through a temporary file, so a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"target_vocab_size": vocab_size, "draft_vocab_size": len(token_ids),
                                     "token_ids": token_ids.tolist()}))
    os.replace(temporary, path)
