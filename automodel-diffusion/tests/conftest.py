"""Fixtures for the diffusion domain's tests (helpers live in diffusion_testing.py, importable from every module)."""

from __future__ import annotations

import diffusion_testing  # noqa: F401  (sets the offline environment before anything imports HF libraries)
import pytest


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to a busy shared machine (restored afterwards)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """A folder of tiny clips with captions (GIF, WebP, a frame folder: diffusion_testing.tiny_clips), for the
    video families' tests."""
    return diffusion_testing.tiny_clips(tmp_path_factory.mktemp("clips") / "clips")


@pytest.fixture(scope="session")
def flow_run(tmp_path_factory):
    """The shipped diffusion/tiny_flow example, trained once (60 steps; validation and checkpoints at 30 and 60)."""
    root = tmp_path_factory.mktemp("tiny_flow")
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recipe = diffusion_testing.train_inprocess(diffusion_testing.EXAMPLES / "tiny_flow.yaml",
                                                   "--checkpoint.checkpoint_dir", root / "ckpt")
    finally:
        torch.set_num_threads(before)
    final = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
    return {"recipe": recipe, "ckpt": root / "ckpt", "final": final}
