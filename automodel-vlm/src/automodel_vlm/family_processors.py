"""Upstream's own processor builders for the VLM families transformers now ships itself: Inkling, MiniMax-M3-VL and
Step3.7 (upstream's ``build_inkling_processor``, ``build_minimax_m3_vl_processor``,
``Step3VLProcessor.from_pretrained``, see plugin.py).

Each loads transformers' own processor class of the family from the checkpoint (hub checkpoints name upstream's
remote-code class in ``processor_class``, which AutoProcessor would follow) and applies what upstream's builder adds
that transformers' class does not do itself. The keyword arguments are ``from_pretrained``'s; ``trust_remote_code:
true`` is refused as everywhere unless the command line trusts it (transformers then runs the checkpoint's own code
for its tokenizer and image processor where it ships some). Upstream's MiniMax builder re-attaches
``chat_template.jinja``, which the checkpoint's remote-code class dropped; transformers' class keeps it, so it only
loads. The three families' image processors are torchvision-backed (no Pillow twin): without torchvision the
builders are refused at validation, saying so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from automodel_vlm.processor import finish_processor, open_processor

# Inkling's end-of-sampling token: upstream's end-of-sequence (and so padding) token for a tokenizer without one
INKLING_END_OF_SAMPLING = "<|content_model_end_sampling|>"


def torchvision_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """Validation's check of the builders: their image processors cannot load without torchvision."""
    if importlib.util.find_spec("torchvision") is not None:
        return {}
    return {"_target_": "this family's image processor (transformers' class) is torchvision-backed, and torchvision "
                        "is not installed here: install the torchvision build that matches your torch, or train "
                        "another model family"}


def inkling_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``InklingProcessor``; a tokenizer without an end-of-sequence token gets Inkling's
    end-of-sampling token as it (and as the pad token), as upstream's builder does."""
    processor = open_processor("InklingProcessor", pretrained_model_name_or_path, kwargs)
    if processor.tokenizer.eos_token_id is None:
        processor.tokenizer.eos_token = INKLING_END_OF_SAMPLING
    return finish_processor(processor)


def minimax_m3_vl_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``MiniMaxM3VLProcessor`` (its chat template from the checkpoint's ``chat_template.jinja``)."""
    return finish_processor(open_processor("MiniMaxM3VLProcessor", pretrained_model_name_or_path, kwargs))


def step3p7_processor(pretrained_model_name_or_path: str | None = None, **kwargs: Any) -> Any:
    """transformers' ``Step3p7Processor`` (global view plus local patch crops per image)."""
    return finish_processor(open_processor("Step3p7Processor", pretrained_model_name_or_path, kwargs))


for _builder in (inkling_processor, minimax_m3_vl_processor, step3p7_processor):
    _builder.automodel_config_issues = torchvision_issues  # type: ignore[attr-defined]
