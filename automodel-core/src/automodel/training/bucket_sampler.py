"""Batches drawn one bucket at a time: ``BucketBatchSampler`` takes the sample indices of each bucket (samples that
may share a batch: images of one size, in diffusion's image-edit loader; sequences of similar lengths, with
``dataloader.group_by_length``) and yields batches that each come from one bucket.

It orders the batches as upstream's ``SequentialBucketSampler`` does with a fixed batch size: per epoch (seeded by
the run's seed plus the epoch) the buckets are shuffled, then the samples within each; each bucket is padded by
repeating its own samples to a multiple of the data-parallel replicas, which take every replicas-th sample; a
bucket's short last batch is dropped with ``drop_last``. It is resumable: its state is the epoch and the batches
already drawn (torchdata's StatefulDataLoader saves and restores it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch


class BucketBatchSampler:
    """Batches of sample indices, each from one bucket (see the module docstring). ``buckets``: the indices of each
    bucket, smallest first (the order before shuffling)."""

    def __init__(self, buckets: Sequence[Sequence[int]], batch_size: int, shuffle: bool = True,
                 drop_last: bool = True, seed: int = 0, replicas: int = 1, rank: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, found {batch_size}")
        self.buckets = [list(b) for b in buckets if b]
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.seed, self.replicas, self.rank = seed, replicas, rank
        self.epoch, self._drawn, self._skip = 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next pass draws (the step scheduler calls this before each epoch)."""
        if epoch != self.epoch:
            self.epoch, self._skip = epoch, 0

    def _rank_share(self, indices: list[int]) -> list[int]:
        padded = math.ceil(len(indices) / self.replicas) * self.replicas
        indices = indices + [indices[i % len(indices)] for i in range(padded - len(indices))]
        return indices[self.rank::self.replicas]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This replica's batches of ``epoch``, in order."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = list(range(len(self.buckets)))
        if self.shuffle:
            order = torch.randperm(len(order), generator=generator).tolist()
        batches = []
        for position in order:
            indices = self.buckets[position]
            if self.shuffle:
                indices = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
            share = self._rank_share(indices)
            for start in range(0, len(share), self.batch_size):
                batch = share[start:start + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0
        self._drawn = skip
        for batch in self.epoch_batches(self.epoch)[skip:]:
            self._drawn += 1
            yield batch

    def __len__(self) -> int:
        count = 0
        for indices in self.buckets:
            share = math.ceil(len(indices) / self.replicas)
            count += share // self.batch_size if self.drop_last else math.ceil(share / self.batch_size)
        return count

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "drawn": self._drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._skip, self._drawn = int(state["epoch"]), int(state["drawn"]), int(state["drawn"])


def length_buckets(lengths: Sequence[int], size: int) -> list[list[int]]:
    """The sample indices sorted by length, longest first (ties in index order), cut into buckets of ``size`` (the
    last may be shorter): upstream's length grouping, with ``size`` the batch size times the data-parallel replicas,
    so that each replica's batch from a bucket holds samples of about one length and little padding."""
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    return [order[start:start + size] for start in range(0, len(order), size)]
