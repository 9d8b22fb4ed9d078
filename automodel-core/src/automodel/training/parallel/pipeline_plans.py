"""Pipeline plans (transformers' ``pp_plan``: the input embedding, the decoder layers, the final norm, the output
head, each with what it takes and gives) for the models whose transformers classes have none, by ``model_type``:
Nemotron-H (upstream cuts its NemotronV3 models into stages; transformers' ``NemotronHForCausalLM`` has no plan) and
Qwen3-VL (its MoE sibling's config has one, the dense one's none; their language models are alike)."""

from __future__ import annotations

from typing import Any

from torch import nn

PLANS: dict[str, dict[str, tuple[list[str], list[str]]]] = {
    "nemotron_h": {"model.embeddings": (["input_ids"], ["inputs_embeds"]),
                   "model.layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                   "model.norm_f": (["hidden_states"], ["hidden_states"]),
                   "lm_head": (["hidden_states"], ["logits"])},
    "qwen3_vl": {"model.language_model.embed_tokens": (["input_ids"], ["inputs_embeds"]),
                 "model.language_model.layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                 "model.language_model.norm": (["hidden_states"], ["hidden_states"])},
}


# text-model children (by the text config's model_type) that only the first stage runs, beside the embedding: Gemma
# 4's per-layer inputs are made there from the token ids and the embeddings (the VLM domain sends them on to the
# later stages, automodel_vlm.gemma4_pipeline); the later stages hold none of them
FIRST_STAGE_ONLY: dict[str, tuple[str, ...]] = {
    "gemma4_text": ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"),
}


def first_stage_only(model: nn.Module, text: str) -> list[str]:
    """The children of ``model``'s text model (named ``text``) that only the first pipeline stage holds."""
    names = FIRST_STAGE_ONLY.get(getattr(model.config.get_text_config(), "model_type", None), ())
    text_model = model.get_submodule(text)
    return [f"{text}.{name}" for name in names if isinstance(getattr(text_model, name, None), nn.Module)]


def pipeline_plan(model: nn.Module) -> dict[str, Any]:
    """``model``'s pipeline plan: transformers', else the one here for its ``model_type`` (empty: none)."""
    plan = dict(getattr(model, "pp_plan", None) or {})
    return plan or dict(PLANS.get(getattr(model.config, "model_type", None), {}))


def has_pipeline_plan(config: Any) -> bool:
    """Whether the model of ``config`` (a transformers config) has a pipeline plan, before it is built."""
    text = config.get_text_config()
    return bool(getattr(config, "base_model_pp_plan", None) or getattr(text, "base_model_pp_plan", None)
                or config.model_type in PLANS)
