"""Tensor-parallel plans: which module of a Hugging Face causal LM is sharded how, as torch ``ParallelStyle``\\ s.

A plan maps module-name patterns (``fnmatch``, relative to the causal LM: ``model.layers.*.self_attn.q_proj``) to
style names. The names are transformers' own, so a model's ``tp_plan`` (its config's ``base_model_tp_plan`` plus
the head's ``_tp_plan``, which transformers 5.x merges and extends with a vocabulary-parallel ``embed_tokens``) is
used as it is; :data:`STYLES` says what each name means (5.x names and the 4.x ones), and
:mod:`automodel.training.parallel.tp_styles` builds the torch style of each.
:class:`TPPlanRegistry` holds plans per ``model_type`` for architectures whose config has none, or to replace it; a
plugin adds its own through the registry (``register(model_type, plan)``).

This module is what validation reads (no ``torch.distributed`` import); the styles themselves are in tp_styles.

Every style returns local tensors between modules, so the model's own code computes on this rank's part: an
attention's ``q_proj`` output holds this rank's heads and transformers' attention, which reshapes with ``-1``
heads, sees the local head count. With ``sequence_parallel`` (:func:`sequence_parallel_entries`) the residual
stream inside the decoder layers holds this rank's part of the sequence: norms (and dropouts) run on it
(``SequenceParallel``), each attention / MLP gathers its input over the sequence and its row-wise output
projection reduce-scatters back; the stage's first layer splits its input and its last gathers its output, so
embeddings, rotary positions, masks and the head see the whole sequence.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from automodel.errors import AutomodelError

if TYPE_CHECKING:
    from torch import nn

# Style name -> what it does (4.x names beside 5.x ones of the same meaning); the torch ParallelStyle each stands for:
# automodel.training.parallel.tp_styles.STYLE_FACTORIES.
STYLES: dict[str, str] = {
    "colwise": "column-wise: output features sharded",
    "local_colwise": "column-wise: output features sharded",
    "rowwise": "row-wise: input features sharded, output all-reduced",
    "local_rowwise": "row-wise: input features sharded, output all-reduced",
    "colwise_rep": "column-wise head: vocabulary-parallel logits",
    "colwise_gather_output": "column-wise head: vocabulary-parallel logits",
    "rowwise_rep": "row-wise on a replicated input",
    "rowwise_split_input": "row-wise on a replicated input",
    "embedding_rowwise": "vocabulary-parallel embedding",
    "embedding_colwise": "embedding with the hidden size sharded",
    "gather": "output all-reduced",
    "all_reduce": "output all-reduced",
    "replicated_with_grad_allreduce": "replicated, gradients summed over the ranks",
    "sequence_parallel": "sequence-parallel (norm, dropout)",
    "replicate": "replicated",
}
HEAD_STYLES = ("colwise_rep", "colwise_gather_output")
ROWWISE_STYLES = ("rowwise", "local_rowwise")


class TPPlanRegistry:
    """Tensor-parallel plans by ``config.model_type``; an entry wins over the model's own ``tp_plan``."""

    def __init__(self) -> None:
        self._plans: dict[str, dict[str, str]] = {}

    def register(self, model_type: str, plan: Mapping[str, str]) -> None:
        """Add (or replace) the plan of ``model_type``: module pattern -> a style name of :data:`STYLES`."""
        unknown = sorted({style for style in plan.values() if style not in STYLES})
        if unknown:
            raise AutomodelError(f"the tensor-parallel plan for '{model_type}' names unknown styles "
                                 f"{', '.join(unknown)}; known: {', '.join(STYLES)}")
        self._plans[model_type] = dict(plan)

    def get(self, model_type: str) -> dict[str, str] | None:
        plan = self._plans.get(model_type)
        return dict(plan) if plan is not None else None

    def __contains__(self, model_type: str) -> bool:
        return model_type in self._plans


TP_PLANS = TPPlanRegistry()


def config_plan(config: Any, registry: TPPlanRegistry = TP_PLANS) -> dict[str, str] | None:
    """The plan validation can see without a model: the registry's, else the config's ``base_model_tp_plan`` (a
    composite config's, such as Llava's, is its text config's: the built model shards its language model by it)."""
    own = getattr(config, "base_model_tp_plan", None)
    if not own and hasattr(config, "get_text_config"):
        own = getattr(config.get_text_config(), "base_model_tp_plan", None)
    return registry.get(config.model_type) or (dict(own or {}) or None)


def model_plan(model: nn.Module, registry: TPPlanRegistry = TP_PLANS) -> dict[str, str]:
    """The plan of a built causal LM: the registry's entry for its ``model_type``, else the model's own."""
    plan = registry.get(model.config.model_type) or dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise AutomodelError(f"'{type(model).__name__}' ({model.config.model_type}) has no tensor-parallel plan (no "
                             "base_model_tp_plan in its config, none registered); set distributed.tp_size: 1 or "
                             "register a plan for this architecture")
    return plan


def expand_plan(plan: Mapping[str, str], model: nn.Module, require_all: bool = True) -> dict[str, str]:
    """Module name -> style name for every module of ``model`` that ``plan`` shards (the first pattern matching
    a module wins, as in transformers). Every style must be one of :data:`STYLES`; ``require_all``: every pattern
    must match a module (a pipeline stage holds only some of them)."""
    names = [name for name, _ in model.named_modules() if name]
    concrete: dict[str, str] = {}
    for pattern, style_name in plan.items():
        if style_name not in STYLES:
            raise AutomodelError(f"the tensor-parallel plan of '{type(model).__name__}' shards '{pattern}' with "
                                 f"'{style_name}', which is not supported here (supported: {', '.join(STYLES)})")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched and require_all:
            raise AutomodelError(f"the tensor-parallel plan names '{pattern}', which matches no module of "
                                 f"'{type(model).__name__}': is the plan for this architecture?")
        for name in matched:
            concrete.setdefault(name, style_name)
    return concrete
