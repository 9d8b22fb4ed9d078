"""The scenario of ``test_pipeline_tied.py`` on four gloo ranks: a pp 2 x tp 2 mesh whose first stage holds a tied
input embedding and whose last stage holds the output head, each a DTensor over its stage's tensor-parallel ranks,
frozen or trained.
Run as ``python pipeline_tied_workers.py copy <json args> <result file>`` (``parallel_testing.launch``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from parallel_workers import main
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from automodel.errors import AutomodelError
from automodel.training.parallel.pipeline_tied import TiedHead

PLACEMENTS = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}


def _case(mesh: Any, embedding: str, head: str, trains: str) -> dict[str, Any]:
    """The head after the copy (whole), the embedding (whole) and, where both train, both gradients after
    ``sum_grads`` (whole: the embedding's gradient is 1 everywhere, the head's 2); or the error each rank raised.
    ``trains``: "none", "both" or "first"."""
    pp, tp = mesh["pp"], mesh["tp"]
    whole = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) / 7  # the same on every rank
    first = pp.get_local_rank() == 0
    placements = [PLACEMENTS[embedding if first else head]]
    weight = distribute_tensor(whole if first else torch.zeros(6, 4), tp, placements)
    weight.requires_grad_(trains == "both" or (trains == "first" and first))
    stage = SimpleNamespace(is_first=first, is_last=not first, input_embedding=SimpleNamespace(weight=weight),
                            output_head=SimpleNamespace(weight=weight))
    tied = TiedHead([stage], dist.get_process_group_ranks(pp.get_group()), torch.device("cpu"))
    try:
        tied.copy_weight()
    except AutomodelError as err:
        return {"error": str(err)}
    result = {"weight": weight.full_tensor().tolist(), "whole": whole.tolist(), "trains": tied.trains}
    if tied.trains:
        weight.grad = distribute_tensor(torch.full((6, 4), 1.0 if first else 2.0), tp, placements)
        tied.sum_grads()
        result["grad"] = weight.grad.full_tensor().unique().tolist()
    return result


def scenario_copy(args: dict[str, Any], out: Path) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    return {name: _case(mesh, *case) for name, case in args["cases"].items()}


if __name__ == "__main__":
    main(globals())
