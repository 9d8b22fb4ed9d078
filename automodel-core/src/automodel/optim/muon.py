"""Muon for the matrices of a model and AdamW for the rest, in one optimizer: upstream NeMo AutoModel's
``optimizer: {_target_: dion.Muon, ...}`` (Microsoft's dion package) in plain torch, FSDP2-aware.

The parameters fall into upstream's groups: the 2-D weights (and, with ``flatten``, the >2-D ones seen as
``[shape[0], rest]`` matrices) get Muon; the 1-D parameters (norms, biases) and >2-D ones without ``flatten`` get
AdamW at ``scalar_lr`` with ``weight_decay``; embeddings (``nn.Embedding`` modules) AdamW at ``embed_lr`` and the
output head (a name holding ``lm_head``) AdamW at ``lm_head_lr``, both without weight decay.

A Muon step of a matrix ``W`` with gradient ``G`` (dion's form):

* ``M <- mu * M + G``; the update direction ``U`` is ``mu * M + G`` with ``nesterov``, else ``M``;
* ``O = NS(U)``: torch.optim.Muon's Newton-Schulz orthogonalisation (Keller Jordan's quintic, 5 steps, ``epsilon``
  bounding the normalisation); dion's own runs a per-step coefficient schedule, the same approximate ``UV^T``;
* ``W <- W * (1 - lr * weight_decay) - lr' * O`` with ``lr'`` from ``adjust_lr``: ``spectral_norm``
  ``lr * sqrt(d_out / d_in)``, ``rms_norm`` ``lr * 0.2 * sqrt(max(d_out, d_in))``, ``null`` ``lr``.

Under FSDP2 a matrix is a DTensor sharded over ranks, and the orthogonalisation needs all of it: each rank gathers
the whole update (``full_tensor``), orthogonalises it (every rank computes the same result) and keeps its own shard.
The state (``momentum_buffer``; AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) is sharded like the parameters, so
the sharded checkpoints save and resume it as any torch optimizer's.

Each group records ``lr_mult`` (its rate over ``lr``) and ``wd_mult`` (1, or 0 for the embeddings and head), which
the upstream schedule (``automodel.optim.OptimizerParamScheduler``) multiplies in, so the groups keep their ratios;
torch's schedulers scale each group from its own initial rate anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, _zeropower_via_newtonschulz
from torch.optim.adam import adam

AdjustLR = Literal["spectral_norm", "rms_norm"]
SCALAR_BETAS = (0.9, 0.999)  # upstream's scalar_betas default


def muon_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """What in a ``Muon`` node cannot act here (argument -> reason); validation reports them before a build."""
    issues = {}
    if kwargs.get("use_triton"):
        issues["use_triton"] = ("true selects dion's Triton Newton-Schulz kernels (CUDA); set false: torch's "
                                "Newton-Schulz iteration runs here on any device")
    scalar_opt = kwargs.get("scalar_opt", "adamw")
    if scalar_opt == "lion":
        issues["scalar_opt"] = "lion (dion's sign-momentum update for the non-matrix groups) is not implemented " \
                               "here; use adamw"
    elif scalar_opt != "adamw":
        issues["scalar_opt"] = f"expected adamw (dion's choices are adamw and lion), found {scalar_opt!r}"
    lr = kwargs.get("lr", 0.01)
    if isinstance(lr, (int, float)) and not lr > 0:
        issues["lr"] = f"must be > 0 (the other groups' rates are scheduled as multiples of it), found {lr}"
    mu = kwargs.get("mu", 0.95)
    if isinstance(mu, (int, float)) and not 0 <= mu < 1:
        issues["mu"] = f"the momentum must be in [0, 1), found {mu}"
    for name in ("betas", "scalar_betas"):
        betas = kwargs.get(name)
        if betas is not None and (not isinstance(betas, (list, tuple)) or len(betas) != 2
                                  or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            issues[name] = f"expected two numbers in [0, 1) such as [0.9, 0.999], found {betas!r}"
    return issues


def muon_notes(optimizer: Any) -> list[str]:
    """The run-start note that ``betas`` governs nothing beside ``scalar_betas`` (upstream's Muon config writes both:
    dion's ``betas`` are the default of the AdamW groups, which upstream always gives their own)."""
    if optimizer is None or optimizer.target is None or "betas" not in optimizer or "scalar_betas" not in optimizer:
        return []
    if optimizer.resolver.resolve(optimizer.target) is not Muon or optimizer["scalar_betas"] is None:
        return []
    return [f"note: optimizer.betas: {list(optimizer['betas'])} governs nothing: the AdamW groups (embeddings, "
            f"output head, vectors) take scalar_betas {list(optimizer['scalar_betas'])}, and Muon's matrices "
            "use mu"]


def _fans(shape: torch.Size) -> tuple[int, int]:
    """(d_out, d_in) of a matrix parameter; a >2-D one (``flatten``) is ``[shape[0], the rest]``."""
    return shape[0], math.prod(shape[1:])


def adjusted_lr(lr: float, shape: torch.Size, adjust_lr: str | None) -> float:
    """The Muon step size of a matrix of ``shape`` (dion's ``adjust_lr``)."""
    d_out, d_in = _fans(shape)
    if adjust_lr == "spectral_norm":
        return lr * math.sqrt(d_out / d_in)
    if adjust_lr == "rms_norm":
        return lr * 0.2 * math.sqrt(max(d_out, d_in))
    return lr


def orthogonalise(update: torch.Tensor, epsilon: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalisation of ``update`` seen as ``[shape[0], rest]``, in the update's
    dtype; a DTensor is gathered whole, orthogonalised, and comes back sharded as it was."""
    whole = update.full_tensor() if isinstance(update, DTensor) else update
    matrix = whole.reshape(whole.shape[0], -1)
    result = _zeropower_via_newtonschulz(matrix, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, epsilon)
    result = result.reshape(whole.shape).to(update.dtype)
    if isinstance(update, DTensor):
        mesh = update.device_mesh
        result = DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim, run_check=False)
        result = result.redistribute(mesh, update.placements)
    return result


class Muon(torch.optim.Optimizer):
    """Muon on the matrices, AdamW on embeddings, output head and vectors (module docstring: groups and formulas).

    Keyword arguments as dion's ``Muon`` and upstream's grouping: ``lr`` (Muon's base rate), ``mu``, ``nesterov``,
    ``adjust_lr``, ``weight_decay``, ``epsilon`` (the Newton-Schulz bound, and AdamW's epsilon unless
    ``scalar_eps``), ``flatten``; the AdamW groups' ``scalar_betas`` (else ``betas``, else upstream's default
    [0.9, 0.999]: with both given ``betas`` governs nothing, as upstream, and a run-start note says so),
    ``scalar_eps``, ``scalar_lr`` (default ``lr``), ``embed_lr`` (default ``scalar_lr``), ``lm_head_lr`` (default
    ``lr / sqrt(d_in)``). ``model`` (the builder supplies it) names the
    parameters; ``params`` are the trainable ones.
    """

    def __init__(self, params: Iterable[nn.Parameter], model: nn.Module, lr: float = 0.01, mu: float = 0.95,
                 betas: tuple[float, float] | None = None, weight_decay: float = 0.01, epsilon: float = 1e-8,
                 nesterov: bool = False, adjust_lr: AdjustLR | None = "spectral_norm", flatten: bool = False,
                 use_triton: bool = False, scalar_opt: str = "adamw",
                 scalar_betas: tuple[float, float] | None = None, scalar_eps: float | None = None,
                 scalar_lr: float | None = None, embed_lr: float | None = None, lm_head_lr: float | None = None):
        issues = muon_issues({"use_triton": use_triton, "scalar_opt": scalar_opt, "lr": lr, "mu": mu,
                              "betas": betas, "scalar_betas": scalar_betas})
        if adjust_lr not in ("spectral_norm", "rms_norm", None):
            issues["adjust_lr"] = f"expected spectral_norm, rms_norm or null, found {adjust_lr!r}"
        if issues:
            raise ValueError("; ".join(f"{name}: {message}" for name, message in issues.items()))
        adamw = {"algorithm": "adamw", "betas": tuple(scalar_betas or betas or SCALAR_BETAS),
                 "eps": epsilon if scalar_eps is None else scalar_eps}
        scalar_lr = lr if scalar_lr is None else scalar_lr
        groups = _split(list(params), model, flatten)
        if lm_head_lr is None and groups["lm_head"]:
            lm_head_lr = lr / math.sqrt(_fans(groups["lm_head"][0].shape)[1])
        param_groups = [
            {"params": groups["matrix"], "algorithm": "muon", "lr": lr, "weight_decay": weight_decay},
            {"params": groups["vector"], **adamw, "lr": scalar_lr, "weight_decay": weight_decay},
            {"params": groups["embed"], **adamw, "lr": scalar_lr if embed_lr is None else embed_lr,
             "weight_decay": 0.0, "wd_mult": 0.0},
            {"params": groups["lm_head"], **adamw, "lr": lr if lm_head_lr is None else lm_head_lr,
             "weight_decay": 0.0, "wd_mult": 0.0},
        ]
        for group in param_groups:
            group["lr_mult"] = group["lr"] / lr
            group.setdefault("wd_mult", 1.0)
        defaults = {"lr": lr, "mu": mu, "nesterov": nesterov, "adjust_lr": adjust_lr, "epsilon": epsilon,
                    "weight_decay": weight_decay}
        super().__init__(param_groups, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, mu = group["lr"], group["mu"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            momentum = state["momentum_buffer"]
            momentum.mul_(mu).add_(param.grad)
            direction = momentum * mu + param.grad if group["nesterov"] else momentum
            update = orthogonalise(direction, group["epsilon"])
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-adjusted_lr(lr, param.shape, group["adjust_lr"]))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for param in params:
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
             [], [s["step"] for s in states], foreach=False, decoupled_weight_decay=True, amsgrad=False,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False)

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        """Validation's check of an ``optimizer: {_target_: dion.Muon, ...}`` node (nothing is built)."""
        return muon_issues(kwargs)


def _split(params: list[nn.Parameter], model: nn.Module, flatten: bool) -> dict[str, list[nn.Parameter]]:
    """Upstream's groups of ``params``: matrix (Muon), vector, embed, lm_head (AdamW), in the model's order."""
    trainable = {id(p) for p in params}
    modules = dict(model.named_modules())
    groups: dict[str, list[nn.Parameter]] = {"matrix": [], "vector": [], "embed": [], "lm_head": []}
    for name, param in model.named_parameters():
        if id(param) not in trainable:
            continue
        if isinstance(modules.get(name.rpartition(".")[0]), nn.Embedding):
            groups["embed"].append(param)
        elif "lm_head" in name:
            groups["lm_head"].append(param)
        elif param.ndim == 2 or (flatten and param.ndim > 2):
            groups["matrix"].append(param)
        else:
            groups["vector"].append(param)
    if sum(map(len, groups.values())) != len(trainable):
        raise ValueError("Muon: some parameters to optimise are not parameters of the model it was given")
    return groups
