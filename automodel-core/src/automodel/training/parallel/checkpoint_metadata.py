"""What a sharded checkpoint records beside the shards, collected from every model part and every rank.

Under data and tensor parallelism every rank holds every tensor (or a shard of it), so any rank's view is the whole
model's; under pipeline parallelism a rank holds only its stages (one module each, under the whole model's names).
The saved tensors' shapes, the optimizer's JSON manifest (param groups list parameters by name) and the names of
the HF export are therefore merged over the parts of a rank and then over the ranks: rank 0 writes the union, and
every rank groups the tensors into the same files.
A part is one module with its optimizer (a pipeline rank running two stages has two parts).
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from automodel.errors import AutomodelError
from automodel.training.parallel.writer import distributed

# {"shapes": {key: shape}, "bytes": {key: size}, "optimizer": manifest | None,
#  "export": [kind, {key: name}] | None (None: the weights are not saved)}
Metadata = dict[str, Any]


def merge_manifests(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two optimizer manifests (of disjoint parameters) as one: group ``i`` lists the parameters of both."""
    if first is None or second is None:
        return first if second is None else second
    if len(first["param_groups"]) != len(second["param_groups"]):
        raise AutomodelError(f"the model parts' optimizers have {len(first['param_groups'])} and "
                             f"{len(second['param_groups'])} parameter groups; give every part the same groups")
    groups = []
    for mine, theirs in zip(first["param_groups"], second["param_groups"], strict=True):
        params = list(mine.get("params", []))
        params += [name for name in theirs.get("params", []) if name not in params]
        groups.append({**mine, "params": params})
    return {"tensors": {**first["tensors"], **second["tensors"]}, "scalars": {**first["scalars"], **second["scalars"]},
            "param_groups": groups}


def merge_metadata(first: Metadata, second: Metadata) -> Metadata:
    """Two parts' (or ranks') records as one; a tensor both hold must have one shape."""
    for key in first["shapes"].keys() & second["shapes"].keys():
        if list(first["shapes"][key]) != list(second["shapes"][key]):
            raise AutomodelError(f"'{key}' has shape {first['shapes'][key]} in one model part and "
                                 f"{second['shapes'][key]} in another")
    return {"shapes": {**first["shapes"], **second["shapes"]}, "bytes": {**first["bytes"], **second["bytes"]},
            "optimizer": merge_manifests(first["optimizer"], second["optimizer"]),
            "export": merge_exports(first["export"], second["export"])}


def merge_exports(first: list[Any] | None, second: list[Any] | None) -> list[Any] | None:
    """Two export plans (``[kind, {key: name}]``, None where the weights are not saved) as one."""
    if first is None or second is None:
        return first if second is None else second
    if first[0] != second[0]:
        raise AutomodelError(f"one model part exports a {first[0]}, another a {second[0]}")
    return [first[0], {**first[1], **second[1]}]


def gather_metadata(mine: Metadata) -> Metadata:
    """Every rank's records merged, on every rank (all call it; each gets the same, in the same order). Sent as
    JSON text."""
    if not distributed() or dist.get_world_size() == 1:
        return mine
    received: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(received, json.dumps(mine))
    merged = json.loads(received[0])
    for text in received[1:]:
        merged = merge_metadata(merged, json.loads(text))
    return merged
