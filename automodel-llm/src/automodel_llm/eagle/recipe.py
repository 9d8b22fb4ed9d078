"""EAGLE-1 / EAGLE-2 draft training (``automodel finetune eagle``; upstream's ``TrainEagle1Recipe`` and
``TrainEagle2Recipe``, which train the same draft: EAGLE-2 differs in the tree it drafts at serving time).

The ``model`` section is the target (:class:`~automodel_llm.draft_recipe.DraftRecipe`), run on every batch for its
last hidden state (the feature) and logits. Slot ``t`` of the draft reads token ``t + 1`` and the target's feature
at ``t`` (with uniform noise while training, ``eagle.feature_noise``) and predicts the feature at ``t + 1``: trained
by the smooth L1 distance to it (``eagle.hidden_loss_weight``) and by the cross entropy of the target's distribution
there under the target's output head applied to the prediction (``eagle.token_loss_weight``). A slot counts where
token ``t + 2``, the one its prediction drafts, is a label token (of the same sample, in packed rows). The loss is
summed over the global batch's counted slots, as the engine's losses are; each part is logged as ``loss_hidden`` /
``loss_token``. Validation reports ``accuracy``: the slots whose drafted token is the target's own choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext
from automodel_llm.draft_recipe import DraftRecipe, whole
from automodel_llm.eagle.draft import ARCHITECTURE, EagleLlamaForCausalLM, draft_config
from automodel_llm.eagle.settings import RECIPE_ARGS, EagleConfig
from automodel_llm.eagle3.unroll import shifted


class EagleRecipe(DraftRecipe):
    """Trains an EAGLE-1 / EAGLE-2 draft (the run's model) against the frozen ``model`` section's target."""

    settings_key = "eagle"
    loss_description = ("EAGLE's feature regression (smooth L1) plus the cross entropy of the target's "
                        "distribution (eagle.hidden_loss_weight, eagle.token_loss_weight)")
    sections: ClassVar[dict] = {"eagle": EagleConfig, "recipe_args": RECIPE_ARGS}
    output_head: torch.Tensor  # the target's output head (frozen), which turns a predicted feature into logits

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        if cfg.peft is not None:
            issues.append(ConfigIssue("peft", "the EAGLE-1/2 draft trains whole (a layer or two; upstream's recipe "
                                      "refuses peft too): remove the section"))
        return issues

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        settings = cfg.get("eagle") or EagleConfig()
        return [*super().describe_plan(cfg), f"EAGLE-1/2: the model section is the frozen target; the trained model is "
                f"a {settings.draft_num_hidden_layers}-layer draft predicting the target's next feature (loss "
                f"{settings.hidden_loss_weight} x smooth L1 + {settings.token_loss_weight} x token cross entropy)"]

    def build_model(self, ctx: BuildContext) -> torch.nn.Module:
        """The frozen target and the draft made for it, which is what this returns: the run's model."""
        settings = self.settings()
        target = self.build_target(ctx)
        text = target.config.get_text_config()
        draft = EagleLlamaForCausalLM(draft_config(text, settings.draft_num_hidden_layers))
        self.share_embeddings(draft, settings.freeze_embeddings)
        self.output_head = whole(target.get_output_embeddings().weight.detach())
        self.log(f"EAGLE-1/2: a {settings.draft_num_hidden_layers}-layer draft for the frozen target "
                 f"{self.target_class} ({text.num_hidden_layers} layers), feature noise "
                 f"+-{settings.feature_noise}, embeddings {'frozen' if settings.freeze_embeddings else 'trained'}")
        return draft

    # ---- the loss ---------------------------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """EAGLE's loss of the batch, summed over its counted slots."""
        settings = self.settings()
        out = self.run_target(batch)
        features = out.hidden_states[-1]  # the final norm's output, which the output head reads
        counted = self.drafted(batch)
        read = features
        if model.training and settings.feature_noise > 0:
            read = features + torch.empty_like(features).uniform_(-settings.feature_noise, settings.feature_noise)
        predicted = model(input_ids=shifted(batch["input_ids"], 1), features=read,
                          position_ids=batch.get("position_ids"))
        wanted = shifted(features, 1).to(predicted.dtype)
        distance = torch.nn.functional.smooth_l1_loss(predicted, wanted, reduction="none").mean(dim=-1)
        logits = torch.nn.functional.linear(predicted, self.output_head.to(predicted.dtype)).float()
        target_logits = shifted(out.logits, 1).float()
        cross_entropy = -(torch.softmax(target_logits, dim=-1) * torch.log_softmax(logits, dim=-1)).sum(dim=-1)
        hidden_sum, token_sum = (distance.float() * counted).sum(), (cross_entropy * counted).sum()
        if model.training:
            self.add_loss_part("hidden", hidden_sum)
            self.add_loss_part("token", token_sum)
        else:
            right = (logits.argmax(dim=-1) == target_logits.argmax(dim=-1)) & counted
            self.count_for_validation(torch.stack([right.sum(), counted.sum()]))
        return settings.hidden_loss_weight * hidden_sum + settings.token_loss_weight * token_sum

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        """``accuracy`` over the validation set: the counted slots whose drafted token (the greedy token of the
        target's head on the predicted feature) is the target's own choice."""
        counts = self.validation_totals()
        if counts is None:
            return {}
        right, counted = counts
        return {"accuracy": (right / counted.clamp_min(1)).item()}

    def final_message(self, model_dir: Path) -> str:
        if not model_dir.is_dir():  # saved sharded only: the base message says how to export it
            return super().final_message(model_dir)
        return (f"the EAGLE-1/2 draft is in {model_dir} ({ARCHITECTURE}): serve it as the speculative model of its "
                f"target, e.g. vllm serve TARGET --speculative-config '{{\"method\": \"eagle\", \"model\": "
                f"\"{model_dir}\", \"num_speculative_tokens\": 5}}' (SGLang: --speculative-algorithm EAGLE, with "
                "architectures LlamaForCausalLMEagle in its config.json)")
