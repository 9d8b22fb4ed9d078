"""``checkpoint.dequantize_base_checkpoint`` against the model built.

Upstream dequantizes a quantized base checkpoint (its config's ``quantization_config``) while loading it; this
build loads no quantized weights, so the key either governs nothing (a note) or the run is refused.
"""

from __future__ import annotations

import torch

from automodel.errors import AutomodelError


def base_quantization_note(wanted: bool | None, model: torch.nn.Module) -> str | None:
    """The note to print for ``wanted`` (None: the key is unset); raises for a quantized base model."""
    if wanted is None:
        return None
    quantization = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantization is None:
        return (f"note: checkpoint.dequantize_base_checkpoint: {str(wanted).lower()} governs nothing this run: "
                "the base model is not quantized (its config has no quantization_config)")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    raise AutomodelError(f"checkpoint.dequantize_base_checkpoint: {str(wanted).lower()}, but the base model is "
                         f"quantized (quantization_config, quant_method {method}) and this build loads no "
                         "quantized weights, dequantized or not; train from a bf16 or fp32 copy of the model")
