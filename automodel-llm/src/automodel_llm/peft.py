"""``automodel_llm.peft.PeftConfig``: the upstream-compatible LoRA settings, at the dotted path configs name.

LoRA itself (config, the ``peft`` pipeline stage, adapter files) is the core's: ``automodel.hf`` and
``automodel.training.stages.peft``.
"""

from automodel.hf import PeftConfig

__all__ = ["PeftConfig"]
