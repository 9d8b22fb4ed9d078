"""The two gloo ranks of test_inbatch_negatives.py's gather test (a module of its own, so that each spawned rank
imports torch and the gather, not the test module's recipe and CLI stack)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from automodel_retrieval.losses import InfoNCELoss
from automodel_retrieval.negatives import gather_documents

QUERIES, DOCUMENTS, WIDTH, TEMPERATURE = (2, 3), (4, 3), 8, 0.5  # per rank; rank 1 has fewer documents (padding)


def toy() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each rank's queries and documents (query i's positive is its rank's document i), as leaves."""
    generator = torch.Generator().manual_seed(0)
    queries = [torch.randn(n, WIDTH, generator=generator).requires_grad_() for n in QUERIES]
    documents = [torch.randn(n, WIDTH, generator=generator).requires_grad_() for n in DOCUMENTS]
    return queries, documents


def teacher() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A teacher's embeddings of the same texts (another draw; its first rank's queries swapped)."""
    queries, documents = toy()
    return [queries[0].detach().flip(0), queries[1].detach()], [d.detach() for d in documents]


def distill_loss(rank: int) -> dict[str, torch.Tensor]:
    """This rank's listwise distillation loss with every rank's documents as candidates (the distillation recipe's
    cross_device_negatives: the student's gathered with gradients, the teacher's as constants)."""
    from automodel_retrieval.distill_losses import InfoNCEDistillLoss

    queries, documents = toy()
    teacher_queries, teacher_documents = teacher()
    query, document = queries[rank], documents[rank]
    keys = torch.arange(len(document)) + 100 * rank
    gathered, _, valid, offset = gather_documents(document, keys)
    teacher_gathered = gather_documents(teacher_documents[rank], keys, detach=True)[0]
    loss = InfoNCEDistillLoss(TEMPERATURE)(query, gathered, teacher_queries[rank], teacher_gathered,
                                           torch.arange(len(query)) + offset, valid[None, :].expand(len(query), -1))
    loss.backward()
    return {"loss": loss.detach(), "query": query.grad}


def gather_worker(rank: int, init: str, out: str) -> None:
    """This rank's loss against the gathered documents and its gradients, with and without ``detach``; and its
    listwise distillation loss over the gathered documents (``distill``)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    found = {}
    for detach in (False, True):
        queries, documents = toy()
        query, document = queries[rank], documents[rank]
        keys = torch.arange(len(document)) + 100 * rank
        gathered, _, valid, offset = gather_documents(document, keys, detach)
        padding = ~valid[None, :].expand(len(query), -1)
        loss = InfoNCELoss(TEMPERATURE)(query, gathered, torch.arange(len(query)) + offset, padding)
        loss.backward()
        found[detach] = {"loss": loss.detach(), "query": query.grad, "documents": document.grad}
    found["distill"] = distill_loss(rank)
    torch.save(found, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()

