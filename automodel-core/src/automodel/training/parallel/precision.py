"""Mixed precision from ``distributed.mp_policy``: FSDP2's ``MixedPrecisionPolicy``, or ``torch.autocast`` elsewhere.

The keys are upstream's (those of ``torch.distributed.fsdp.MixedPrecisionPolicy``, which upstream configs may also
name in ``_target_``), with its meaning of an unset dtype: ``param_dtype`` (the compute dtype: bf16 | fp16 | fp32),
``reduce_dtype`` (gradient reduction; unset: param_dtype), ``output_dtype`` (the forward's outputs; unset: no cast),
``cast_forward_inputs``. The parameters keep the model's own dtype (``model.torch_dtype``): float32 storage with
``param_dtype: bf16`` is the fp32-master-weights pattern. The loss is computed in float32 in every case (the
engine's cross entropy upcasts the logits). fp16 needs a gradient scaler, which :meth:`Precision.grad_scaler`
makes. Without FSDP2 (one process, DDP) ``torch.autocast`` runs the forward in ``param_dtype``; there gradients are
reduced in float32 and outputs are not cast, so other values of those keys are refused. Without ``mp_policy``:
float32 on a CPU, bf16 (reduced and output in fp32) on a GPU that supports it. Upstream's sibling key
``distributed.autocast_dtype`` also runs the forward under ``torch.autocast`` in that dtype, under FSDP2 too (its
pattern: ``output_dtype: fp32`` keeps the residual stream in fp32 while the matmuls run in bf16); without FSDP2 it
is the autocast dtype, and must agree with ``param_dtype`` when both are set.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    autocast_dtype: torch.dtype | None = None  # distributed.autocast_dtype

    @property
    def mixed(self) -> bool:
        return self.param_dtype in (torch.bfloat16, torch.float16)

    def fsdp_policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` for ``fully_shard`` (its defaults where a dtype is unset)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                                    output_dtype=self.output_dtype, cast_forward_inputs=self.cast_forward_inputs)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The forward's context without FSDP2 (single process, DDP): autocast to ``param_dtype`` (or
        ``autocast_dtype``) when mixed. Under FSDP2 see :meth:`forward_context`."""
        return self.forward_context(device_type, fsdp2=False)

    def forward_context(self, device_type: str, fsdp2: bool) -> contextlib.AbstractContextManager:
        """What the forward (and the loss) run under: FSDP2's policy casts the parameters itself, so there only
        ``autocast_dtype`` adds an autocast; elsewhere autocast runs in the compute dtype when it is mixed."""
        dtype = self.autocast_dtype if fsdp2 else (self.autocast_dtype or (self.param_dtype if self.mixed else None))
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=dtype)

    def compute_dtype(self, storage_dtype: torch.dtype, fsdp2: bool) -> torch.dtype:
        """The dtype the forward and backward run in (the matmuls', under ``autocast_dtype``)."""
        if self.autocast_dtype is not None:
            return self.autocast_dtype
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
        if fsdp2 and self.autocast_dtype is not None:
            output = self.output_dtype or self.param_dtype or storage_dtype
        if compute == storage_dtype and reduce == storage_dtype and output == storage_dtype:
            return f"precision: {dtype_name(storage_dtype)} (no mixed precision), loss fp32"
        how = "FSDP2 MixedPrecisionPolicy" if fsdp2 else "torch.autocast"
        if fsdp2 and self.autocast_dtype is not None:
            how += f" + torch.autocast {dtype_name(self.autocast_dtype)}"
        return (f"mixed precision ({how}): params {dtype_name(compute)} (stored {dtype_name(storage_dtype)}), reduce "
                f"{dtype_name(reduce)}, output {dtype_name(output)}, loss fp32"
                + (", gradient scaler" if compute == torch.float16 else ""))


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a training dtype (bf16, fp16, fp32), else torch's."""
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
                     section: str = "distributed.mp_policy", autocast_dtype: Any = None) -> list[ConfigIssue]:
    """Every problem with an ``mp_policy`` mapping (and ``autocast_dtype``), each under its dotted key (``fsdp2``:
    the run shards with it)."""
    return _with_autocast(mp_policy, device, fsdp2, section, autocast_dtype)[1]


def resolve_precision(mp_policy: Mapping[str, Any] | None, device: torch.device, fsdp2: bool,
                      section: str = "distributed.mp_policy", autocast_dtype: Any = None) -> Precision:
    """The precision for ``mp_policy`` (None: :func:`default_precision`) and upstream's ``autocast_dtype``
    (None: none); a ``ConfigError`` when either is wrong."""
    precision, issues = _with_autocast(mp_policy, device, fsdp2, section, autocast_dtype)
    if issues:
        raise ConfigError(issues)
    return precision


def _with_autocast(mp_policy: Mapping[str, Any] | None, device: torch.device, fsdp2: bool, section: str,
                   autocast_dtype: Any) -> tuple[Precision, list[ConfigIssue]]:
    precision, issues = _parse(mp_policy, device, fsdp2, section)
    if autocast_dtype is None:
        return precision, issues
    key = f"{section.rsplit('.', 1)[0]}.autocast_dtype" if "." in section else "autocast_dtype"
    dtype = parse_dtype_name(autocast_dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        issues.append(ConfigIssue(key, f"{autocast_dtype!r} is not an autocast dtype; use bf16 (bfloat16) or fp16 "
                                  "(float16), or remove the key"))
        return precision, issues
    if not fsdp2 and precision.mixed and precision.param_dtype != dtype:
        issues.append(ConfigIssue(key, f"{dtype_name(dtype)} disagrees with {section}.param_dtype "
                                  f"({dtype_name(precision.param_dtype)}); without fsdp2 both name the autocast dtype: "
                                  "give one"))
    return dataclasses.replace(precision, autocast_dtype=dtype), issues


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


FSDP2_RUN = ("distributed.strategy: fsdp2 and more than one process (FSDP2 shards over the run's processes; one "
             "process trains unsharded, under autocast)")


def _autocast_issues(dtypes: dict[str, torch.dtype | None], cast: Any, section: str) -> list[ConfigIssue]:
    """What only FSDP2's policy can do: autocast neither reduces in another dtype nor casts outputs or inputs."""
    issues = []
    for key, allowed in (("reduce_dtype", (None, torch.float32)), ("output_dtype", (None, torch.float32))):
        if dtypes[key] not in allowed:
            issues.append(ConfigIssue(f"{section}.{key}", f"{dtype_name(dtypes[key])} is FSDP2's, so it needs "
                                      f"{FSDP2_RUN} (without FSDP2 gradients are reduced in fp32 and outputs are left "
                                      "as autocast computes them, the loss in fp32); remove the key or use fsdp2"))
    if cast is False:
        issues.append(ConfigIssue(f"{section}.cast_forward_inputs", f"false is FSDP2's, so it needs {FSDP2_RUN} "
                                  "(autocast casts each operation's inputs); remove the key or use fsdp2"))
    return issues
