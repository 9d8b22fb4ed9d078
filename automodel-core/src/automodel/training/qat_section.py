"""The ``qat`` section: quantisation-aware training through torchao, with upstream's keys (``qat_config``,
``fake_quant_after_n_steps``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from automodel.config.schema import FieldErrors

# upstream's QATConfig.quantizer_type -> qat.quantizer here (the same torchao quantizers)
_UPSTREAM_QUANTIZER_TYPES = {"int8_dynact_int4weight": "int8_dynamic_act_int4_weight",
                             "int4_weight_only": "int4_weight_only"}


@dataclass
class QATConfig:
    """``qat_config`` is upstream's form of ``quantizer`` / ``group_size`` (its QATConfig, never imported): it sets
    them, with torchao's group size (256) where it names none, as upstream's does (``settings()``)."""

    enabled: bool = field(default=False, metadata={"help": "quantisation-aware training through torchao"})
    quantizer: str | None = field(default=None, metadata={"help":
        "torchao fake-quantiser: int8_dynamic_act_int4_weight (unset: this one) or int4_weight_only"})
    group_size: int | None = field(default=None, metadata={"help":
        "weight group size (unset: 32; 256, torchao's, under qat_config without groupsize)"})
    fake_quant_after_n_steps: int | None = field(default=None, metadata={"help":
        "upstream's delay: the first N optimizer steps (and validations) run without fake quantisation, which "
        "turns on before step N+1, also on a resume (0 or unset: from the start)"})
    qat_config: dict | None = field(default=None, metadata={"help":
        "upstream's form: {_target_: ...QATConfig, quantizer_type: int8_dynact_int4weight | int4_weight_only, "
        "groupsize}; sets quantizer and group_size"})

    def __post_init__(self) -> None:
        errors = {}
        if self.fake_quant_after_n_steps is not None and self.fake_quant_after_n_steps < 0:
            errors["fake_quant_after_n_steps"] = f"{self.fake_quant_after_n_steps} is negative; use 0 or more steps"
        if self.qat_config is not None:
            upstream = _upstream_qat_settings(self.qat_config)
            if isinstance(upstream, str):
                errors["qat_config"] = upstream
            else:
                errors.update({name: f"{getattr(self, name)!r} disagrees with qat_config's {value!r}; give one of them"
                               for name, value in upstream.items() if getattr(self, name) not in (None, value)})
        if errors:
            raise FieldErrors(errors)

    def settings(self) -> tuple[str, int]:
        """The torchao quantizer and weight group size: qat_config's (upstream's form) where given, else quantizer
        and group_size, else their defaults."""
        given = {"quantizer": self.quantizer, "group_size": self.group_size}
        if self.qat_config is not None:
            given = _upstream_qat_settings(self.qat_config)
        return given["quantizer"] or "int8_dynamic_act_int4_weight", given["group_size"] or 32


def _upstream_qat_settings(node: dict) -> dict | str:
    """``quantizer`` / ``group_size`` as upstream's QATConfig node sets them, or why it cannot be read."""
    target = str(node.get("_target_", ""))
    if target.rsplit(".", 1)[-1] != "QATConfig":
        return (f"_target_ {target or '(missing)'!r}: only upstream's QATConfig is read here "
                "(nemo_automodel.components.quantization.qat.QATConfig)")
    extra = sorted(set(node) - {"_target_", "quantizer_type", "groupsize"})
    if extra:
        return (f"{', '.join(extra)}: torchao quantizer arguments not set here (quantizer_type and groupsize are); "
                "remove them")
    kind = node.get("quantizer_type", "int8_dynact_int4weight")
    if kind not in _UPSTREAM_QUANTIZER_TYPES:
        return f"quantizer_type {kind!r} is not one of {', '.join(_UPSTREAM_QUANTIZER_TYPES)}"
    groupsize = node.get("groupsize")
    return {"quantizer": _UPSTREAM_QUANTIZER_TYPES[kind], "group_size": 256 if groupsize is None else groupsize}
