"""Slot ``qat``: quantisation-aware training through torchao's fake quantisers (``qat.enabled``; runs on CPU)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext

QAT_QUANTIZERS = {
    "int8_dynamic_act_int4_weight": "Int8DynActInt4WeightQATQuantizer",
    "int4_weight_only": "Int4WeightOnlyQATQuantizer",
}


def select(cfg: Config) -> tuple[str, str] | None:
    return ("torchao", "qat.enabled") if cfg.qat is not None and cfg.qat.enabled else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    if select(cfg) is None:
        return []
    found = []
    if importlib.util.find_spec("torchao") is None:
        found.append(ConfigIssue("qat.enabled", "QAT needs torchao: pip install torchao"))
    quantizer, _ = cfg.qat.settings()
    if quantizer not in QAT_QUANTIZERS:
        found.append(ConfigIssue("qat.quantizer", f"'{quantizer}' is not one of {', '.join(QAT_QUANTIZERS)}"))
    if cfg.peft is not None:
        found.append(ConfigIssue("qat.enabled", "QAT together with peft (LoRA) is not supported: the fake-quantised "
                                                "layers would sit under the adapters; use one"))
    return found


def fake_quantize(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """torchao swaps the linear layers for fake-quantised ones."""
    import torchao.quantization.qat as qat

    name, group_size = ctx.cfg.qat.settings()
    quantizer = getattr(qat, QAT_QUANTIZERS[name])(groupsize=group_size)
    return quantizer.prepare(model), f"QAT fake quantisation {name} (group size {group_size})"


def set_fake_quantization(model: torch.nn.Module, enabled: bool) -> None:
    """Turn the fake quantisers of every torchao fake-quantised linear layer on or off (upstream's
    ``qat.fake_quant_after_n_steps`` runs the first steps with them off); the layers' weights are untouched."""
    from torchao.quantization.qat.linear import enable_linear_fake_quant

    for module in model.modules():
        enable_linear_fake_quant(module, enabled)


def delay_fake_quantization(cfg: Config, model: torch.nn.Module, step: int, log: Callable[[str], None]) -> int | None:
    """``qat.fake_quant_after_n_steps: N`` (upstream's): the first N steps run with the fake quantisers off (from
    ``step``, the step a run starts from); returns the step count at which they turn on (None: they are on, or
    QAT is off)."""
    qat = cfg.qat
    after = qat.fake_quant_after_n_steps if qat is not None and qat.enabled else None
    if not after or step >= after:
        return None
    set_fake_quantization(model, False)
    log(f"QAT: fake quantisation off for the first {after} steps (qat.fake_quant_after_n_steps), on from step "
        f"{after + 1}")
    return after
