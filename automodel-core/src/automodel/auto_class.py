"""Which transformers Auto class loads a saved Hugging Face model directory, for the lines that tell the user how.

Read from the directory's ``config.json`` (its ``architectures`` and ``model_type``) against transformers' own
Auto mappings, so a vision-language model is named ``AutoModelForImageTextToText``, a T5 ``AutoModelForSeq2SeqLM``
and a classifier ``AutoModelForSequenceClassification`` rather than every model ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import json
from pathlib import Path


def _auto_mappings() -> list[tuple[str, dict[str, str]]]:
    from transformers.models.auto import modeling_auto as auto

    return [("AutoModelForSequenceClassification", auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
            ("AutoModelForImageTextToText", auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
            ("AutoModelForSeq2SeqLM", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
            ("AutoModelForCausalLM", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]


def loading_auto_class(model_dir: Path) -> str:
    """The Auto class whose mapping gives the saved architecture for the saved model type; else the first that
    knows the model type; ``AutoModelForCausalLM`` when config.json is missing or unreadable."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "AutoModelForCausalLM"
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    mappings = _auto_mappings()
    for name, mapping in mappings:
        if mapping.get(model_type) in architectures:
            return name
    return next((name for name, mapping in mappings if model_type in mapping), "AutoModel")
