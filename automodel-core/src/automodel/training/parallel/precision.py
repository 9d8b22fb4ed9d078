"""Mixed precision from ``distributed.mp_policy``: FSDP2's ``MixedPrecisionPolicy``, or ``torch.autocast`` elsewhere.

The keys are upstream's (those of ``torch.distributed.fsdp.MixedPrecisionPolicy``, which upstream configs may also
name in ``_target_``), with its meaning of an unset dtype: ``param_dtype`` (the compute dtype: bf16 | fp16 | fp32),
``reduce_dtype`` (gradient reduction; unset: param_dtype), ``output_dtype`` (the forward's outputs; unset: no cast),
``cast_forward_inputs``. The parameters keep the model's own dtype (``model.torch_dtype``): float32 storage with
``param_dtype: bf16`` is the fp32-master-weights pattern. The loss is computed in float32 in every case (the
engine's cross entropy upcasts the logits). fp16 needs a gradient scaler, which :meth:`Precision.grad_scaler`
makes. Without FSDP2 (one process, DDP) ``torch.autocast`` runs the forward in ``param_dtype``; there gradients are
reduced in float32 and outputs are not cast, so other values of those keys are refused. Without ``mp_policy``:
float32 on a CPU, bf16 (reduced and output in fp32) on a GPU that supports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from automodel.errors import ConfigError, ConfigIssue

FSDP_MP_TARGET = "torch.distributed.fsdp.MixedPrecisionPolicy"
MP_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Precision:
    """What runs in which dtype. ``param_dtype`` None: compute in the parameters' own dtype (no casting)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @property
    def mixed(self) -> bool:
        return self.param_dtype in (torch.bfloat16, torch.float16)

    def fsdp_policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` for ``fully_shard`` (its defaults where a dtype is unset)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                                    output_dtype=self.output_dtype, cast_forward_inputs=self.cast_forward_inputs)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The forward's context without FSDP2 (single process, DDP): autocast to ``param_dtype`` when mixed.

        Under FSDP2 the policy casts the parameters itself; use ``contextlib.nullcontext()`` there."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.param_dtype)

    def compute_dtype(self, storage_dtype: torch.dtype, fsdp2: bool) -> torch.dtype:
        """The dtype the forward and backward run in."""
        if fsdp2:
            return self.param_dtype or storage_dtype
        return self.param_dtype if self.mixed else storage_dtype

    def grad_scaler(self, device_type: str, storage_dtype: torch.dtype, fsdp2: bool, process_group: Any = None
                    ) -> Any:
        """A gradient scaler when computing in fp16 (None otherwise); under FSDP2 its inf check spans the ranks."""
        if self.compute_dtype(storage_dtype, fsdp2) != torch.float16:
            return None
        if fsdp2:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device_type, process_group=process_group)
        return torch.amp.GradScaler(device_type)

    def describe(self, storage_dtype: torch.dtype, fsdp2: bool) -> str:
        """One line for the plan and the first log lines: the dtypes that act, FSDP2's policy or autocast."""
        compute = self.compute_dtype(storage_dtype, fsdp2)
        if fsdp2:
            reduce, output = self.reduce_dtype or compute, self.output_dtype or compute
        else:
            reduce, output = storage_dtype, compute
        if compute == storage_dtype and reduce == storage_dtype and output == storage_dtype:
            return f"precision: {_name(storage_dtype)} (no mixed precision), loss fp32"
        how = "FSDP2 MixedPrecisionPolicy" if fsdp2 else "torch.autocast"
        return (f"mixed precision ({how}): params {_name(compute)} (stored {_name(storage_dtype)}), reduce "
                f"{_name(reduce)}, output {_name(output)}, loss fp32"
                + (", gradient scaler" if compute == torch.float16 else ""))


def _name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def parse_dtype_name(value: Any) -> torch.dtype | None:
    """``bf16`` / ``bfloat16`` / ``torch.bfloat16`` / a dtype -> the dtype; None when it names none we train in."""
    if isinstance(value, torch.dtype):
        return value if value in _SHORT else None
    if isinstance(value, str):
        return _DTYPES.get(value.strip().lower().removeprefix("torch."))
    return None


def default_precision(device: torch.device) -> Precision:
    """fp32 on a CPU; bf16 compute with fp32 reduction and outputs on a GPU that supports bf16."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return Precision(torch.bfloat16, torch.float32, torch.float32)
    return Precision()


def precision_issues(mp_policy: Mapping[str, Any] | None, device: torch.device, fsdp2: bool,
                     section: str = "distributed.mp_policy") -> list[ConfigIssue]:
    """Every problem with an ``mp_policy`` mapping, each under its dotted key (``fsdp2``: the run shards with it)."""
    return _parse(mp_policy, device, fsdp2, section)[1]


def resolve_precision(mp_policy: Mapping[str, Any] | None, device: torch.device, fsdp2: bool,
                      section: str = "distributed.mp_policy") -> Precision:
    """The precision for ``mp_policy`` (None: :func:`default_precision`); a ``ConfigError`` when it is wrong."""
    precision, issues = _parse(mp_policy, device, fsdp2, section)
    if issues:
        raise ConfigError(issues)
    return precision


def _parse(mp_policy: Mapping[str, Any] | None, device: torch.device, fsdp2: bool,
           section: str) -> tuple[Precision, list[ConfigIssue]]:
    if mp_policy is None:
        return default_precision(device), []
    issues: list[ConfigIssue] = []
    target = mp_policy.get("_target_")
    if target is not None and target != FSDP_MP_TARGET:
        issues.append(ConfigIssue(f"{section}._target_", f"'{target}' is not accepted here; name "
                                  f"{FSDP_MP_TARGET} or leave _target_ out"))
    for key in mp_policy:
        if key != "_target_" and key not in MP_KEYS:
            issues.append(ConfigIssue(f"{section}.{key}", f"unknown key; mp_policy takes {', '.join(MP_KEYS)}"))
    dtypes: dict[str, torch.dtype | None] = {}
    for key in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = mp_policy.get(key)
        dtypes[key] = parse_dtype_name(value) if value is not None else None
        if value is not None and dtypes[key] is None:
            issues.append(ConfigIssue(f"{section}.{key}", f"{value!r} is not a training dtype; use bf16 "
                                      "(bfloat16), fp16 (float16) or fp32 (float32)"))
    cast = mp_policy.get("cast_forward_inputs", True)
    if not isinstance(cast, bool):
        issues.append(ConfigIssue(f"{section}.cast_forward_inputs", f"must be true or false, found {cast!r}"))
    param = dtypes["param_dtype"]
    if param == torch.bfloat16 and device.type == "cuda" and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        issues.append(ConfigIssue(f"{section}.param_dtype", f"bf16 is not supported by {torch.cuda.get_device_name()}"
                                  "; use fp16 (with its gradient scaler) or fp32"))
    if not fsdp2:
        issues += _autocast_issues(dtypes, cast, section)
    return Precision(param, dtypes["reduce_dtype"], dtypes["output_dtype"], cast if isinstance(cast, bool) else True
                     ), issues


def _autocast_issues(dtypes: dict[str, torch.dtype | None], cast: Any, section: str) -> list[ConfigIssue]:
    """What only FSDP2's policy can do: autocast neither reduces in another dtype nor casts outputs or inputs."""
    issues = []
    for key, allowed in (("reduce_dtype", (None, torch.float32)), ("output_dtype", (None, torch.float32))):
        if dtypes[key] not in allowed:
            issues.append(ConfigIssue(f"{section}.{key}", f"{_name(dtypes[key])} needs distributed.strategy: fsdp2 "
                                      "(without it gradients are reduced in fp32 and outputs are left as autocast "
                                      "computes them, the loss in fp32); remove the key or use fsdp2"))
    if cast is False:
        issues.append(ConfigIssue(f"{section}.cast_forward_inputs", "false needs distributed.strategy: fsdp2 "
                                  "(autocast casts each operation's inputs); remove the key or use fsdp2"))
    return issues
