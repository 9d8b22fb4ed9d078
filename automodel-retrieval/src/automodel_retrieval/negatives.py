"""In-batch negatives: the documents each query is scored against, on one rank or gathered from every rank.

Documents are identified by a 64-bit hash of their text (``text_key``), so that a copy of one of a query's
positives is never pushed away as a negative, also when the copy comes from another rank's micro-batch.

Under DDP / FSDP2 every rank scores its queries against the documents of all ranks: the document embeddings are
gathered with torch's autograd-aware ``all_gather_single`` (``torch.distributed._functional_collectives``, what
torch 2.13 names in place of the deprecated ``torch.distributed.nn.functional.all_gather``), whose backward sends
each rank the gradient that the other ranks' losses put on its documents. With the loop's loss scaling (world size
/ the step's queries) and the gradient averaging of DDP / FSDP2, N ranks then train exactly as one process with an
N times larger batch.

``detach=True`` (upstream's ``detach_distributed_inbatch_negatives``) gathers the other ranks' documents as
constants: a rank's loss still scores its queries against every rank's documents (the same loss as above), but its
gradient reaches only its own queries and documents. Each rank's update then lacks what the other ranks' queries
would push on its documents, so training differs from the one-process run from the second step on; the backward
sends nothing between ranks.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


def text_key(text: str) -> int:
    """A stable 64-bit signed key of a document's text (the same on every rank and in every process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def exclusions(document_keys: torch.Tensor, positive_keys: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, D]: document j is one of query i's positives but not its target (another copy of a positive).

    ``positive_keys`` [B, P] holds each query's positives' keys (a row shorter than P repeats its first key).
    """
    duplicate = (document_keys[None, :, None] == positive_keys[:, None, :]).any(-1)
    duplicate[torch.arange(len(labels), device=labels.device), labels] = False
    return duplicate


def gather_documents(documents: torch.Tensor, keys: torch.Tensor, detach: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Every rank's document embeddings [R * D_max, H] (gradient flowing back to each rank's own; with ``detach``
    only this rank's rows carry a gradient), their keys, which rows are real (ranks with fewer documents are padded)
    and where this rank's documents start."""
    count = torch.tensor([documents.shape[0]], device=documents.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    padding = int(count.item()) - documents.shape[0]
    valid = torch.ones(documents.shape[0], dtype=torch.bool, device=documents.device)
    if padding:
        documents = torch.cat([documents, documents.new_zeros(padding, documents.shape[1])])
        keys = torch.cat([keys, keys.new_zeros(padding)])
        valid = torch.cat([valid, valid.new_zeros(padding)])
    gathered = _gather_detached(documents) if detach else _gather_with_gradients(documents)
    labels = torch.stack([keys, valid.long()], dim=1)  # the keys and validity need no gradient: a plain gather
    parts = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, labels)
    everyone = torch.cat(parts)
    return gathered, everyone[:, 0], everyone[:, 1].bool(), dist.get_rank() * documents.shape[0]


def _gather_with_gradients(documents: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_gather_single

    return all_gather_single(documents, 0, dist.group.WORLD)


def _gather_detached(documents: torch.Tensor) -> torch.Tensor:
    """The other ranks' rows as constants, this rank's own rows (with their gradient) in their place."""
    parts = [torch.empty_like(documents) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, documents.detach().contiguous())
    parts[dist.get_rank()] = documents
    return torch.cat(parts)
