"""automodel-llm: causal language model recipes. Importing this package imports no torch."""

from automodel_llm.models import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

__all__ = ["AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification"]
