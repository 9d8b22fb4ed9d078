"""The ``prewarm`` section: upstream's one-time CUDA initialisations at setup (none is implemented here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from automodel.config.schema import FieldErrors

_PREWARMS = {
    "cublas_backward": "cuBLAS's backward-pass workspaces (a tiny matmul per dtype)",
    "fla_gdn_autotune": "the Triton autotuning of flash-linear-attention's gated-delta-rule kernels",
    "mamba_ssd_autotune": "the Triton autotuning of Mamba's SSD kernels",
    "comm_groups": "the NCCL communicators of the gradient-norm all-reduce",
}


def _refused(name: str) -> str:
    return f"refused when true: {_PREWARMS[name]}"


@dataclass
class PrewarmConfig:
    """Upstream's ``prewarm:``: one-time CUDA initialisations run at setup rather than in the first step, so their
    memory spikes come before the activations do. They change no result (upstream's runs train the same with
    them off), and none is implemented here: false (or absent) is the only setting."""

    cublas_backward: bool = field(default=False, metadata={"help": _refused("cublas_backward")})
    fla_gdn_autotune: bool = field(default=False, metadata={"help": _refused("fla_gdn_autotune")})
    mamba_ssd_autotune: bool = field(default=False, metadata={"help": _refused("mamba_ssd_autotune")})
    comm_groups: bool = field(default=False, metadata={"help": _refused("comm_groups")})

    def __post_init__(self) -> None:
        on = {name: what for name, what in _PREWARMS.items() if getattr(self, name)}
        if on:
            raise FieldErrors({name: f"true initialises {what} at setup instead of in the first step (upstream's "
                                     "CUDA out-of-memory guard; training is the same without it), which this build "
                                     "does not do: set false or remove it" for name, what in on.items()})
