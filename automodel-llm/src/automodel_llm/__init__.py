"""automodel-llm: causal language model recipes. Importing this package imports no torch."""

from automodel_llm.models import AutoModelForCausalLM

__all__ = ["AutoModelForCausalLM"]
