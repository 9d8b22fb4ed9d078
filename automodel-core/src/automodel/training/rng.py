"""Seeding and saving the state of every random number generator a run uses."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch


class StatefulRNG:
    """Seeds python, numpy and torch (CPU and CUDA); its state_dict holds plain types and tensors only."""

    def __init__(self, seed: int = 42, ranked: bool = False, rank: int = 0):
        self.base_seed, self.ranked = seed, ranked
        self.seed = seed + (rank if ranked else 0)
        _seed_all(self.seed)

    @contextlib.contextmanager
    def same_on_every_rank(self) -> Iterator[None]:
        """Within the block every rank draws what one process draws (the unranked seed), so that what is made there
        (a pretrained model's freshly initialised tensors: a new task head, LoRA's matrices) is the same on every
        rank, as FSDP2's shards of it must be; after it each rank's own stream starts from its ranked seed. Nothing
        changes where the seed is not ranked."""
        if not self.ranked:
            yield
            return
        _seed_all(self.base_seed)
        try:
            yield
        finally:
            _seed_all(self.seed)

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {
            "python": random.getstate(),
            "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def use_deterministic_algorithms() -> None:
    """``rng.deterministic``: torch runs only deterministic kernels (and raises for an operation that has none).
    cuBLAS needs a fixed workspace for that (``CUBLAS_WORKSPACE_CONFIG``, read when CUDA starts); cuDNN's autotuner
    would pick kernels by timing."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
