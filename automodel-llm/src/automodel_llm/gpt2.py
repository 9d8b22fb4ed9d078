"""A GPT-2 of chosen sizes from flat keys (upstream's ``build_gpt2_model``), for pre-training from scratch.

Upstream's builder returns its own PyTorch GPT-2 and ignores several of its arguments. Here the model is
transformers' ``GPT2LMHeadModel`` built from a ``GPT2Config``, so the saved ``model/`` loads with
``transformers.GPT2LMHeadModel.from_pretrained``, and every argument acts: it is a ``GPT2Config`` key (the token
ids are written into the config), a model construction argument, or refused at validation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from automodel.errors import AutomodelError
from automodel_llm.models import AutoModelForCausalLM

# GPT2Config's architecture keys a config may set besides the named parameters of GPT2.build
CONFIG_KEYS = ("n_inner", "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
               "initializer_range", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
               "reorder_and_upcast_attn", "tie_word_embeddings", "pad_token_id", "use_cache")
# what the model build takes besides the config (AutoModelForCausalLM.from_config's keyword arguments)
BUILD_KEYS = ("attn_implementation", "backend", "dtype", "torch_dtype", "seed")


def _positions(n_positions: int | None, n_ctx: int | None) -> int:
    """The context length: ``n_positions``, or GPT-2's older name for it, ``n_ctx``; 2048 (upstream's) if neither."""
    if n_positions is not None and n_ctx is not None and n_positions != n_ctx:
        raise AutomodelError(f"model.n_ctx: {n_ctx} differs from model.n_positions: {n_positions}; both are the "
                             "context length: give one of them")
    return n_positions or n_ctx or 2048


class GPT2:
    """Upstream's ``build_gpt2_model`` keys, checked at validation (:meth:`automodel_config_issues`)."""

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        """Keys that are not GPT-2's, sizes that do not fit, two context lengths that disagree."""
        named = {"vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "bos_token_id",
                 "eos_token_id"}
        issues = {key: (f"not a GPT-2 setting here (upstream printed a warning and ignored it); known: "
                        f"{', '.join(sorted(named | set(CONFIG_KEYS) | set(BUILD_KEYS)))}")
                  for key in kwargs if key not in named | set(CONFIG_KEYS) | set(BUILD_KEYS)}
        n_embd, n_head = kwargs.get("n_embd", 768), kwargs.get("n_head", 12)
        if isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0 and n_embd % n_head:
            issues["n_head"] = f"{n_head} does not divide n_embd {n_embd}: each head gets n_embd / n_head features"
        try:
            _positions(kwargs.get("n_positions"), kwargs.get("n_ctx"))
        except AutomodelError as err:
            issues["n_ctx"] = str(err).split(": ", 1)[1]
        return issues

    @classmethod
    def build(cls, *, vocab_size: int = 50257, n_positions: int | None = None, n_ctx: int | None = None,
              n_embd: int = 768, n_layer: int = 12, n_head: int = 12, bos_token_id: int | None = 50256,
              eos_token_id: int | None = 50256, **kwargs: Any) -> Any:
        """transformers' ``GPT2LMHeadModel``, freshly initialised (seeded, on the meta device when the engine
        builds so); ``kwargs`` are GPT2Config keys (``CONFIG_KEYS``) or build arguments (``BUILD_KEYS``)."""
        unknown = sorted(set(kwargs) - set(CONFIG_KEYS) - set(BUILD_KEYS))
        if unknown:
            raise AutomodelError(f"model.{unknown[0]}: not a GPT-2 setting here; known: "
                                 f"{', '.join(CONFIG_KEYS + BUILD_KEYS)}")
        config = {"model_type": "gpt2", "vocab_size": vocab_size, "n_positions": _positions(n_positions, n_ctx),
                  "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head, "bos_token_id": bos_token_id,
                  "eos_token_id": eos_token_id, **{k: kwargs.pop(k) for k in CONFIG_KEYS if k in kwargs}}
        return AutoModelForCausalLM.from_config(config, **kwargs)


build_gpt2_model = GPT2.build
